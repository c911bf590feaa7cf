"""benchmarks/bench_kernel.py on CPU: at one shape the backends' timed calls alternate, so a
machine that slows down during the run does not favour the backend timed first; a small run
writes rows for ringseq and its peer with their ratio."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_timed_calls_alternate_between_backends(monkeypatch):
    import bench_kernel

    calls = []

    def fake_runner(name, q, k, v, causal, tile_config, window=-1, softcap=0.0):
        def run():
            calls.append(name)
            return (q * 1).sum()
        return run, (q, k, v)

    monkeypatch.setattr(bench_kernel, "make_runner", fake_runner)
    monkeypatch.setattr(bench_kernel, "supported", lambda *a, **kw: None)
    monkeypatch.setattr(bench_kernel, "accuracy",
                        lambda *a, **kw: (0.0, 0.0, None, None))  # (checked below)
    _, args = bench_kernel.parse_args(["--device", "cpu", "--modes", "fwd", "--warmup", "1",
                                       "--repeats", "4", "--heads", "1"])
    rows = bench_kernel.measure([("ringseq", 0), ("torch_sdpa", 0)], args, bench_kernel.torch.device("cpu"),
                                "fp32", 16, 8, False)
    # Per backend: one call for the peak memory, one warm-up; then the 4 timed rounds in turn.
    assert calls == ["ringseq"] * 2 + ["torch_sdpa"] * 2 + ["ringseq", "torch_sdpa"] * 4
    assert [r["backend"] for r in rows] == ["ringseq", "torch_sdpa"]
    assert all(r["ms"] > 0 and r["mode"] == "fwd" for r in rows)


def test_small_cpu_run_writes_ratio_rows(tmp_path):
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kernel.py"),
                           "--device", "cpu", "--isa", "current", "--backends", "ringseq,torch_sdpa",
                           "--seqlens", "64", "--heads", "2", "--headdims", "16", "--causal", "true",
                           "--dtype", "fp32", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backends interleaved" in proc.stdout
    assert "# core probe" in proc.stdout
    data = json.loads(out.read_text())
    assert data["core_probe_gflops"]["before"] > 0 and data["core_probe_gflops"]["after"] > 0
    rows = data["results"]
    assert {(r["backend"], r["mode"]) for r in rows} == {
        (b, m) for b in ("ringseq", "torch_sdpa") for m in ("fwd", "fwd_bwd")}
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["check"] == "ok" and r["max_err"] <= 2 * r["plain_err"] + 1e-6, r
        ratio = r["x_torch_sdpa"]
        peer = next(x for x in rows if x["backend"] == "torch_sdpa" and x["mode"] == r["mode"])
        assert abs(ratio - peer["ms"] / r["ms"]) < 1e-9
        # the paired ratio: the median of the per-round ratios (the rounds alternate backends)
        assert len(r["rounds_ms"]) == len(peer["rounds_ms"]) == 2
        per_round = sorted(p / m for p, m in zip(peer["rounds_ms"], r["rounds_ms"]))
        assert abs(r["px_torch_sdpa"] - sum(per_round) / 2) < 1e-9


def _failing_run(bench_kernel, tmp_path, capsys):
    """A small ringseq + torch_sdpa run that must exit CHECK_FAILED: (its output, its JSON)."""
    out = tmp_path / "k.json"
    with pytest.raises(SystemExit) as exit_:
        bench_kernel.main(["--device", "cpu", "--isa", "current", "--backends",
                           "ringseq,torch_sdpa", "--seqlens", "64", "--heads", "2",
                           "--headdims", "16", "--causal", "true", "--repeats", "1",
                           "--json", str(out)])
    assert exit_.value.code == bench_kernel.CHECK_FAILED
    return capsys.readouterr().out, out


def test_a_backend_computing_something_else_fails_the_run(monkeypatch, tmp_path, capsys):
    """Each backend's output is checked against float64 at every shape before it is timed
    (before: a kernel returning q itself was timed and reported 90x faster than SDPA)."""
    import bench_kernel

    monkeypatch.setattr(bench_kernel.ringseq, "flash_attn_func", lambda q, k, v, **kw: q * 1.0)
    text, out = _failing_run(bench_kernel, tmp_path, capsys)
    assert "WARNING: ringseq fp32 s=64 d=16 causal fwd: max error" in text, text[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["backend"]: r["check"] for r in rows} == {"ringseq": "FAIL", "torch_sdpa": "ok"}
    for r in rows:
        assert r["plain_err"] < 1e-5 and (r["max_err"] > 0.1) == (r["backend"] == "ringseq")


def test_a_wrong_backward_fails_the_run(monkeypatch, tmp_path, capsys):
    """The gradients are checked against float64 too (before: a backward 100x off was timed,
    its fwd_bwd rows said "ok" and the run exited 0)."""
    import bench_kernel
    torch = bench_kernel.torch

    class Times100(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 100.0

    real = bench_kernel.ringseq.flash_attn_func
    monkeypatch.setattr(bench_kernel.ringseq, "flash_attn_func",
                        lambda *a, **kw: Times100.apply(real(*a, **kw)))
    text, out = _failing_run(bench_kernel, tmp_path, capsys)
    assert "WARNING: ringseq fp32 s=64 d=16 causal fwd_bwd: max gradient error" in text, text
    rows = json.loads(out.read_text())["results"]
    # the forward alone is right: its row passes; the peer's gradients pass the same bound
    assert {(r["backend"], r["mode"]): r["check"] for r in rows} == {
        ("ringseq", "fwd"): "ok", ("ringseq", "fwd_bwd"): "FAIL",
        ("torch_sdpa", "fwd"): "ok", ("torch_sdpa", "fwd_bwd"): "ok"}
    for r in rows:  # (the fwd rows: their forward under no_grad, no gradients)
        if r["mode"] == "fwd":
            assert r["grad_err"] is None and r["grad_plain_err"] is None, r
            continue
        assert r["grad_plain_err"] < 1e-5
        assert (r["grad_err"] > 1.0) == (r["backend"] == "ringseq"), r


def test_mask_rows_are_compared_with_the_masked_peer_whatever_backends_says(tmp_path):
    """(before: --backends ringseq --masks timed SDPA's masked rows but showed no ratio)"""
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kernel.py"),
                           "--device", "cpu", "--isa", "current", "--backends", "ringseq",
                           "--masks", "16:0", "--seqlens", "64", "--heads", "2", "--headdims",
                           "16", "--causal", "true", "--modes", "fwd", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "x torch_sdpa" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["results"]
    masked = [r for r in rows if r.get("window") == 16]
    assert {r["backend"] for r in masked} == {"ringseq", "torch_sdpa"}
    ours = next(r for r in masked if r["backend"] == "ringseq")
    peer = next(r for r in masked if r["backend"] == "torch_sdpa")
    assert abs(ours["x_torch_sdpa"] - peer["ms"] / ours["ms"]) < 1e-9


def test_the_native_sdpa_child_gives_only_sdpa_rows(monkeypatch):
    """--sdpa-isa native with --masks: the native child timed ringseq's masked rows too, which
    became "torch_sdpa_native" rows (the ratio of ringseq with itself) -- now it times SDPA
    alone, and the parent keeps SDPA's rows only."""
    import bench_kernel
    commands = []

    def child(cmd, env):
        commands.append(cmd)
        rows = [{"backend": b, "dtype": "fp32", "threads": 1, "mode": "fwd", "seqlen": 64,
                 "headdim": 16, "causal": True, "window": 16, "softcap": 0.0, "ms": ms,
                 "rounds_ms": [ms], "skipped": None}
                for b, ms in (("ringseq", 1.0), ("torch_sdpa", 4.0))]
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"results": rows, "core_probe_gflops": None}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_kernel.subprocess, "run", child)
    _, args = bench_kernel.parse_args(["--device", "cpu", "--seqlens", "64", "--headdims", "16",
                                       "--sdpa-isa", "native", "--masks", "16:0"])
    rows, peers, _ = bench_kernel.run_cpu_levels(args, ["avx2"])
    native = [r for r in rows if r["level"] == "native"]
    assert [r["backend"] for r in native] == ["torch_sdpa_native"] and native[0]["ms"] == 4.0
    ours = next(r for r in rows if r["backend"] == "ringseq")
    assert ours["x_torch_sdpa_native"] == 4.0
    # and the native child itself runs no ringseq row: its masks jobs keep the peer only
    _, child_args = bench_kernel.parse_args(commands[-1][2:])
    assert child_args.backends == "torch_sdpa"


def test_a_level_failing_the_check_keeps_its_rows_and_says_so(monkeypatch, tmp_path, capsys):
    """A level's child whose ringseq rows fail the accuracy check exits CHECK_FAILED: its rows
    are kept with check FAIL, and the run exits CHECK_FAILED (before: read as a crashed
    child, its rows dropped, "exit status 1")."""
    import bench_kernel

    def child(cmd, env):
        bad = env["RINGSEQ_CPU_ISA"] == "avx512"
        rows = [{"backend": b, "dtype": "fp32", "threads": 1, "mode": "fwd", "seqlen": 64,
                 "headdim": 16, "causal": True, "ms": 1.0, "rounds_ms": [1.0], "skipped": None,
                 "max_err": 5.0 if bad and b == "ringseq" else 1e-7, "plain_err": 1e-7,
                 "check": "FAIL" if bad and b == "ringseq" else "ok"}
                for b in ("ringseq", "torch_sdpa")]
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"results": rows, "core_probe_gflops": None}, f)
        return subprocess.CompletedProcess(cmd, bench_kernel.CHECK_FAILED if bad else 0)

    monkeypatch.setattr(bench_kernel.subprocess, "run", child)
    monkeypatch.setattr(bench_kernel.ringseq.kernels.extension, "cpu_isa_levels",
                        lambda: ["avx2", "avx512"])
    out = tmp_path / "k.json"
    with pytest.raises(SystemExit) as exit_:
        bench_kernel.main(["--device", "cpu", "--isa", "avx2,avx512", "--seqlens", "64",
                           "--headdims", "16", "--json", str(out)])
    assert exit_.value.code == bench_kernel.CHECK_FAILED
    text = capsys.readouterr().out
    assert "WARNING: ringseq fp32 s=64 d=16 causal fwd: max error 5.00e+00" in text, text
    rows = json.loads(out.read_text())["results"]
    assert {(r["level"], r["check"]) for r in rows if r["backend"] == "ringseq"} == {
        ("avx2", "ok"), ("avx512", "FAIL")}


def test_a_backend_without_the_soft_cap_is_skipped_with_its_reason(tmp_path):
    """(before: --softcap with --isa current ended in sdpa's NotImplementedError traceback)"""
    out = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kernel.py"),
                           "--device", "cpu", "--isa", "current", "--backends",
                           "ringseq,sdpa", "--window", "8", "--softcap", "10", "--seqlens",
                           "64", "--heads", "2", "--headdims", "16", "--causal", "true",
                           "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["skipped"] for r in rows if r["backend"] == "sdpa"] == [
        "cannot do logit soft-capping (softcap=10.0): torch's SDPA ops would have to appl"] * 2
    assert all(r["check"] == "ok" for r in rows if r["backend"] == "ringseq")


def test_core_probe_note_says_whether_the_two_ends_differ():
    from common import probe_note

    # 1.7 % apart: within the 5 % tolerance, no claim that the speed changed.
    assert probe_note(95.7, 94.1) == "95.7 GFLOP/s before, 94.1 after (within 5% of each other)"
    # 9.2 % apart (95.0 -> 86.3): flagged, with the spread.
    assert probe_note(95.0, 86.3) == ("95.0 GFLOP/s before, 86.3 after "
                                      "(apart by 9.2%: the machine's speed changed during the run)")
    assert "apart by 9.2%" in probe_note(86.3, 95.0)
    # just over the tolerance: flagged, and the printed spread does not round down onto it
    assert "apart by 5.3%" in probe_note(100.0, 94.7)


def test_levels_run_in_children_whose_rows_keep_their_level_probe_and_ratio(monkeypatch):
    import bench_kernel

    commands = []

    def fake_child(cmd, env):
        # A child writes its rows and its own core probe to the --json path it is given.
        commands.append((cmd, env))
        level = env["RINGSEQ_CPU_ISA"]
        speed = {"avx2": 2.0, "avx512": 4.0}[level]
        rows = [{"backend": b, "dtype": "fp32", "threads": 1, "mode": "fwd", "seqlen": 64,
                 "headdim": 16, "causal": True, "ms": ms, "rounds_ms": [ms, ms], "skipped": None}
                for b, ms in (("ringseq", 10.0 / speed), ("torch_sdpa", 10.0))]
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"results": rows, "core_probe_gflops": {"before": speed, "after": speed}}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_kernel.subprocess, "run", fake_child)
    _, args = bench_kernel.parse_args(["--device", "cpu", "--seqlens", "64", "--headdims", "16"])
    rows, peers, failed = bench_kernel.run_cpu_levels(args, ["avx2", "avx512"])
    assert peers == ["torch_sdpa_match"] and failed == {}
    # one child per level, with ringseq's level and torch's ISA capped to match
    assert [env["RINGSEQ_CPU_ISA"] for _, env in commands] == ["avx2", "avx512"]
    assert commands[0][1]["ATEN_CPU_CAPABILITY"] == "avx2"
    ours = {r["level"]: r for r in rows if r["backend"] == "ringseq"}
    assert ours["avx2"]["x_torch_sdpa_match"] == 2.0 and ours["avx512"]["x_torch_sdpa_match"] == 4.0
    assert ours["avx2"]["core_probe_gflops"] == {"before": 2.0, "after": 2.0}
    assert ours["avx512"]["core_probe_gflops"] == {"before": 4.0, "after": 4.0}


def test_a_level_whose_child_fails_is_named_and_the_others_are_kept(monkeypatch, tmp_path,
                                                                     capsys):
    """An ISA level's child killed (SIGKILL, as the OOM killer sends: subprocess reports -9)
    fails the run (exit 1), but the levels that finished are printed and written (before: a
    CalledProcessError traceback, and the finished levels' rows were lost)."""
    import bench_kernel

    def child(cmd, env):
        if env["RINGSEQ_CPU_ISA"] == "avx512":
            return subprocess.CompletedProcess(cmd, -9)
        rows = [{"backend": b, "dtype": "fp32", "threads": 1, "mode": "fwd", "seqlen": 64,
                 "headdim": 16, "causal": True, "ms": ms, "rounds_ms": [ms], "skipped": None}
                for b, ms in (("ringseq", 5.0), ("torch_sdpa", 10.0))]
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"results": rows, "core_probe_gflops": None}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_kernel.subprocess, "run", child)
    monkeypatch.setattr(bench_kernel.ringseq.kernels.extension, "cpu_isa_levels",
                        lambda: ["baseline", "avx2", "avx512"])
    out = tmp_path / "levels.json"
    with pytest.raises(SystemExit) as stop:
        bench_kernel.main(["--device", "cpu", "--isa", "avx2,avx512", "--seqlens", "64",
                           "--headdims", "16", "--json", str(out)])
    assert stop.value.code == 1
    printed = capsys.readouterr().out
    assert "FAILED: ISA level avx512: exit status -9 (killed by signal 9)" in printed, printed
    data = json.loads(out.read_text())
    assert data["failed_children"] == {"avx512": "exit status -9 (killed by signal 9)"}
    kept = [r for r in data["results"] if r["backend"] == "ringseq"]
    assert [r["level"] for r in kept] == ["avx2"] and kept[0]["x_torch_sdpa_match"] == 2.0


def test_ratio_to_must_name_a_timed_peer():
    """--ratio-to a peer --backends does not time is a usage error (its columns were all "-");
    --masks times its own peer (SDPA with a mask), which --ratio-to may then name."""
    import bench_kernel
    _, args = bench_kernel.parse_args(["--device", "cpu", "--backends", "ringseq", "--ratio-to",
                                       "torch_sdpa", "--masks", "16:0"])
    assert args.ratio_to == "torch_sdpa"
    with pytest.raises(SystemExit) as stop:
        bench_kernel.parse_args(["--device", "cpu", "--backends", "ringseq", "--ratio-to",
                                 "torch_sdpa"])
    assert stop.value.code == 2


def test_a_run_that_times_no_row_fails():
    """Every backend asked for skipped here (flash_attn on a machine without it): exit status
    1 naming it (before: an empty table and exit status 0)."""
    import importlib.util
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here: its rows are timed")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kernel.py"),
                           "--device", "cpu", "--isa", "current", "--backends", "flash_attn",
                           "--seqlens", "64", "--headdims", "64", "--repeats", "1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED: no row was timed: every backend asked for was skipped here" in proc.stdout


def test_a_per_level_run_whose_sdpa_child_skips_every_row_still_reports():
    """The native-SDPA child takes no soft-cap: its rows are skipped, and ringseq's rows are
    the run's result (a first version of the no-row failure failed the whole run there)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_kernel.py"),
                           "--device", "cpu", "--isa", "baseline", "--sdpa-isa", "native",
                           "--softcap", "30", "--seqlens", "64", "--headdims", "64", "--modes",
                           "fwd", "--warmup", "0", "--repeats", "1", "--heads", "2",
                           "--threads", "1"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no soft-cap in SDPA" in proc.stdout and "FAILED" not in proc.stdout
