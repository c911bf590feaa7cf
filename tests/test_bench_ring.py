"""The main job's command line (benchmarks/bench_ring.py): bad arguments stop with an argparse
error before any rank starts, --help describes every option, and a small run writes its JSON
with every row's invariants evaluated; so do its --sp-mode, --window and --docs jobs, and
every job reports how busy the machine was (spawned ranks and torchrun)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from command_lines import run_command_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench_ring.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _bench(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def test_help_describes_every_option():
    import bench_ring  # torch-free at import: the first line comes before torch loads
    assert "torch" not in bench_ring.__dict__
    for action in bench_ring.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
    proc = _bench("--help")
    assert proc.returncode == 0 and "--layouts" in proc.stdout and "zigzag" in proc.stdout


def test_sp_mode_all_runs_the_modes_that_fit_and_differ():
    """``--sp-mode all`` leaves out the modes whose sizes do not fit, and those that would
    repeat another (a hybrid with a ring of one is the Ulysses mode; a double ring of one inner
    ring the plain ring or the hybrid). Before, it refused modes it had picked itself (W = 3,
    W = 1) or ran a hybrid 2 x 1 row at W = 2."""
    from sp_modes import SP_MODE_NAMES, fitting_sp_modes
    every = list(SP_MODE_NAMES)
    for (world, heads, ulysses, inner), want in [
            ((1, 8, 2, 2), ["ring"]), ((2, 8, 2, 2), ["ring", "ulysses"]),
            ((3, 6, 3, 2), ["ring", "ulysses"]), ((4, 6, 2, 2), ["ring", "hybrid", "double_ring"]),
            ((6, 6, 3, 2), ["ring", "ulysses", "hybrid", "double_ring"]),
            ((8, 8, 2, 2), every), ((4, 4, 1, 2), ["ring", "ulysses", "double_ring"])]:
        assert fitting_sp_modes(every, True, world, heads, ulysses, inner) == want, world
    # named modes are refused as before
    with pytest.raises(SystemExit, match=r"^--sp-mode double_ring: --inner-ring-size 2 must "
                                         r"divide the ring size 3"):
        fitting_sp_modes(["double_ring"], False, 3, 6, 3, 2)


# (command line, what its usage error says)
_USAGE_CASES = [
    # (before: get_layout's list, with the per-batch layouts refused below and "a Layout
    # instance", which a command line cannot give)
    (["--layouts", "foo"], "--layouts 'foo': expected a comma list of contiguous, zigzag and "
                           "stripe (packed documents: --docs)"),
    (["--docs="], "--docs '': give seeded, longtail or a comma list of lengths"),  # (dropped)
    (["--seqlen", "1000", "--world-size", "3", "--layouts", "zigzag"], "multiple of 6"),
    (["--modes", "fwd,bwd"], "'bwd' not among fwd, fwd_bwd"),
    (["--heads", "8", "--heads-kv", "3"], "--heads-kv 3 must divide --heads 8"),
    (["--world-size", "0"], "must be a positive integer"),
    (["--memory-scaling", "1,x"], "comma list of positive integers"),
    (["--timeout", "-5"], "positive number of seconds"),
    (["--sp-mode", "bogus"], "--sp-mode takes ring, ulysses"),
    (["--docs", "foo"], "comma list of ints: 'foo'"),
    (["--docs", "5000,5000", "--seqlen", "1024"], "sum to 10000 > --seqlen 1024"),
    (["--window", "100", "--docs", "seeded"], "--window and --docs are two jobs"),
    # (before: ran as documents [100, 924], labelled "docs 100,-50")
    (["--docs", "100,-50", "--seqlen", "1024"], "lengths must be >= 0, got -50"),
    # (before: silently ignored by the mode comparison)
    (["--sp-mode", "ring", "--memory-scaling", "2"], "--memory-scaling does not apply"),
    (["--sp-mode", "ring", "--modes", "fwd"], "--modes does not apply"),
    (["--sp-mode", "ring", "--causal", "both"], "--causal both does not apply"),
    # (before: the whole run, then a traceback writing the file)
    (["--json", "/"], "ends in '/': a directory, not a file path"),
    (["--json", "no-such-dir/out/"], "ends in '/': a directory, not a file path"),
    (["--json", "/tmp"], "is a directory, not a file path"),
    (["--json", "/proc/no-such-dir/out.json"], "cannot write"),
    # (before: the whole run, then a traceback and exit status 1; or 'chart' written as
    # chart.png while 'wrote chart' was printed)
    (["--plot", "/proc/no-such-dir/plot.png"], "cannot write"),
    (["--plot", "chart"], "'chart' must end in .png"),
    # (before: ignored by the masked jobs; a bare message and exit status 1 for 'all')
    (["--window", "64", "--memory-scaling", "1,2"], "--memory-scaling does not apply"),
    (["--docs", "seeded", "--sp-mode", "ring"], "--sp-mode does not apply"),
    # (each condition named by its own option; before: "adjust --ulysses-size", which the
    # Ulysses mode does not take, and "ring 0" for a degree past the world size)
    (["--sp-mode", "ulysses", "--heads", "6", "--world-size", "4"],
     "--sp-mode ulysses: --heads 6 must be a multiple of the Ulysses degree 4 (the world size)"),
    (["--sp-mode", "hybrid", "--ulysses-size", "3", "--world-size", "2"],
     "--sp-mode hybrid: the Ulysses degree 3 (--ulysses-size) must divide --world-size 2"),
    # (before: blamed --seqlen and advised a library call)
    (["--layouts", "documents"], "--layouts documents: a layout of packed documents"),
    # (before: the ranks failed on a length they had cut to a multiple of W, exit status 3)
    (["--docs", "seeded", "--seqlen", "1001", "--world-size", "2"],
     "--seqlen 1001 with --docs at world size 2"),
    # (before: silently ignored by the masked jobs)
    (["--window", "64", "--batch", "2"], "--batch does not apply"),
    (["--docs", "seeded", "--causal", "false"], "--causal does not apply"),
    # (before: random.sample's "Sample larger than population or is negative")
    (["--docs", "seeded", "--seqlen", "8"], "'seeded' cuts the sequence at 9 places: it needs "
                                            "at least 10 tokens, got 8"),
    (["--window", "64", "--modes", "fwd"], "--modes does not apply"),
    # (before: no mode ran and the run exited 0)
    (["--sp-mode", ","], "--sp-mode needs at least one mode"),
    # (before: a plain ring labelled a double ring, held to the double ring's byte formula)
    # (before: run and labelled as asked, moving none of the mode's own bytes)
    (["--sp-mode", "hybrid", "--ulysses-size", "1", "--world-size", "2"],
     "--sp-mode hybrid: --ulysses-size 1 moves no heads: that is the plain ring"),
    (["--sp-mode", "double_ring", "--inner-ring-size", "2", "--world-size", "2"],
     "--sp-mode double_ring: --inner-ring-size 2 is the whole ring of 2 ranks"),
    (["--sp-mode", "ulysses", "--world-size", "1"],
     "--sp-mode ulysses: --world-size 1: a Ulysses degree of 1 moves nothing"),
    (["--sp-mode", "double_ring", "--inner-ring-size", "1", "--world-size", "4"],
     "--inner-ring-size 1 must be at least 2"),
    # (before: taken and ignored: the Documents layout ran, the plain ring ran)
    (["--docs", "seeded", "--layouts", "stripe"],
     "--layouts stripe with --docs: the documents job runs the Documents layout only"),
    (["--ulysses-size", "4"], "--ulysses-size 4: sizes a mode of --sp-mode"),
    (["--window", "64", "--inner-ring-size", "4"], "--inner-ring-size 4: sizes a mode of --sp-mode"),
    # (given with their default values too)
    (["--docs", "seeded", "--layouts", "contiguous,zigzag,stripe"], "with --docs: the documents"),
    (["--window", "64", "--ulysses-size", "2"], "--ulysses-size 2: sizes a mode of --sp-mode"),
]


@pytest.fixture(scope="module")
def usage_runs(tmp_path_factory):
    """Every case's command line, run in one child process (tests/command_lines.py: one torch
    import for all of them, not one per case)."""
    cases = [a for a, _ in _USAGE_CASES]
    runs = run_command_lines(BENCH, cases, cwd=str(tmp_path_factory.mktemp("bench_ring_usage")))
    return {tuple(a): r for a, r in zip(cases, runs)}


@pytest.mark.parametrize("args, message", _USAGE_CASES)
def test_bad_arguments_stop_before_any_rank_starts(usage_runs, args, message):
    proc = usage_runs[tuple(args)]
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "local CPU ranks" not in proc.stdout, proc.stdout


def test_a_failed_spot_check_is_kept_when_the_row_is_measured_again():
    """A row whose overhead is below the bar is measured once more; a wrong first result
    (which may well time fast) keeps the row failed (before: the repeat's check replaced it,
    and a run whose first measurement was wrong exited 0)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from common import keep_failed_check
    first = {"check_ok": False, "max_err": 1.0, "plain_err": 1e-7}
    again = {"check_ok": True, "max_err": 1e-7, "plain_err": 1e-7, "ms": 2.0}
    assert keep_failed_check(first, dict(again)) == dict(again, check_ok=False, max_err=1.0)
    assert keep_failed_check(dict(again), dict(again, ms=3.0)) == dict(again, ms=3.0)


def test_small_run_writes_rows_with_their_checks(tmp_path):
    out = tmp_path / "ring.json"
    proc = _bench("--world-size", "2", "--seqlen", "512", "--layouts", "contiguous,zigzag",
                  "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].endswith("bench_ring: starting (importing torch and ringseq) ...")
    data = json.loads(out.read_text())
    rows = data["results"]
    assert [(r["layout"], r["mode"]) for r in rows] == [
        ("contiguous", "fwd"), ("contiguous", "fwd_bwd"), ("zigzag", "fwd"), ("zigzag", "fwd_bwd")]
    for r in rows:
        assert r["check_ok"] and r["max_err"] <= 2 * r["plain_err"] + 1e-5, r
        assert r["ring_overhead"] == pytest.approx(r["ms"] / r["compute_only_ms"])
        # a timing invariant that still fails after the second measurement carries a warning
        assert (r["ring_overhead"] >= 0.95) or r["warnings"], r
    for b in data["load_balance_all"]:
        # W=2 causal: the busiest rank sees 3/4 of the pairs under contiguous, 1/2 under
        # zigzag (2 - 1/W as s grows; diagonals make it 1.499 at s=512)
        assert b["ideal"] == pytest.approx(1.5, rel=2e-3)
        assert b["ok"] or "warning" in b, b
    assert set(data["machine_load"]) >= {"other_cores_during", "load_average_before"}
    assert isinstance(data["warnings"], list)
    _load_reported(proc.stdout, data)


def _load_reported(stdout, data):
    """The run printed and wrote the machine's load over it (other processes' cores), and
    named the CPU (cpuid family / model / stepping where Linux shows them) and the kernel's
    ISA level (before: the --sp-mode, --window and --docs reports named neither)."""
    from common import cpu_description
    assert "other processes used" in stdout, stdout[-3000:]
    assert f"# CPU: {cpu_description()}, " in stdout, stdout[-3000:]
    assert "ringseq CPU kernel ISA " in stdout, stdout[-3000:]
    load = data["machine_load"]
    assert 0.0 <= load["other_cores_during"] <= os.cpu_count(), load


def test_sp_mode_run_checks_bytes_and_numbers_and_reports_the_load(tmp_path):
    """--sp-mode: every mode's bytes equal docs/sp_modes.md's formulas and its output passes
    the float64 spot check; TFLOP/s, peak memory (the ring's exchange buffers included) and
    the machine's load are reported (before: no load, TFLOP/s or peak memory). ``all`` at
    W = 2 runs the two modes that differ there and says which it left out."""
    out = tmp_path / "sp.json"
    proc = _bench("--sp-mode", "all", "--world-size", "2", "--seqlen", "256",
                  "--repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--sp-mode all: leaving out hybrid, double_ring, hybrid_double_ring" in \
        proc.stdout, proc.stdout[-3000:]
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["ring", "ulysses"]
    assert "causal=True, layout zigzag\n" in proc.stdout, proc.stdout[-3000:]  # (the one run)
    for r in data["results"]:
        assert r["check_ok"] and r["bytes_as_formula"], r
        assert r["tflops"] == pytest.approx(3.5 * 4 * 256 * 256 / 2 * 8 * 64 / r["ms"] / 1e9,
                                            rel=0.01), r  # (causal fwd+bwd, h 8, d 64)
    ring, ulysses = (r["peak_mib_per_rank"] for r in data["results"])
    if ring is not None:  # (Linux: the resident-set high-water mark)
        # the ring's cached exchange buffers count (before: left in the baseline, 1.4 against
        # Ulysses' 4.4 MiB here; both need about the same)
        assert 0.5 * ulysses <= ring <= 2 * ulysses, (ring, ulysses)
    _load_reported(proc.stdout, data)


def test_sp_mode_formulas_count_the_padding_and_the_checks_off_lse_slot(tmp_path):
    """At a shape whose dK/dV accumulator segment (48 bytes) and all-to-all pieces (12 bytes)
    are padded, with the consistency checks off (Ulysses' backward then always carries the lse
    gradient's slot), the counted bytes still equal the formulas (before: "= formula" read
    False for correct counts; with the checks on the padding alone: one run covers both)."""
    out = tmp_path / "sp.json"
    proc = _bench("--sp-mode", "ring,ulysses", "--world-size", "2", "--seqlen", "12",
                  "--heads", "2", "--headdim", "1", "--dtype", "bf16", "--repeats", "1",
                  "--warmup", "0", "--check-rows", "2", "--json", str(out),
                  env={"RINGSEQ_CHECK_CONSISTENCY": "0"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["ring", "ulysses"]
    for r in rows:
        assert r["check_ok"] and r["bytes_as_formula"], r


@pytest.mark.parametrize("job", [["--window", "64"], ["--docs", "100,50"]])
def test_masked_jobs_run_and_report_the_load(tmp_path, job):
    """--window / --docs: every case's row is written, and the machine's load is reported
    (before: not reported); the arguments are written as the numbers they are, and a
    documents row has the lengths it ran (before: strings, and "100,50" without the 874
    tokens the last document absorbs). The overhead's baseline is timed with the main job's
    clock (a thread's CPU time with one thread per rank; before: wall time, 0.6-0.8 on a
    loaded machine), and an overhead below 0.95 is measured again, then warned about (before:
    printed without a word)."""
    out = tmp_path / "masked.json"
    proc = _bench(*job, "--world-size", "2", "--seqlen", "1024", "--repeats", "1",
                  "--threads-per-rank", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["results"], data
    for r in data["results"]:
        assert r["ms"] > 0 and r["overhead"] == pytest.approx(r["ms"] / r["compute_ms"]), r
        # the ring's output against float64 attention with the case's mask
        assert r["check_ok"] and r["max_err"] <= 2 * r["plain_err"] + 1e-6, r
        if job[0] == "--docs":
            assert r["doc_lengths"] == [100, 924], r
        assert r["compute_clock"] == "cpu", r  # (one thread per rank)
        if r["overhead"] < 0.95:
            assert r.get("remeasured") and any(w.startswith(f"{r['name']}: ring overhead")
                                               for w in data["warnings"]), data["warnings"]
            assert f"WARNING: {r['name']}: ring overhead" in proc.stdout, proc.stdout[-3000:]
    assert data["args"]["world_size"] == 2 and data["args"]["seqlen"] == 1024, data["args"]
    _load_reported(proc.stdout, data)


def test_plot_without_matplotlib_stops_before_any_rank_starts():
    import importlib.util
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed here: --plot is valid")
    proc = _bench("--plot", "out.png")
    assert proc.returncode == 2, proc.stderr
    assert "--plot out.png: needs matplotlib" in proc.stderr, proc.stderr
    assert "local CPU ranks" not in proc.stdout, proc.stdout


def _burn_one_cpu_second(args, device):
    import time
    start = time.process_time()
    while time.process_time() - start < 1.0:
        pass


def test_the_ranks_cpu_time_is_not_counted_as_other_processes_load():
    """The local ranks are started by a fork server, not as this process's children: their CPU
    time reaches own_cpu_seconds through spawn_cpu_ranks (before: the run-wide load line
    counted them as other processes and reported a busy machine on an idle one)."""
    import common
    before = common.own_cpu_seconds()
    common.spawn_cpu_ranks(2, _burn_one_cpu_second, None, 60, 1)
    assert common.own_cpu_seconds() - before >= 2.0


_FAULT = """import os
if os.environ.get("RINGSEQ_TEST_FAULT_RANK"):
    import ringseq, torch, torch.distributed as dist
    _calls = [0]
    def _faulty(call):
        def faulty(*a, **k):
            out = call(*a, **k)
            _calls[0] += 1  # (RINGSEQ_TEST_FAULT_FROM_CALL: this process's calls before it pass)
            if dist.is_initialized() and \
                    _calls[0] >= int(os.environ.get("RINGSEQ_TEST_FAULT_FROM_CALL", "1")) and \
                    dist.get_rank() == int(os.environ["RINGSEQ_TEST_FAULT_RANK"]):
                fault = float(os.environ.get("RINGSEQ_TEST_FAULT", "1.5e-2"))
                o = out[0] if isinstance(out, tuple) else out
                if os.environ.get("RINGSEQ_TEST_FAULT_ROWS") == "tail":  # the last half only
                    o = torch.cat([o[:, :o.shape[1] // 2], o[:, o.shape[1] // 2:] + fault], 1)
                else:
                    o = o + fault
                out = (o,) + out[1:] if isinstance(out, tuple) else o
            return out
        return faulty
    ringseq.ring_flash_attn_func = _faulty(ringseq.ring_flash_attn_func)
    ringseq.usp_attn_func = _faulty(ringseq.usp_attn_func)
"""


@pytest.mark.parametrize("job", [["--layouts", "contiguous", "--modes", "fwd"],
                                 ["--sp-mode", "ulysses"]], ids=["ring", "sp-mode"])
def test_under_torchrun_the_report_says_how_busy_the_machine_was(tmp_path, job):
    """Under torchrun rank 0 subtracts every rank's CPU time from the machine's, as for
    spawned ranks (before: no line about other processes, and null in the JSON). The ranks
    run --threads-per-rank's count, which the report states (before: the launcher's
    OMP_NUM_THREADS ran, 2 here, while the report said 1)."""
    out = tmp_path / "ring.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", BENCH, "--seqlen", "512", *job,
                           "--repeats", "1", "--threads-per-rank", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "this run's ranks use 2" in proc.stdout, proc.stdout[-3000:]
    report = json.loads(out.read_text())
    assert report["environment"]["cpu_threads"] == 1, report["environment"]
    _load_reported(proc.stdout, report)


def test_a_wrong_result_on_one_rank_fails_the_spot_check(tmp_path):
    """Each rank's error is bounded by its own rows' plain error: 1.5e-2 added to rank 1's
    bf16 output (its rows' plain error ~3e-3, bound ~7e-3) fails the row, exit status 1
    (before: compared with rank 0's larger plain error, 1.1e-2, and passed). The fault is in
    the last half of the shard's rows only, zigzag's second chunk: the checked rows span the
    shard (before: its first --check-rows rows, all in the first chunk; the row passed)."""
    (tmp_path / "sitecustomize.py").write_text(_FAULT)
    env = dict(os.environ, RINGSEQ_TEST_FAULT_RANK="1", RINGSEQ_TEST_FAULT_ROWS="tail",
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, BENCH, "--world-size", "2", "--seqlen", "1024",
                           "--heads", "2", "--dtype", "bf16", "--layouts", "zigzag",
                           "--modes", "fwd", "--repeats", "1"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spot check failed" in proc.stdout, proc.stdout[-3000:]
    # the table's check column says FAIL, not the WARN of a timing warning
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("zigzag ")]
    assert rows and all(r[-1] == "FAIL" for r in rows), proc.stdout[-3000:]


@pytest.mark.parametrize("job, rank", [(["--layouts", "contiguous", "--modes", "fwd"], "0"),
                                       (["--sp-mode", "ring"], "1")], ids=["layout", "sp-mode"])
def test_an_all_nan_result_on_one_rank_fails_the_spot_check(tmp_path, job, rank):
    """A NaN error on one rank counts as infinite over the ranks (before: gloo's MAX dropped
    it, the row passed and the run exited 0)."""
    (tmp_path / "sitecustomize.py").write_text(_FAULT)
    env = dict(os.environ, RINGSEQ_TEST_FAULT_RANK=rank, RINGSEQ_TEST_FAULT="nan",
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "ring.json"
    proc = subprocess.run([sys.executable, BENCH, "--world-size", "2", "--seqlen", "512", *job,
                           "--repeats", "1", "--warmup", "0", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spot check failed" in proc.stdout.lower() and " inf " in proc.stdout, \
        proc.stdout[-3000:]
    data = json.loads(out.read_text())
    rows = data.get("results") or data["sp_modes"]
    assert rows and not any(r["check_ok"] for r in rows), rows


@pytest.mark.parametrize("job", [["--layouts", "contiguous", "--modes", "fwd"],
                                 ["--sp-mode", "ring"]], ids=["layout", "sp-mode"])
def test_a_result_wrong_only_in_the_timed_calls_fails_the_spot_check(tmp_path, job):
    """With --warmup 0 --repeats 1 a row makes three calls: the first, the peak-memory call
    (the sp-mode job: a warm-up, then the peak-memory call) and the timed one. A fault from
    the third call on (a defect of reused exchange buffers or cached plans) fails the row:
    the last timed call's output is spot-checked too (before: only a call on fresh buffers
    was, and the run exited 0 with every timed call wrong)."""
    (tmp_path / "sitecustomize.py").write_text(_FAULT)
    env = dict(os.environ, RINGSEQ_TEST_FAULT_RANK="1", RINGSEQ_TEST_FAULT_FROM_CALL="3",
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "ring.json"
    proc = subprocess.run([sys.executable, BENCH, "--world-size", "2", "--seqlen", "512", *job,
                           "--causal", "true", "--repeats", "1", "--warmup", "0",
                           "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spot check failed" in proc.stdout.lower(), proc.stdout[-3000:]
    data = json.loads(out.read_text())
    rows = data.get("results") or data["sp_modes"]
    assert rows and not any(r["check_ok"] for r in rows), rows


@pytest.mark.parametrize("job", [["--window", "64", "--layouts", "contiguous"],
                                 ["--docs", "seeded"]], ids=["window", "docs"])
def test_a_wrong_result_fails_the_masked_jobs_too(tmp_path, job):
    """The masked jobs check the ring's output against float64 attention with their mask
    (before: they checked nothing, and a wrong result exited 0)."""
    (tmp_path / "sitecustomize.py").write_text(_FAULT)
    env = dict(os.environ, RINGSEQ_TEST_FAULT_RANK="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, BENCH, "--world-size", "2", "--seqlen", "512", *job,
                           "--repeats", "1", "--warmup", "0"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spot check failed" in proc.stdout, proc.stdout[-3000:]


def test_ranks_past_their_timeout_exit_with_status_3():
    """A run whose ranks time out ends with exit status 3 and a line saying so (before: a
    RankTimeout traceback, exit status 1, which reads as a failed spot check)."""
    proc = _bench("--world-size", "2", "--seqlen", "16384", "--layouts", "contiguous",
                  "--modes", "fwd_bwd", "--timeout", "1")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "bench_ring.py: the local ranks did not finish (RankTimeout)" in proc.stderr, \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr.split("(RankTimeout)")[0]
