"""Shared benchmark plumbing: timing, FLOP counts, peak memory, progress, tables, JSON."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

# The rank spawner is shared with the tests (tests/dist_utils.py), not part of the library.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dist_utils import RankError, RankTimeout, run_ranks  # noqa: E402

import json_io  # noqa: E402 - (this folder: the scripts run from it, the tests add it)


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, mode="fwd"):
    """FLOPs as flash-attn counts them: forward 4·b·h·s_q·s_k·d (halved for causal);
    backward 2.5× forward; "fwd_bwd" is their sum."""
    fwd = 4 * batch * nheads * seqlen_q * seqlen_k * headdim / (2 if causal else 1)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


# the benchmarks' --dtype names
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
# absolute floor of the spot check (docs/design.md tolerance: 2x plain same-dtype error + floor;
# the tests' default floors: a float32 floor of 1e-5 let an error 27x plain pass)
CHECK_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def plain_attention(q, k, v, dtype, causal, rows=None, window=(-1, -1), cu_seqlens=None,
                    softcap=0.0):
    """Plain softmax attention computed in ``dtype``: the float64 reference, or the same-dtype
    attention whose error flash-attn's rule scales. q (b, s_q, h, d), or only its query rows
    at the global positions ``rows`` (an int tensor); k, v (b, s_k, h_kv, d), their heads
    repeated for GQA; causal: a query sees the keys up to its position; ``window`` (left,
    right): and only those within it (-1: unbounded); ``cu_seqlens``: and only those of its
    own document; ``softcap``: scores soft-capped, ``softcap * tanh(score / softcap)``.
    Returns (b, rows, h, d) in ``dtype``, differentiable in q, k, v (every query row must see
    a key: causal attention always does)."""
    pos = torch.arange(q.shape[1]) if rows is None else rows
    g = q.shape[2] // k.shape[2]
    qs = q[:, pos].to(dtype)
    ks, vs = (t.to(dtype).repeat_interleave(g, 2) for t in (k, v))  # (b, s_k, h, d)
    scores = torch.einsum("bqhd,bkhd->bhqk", qs, ks) * q.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    hidden = _hidden(pos, k.shape[1], causal, window, cu_seqlens)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(
        scores.masked_fill(hidden, float("-inf")), -1), vs)


def plain_attention_grads(q, k, v, dout, dtype, causal, rows, window=(-1, -1), softcap=0.0):
    """(dq, dk, dv) of :func:`plain_attention` in ``dtype`` for the output gradient ``dout``
    (b, rows, h, d) on the query rows ``rows``, by the flash backward's formula (D =
    rowsum(dO * O), dS = P (dP - D)) rather than autograd's softmax backward (sum(dP * P)):
    where a row sees one key, autograd's is exact (0) and would make the rule's bound 0,
    while every flash-style backward leaves a rounding there. Shapes as q, k, v."""
    g = q.shape[2] // k.shape[2]
    qs = q[:, rows].to(dtype)                                         # (b, rows, h, d)
    ks, vs = (t.to(dtype).repeat_interleave(g, 2) for t in (k, v))    # (b, s_k, h, d)
    scale = q.shape[-1] ** -0.5
    raw = torch.einsum("bqhd,bkhd->bhqk", qs, ks) * scale             # (b, h, rows, s_k)
    capped = torch.tanh(raw / softcap) if softcap else None
    scores = softcap * capped if softcap else raw
    p = torch.softmax(scores.masked_fill(_hidden(rows, k.shape[1], causal, window, None),
                                         float("-inf")), -1)
    do = dout.to(dtype)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vs)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vs)
    delta = (do * o).sum(-1).transpose(1, 2).unsqueeze(-1)           # (b, h, rows, 1)
    ds = p * (dp - delta)
    if softcap:
        ds = ds * (1 - capped * capped)
    dq = torch.zeros(q.shape, dtype=dtype)
    dq[:, rows] = torch.einsum("bhqk,bkhd->bqhd", ds, ks) * scale
    b, s_k, h_kv, d = k.shape
    dk = (torch.einsum("bhqk,bqhd->bkhd", ds, qs) * scale).view(b, s_k, h_kv, g, d).sum(3)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do).view(b, s_k, h_kv, g, d).sum(3)
    return dq, dk, dv


def max_error(x, ref) -> float:
    """max |x - ref| as a float, infinite where x has a NaN (Python's max() and gloo's MAX can
    drop a NaN: a NaN result passed checks)."""
    return float(torch.nan_to_num((x.double().cpu() - ref.double().cpu()).abs(),
                                  nan=float("inf")).max())


def _hidden(pos, s_k, causal, window, cu_seqlens) -> torch.Tensor:
    """(rows, s_k) bool: the keys each query row at global position ``pos`` does not see."""
    keys = torch.arange(s_k)[None, :]
    hidden = torch.zeros(len(pos), s_k, dtype=torch.bool)  # (rows, s_k)
    if causal:
        hidden |= keys > pos[:, None]
    left, right = window
    if left >= 0:
        hidden |= keys < pos[:, None] - left
    if right >= 0:
        hidden |= keys > pos[:, None] + right
    if cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(s_k), torch.tensor(cu_seqlens[1:]),
                              right=True)  # (s_k,) each token's document
        hidden |= doc[None, :] != doc[pos][:, None]
    return hidden


def checked_rows(s_local: int, rows: int) -> torch.Tensor:
    """The local query rows a spot check compares: ``rows`` of the shard's ``s_local``,
    evenly spaced from the first to the last, so that every chunk of a layout that holds
    several (zigzag's two) is checked (before: the first rows, all in zigzag's first chunk,
    so a wrong second chunk passed)."""
    rows = min(rows, s_local)
    return torch.linspace(0, s_local - 1, rows, dtype=torch.float64).round().long().unique()


def spot_check(full, out_local, positions, causal, rows, window=(-1, -1), cu_seqlens=None):
    """Max |out - float64| on ``rows`` of this rank's queries spread over its shard
    (:func:`checked_rows`; ``positions``: the global positions of all its queries), and plain
    same-dtype attention's error there (docs/design.md's tolerance base). full = (q, k, v) of
    the whole sequence; ``window`` and ``cu_seqlens`` as :func:`plain_attention`."""
    q, k, v = full
    local = checked_rows(out_local.shape[1], rows)  # (rows,)
    pos = positions[local]
    mask = dict(window=window, cu_seqlens=cu_seqlens)
    ref = plain_attention(q, k, v, torch.float64, causal, pos, **mask)
    plain = (plain_attention(q, k, v, q.dtype, causal, pos, **mask) if q.dtype != torch.float64
             else ref)
    return (float((out_local[:, local.to(out_local.device)].double().cpu() - ref).abs().max()),
            float((plain.double() - ref).abs().max()))


def worst(*errors: float) -> float:
    """The largest of spot-check errors, a NaN as inf (Python's max keeps or drops a NaN by
    the order of its arguments)."""
    return max(float("inf") if e != e else e for e in errors)


def keep_failed_check(first: dict, row: dict) -> dict:
    """``row``, a measurement repeated after ``first`` (an overhead below the bar), with
    ``first``'s spot check where that one failed: a wrong result, which may well time fast,
    must not pass by being measured again (before: the repeat's check replaced it)."""
    if not first["check_ok"]:
        row.update(check_ok=False, max_err=first["max_err"], plain_err=first["plain_err"])
    return row


def max_over_ranks(values, device=None) -> torch.Tensor:
    """(len(values),) float64: each value's maximum over the ranks of the default group, a
    NaN on any rank as inf. (gloo's MAX drops a NaN or keeps it by the order of its operands:
    a rank whose output was all NaN passed the spot check.)"""
    t = torch.tensor([float(x) for x in values], dtype=torch.float64, device=device)
    t = torch.nan_to_num(t, nan=float("inf"), posinf=float("inf"))  # (len(values),)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, warmup=1, repeats=3, clock="wall"):
    """Median time of fn() in ms: wall time (CUDA events on GPU, perf_counter on CPU), or with
    clock="cpu" the calling thread's CPU time (time.thread_time), which other jobs sharing the
    machine do not inflate; only meaningful when all the work runs on the calling thread (one
    torch thread)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            now = time.thread_time if clock == "cpu" else time.perf_counter
            t0 = now()
            fn()
            times.append((now() - t0) * 1e3)
    return statistics.median(times)


class PeakMemory:
    """Peak memory of a block above its starting point, in bytes.

    CUDA: torch.cuda.max_memory_allocated. CPU (Linux): the resident-set high-water mark
    (VmHWM), reset through /proc/self/clear_refs; None where that is unavailable.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _reset_rss_peak()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.base is not None:
            self.peak = max(0, _status_kb("VmHWM") * 1024 - self.base)
        return False


def _pin_malloc_to_mmap():
    """Makes glibc serve large blocks with mmap and give them back on free, so that the
    resident-set high-water mark of a call reflects what it allocated rather than what an
    earlier call left cached in the heap (glibc otherwise raises its mmap threshold
    dynamically and keeps freed blocks resident)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 17)
        libc.mallopt(m_trim_threshold, 1 << 17)
    except (OSError, AttributeError):
        pass


if sys.platform.startswith("linux"):
    _pin_malloc_to_mmap()


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_rss_peak():
    """Resets VmHWM to the current RSS; returns the current RSS in bytes, or None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024
    except OSError:
        return None


_T0 = time.time()


def set_progress_start(t0):
    """Elapsed times in progress lines count from t0 (time.time()); spawned ranks get the
    parent's start so every line of one run shares one clock."""
    global _T0
    _T0 = t0


def progress(msg):
    """One line on stdout, flushed at once (also when stdout is a file or a pipe), prefixed with
    the time since the run started."""
    print(f"[{time.time() - _T0:7.1f}s] {msg}", flush=True)


class Stage:
    """Prints `name ...` when entered and `name: done in X s` when left (only when `enabled`,
    e.g. on rank 0); `note` may be set inside the block to extend the closing line."""

    def __init__(self, name, enabled=True):
        self.name, self.enabled, self.note = name, enabled, ""

    def __enter__(self):
        self.t0 = time.time()
        if self.enabled:
            progress(f"{self.name} ...")
        return self

    def __exit__(self, exc_type, *exc):
        if self.enabled:
            state = "failed" if exc_type else "done"
            progress(f"{self.name}: {state} in {time.time() - self.t0:.1f} s"
                     + (f" ({self.note})" if self.note else ""))
        return False


def _allowed_cpus():
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def usable_cores():
    """Physical cores this process may run on: its affinity mask, with SMT siblings (logical
    CPUs of one core, /sys/devices/system/cpu/cpuN/topology) counted once. Two ranks on sibling
    CPUs share one core's arithmetic units, so for ranks that must run in parallel they count
    as one core. Falls back to the logical CPU count where the topology is not readable."""
    cpus = _allowed_cpus()
    cores = set()
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as f:
                pkg = f.read().strip()
            with open(base + "core_id") as f:
                core = f.read().strip()
        except OSError:
            return len(cpus)
        cores.add((pkg, core))
    return max(1, len(cores))


def logical_cpus():
    """Logical CPUs this process may run on (affinity mask)."""
    return len(_allowed_cpus())


def proc_stat():
    """(busy, total) jiffies summed over all CPUs since boot (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(start, end):
    """Average logical CPUs busy between two proc_stat() samples (None if unknown)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1]) * len(os.sched_getaffinity(0)
                                                             if hasattr(os, "sched_getaffinity")
                                                             else range(os.cpu_count() or 1))


def _cpu_seconds(who) -> float:
    import resource
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


# CPU seconds of the local ranks this process ran and that finished: they are started by a
# fork server (tests/dist_utils.py), not as children of this process, so each reports its own
_RANKS_CPU_SECONDS = [0.0]


def own_cpu_seconds():
    """CPU seconds of this process, its finished (waited-for) children and the local ranks it
    ran (spawn_cpu_ranks), all threads."""
    import resource
    return (_cpu_seconds(resource.RUSAGE_SELF) + _cpu_seconds(resource.RUSAGE_CHILDREN)
            + _RANKS_CPU_SECONDS[0])


class MachineLoad:
    """How busy the machine is with other processes: sampled for a moment before the ranks
    start (``before``), and over the whole run (``after``: the machine's busy time minus this
    process's and its finished ranks' CPU time, and the CPU time of the run's processes that
    are not its children: torchrun's other local ranks). Linux only; elsewhere every figure is
    None."""

    SAMPLE_S = 0.5
    BUSY = 0.25  # cores used by others above which the machine counts as busy

    def __init__(self):
        self.others_before = self.others_during = self.cores_used = None
        self.load_before = load_average()

    def before(self, cores_used):
        """Samples others' CPU use; returns a note when they leave this run fewer than
        ``cores_used`` free cores (else None)."""
        self.cores_used = cores_used
        a, cpu0, t0 = proc_stat(), own_cpu_seconds(), time.time()
        time.sleep(self.SAMPLE_S)
        b = proc_stat()
        total = busy_cores(a, b)
        if total is not None:
            ours = (own_cpu_seconds() - cpu0) / max(1e-9, time.time() - t0)
            self.others_before = max(0.0, total - ours)
        self.stat0, self.cpu0, self.t0 = proc_stat(), own_cpu_seconds(), time.time()
        # The sampled use, not the 1-minute load average: that one lags (a build that just
        # ended still counts) and is only printed.
        free = logical_cpus() - (self.others_before or 0.0)
        if self.others_before is not None and self.others_before > self.BUSY and free < cores_used:
            return (f"the machine is busy: other processes use {self.others_before or 0:.1f} of "
                    f"{logical_cpus()} logical CPUs now (1-minute load average "
                    f"{self.load_before:.1f}) and this run needs {cores_used}: its times will "
                    f"be inflated; overhead and load balance may break their invariants")
        return None

    def own_cpu_since_before(self):
        """CPU seconds this process (with its children) used since ``before``."""
        return own_cpu_seconds() - self.cpu0

    def after(self, peers_cpu_s=0.0):
        """``peers_cpu_s``: CPU seconds the run's other processes used since ``before``."""
        total = busy_cores(self.stat0, proc_stat())
        if total is not None:
            ours = (own_cpu_seconds() - self.cpu0 + peers_cpu_s) / max(1e-9, time.time() - self.t0)
            self.others_during = max(0.0, total - ours)

    def summary_lines(self, cores_used, load_now):
        """The report's lines about the load (busy marked with NOTE)."""
        lines = []
        if self.others_during is not None:
            busy = self.others_during > self.BUSY and logical_cpus() - self.others_during < cores_used
            lines.append(f"# {'NOTE: machine busy: ' if busy else ''}other processes used "
                         f"{self.others_during:.2f} of {logical_cpus()} logical CPUs on average "
                         f"during the run ({self.others_before or 0:.2f} just before); this "
                         f"run's ranks use {cores_used}")
        if self.load_before is not None and load_now is not None:
            lines.append(f"# 1-minute load average {self.load_before:.2f} before, "
                         f"{load_now:.2f} after the run (this run's own ranks add up to "
                         f"{cores_used})")
        return lines

    def print_summary(self, cores_used):
        """Prints :meth:`summary_lines` with the load average now (a report's lines)."""
        for line in self.summary_lines(cores_used, load_average()):
            print(line)

    def as_dict(self):
        return {"other_cores_before": self.others_before, "other_cores_during": self.others_during,
                "load_average_before": self.load_before, "cores_used": self.cores_used}


def run_with_load(launched, device, cores_used, run):
    """``run()`` (the job: spawned ranks, or this rank's share under a launcher) with the
    machine's load sampled before it and measured over it: returns ``(run's result, the
    MachineLoad)``. Under a launcher every rank samples at once (the others idle meanwhile)
    and every rank's CPU time is subtracted from the machine's, as for spawned ranks; on one
    node only (``/proc/stat`` is this node's; across nodes the figures stay None). Collective
    under a launcher. A busy machine is announced (by rank 0) before the job starts."""
    load = MachineLoad()
    busy = load.before(cores_used)
    if busy and (not launched or dist.get_rank() == 0):
        progress(f"NOTE: {busy}")
    out = run()
    if not launched:
        load.after()
        return out, load
    world = dist.get_world_size()
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    own = load.own_cpu_since_before()
    cpu_s = torch.tensor([own], dtype=torch.float64, device=device)  # (1,)
    dist.all_reduce(cpu_s)  # every rank's CPU seconds since `before`
    if one_node:
        load.after(float(cpu_s) - own)
    return out, load


def load_average():
    """The 1-minute load average (None where unavailable): how busy the machine was."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def core_probe_gflops(seconds=0.2):
    """One core's speed right now: GFLOP/s of a float32 matmul whose operands stay in cache
    (128 x 128 by 128 x 128, repeated for ~`seconds`, best of 3) on one thread, with torch's
    thread count restored after. A relative measure (torch's dispatch is part of it: ~60 on a
    Zen 3 whose FMA peak is ~100): a VM's clock can swing by a third within minutes (seen on a
    shared Zen 3: 3.2 and 2.1 GHz), so a table's numbers come with this probe before and after."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.rand(128, 128)
        b = torch.rand(128, 128)
        out = torch.empty(128, 128)
        best = 0.0
        for _ in range(3):
            n, t0 = 0, time.perf_counter()
            while True:
                for _ in range(16):
                    torch.mm(a, b, out=out)
                n += 16
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds / 3:
                    break
            best = max(best, 2 * 128 ** 3 * n / elapsed / 1e9)
        return best
    finally:
        torch.set_num_threads(threads)


def probe_note(before, after, tolerance=0.05):
    """The core probe's two readings (GFLOP/s, core_probe_gflops) as one line, saying whether
    they differ by more than `tolerance` of the larger: if so the machine's speed changed
    between the run's two ends; if not it may still have swung inside the run."""
    spread = abs(after - before) / max(before, after, 1e-9)
    verdict = (f"apart by {spread:.1%}: the machine's speed changed during the run" if spread > tolerance
               else f"within {tolerance:.0%} of each other")
    return f"{before:.1f} GFLOP/s before, {after:.1f} after ({verdict})"


def cpu_model():
    """The CPU's model name (Linux /proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_identity():
    """{"vendor", "family", "model", "stepping"} of the CPU from /proc/cpuinfo (Linux; empty
    elsewhere): the numbers that name a microarchitecture where the model name does not (a VM
    often reports just "AMD EPYC")."""
    keys = {"vendor_id": "vendor", "cpu family": "family", "model": "model", "stepping": "stepping"}
    ident = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    value = value.strip()
                    ident[keys[key.strip()]] = int(value) if value.isdigit() else value
    except OSError:
        pass
    return ident


def amd_microarchitecture(family, model):
    """AMD's core generation from cpuid family/model (None when unknown), per AMD's published
    family/model assignments: family 23 = Zen/Zen+ (models < 0x30) or Zen 2; family 25 =
    Zen 3 (models 0x00-0x0f, 0x20-0x5f) or Zen 4 (0x10-0x1f, 0x60-0xaf); family 26 = Zen 5."""
    if family == 23:
        return "Zen/Zen+" if model < 0x30 else "Zen 2"
    if family == 25:
        if model <= 0x0F or 0x20 <= model <= 0x5F:
            return "Zen 3"
        if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF:
            return "Zen 4"
    if family == 26:
        return "Zen 5"
    return None


def cpu_description():
    """One line naming the CPU: model name, cpuid family/model/stepping and, for AMD, the
    core generation they stand for, e.g. "AMD EPYC (AuthenticAMD family 25 model 17
    stepping 1 = Zen 4)"."""
    ident = cpu_identity()
    if "family" not in ident:
        return cpu_model()
    text = (f"{ident.get('vendor', '?')} family {ident['family']} model {ident.get('model', '?')} "
            f"stepping {ident.get('stepping', '?')}")
    if ident.get("vendor") == "AuthenticAMD" and isinstance(ident.get("model"), int):
        arch = amd_microarchitecture(ident["family"], ident["model"])
        text += f" = {arch}" if arch else ""
    return f"{cpu_model()} ({text})"


def isa_forced_note(level, requested=None):
    """How ringseq's CPU kernel came to run `level`: "forced" when RINGSEQ_CPU_ISA (or
    `requested`, what a child process was given) asks for a level other than the one auto
    picks on this CPU, so the numbers stand for a CPU of that level only as far as this CPU's
    caches and pipes resemble it; else auto's choice (this CPU's best level, but avx512 on an
    Intel CPU with AVX512_BF16 and no usable AMX: docs/kernels.md)."""
    try:
        from ringseq.kernels.extension import _C, cpu_isa_levels
        best = (cpu_isa_levels() or [None])[-1]
        chosen = _C._cpu_isa_auto() if best is not None else None
    except (ImportError, AttributeError, RuntimeError):
        best = chosen = None
    if requested is None:
        requested = os.environ.get("RINGSEQ_CPU_ISA", "").strip().lower()
    if requested not in ("", "auto") and chosen is not None and level != chosen:
        return (f"{level} forced with RINGSEQ_CPU_ISA={requested} (auto runs {chosen} here; "
                f"this CPU runs up to {best})")
    if level == chosen and chosen != best:
        return f"{level} (auto's choice on this CPU, which runs up to {best})"
    return f"{level} (this CPU's best level)"


def cpu_header(threads_per_rank=None):
    """The report line naming the CPU (model and cpuid family / model / stepping), its usable
    cores and the ISA level ringseq's CPU kernel runs (auto's or forced), e.g. "# CPU: AMD EPYC
    (AuthenticAMD family 25 model 1 stepping 1 = Zen 3), 2 physical cores; ringseq CPU kernel
    ISA avx2 (this CPU's best level); 1 thread(s) per rank"."""
    isa = cpu_isa()
    text = (f"# CPU: {cpu_description()}, {usable_cores()} physical cores; ringseq CPU kernel "
            f"ISA {isa_forced_note(isa) if isa else 'none (ringseq._C not built)'}")
    return text + (f"; {threads_per_rank} thread(s) per rank" if threads_per_rank else "")


def cpu_isa():
    """The ISA level ringseq's CPU kernel runs (None without the extension)."""
    try:
        from ringseq.kernels.extension import cpu_isa as _isa
        return _isa()
    except (ImportError, RuntimeError):
        return None


def environment(device):
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_id": cpu_identity(),
        "cpu_description": cpu_description(),
        "cpu_cores": usable_cores(),
        "cpu_logical": logical_cpus(),
        "load_average_1min": load_average(),
        "cpu_isa": cpu_isa(),
        "cpu_isa_note": isa_forced_note(cpu_isa()) if cpu_isa() else None,
        "cpu_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def write_json(path, payload):
    """``payload`` as strict JSON at ``path`` (nothing without one); non-finite floats are
    written as strings (``json_io``, which reads them back as floats)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json_io.dump(payload, f)
    progress(f"wrote {path}")


def format_table(rows, columns):
    """Fixed-width text table of dict rows; columns: list of (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mib(nbytes):
    return None if nbytes is None else nbytes / 2**20


# ---------------------------------------------------------------- local CPU ranks
def _bench_rank(fn, args, t0):
    """(fn's result, this rank process's CPU seconds so far, all threads)."""
    import resource
    set_progress_start(t0)  # progress lines of every rank count from the parent's start
    out = fn(args, torch.device("cpu"))
    return out, _cpu_seconds(resource.RUSAGE_SELF)


RANKS_FAILED = 3  # exit status of a run whose local ranks raised, died or timed out


def spawn_cpu_ranks(world, fn, args, timeout, threads):
    """Runs fn(args, device) on `world` local gloo ranks with `threads` torch threads each and
    returns rank 0's result; fn must be a module-level function. A rank that fails or dies
    raises RankError, ranks that outlive `timeout` seconds are killed with RankTimeout
    (tests/dist_utils.py): no hang. The ranks' CPU seconds count as this process's own
    (own_cpu_seconds), not as other processes' load."""
    import resource
    children = _cpu_seconds(resource.RUSAGE_CHILDREN)
    try:
        results = run_ranks(_bench_rank, world, fn, args, _T0, timeout=timeout, threads=threads)
    except (RankError, RankTimeout) as exc:
        # Exit status 3, not a traceback's 1 (which a script would read as a failed spot
        # check): the ranks' own report (their tracebacks) goes to stderr.
        print(f"{os.path.basename(sys.argv[0])}: the local ranks did not finish "
              f"({type(exc).__name__}):\n{exc}", file=sys.stderr, flush=True)
        raise SystemExit(RANKS_FAILED) from None
    # (ranks started as this process's own children, when run_ranks falls back from its fork
    # server, are counted by RUSAGE_CHILDREN already)
    counted = _cpu_seconds(resource.RUSAGE_CHILDREN) - children
    _RANKS_CPU_SECONDS[0] += max(0.0, sum(cpu for _, cpu in results) - counted)
    return results[0][0]


def launcher_device():
    """(launched, device): whether a launcher (torchrun) started this process, and its device:
    cuda:LOCAL_RANK when launched on a GPU machine, else the CPU."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched and torch.cuda.is_available():
        return True, torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return launched, torch.device("cpu")


def init_launched_group(device, timeout):
    """The launcher's process group: NCCL on GPUs (device set first), gloo on CPUs."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=timeout))


def threads_per_rank(requested, world):
    """torch threads for each of `world` local CPU ranks: `requested`, else cores // world."""
    return requested or max(1, usable_cores() // world)
