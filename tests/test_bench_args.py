"""The other benchmark scripts stop on a bad argument with a usage error (exit status 2, the
option named, no traceback) before any work starts: bench_kernel.py, bench_decode.py,
train_long_context.py, memory_check.py, bench_integrity.py, bench_ring_vs_rfa.py (bench_ring.py's
own: tests/test_bench_ring.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from command_lines import run_command_lines

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


# (script, command line, what its usage error says)
_USAGE_CASES = [
    ("bench_kernel.py", ["--repeats", "0"], "--repeats: must be a positive integer"),
    ("bench_kernel.py", ["--seqlens", "abc"], "--seqlens: must be a comma list"),
    ("bench_kernel.py", ["--heads", "8", "--heads-kv", "3"], "--heads-kv 3 must divide"),
    ("bench_kernel.py", ["--backends", "bogus"], "--backends: unknown ['bogus']"),
    ("bench_kernel.py", ["--masks", "64"], "--masks takes W:C1,C2"),
    ("bench_decode.py", ["--cp-cache", "1001"], "--cp-cache 1001: zigzag over --world-size 2"),
    ("bench_decode.py", ["--world-size", "0"], "--world-size: must be a positive integer"),
    ("train_long_context.py", ["--layout", "foo"], "--layout: invalid choice: 'foo' (choose "
                                                   "from 'zigzag', 'contiguous', 'stripe')"),
    ("train_long_context.py", ["--seqlen", "1001"], "--seqlen 1001 over 2"),
    ("train_long_context.py", ["--steps", "0"], "--steps: must be a positive integer"),
    # (before: tracebacks, failures after the ranks started, or silently accepted)
    ("train_long_context.py", ["--backend", "foo"], "--backend foo: get_backend: backend must"),
    # (before: refused by every rank after it built the model, exit status 3)
    ("train_long_context.py", ["--backend", "flash_attn"],
     "--backend flash_attn: get_backend: backend 'flash_attn' cannot run torch.float32 inputs "
     "with head dim 64 on cpu"),
    ("train_long_context.py", ["--peak-tflops", "-5"], "--peak-tflops: must be a finite"),
    # (before: spawned the ranks, then failed there naming library arguments, or trained fp16
    # weights into nan and exited 0)
    ("train_long_context.py", ["--dtype", "fp16"], "--dtype fp16 needs --plugin"),
    ("train_long_context.py", ["--zero", "2", "--dtype", "fp16"], "--dtype fp16 with --zero 2"),
    ("train_long_context.py", ["--tp", "2", "--kv-heads", "1"], "--tp 2 with --heads 4 "
                                                                "--kv-heads 1: ParallelDims"),
    ("train_long_context.py", ["--tp", "2", "--intermediate", "101"], "--tp 2 must divide the "
                                                                      "MLP width"),
    ("train_long_context.py", ["--lr", "nan"], "--lr: must be a finite positive number"),
    ("train_long_context.py", ["--seed", str(10 ** 20)], "--seed must be below 2**63"),
    ("train_long_context.py", ["--layout", "documents"], "--layout: invalid choice: "
                                                         "'documents'"),
    # the DDP x sp comparison of a --tp run rings over sp x tp ranks (before: the first
    # configuration trained, then every rank failed in the second, exit status 3, no JSON)
    ("train_long_context.py", ["--world-size", "2", "--tp", "2", "--seqlen", "6"],
     "--seqlen 6 over the 2 ranks of the DDP x sp2 comparison run (--no-peer leaves it out)"),
    # (before: one message for both rules, naming no value)
    ("train_long_context.py", ["--heads", "4", "--kv-heads", "3"],
     "--heads 4 must be a multiple of --kv-heads 3"),
    ("train_long_context.py", ["--hidden", "256", "--heads", "3", "--kv-heads", "1"],
     "--heads 3 must divide --hidden 256"),
    ("memory_check.py", ["--only", "W8", "--quick"], "--only 'W8' with --quick: no quick"),
    ("bench_decode.py", ["--device", "foo"], "--device: invalid choice: 'foo'"),
    ("bench_integrity.py", ["--world-size", "0"], "--world-size: must be a positive integer"),
    ("bench_integrity.py", ["--repeats", "0"], "--repeats: must be a positive integer"),
    ("bench_integrity.py", ["--seqlen", "1001"], "--seqlen 1001: zigzag over --world-size 2"),
    # (before: a cost of 1.8 % reported for a ring that has no control collective)
    ("bench_integrity.py", ["--world-size", "1"], "--world-size 1: integrity costs nothing"),
    ("memory_check.py", ["--timeout", "nan"], "--timeout: must be a positive number"),
    ("bench_kernel.py", ["--json", "/"], "--json: '/' ends in '/': a directory"),
    # (before: accepted; the kernels take 0..2)
    ("bench_kernel.py", ["--tile-configs", "0,5"], "--tile-configs: must be 0, 1 or 2"),
    # (before: taken on CPU, and nothing done with them)
    ("bench_kernel.py", ["--device", "cpu", "--tile-configs", "1"],
     "--tile-configs 1: tile configurations of the CUDA kernel; the CPU kernel has none"),
    ("bench_kernel.py", ["--device", "cpu", "--isa", "current", "--sdpa-isa", "native"],
     "--sdpa-isa native: applies to the per-level CPU run"),
    ("bench_ring_vs_rfa.py", ["--headdim", "288"], "--headdim 288: flash-attn 2, "
     "ring-flash-attn's kernel, takes head dims up to 256"),
    # (before: tracebacks from the kernels, some after rows had been timed)
    ("bench_kernel.py", ["--softcap", "inf"], "--softcap: softcap must be a finite float"),
    ("bench_kernel.py", ["--softcap", "1e39"], "--softcap: softcap must be 0.0 (off) or within"),
    ("bench_kernel.py", ["--masks", "8:1e-40"], "--masks: softcap must be 0.0 (off) or within"),
    ("bench_kernel.py", ["--device", "foo"], "--device takes cpu, cuda or cuda:N, got 'foo'"),
    ("bench_kernel.py", ["--backends", "ringseq", "--ratio-to", "torch_sdpa"],
     "--ratio-to torch_sdpa: not among --backends ringseq"),
    # (before: an empty table and exit 0; a repeated level's ratio took the other child's SDPA;
    # --ratio-to was ignored by the per-level run; "," passed the check, then int("") failed)
    ("bench_kernel.py", ["--isa", ","], "--isa: no level given in ','"),
    ("bench_kernel.py", ["--isa", ""], "--isa: no level given in ''"),  # (before: every level)
    ("bench_kernel.py", ["--isa", "baseline,baseline"], "--isa: each level once"),
    ("bench_kernel.py", ["--isa", "baseline", "--ratio-to", "torch_sdpa"],
     "--ratio-to applies to one process (--isa current)"),
    ("bench_kernel.py", ["--seqlens", ","], "--seqlens: "),
    # (before: an empty table and exit 0; fp32 in the per-level children; an IndexError)
    ("bench_kernel.py", ["--modes", ","], "--modes: no mode given in ','"),
    ("bench_kernel.py", ["--dtype", ","], "--dtype: no dtype given in ','"),
    ("bench_kernel.py", ["--dtype", ",", "--isa", "current"], "--dtype: no dtype given"),
    # (before: the ranks started, then transformers' rotary failed on head dim 3, exit 3)
    ("train_long_context.py", ["--hidden", "12", "--heads", "4", "--kv-heads", "2"],
     "--hidden 12 / --heads 4 = head dim 3: Llama's rotary embedding needs an even head dim"),
    # (before: ZeroDivisionError, objdump's CalledProcessError, FileNotFoundError)
    ("mca_loops.py", ["--iterations", "0"], "--iterations: must be a positive integer"),
    ("mca_loops.py", ["--so", "/nonexistent.so"], "--so '/nonexistent.so': not a readable file"),
    ("mca_loops.py", ["--mca", "/nonexistent/llvm-mca"],
     "--mca '/nonexistent/llvm-mca': no such executable"),
    ("mca_loops.py", ["--mcpu", ","], "argument --mcpu: needs at least one value"),  # (IndexError)
    # (before: plain int / float options: exceptions inside the ranks, exit 1 or 3)
    ("bench_ring_vs_rfa.py", ["--repeats", "0"], "--repeats: must be a positive integer"),
    ("bench_ring_vs_rfa.py", ["--world-size", "0"], "--world-size: must be a positive integer"),
    ("bench_ring_vs_rfa.py", ["--world-size", "1"], "--world-size 1: a ring needs 2 ranks"),
    ("bench_ring_vs_rfa.py", ["--dtype", "fp32"], "--dtype: invalid choice: 'fp32'"),
    ("bench_ring_vs_rfa.py", ["--seqlen", "102"], "--seqlen 102 must be a multiple of 2 x "
                                                  "--world-size = 4"),
    ("bench_ring_vs_rfa.py", ["--timeout", "-1"], "--timeout: must be a positive number"),
]


@pytest.fixture(scope="module")
def usage_runs(tmp_path_factory):
    """What a script's command line gave: each script's cases run in one child process
    (tests/command_lines.py: one torch import per script, not per case)."""
    runs = {}

    def run(script, args):
        if script not in runs:
            cases = [a for s, a, _ in _USAGE_CASES if s == script]
            done = run_command_lines(os.path.join(BENCH, script), cases,
                                     cwd=str(tmp_path_factory.mktemp(script.replace(".", "_"))))
            runs[script] = {tuple(a): r for a, r in zip(cases, done)}
        return runs[script][tuple(args)]
    return run


@pytest.mark.parametrize("script, args, message", _USAGE_CASES)
def test_bad_arguments_are_usage_errors(usage_runs, script, args, message):
    _check_usage_error(usage_runs(script, args), message)


def test_bench_decode_checks_part_twos_lengths_only_where_part_two_runs():
    """(before: --no-cp, or --device cuda, still refused a --cp-cache its world size could
    not split)"""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import bench_decode
    args = bench_decode.parse_args(["--no-cp", "--world-size", "3", "--cp-cache", "16384"])
    assert args.no_cp and args.cp_cache == [16384]
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--world-size", "3", "--cp-cache", "16384"])


def test_the_json_path_is_tried_without_leaving_folders(tmp_path):
    """--json is tried while the arguments are read, and no folder is made then: a later
    argument refused leaves nothing behind (before: the folders stayed; removing them again
    made ranks of a launcher refuse each other's path); the results' writer makes them. A file
    or a dangling link where a folder must be is refused at once."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import bench_decode
    from common import write_json
    target = tmp_path / "new" / "sub" / "out.json"
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--json", str(target), "--world-size", "3", "--cp-cache", "16384"])
    assert not (tmp_path / "new").exists()
    args = bench_decode.parse_args(["--json", str(target)])
    assert args.json == str(target) and not (tmp_path / "new").exists()
    write_json(args.json, {"ok": 1})
    assert target.read_text().strip().startswith("{")
    with pytest.raises(SystemExit):  # (a folder that cannot be made: nothing made either)
        bench_decode.parse_args(["--json", str(target / "x.json")])
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SystemExit):  # (before: taken, and the run ended in FileExistsError)
        bench_decode.parse_args(["--json", str(tmp_path / "link" / "out.json")])


@pytest.mark.skipif(not (shutil.which("llvm-mca") and shutil.which("objdump")),
                    reason="needs llvm-mca and objdump")
@pytest.mark.parametrize("args, message", [
    # (before: every loop "skipped", then FAILED with status 1; objdump's traceback)
    (["--mcpu", "bogus"], "--mcpu 'bogus': not a CPU this llvm-mca models"),
    (["--so", os.path.join(BENCH, "mca_loops.py")], "objdump cannot read it"),
])
def test_mca_loops_refuses_what_llvm_mca_or_objdump_cannot_take(tmp_path, args, message):
    _assert_usage_error(tmp_path, "mca_loops.py", args, message)


def _assert_usage_error(tmp_path, script, args, message):
    _check_usage_error(subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                                      capture_output=True, text=True, timeout=120, cwd=tmp_path),
                       message)


def _check_usage_error(proc, message):
    """Exit status 2 (argparse's), the message after "error:", no traceback."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_benchmark_json_is_strict_and_failed_rows_read_back_as_floats(tmp_path):
    """A failed row's non-finite error is written as a string (strict JSON: no Infinity / NaN
    tokens) and read back as a float by the scripts that read these files: bench_kernel's
    per-level parent and the GPU check's summary. (Before the strict writer: tokens strict
    parsers refuse; with it alone: the readers failed formatting the string "inf".)"""
    import json
    import math
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import common
    import gpu_check_summary
    import json_io
    row = dict(world_size=2, layout="zigzag", mode="fwd", ms=1.0, compute_only_ms=0.5,
               ring_overhead=0.1, max_err=float("inf"), plain_err=float("nan"), check_ok=False)
    path = tmp_path / "ring_w2.json"
    common.write_json(str(path), {"results": [row]})

    def refuse(token):
        raise AssertionError(f"not JSON: {token}")

    assert json.loads(path.read_text(), parse_constant=refuse)["results"][0]["max_err"] == "inf"
    with open(path) as f:
        back = json_io.load(f)["results"][0]
    assert back["max_err"] == math.inf and math.isnan(back["plain_err"])
    table = gpu_check_summary.ring_table(gpu_check_summary.ring_rows(str(tmp_path)))
    assert any("inf" in line and "FAILED" in line for line in table), table


def test_one_command_line_that_hangs_or_dies_fails_alone(tmp_path):
    """The batch of tests/command_lines.py: a command line past its time is stopped and named,
    the next ones run, and those after a dying child are reported as not run (before: the
    whole batch failed, without naming the case, and ran again for each case)."""
    script = tmp_path / "cli.py"
    script.write_text("import os, sys, time\n"
                      "if sys.argv[1:] == ['sleep']: time.sleep(60)\n"
                      "if sys.argv[1:] == ['die']: os._exit(7)\n"
                      "print('ran', sys.argv[1:])\n"
                      "sys.exit(2 if sys.argv[1:] == ['bad'] else 0)\n")
    runs = run_command_lines(str(script), [["bad"], ["sleep"], ["ok"], ["die"], ["ok"]],
                             cwd=str(tmp_path), per_case=3)
    assert [r.returncode for r in runs] == [2, 124, 0, -1, -1], runs
    assert runs[0].stdout == "ran ['bad']\n" and runs[2].stdout == "ran ['ok']\n", runs
    assert "did not finish within 3 s" in runs[1].stderr, runs[1]
    assert "ended before this command line finished (exit status 7" in runs[4].stderr, runs[4]
