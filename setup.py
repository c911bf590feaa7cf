"""Build and install ringseq with its C++/CUDA extension ``ringseq._C``.

Install from a checkout with ``pip install --no-build-isolation -e .``: the extension is
compiled against the torch that is already installed in the environment (an isolated build
environment would download and build against a different torch, whose ABI may not match).
pip shows the build's output only with ``-v``: ``pip install -v --no-build-isolation -e .``
prints how many translation units will be compiled and, as they compile, ninja's ``[n/N]``
lines (one ninja run per CPU ISA level, then one for the rest).

Environment variables:
  RINGSEQ_CUDA=auto|1|0   auto (default): build the CUDA kernels only when torch is a CUDA
                          build, a CUDA toolkit with the same major version is found AND a GPU
                          is visible (torch.cuda.is_available() or `nvidia-smi -L`); 1: build
                          them without a GPU too (stop with a message if torch or the toolkit
                          cannot); 0: CPU kernels only. The build prints which it chose and why.
  CUDA_HOME               toolkit root holding include/cuda_runtime.h (else guessed by torch).
  TORCH_CUDA_ARCH_LIST    e.g. "8.0;9.0"; default builds sm_80 and sm_90.
  MAX_JOBS                parallel compile jobs (ninja).
  RINGSEQ_CPU_FLAGS       extra flags for the CPU kernel, appended to every ISA level's flags
                          (default none: the build runs on any CPU of its architecture). For
                          experts: e.g. "-mtune=znver3"; "-march=native" makes every level
                          require the build machine's CPU.
  RINGSEQ_CPU_ISAS        CPU kernel ISA levels to build (default: every level the compiler
                          accepts; x86-64: baseline,avx2,avx512,avx512bf16,amx; elsewhere: baseline).
"""
import glob
import os
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def fail(message):
    """Stops the build with one readable message instead of a traceback."""
    sys.stderr.write(f"\nringseq build error: {message}\n\n")
    sys.exit(1)


try:
    import torch
    from torch.utils import cpp_extension
except ImportError as exc:
    # (pip's default isolated build cannot see the torch already installed: before, this said
    # to install torch, which the user had done)
    fail(f"torch cannot be imported where ringseq is being built ({exc}). pip builds in an "
         f"isolated environment unless told not to, and that environment does not see the "
         f"torch you installed: `pip install --no-build-isolation -e .` (or `.`). Without "
         f"torch at all, install it first: `pip install torch` (or `pip install "
         f"torch==2.13.0` for a CPU build)")


def require_bdist_wheel():
    """pip builds this project (its metadata, an editable install, a wheel) through setuptools'
    bdist_wheel, which setuptools >= 70.1 carries and older ones take from the wheel package.
    Python 3.11's venv ships setuptools 65.5 without wheel, and torch 2.13 pulls a newer
    setuptools but torch <= 2.12 does not: without this check the build stops with setuptools'
    bare "invalid command 'bdist_wheel'"."""
    if not {"dist_info", "bdist_wheel", "editable_wheel"} & set(sys.argv[1:]):
        return  # e.g. `python setup.py build_ext --inplace` needs no wheel
    try:
        import setuptools.command.bdist_wheel  # noqa: F401  (setuptools >= 70.1)
    except ImportError:
        try:
            import wheel.bdist_wheel  # noqa: F401
        except ImportError:
            import setuptools

            fail(f"setuptools {setuptools.__version__} in this environment cannot build wheels "
                 f"(it needs setuptools >= 70.1 or the wheel package, and "
                 f"--no-build-isolation builds with this environment's own): "
                 f"`pip install -U setuptools`, then `pip install --no-build-isolation -e .` again")


require_bdist_wheel()


def package_version():
    """ringseq.__version__, read from ringseq/__init__.py (the one place it is written; the
    package cannot be imported before its extension is built)."""
    import re

    with open(os.path.join(ROOT, "ringseq", "__init__.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if match is None:
        fail("ringseq/__init__.py has no line __version__ = \"...\"")
    return match.group(1)


def nvcc_version(cuda_home):
    """Returns (major, minor) of the toolkit's nvcc, or None."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for token in out.replace(",", " ").split():
        if token.startswith("V") and token[1:2].isdigit():
            major, minor = token[1:].split(".")[:2]
            return int(major), int(minor)
    return None


def find_cuda_home():
    """CUDA_HOME if it holds the toolkit headers, else the root of the nvcc on PATH."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    from shutil import which

    nvcc = which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        candidates.append(os.path.dirname(os.path.dirname(nvcc)))
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


def visible_gpu():
    """Describes the NVIDIA GPU this machine shows (torch.cuda, else `nvidia-smi -L`), or
    returns None when there is none."""
    try:
        if torch.cuda.is_available():
            return f"GPU {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU here
        pass
    from shutil import which

    smi = which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
        if out.returncode == 0 and gpus:
            return gpus[0].split(" (UUID")[0]
    return None


def want_cuda():
    """Decides whether to build the CUDA kernels; returns (bool, reason)."""
    mode = os.environ.get("RINGSEQ_CUDA", "auto").strip().lower()
    if mode not in ("auto", "1", "0", "true", "false", "yes", "no"):
        fail(f"RINGSEQ_CUDA must be auto, 1 or 0, got {mode!r}")
    if mode in ("0", "false", "no"):
        return False, "RINGSEQ_CUDA=0"
    forced = mode in ("1", "true", "yes")
    problems = []
    if torch.version.cuda is None:
        problems.append(f"the installed torch {torch.__version__} is not a CUDA build")
    cuda_home = find_cuda_home()
    if cuda_home is None:
        problems.append("no CUDA toolkit found (set CUDA_HOME to the folder holding include/cuda_runtime.h)")
    elif torch.version.cuda is not None:
        version = nvcc_version(cuda_home)
        torch_major = int(torch.version.cuda.split(".")[0])
        if version is None:
            problems.append(f"no working nvcc in {cuda_home}/bin")
        elif version[0] != torch_major:
            problems.append(f"nvcc {version[0]}.{version[1]} in {cuda_home} does not match the "
                            f"CUDA {torch.version.cuda} that torch was built with")
    if problems:
        reason = "; ".join(problems)
        if forced:
            fail(f"RINGSEQ_CUDA=1 but the CUDA kernels cannot be built: {reason}")
        return False, reason
    gpu = visible_gpu()
    if gpu is None and not forced:
        return False, (f"no GPU visible (CUDA toolkit {cuda_home} and CUDA torch found: "
                       f"RINGSEQ_CUDA=1 builds the CUDA kernels anyway)")
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    why = "RINGSEQ_CUDA=1" if forced else f"RINGSEQ_CUDA=auto, {gpu}"
    return True, f"{why}, CUDA toolkit {cuda_home}"


def cxx_command():
    """The C++ compiler setuptools will use, as a command (CXX, else Python's configured one)."""
    import shlex
    import sysconfig

    return shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")


def compiler_found() -> bool:
    import shutil

    cxx = cxx_command()
    return bool(cxx) and shutil.which(cxx[0]) is not None


def require_compiler():
    """Stops the build when there is no C++ compiler to run (before: each ISA level's flags
    were reported as rejected, then ninja failed with "c++: not found" in a long log)."""
    if not compiler_found():
        cxx = cxx_command()
        fail(f"no C++ compiler: {cxx[0] if cxx else '(empty CXX)'!r} (the CXX variable, else "
             f"the compiler Python was configured with) is not on PATH; install one (e.g. "
             f"`apt-get install g++`) or point CXX at it, then build again")


def compiler_accepts(flag):
    """Whether the C++ compiler setuptools will use accepts `flag` (preprocesses an empty file)."""
    cxx = cxx_command()
    try:
        return subprocess.run([*cxx, flag, "-x", "c++", "-E", "-o", os.devnull, os.devnull],
                              capture_output=True).returncode == 0
    except OSError:
        return False


# The CPU kernel's translation units (csrc/cpu/kernels/) are compiled once per ISA level with
# that level's flags and RINGSEQ_CPU_ISA_NS=<level>, into namespace ringseq::cpu::<level>, and
# linked into the one extension; csrc/cpu/dispatch.cpp picks a level at first use (cpuid, or
# RINGSEQ_CPU_ISA). Separate objects with per-level command-line flags (ATen's way) rather than
# `#pragma GCC target` / target attributes: the flags also set the predefined macros
# (__AVX2__, __AVX512F__) the vector header keys on, apply to every inline function of the unit,
# and work the same with GCC and Clang. BuildExtension gives one flag set to all sources of an
# extension, so BuildExtWithIsaLevels compiles these units itself (through the same ninja-backed
# compiler) and adds them as extra objects.
CPU_ISA_SOURCES = ["csrc/cpu/kernels/flash_fwd.cpp", "csrc/cpu/kernels/flash_bwd.cpp",
                   "csrc/cpu/kernels/table.cpp"]
X86_ISA_FLAGS = {
    "baseline": [],  # the compiler's x86-64 default (SSE2)
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    # AVX-512 plus the bf16 dot product (Zen 4 and later, Intel Cooper Lake / Sapphire Rapids):
    # the forward's S = Q·Kᵀ of bf16 inputs at twice the terms per instruction (gemm.h)
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mavx2",
                   "-mfma", "-mf16c"],
    # AVX-512 plus AMX tiles (Intel Sapphire Rapids and later): the forward's bf16 products and
    # the backward's S and dP on tiles (csrc/cpu/amx.h); AVX512_BF16 for its bf16 conversion only
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mamx-tile",
            "-mamx-bf16", "-mavx2", "-mfma", "-mf16c"],
}


def cpu_isa_levels():
    """{level: flags} of the CPU kernel's ISA levels this build compiles (without a compiler,
    every level asked for: the build stops at its start, saying so, and metadata such as
    ``setup.py --version`` needs none)."""
    import platform

    extra = os.environ.get("RINGSEQ_CPU_FLAGS", "").split()
    machine = platform.machine().lower()
    x86 = machine in ("x86_64", "amd64", "i686", "i386")
    candidates = X86_ISA_FLAGS if x86 else {"baseline": []}
    wanted = os.environ.get("RINGSEQ_CPU_ISAS")
    names = [n.strip() for n in wanted.split(",") if n.strip()] if wanted else list(candidates)
    for n in names:
        if n not in candidates:
            fail(f"RINGSEQ_CPU_ISAS: {n!r} is not a CPU ISA level on {machine} "
                 f"(levels: {', '.join(candidates)})")
    if "baseline" not in names:
        names.insert(0, "baseline")  # the fallback every CPU can run
    levels = {}
    found = compiler_found()
    for n in names:
        flags = candidates[n]
        if not found or all(compiler_accepts(f) for f in flags):
            levels[n] = flags + extra
        else:
            print(f"ringseq: the compiler rejects {' '.join(flags)}: CPU ISA level {n} not built")
    return levels


# Rough seconds per translation unit and job, for the estimate printed before the build:
# measured on a 2-core Zen 4 VM with torch 2.13 (9 CPU kernel units in 48 s and 4 host units,
# which include torch's headers, in 26 s on 2 jobs); a CUDA unit compiles for three -gencode
# targets (the compile gate's ~4 s per target and file, plus the host pass).
SECONDS_PER_UNIT = {"cpu_isa": 11, "host": 13, "cuda": 20}


def build_jobs():
    """Parallel compile jobs: MAX_JOBS, else the CPUs this process may use (ninja's default is
    about that many)."""
    if os.environ.get("MAX_JOBS", "").isdigit():
        return max(1, int(os.environ["MAX_JOBS"]))
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def say(message):
    """One build progress line on stdout, flushed (pip shows it with -v)."""
    print(f"ringseq: {message}", flush=True)


class BuildExtWithIsaLevels(cpp_extension.BuildExtension):
    """torch's BuildExtension plus the CPU kernel's per-ISA-level objects (see above), with
    progress: the number of translation units and a time estimate first, then one line per
    compile stage (ninja's own [n/N] lines in between)."""

    def build_extension(self, ext):
        import time

        require_compiler()
        levels = getattr(ext, "cpu_isa_levels", None) or {}
        cuda_units = [s for s in ext.sources if s.endswith(".cu")]
        host_units = [s for s in ext.sources if not s.endswith(".cu")]
        counts = {"cpu_isa": len(CPU_ISA_SOURCES) * len(levels), "host": len(host_units),
                  "cuda": len(cuda_units)}
        total = sum(counts.values())
        jobs = build_jobs()
        estimate = sum(SECONDS_PER_UNIT[k] * n for k, n in counts.items()) / min(jobs, total)
        about = f"{estimate:.0f} s" if estimate < 120 else f"{estimate / 60:.0f} min"
        say(f"compiling up to {total} translation units: {counts['cpu_isa']} CPU kernel "
            f"({len(CPU_ISA_SOURCES)} per ISA level x {len(levels)}), {counts['host']} host "
            f"C++, {counts['cuda']} CUDA; about {about} with {jobs} parallel job(s) "
            f"(MAX_JOBS) on a recent core; ninja prints [n/N] as it goes (and skips units "
            f"already up to date in the same build folder: `python setup.py build_ext "
            f"--inplace` again, not a new pip install, which builds in a new temporary one)")
        start = time.time()
        done = 0

        def stage_done(what, n):
            nonlocal done
            done += n
            say(f"{what}: done, {done}/{total} units after {time.time() - start:.0f} s")

        if levels:
            cxx = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) \
                else list(ext.extra_compile_args)
            objects = []
            # -fvisibility=hidden: the levels' symbols stay inside the extension (direct calls,
            # no PLT, nothing another library could interpose).
            for level, flags in levels.items():
                say(f"CPU kernel, ISA level {level}: {len(CPU_ISA_SOURCES)} units ...")
                # Its own folder per level: the same sources give different objects.
                objects += self.compiler.compile(
                    CPU_ISA_SOURCES, output_dir=os.path.join(self.build_temp, f"cpu_isa_{level}"),
                    macros=[*ext.define_macros, ("RINGSEQ_CPU_ISA_NS", level)],
                    include_dirs=ext.include_dirs, debug=self.debug,
                    extra_postargs={"cxx": [*cxx, "-fvisibility=hidden", *flags]},
                    depends=ext.depends)
                stage_done(f"CPU kernel, ISA level {level}", len(CPU_ISA_SOURCES))
            ext.extra_objects = [*(ext.extra_objects or []), *objects]
        say(f"host C++ ({len(host_units)} units)"
            + (f" and CUDA kernels ({len(cuda_units)} units, nvcc)" if cuda_units else "")
            + ", then linking ...")
        super().build_extension(ext)
        stage_done("extension ringseq._C built", len(host_units) + len(cuda_units))


def extension():
    with_cuda, reason = want_cuda()
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # torch >= 2.14's headers require C++20 (kernels compiled by nvcc stay C++17: no torch there).
    cxx = ["-O3", "-std=c++20", "-fopenmp"]
    isa_levels = cpu_isa_levels()
    define_macros = [(f"RINGSEQ_CPU_HAVE_{level.upper()}", None) for level in isa_levels]
    print(f"ringseq: CPU kernel ISA levels: {', '.join(isa_levels)}")
    extra_link_args = ["-fopenmp"]
    nvcc = []
    if with_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
        define_macros.append(("RINGSEQ_WITH_CUDA", None))
        # The compile gate (.ci/cuda_compile_check.py) reads the same flags; by path, since the
        # ringseq package cannot be imported before its extension is built.
        import importlib.util

        spec = importlib.util.spec_from_file_location("build_flags", os.path.join(ROOT, "csrc", "build_flags.py"))
        build_flags = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build_flags)
        # SASS for sm_80 and sm_90 plus compute_90 PTX, unless TORCH_CUDA_ARCH_LIST chooses
        nvcc = build_flags.nvcc_flags(default_gencode=not os.environ.get("TORCH_CUDA_ARCH_LIST"))
        print(f"ringseq: building CPU and CUDA kernels ({reason})")
        ext_cls = cpp_extension.CUDAExtension
    else:
        print(f"ringseq: building CPU kernels only ({reason})")
        ext_cls = cpp_extension.CppExtension
    args = {"cxx": cxx}
    if with_cuda:
        args["nvcc"] = nvcc
    ext = ext_cls(
        name="ringseq._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args=args,
        extra_link_args=extra_link_args,
        depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/cpu/*.h")),
    )
    ext.cpu_isa_levels = isa_levels
    return ext


setup(
    name="ringseq",
    version=package_version(),
    description="Ring sequence parallelism for PyTorch with its own flash-attention kernels",
    long_description=open(os.path.join(ROOT, "README.md")).read() if os.path.exists(os.path.join(ROOT, "README.md")) else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["ringseq", "ringseq.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "einops"],  # the oldest torch the suite ran on (README)
    extras_require={
        "test": ["pytest", "hypothesis", "numpy"],  # numpy: the lane-level CUDA emulation tests
        "flash": ["flash-attn"],
        # verified with 4.57.1 and 5.24.0 (AttentionInterface + AttentionMaskInterface)
        "hf": ["transformers>=4.57,<6"],
        "plot": ["matplotlib"],
    },
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtWithIsaLevels.with_options(use_ninja=True)},
    zip_safe=False,
)
