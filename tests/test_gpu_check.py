"""CPU tests of the prepared GPU run (benchmarks/gpu_check.sh) and its summary.

The GPU run happens once, unattended, in a few minutes of borrowed device time: its plan must
fit its budget and its summary must read what the stages write, before a GPU is at hand.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
ORDER = ["env", "build", "tests", "memcheck", "racecheck", "bench", "ring"]

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def dry_run(tmp_path, **env):
    # (this interpreter, which has what the check needs, unless the test names another)
    env = {"PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path / "out"), **env})
    plan = {}
    for m in re.finditer(r"^PLAN stage=(\w+) limit=(\d+) (run|off): (.*)$", proc.stdout, re.M):
        plan[m.group(1)] = (int(m.group(2)), m.group(4))
    totals = re.search(r"^PLAN total_limits=(\d+) reserve=(\d+) budget=(\d+) cap=(\d+)$", proc.stdout, re.M)
    return proc, plan, totals


def num_fwd_configs():
    text = open(os.path.join(ROOT, "csrc", "kernel_math.h")).read()
    return int(re.search(r"constexpr int kNumFwdConfigs = (\d+);", text).group(1))


@needs_bash
def test_dry_run_plan_fits_eight_minutes(tmp_path):
    proc, plan, totals = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(plan) == ORDER  # sanitizers right after the tests, before the benchmark
    total, reserve, budget, cap = map(int, totals.groups())
    assert cap == 480 and budget <= cap
    assert total == sum(limit for limit, _ in plan.values())
    assert total + reserve <= budget
    assert all(limit > 0 for limit, _ in plan.values())
    assert "plan fits" in proc.stdout

    assert "MAX_JOBS=16" in plan["build"][1] and "build_ext --inplace" in plan["build"][1]
    assert "-m cuda" in plan["tests"][1] and "--junitxml" in plan["tests"][1]
    for tool in ("memcheck", "racecheck"):
        assert f"--tool {tool}" in plan[tool][1] and "sanitize_shape.py" in plan[tool][1]
    bench = plan["bench"][1]
    configs = re.search(r"--tile-configs (\S+)", bench).group(1)
    assert configs == ",".join(str(c) for c in range(num_fwd_configs()))  # every tile config
    for arg in ("--backends ringseq,sdpa_flash,sdpa_cudnn", "--batch 2", "--heads 16", "--seqlens 4096,8192",
                "--headdims 64,128", "--causal both", "--dtype bf16"):
        assert arg in bench, arg
    ring = plan["ring"][1]
    assert "--nproc-per-node 1" in ring and "--nproc-per-node 2" in ring  # W=2 behind a GPU count check
    assert "--layouts zigzag" in ring and "--dtype bf16" in ring


@needs_bash
def test_dry_run_rejects_limits_over_the_budget(tmp_path):
    proc, plan, _ = dry_run(tmp_path, GPU_CHECK_BENCH_S="200")
    assert proc.returncode == 1 and plan["bench"][0] == 200 and "FAIL" in proc.stdout
    proc, _, _ = dry_run(tmp_path, GPU_CHECK_BUDGET_S="600")
    assert proc.returncode == 1, "a budget over the 8-minute cap must be refused"


def load_summary():
    path = os.path.join(ROOT, "benchmarks", "gpu_check_summary.py")
    spec = importlib.util.spec_from_file_location("gpu_check_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_reads_every_stage_output(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "stages.txt").write_text("env|ok|2|15|H200\ntests|ok|61.5|95|120 passed\nbench|TIMEOUT|75|75|killed\n")
    (raw / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0+cu130",
                                              "nvcc": "13.0", "python": "3.12.3"}))
    (raw / "tests.xml").write_text('<testsuites><testsuite tests="10" failures="1" errors="0" skipped="2"/>'
                                   '</testsuites>')
    (raw / "memcheck.log").write_text("sanitize_shape: ok\n========= ERROR SUMMARY: 0 errors\n")
    (raw / "racecheck.log").write_text("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    rows = []
    for backend, ms in (("ringseq", 4.0), ("ringseq:1", 5.0), ("ringseq:2", 2.0), ("sdpa_flash", 3.0),
                        ("sdpa_cudnn", 1.0)):
        rows.append({"backend": backend, "mode": "fwd", "seqlen": 4096, "headdim": 128, "causal": True,
                     "ms": ms, "tflops": 100 / ms, "skipped": None})
    rows.append({"backend": "ringseq", "mode": "fwd_bwd", "seqlen": 8192, "headdim": 64, "causal": False,
                 "skipped": "unavailable"})
    (raw / "bench_kernel.json").write_text(json.dumps({"results": rows}))
    (raw / "ring_w1.json").write_text(json.dumps({"results": [{
        "world_size": 1, "layout": "zigzag", "mode": "fwd", "ms": 10.0, "compute_only_ms": 9.0,
        "ring_overhead": 1.111, "max_err": 1e-3, "plain_err": 2e-3, "check_ok": True}]}))
    # a failed ring row, as the strict writer leaves it: a non-finite error as a string
    (raw / "ring_w2.json").write_text(json.dumps({"results": [{
        "world_size": 2, "layout": "zigzag", "mode": "fwd", "ms": 12.0, "compute_only_ms": 9.0,
        "ring_overhead": 1.333, "max_err": "inf", "plain_err": 2e-3, "check_ok": False}]}))

    assert load_summary().main([str(tmp_path), "--total", "300", "--ring-args", "--layouts zigzag"]) == 0
    text = (tmp_path / "summary.txt").read_text()
    assert capsys.readouterr().out == text
    assert text.rstrip().splitlines()[-1].startswith("bench ")  # the stage table comes last
    assert "tests: 7 passed, 1 failed, 0 errors, 2 skipped" in text
    assert "memcheck: ERROR SUMMARY: 0 errors" in text and "racecheck: RACECHECK SUMMARY: 0 hazards" in text
    fwd = next(line for line in text.splitlines() if line.startswith("fwd "))
    # TFLOP/s of configs 0, 1, 2, flash, cuDNN; best config 2; flash / best = 1.5, cuDNN / best = 0.5
    assert fwd.split()[4:] == ["25.0", "20.0", "50.0", "33.3", "100.0", "2", "1.50", "0.50"]
    assert re.search(r"^ 1 zigzag\s+fwd\s+10\.00\s+9\.00\s+1\.111\s", text, re.M)

    md = (tmp_path / "results.md").read_text()
    assert "NVIDIA H200" in md and "GPU tests: 7 passed, 1 failed" in md
    assert "| fwd | 4096 | 128 | causal | 25.0 | 20.0 | 50.0 | 33.3 | 100.0 | 1.50 | 0.50 |" in md
    assert "| 1 | zigzag | fwd | 10.00 | 9.00 | 1.111 |" in md
    assert re.search(r"^ 2 zigzag\s+fwd\s+12\.00\s+9\.00\s+1\.333\s+inf\s.*FAILED", text, re.M)

    def refuse(token):  # (strict: before, Infinity / NaN tokens, which strict parsers refuse)
        raise AssertionError(f"not JSON: {token}")
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert summary["tests"]["failures"] == 1 and len(summary["bench"]) == 5


def test_summary_copes_with_nothing(tmp_path):
    (tmp_path / "raw").mkdir()
    assert load_summary().main([str(tmp_path), "--has-gpu", "0"]) == 0
    assert "no junit report (the stage did not run)" in (tmp_path / "results.md").read_text()


def test_summary_says_why_the_tests_did_not_run(tmp_path):
    # a failed build lists every later stage as skipped (before: they were left out)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "stages.txt").write_text("env|ok|2|25|H200\nbuild|FAIL(1)|80.2|115|see raw/build.log\n"
                                    "tests|skipped|0|95|the build failed\n")
    assert load_summary().main([str(tmp_path), "--total", "90"]) == 0
    assert ("GPU tests: no junit report (tests stage: skipped, the build failed)."
            in (tmp_path / "results.md").read_text())
    assert re.search(r"^tests\s+skipped\s+0\.0\s+95  the build failed$",
                     (tmp_path / "summary.txt").read_text(), re.M)


@needs_bash
def test_a_python_without_einops_stops_the_check_after_env(tmp_path):
    # import ringseq needs einops: without it the build's import check failed after minutes
    # of compiling, and every later stage was lost; now env fails and names it
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "einops.py").write_text("raise ImportError('blocked for the test')\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/bash\nPYTHONPATH={tmp_path / 'blocker'}:$PYTHONPATH "
                      f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    proc, _, _ = dry_run(tmp_path, PYTHON=str(python))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISSING: einops (pip install einops)" in proc.stdout
    assert "cannot import einops: every stage after env would fail" in proc.stdout


@needs_bash
def test_without_python_the_check_takes_the_first_interpreter_that_imports_torch(tmp_path):
    # python3 without torch (nor einops), python with both: the check runs with python (a
    # python3 that lacks torch must not stop the check as "missing einops")
    (tmp_path / "no_torch").mkdir()
    for module in ("torch", "einops"):
        (tmp_path / "no_torch" / f"{module}.py").write_text("raise ImportError('not here')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, path in (("python3", f"{tmp_path / 'no_torch'}:$PYTHONPATH"),
                       ("python", "$PYTHONPATH")):
        exe = bin_dir / name
        exe.write_text(f"#!/bin/bash\nPYTHONPATH={path} exec {shlex.quote(sys.executable)} "
                       f"\"$@\"\n")
        exe.chmod(0o755)
    proc, plan, _ = dry_run(tmp_path, PYTHON="", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "python=python " in proc.stdout and list(plan) == ORDER, proc.stdout
