#!/usr/bin/env python3
"""CUDA compile gate: every csrc/**/*.cu must compile for sm_80 and sm_90 without spills.

Compiles each .cu file once per architecture with the build's own nvcc flags
(csrc/build_flags.py, which setup.py uses too; choices in docs/kernels.md) plus
``-Xptxas -v,-warn-spills,-Werror``, parses ptxas' resource report into a per-kernel table
(arch, kernel, registers, shared memory, stack frame, spills) and fails when a file does not
compile, a kernel spills or a kernel has a non-zero stack frame. No GPU is needed.

Successful results are cached under build/cuda_compile_check/, keyed on the hash of the .cu
file, the project headers it includes (transitively), the flags, this script and
``nvcc --version``: a second run in an unchanged checkout is instant. Failures are never
cached.

Usage: python3 .ci/cuda_compile_check.py [-j N] [--no-cache] [--arch 80 --arch 90]
                                         [--root DIR] [--json PATH] [--nvcc PATH]
Exit status: 0 pass (also when there is no .cu file), 1 failure, 2 nvcc missing.
Python 3 standard library only.
"""
import argparse
import concurrent.futures
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def load_build_flags(root):
    """csrc/build_flags.py of the checkout at `root`, loaded by path (stdlib only, no torch)."""
    spec = importlib.util.spec_from_file_location("build_flags", os.path.join(root, "csrc", "build_flags.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PTXAS = ["-Xptxas", "-v,-warn-spills,-Werror"]
CACHE_VERSION = "1"

RE_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
RE_PROPS = re.compile(r"Function properties for (\S+)")
RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
RE_USED = re.compile(r"Used (\d+) registers")
RE_SMEM = re.compile(r"(\d+) bytes smem")


def find_nvcc(explicit):
    if explicit:
        return explicit if os.path.exists(explicit) or shutil.which(explicit) else None
    for cand in (shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    return None


def sha(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()


RE_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def include_closure(root, rel, search):
    """Project headers a source reaches through #include "..." (relative to the including
    file, then the -I directories): the cache key covers exactly these, so editing an
    unrelated header does not invalidate every entry. System headers are covered by the
    nvcc version in the key."""
    seen, todo = set(), [os.path.join(root, rel)]
    while todo:
        path = todo.pop()
        try:
            text = open(path, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        for inc in RE_INCLUDE.findall(text):
            for base in [os.path.dirname(path), *search]:
                cand = os.path.normpath(os.path.join(base, inc))
                if os.path.isfile(cand):
                    if cand not in seen:
                        seen.add(cand)
                        todo.append(cand)
                    break
    return sorted(seen)


def parse_ptxas(text):
    """Returns {mangled kernel: {...}} from ptxas -v output of one compilation (one arch)."""
    kernels = {}
    current = None
    for line in text.splitlines():
        m = RE_ENTRY.search(line)
        if m:
            current = kernels.setdefault(m.group(1), {"mangled": m.group(1), "arch": m.group(2)})
            continue
        m = RE_PROPS.search(line)
        if m:
            current = kernels.setdefault(m.group(1), {"mangled": m.group(1)})
            continue
        if current is None:
            continue
        m = RE_FRAME.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
            continue
        m = RE_USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = RE_SMEM.search(line)
            current["smem"] = int(s.group(1)) if s else 0
    # ptxas also reports device functions that are not kernels ("Function properties" only)
    return [k for k in kernels.values() if "arch" in k]


def demangle(names):
    if not names:
        return {}
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def short_name(demangled):
    s = re.sub(r"^void ", "", demangled)
    s = re.sub(r"\(.*\)$", "", s)
    return s.replace("ringseq::", "").replace("(int)", "")


def compile_one(nvcc, root, rel, arch, flags, key, cache_dir, use_cache):
    """Compiles rel for sm_<arch>; returns a result dict (from the cache when possible)."""
    cache_file = os.path.join(cache_dir, key + ".json")
    if use_cache and os.path.exists(cache_file):
        with open(cache_file) as f:
            result = json.load(f)
        result["cached"] = True
        return result
    cmd = [nvcc, *flags, *PTXAS,
           "-I", os.path.join(root, "csrc"), "-c", os.path.join(root, rel), "-o", os.devnull]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rs_nvcc_") as tmp:
        env = dict(os.environ, TMPDIR=tmp)  # parallel nvcc runs keep their temporaries apart
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
    log = proc.stdout + proc.stderr
    result = {
        "file": rel, "arch": f"sm_{arch}", "returncode": proc.returncode,
        "seconds": round(time.time() - t0, 1), "kernels": parse_ptxas(log), "log": log,
        "cmd": " ".join(cmd), "cached": False,
    }
    ok = proc.returncode == 0 and all(
        k.get("stack", 0) == 0 and k.get("spill_stores", 0) == 0 and k.get("spill_loads", 0) == 0
        for k in result["kernels"])
    if ok and use_cache:
        os.makedirs(cache_dir, exist_ok=True)
        tmp_file = cache_file + f".{os.getpid()}.tmp"
        with open(tmp_file, "w") as f:
            json.dump(result, f)
        os.replace(tmp_file, cache_file)
    return result


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(here), help="repository root")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--arch", action="append", help="SM versions (default: the build's, 80 and 90)")
    ap.add_argument("--nvcc", help="nvcc to use (default: PATH, then $CUDA_HOME/bin)")
    ap.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    ap.add_argument("--json", help="write the per-kernel table as JSON here")
    ap.add_argument("--flag", action="append", default=[], help="extra nvcc flag (repeatable)")
    args = ap.parse_args(argv)
    t_start = time.time()
    root = os.path.abspath(args.root)
    build_flags = load_build_flags(root)
    archs = args.arch or list(build_flags.DEFAULT_ARCHS)
    flags = list(build_flags.NVCC_FLAGS) + args.flag

    csrc = os.path.join(root, "csrc")
    sources = []
    for dirpath, _, files in os.walk(csrc):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if name.endswith(".cu"):
                sources.append(rel)
    sources.sort()
    if not sources:
        print("cuda_compile_check: no .cu files under csrc/: nothing to compile, PASS")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ok": True, "kernels": [], "files": []}, f, indent=1)
        return 0

    nvcc = find_nvcc(args.nvcc)
    if nvcc is None:
        print("cuda_compile_check: FAIL: nvcc not found (put it on PATH or set CUDA_HOME)")
        return 2
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout

    with open(os.path.abspath(__file__), "rb") as f:
        script_hash = sha(f.read())
    common = sha(CACHE_VERSION, script_hash, version, " ".join(flags + PTXAS))
    cache_dir = os.path.join(root, "build", "cuda_compile_check")

    jobs = []
    for rel in sources:
        deps = [os.path.join(root, rel)] + include_closure(root, rel, [csrc])
        src_hash = sha(*(os.path.relpath(d, root).encode() + b"\0" + open(d, "rb").read() for d in deps))
        for arch in archs:
            jobs.append((rel, arch, sha(common, rel, src_hash, arch)))

    print(f"cuda_compile_check: {len(sources)} .cu files x {len(archs)} archs with "
          f"{os.path.basename(nvcc)} ({version.strip().splitlines()[-1]}), -j {args.jobs}")
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        # one architecture per compilation (SASS only: the build's PTX target adds nothing here)
        futures = [pool.submit(compile_one, nvcc, root, rel, arch,
                               flags + build_flags.gencode_flags([arch], ptx_arch=None), key,
                               cache_dir, not args.no_cache) for rel, arch, key in jobs]
        for fut in concurrent.futures.as_completed(futures):
            r = fut.result()
            state = "cached" if r["cached"] else f"{r['seconds']}s"
            status = "ok" if r["returncode"] == 0 else f"FAILED (exit {r['returncode']})"
            print(f"  {r['file']} [{r['arch']}]: {status}, {len(r['kernels'])} kernels ({state})",
                  flush=True)
            results.append(r)
    results.sort(key=lambda r: (r["file"], r["arch"]))

    names = demangle(sorted({k["mangled"] for r in results for k in r["kernels"]}))
    rows, problems = [], []
    for r in results:
        if r["returncode"] != 0:
            problems.append(f"{r['file']} [{r['arch']}] failed to compile:\n{r['log'].strip()}")
        for k in sorted(r["kernels"], key=lambda k: names.get(k["mangled"], k["mangled"])):
            row = {
                "file": r["file"], "arch": k["arch"], "kernel": short_name(names.get(k["mangled"], k["mangled"])),
                "mangled": k["mangled"], "registers": k.get("registers"), "smem": k.get("smem"),
                "stack": k.get("stack", 0), "spill_stores": k.get("spill_stores", 0),
                "spill_loads": k.get("spill_loads", 0),
            }
            rows.append(row)
            if row["stack"] or row["spill_stores"] or row["spill_loads"]:
                problems.append(f"{row['kernel']} [{row['arch']}] in {row['file']}: stack frame "
                                f"{row['stack']} B, spills {row['spill_stores']}/{row['spill_loads']} B "
                                "(stores/loads); a 0-byte stack frame without spills is required")

    headers_row = ("arch", "regs", "smem B", "stack", "spill st/ld", "kernel")
    table = [headers_row] + [
        (x["arch"], str(x["registers"]), str(x["smem"]), str(x["stack"]),
         f"{x['spill_stores']}/{x['spill_loads']}", x["kernel"]) for x in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(headers_row))]
    print()
    for i, t in enumerate(table):
        print("  ".join(c.ljust(w) if j == len(t) - 1 else c.rjust(w) if j else c.ljust(w)
                        for j, (c, w) in enumerate(zip(t, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    ok = not problems
    elapsed = time.time() - t_start
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": ok, "seconds": round(elapsed, 1), "kernels": rows,
                       "files": [{k: r[k] for k in ("file", "arch", "returncode", "cached", "seconds")}
                                 for r in results]}, f, indent=1)
    print()
    for p in problems:
        print("FAIL: " + p)
    cached = sum(r["cached"] for r in results)
    print(f"cuda_compile_check: {'PASS' if ok else 'FAIL'}: {len(rows)} kernels from "
          f"{len(results)} compilations ({cached} cached) in {elapsed:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
