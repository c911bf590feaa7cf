"""Decoding benchmark: one new token per sequence per step against a long KV cache.

Part 1, one device: ``ringseq.flash_attn_with_kvcache`` (the kernel reads the valid prefix of
the cache in place, GQA heads as rows, keys split over the threads) against
``torch.nn.functional.scaled_dot_product_attention`` over the same cache prefix (a strided
view, ``enable_gqa=True``), per (batch, cache length, threads): ms per step, tokens/s
(batch / step time), GB/s of the cache read (K and V once per step), the ratio SDPA / ringseq,
the peak memory of a step above the inputs, and a check that both agree with the float64
result on every sequence of the batch (each error at most 2x plain attention's in the same
dtype, plus the shared float floor; a NaN counts as an infinite error). A ringseq row failing
it, or the last context-parallel step failing it on any rank (part 2: against float64
attention over the cache and the decoded tokens as generated, not as the ranks wrote them),
fails the run
(exit status 1, after the tables and the JSON); torch's SDPA failing it is warned about.

Part 2, context parallel (``--world-size`` local gloo ranks, one thread each): the cache of
``--cp-cache`` tokens stays sharded (zigzag prefill, ``ringseq.ring_flash_attn_with_kvcache``):
latency per token (each rank attends to its shard, one all-gather of (out, lse)) against
gathering the whole cache once (one all-gather: every rank then holds it, as a gather onto one
rank would leave that rank) and decoding over it (rank 0's decode is timed; the one-time
gather's time and memory are reported too), plus each one's peak memory per rank. The table
shows the largest value over the ranks (a token is done when the slowest rank is); the JSON
keeps every rank's (``per_rank``).

Timing: the median of ``--repeats``; with one torch thread the calling thread's CPU time (which
other jobs on the machine do not inflate), otherwise wall time. Part 2 reports wall time per
token and, next to it, the calling thread's CPU time on each rank (its own work, without the
wait for the other rank). The 1-minute load average is printed and stored with the results.

    python benchmarks/bench_decode.py                        # the full grid (a few minutes)
    python benchmarks/bench_decode.py --cache 4096 --batch 1 --threads 1 --no-cp   # a quick look
    python benchmarks/bench_decode.py --json decode.json
    python benchmarks/bench_decode.py --device cuda --cache 8192,32768 --batch 1,8   # a GPU
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
                    CHECK_FLOOR, DTYPES, PeakMemory, environment, format_table, load_average,
                    max_error, max_over_ranks, mib, progress, spawn_cpu_ranks, time_ms,
                    write_json)

import ringseq  # noqa: E402
from cli_types import json_path, positive_int, positive_ints, positive_seconds  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=positive_ints, default="4096,8192,16384,32768", help="cache lengths (valid prefix)")
    p.add_argument("--batch", type=positive_ints, default="1,4")
    p.add_argument("--threads", type=positive_ints, default="1,2", help="torch threads of part 1")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--heads-kv", type=positive_int, default=8)
    p.add_argument("--headdim", type=positive_int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp32 (CPU), bf16 (CUDA)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu or cuda (part 1 only on cuda; --threads ignored)")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--no-cp", action="store_true", help="skip part 2 (context parallel)")
    p.add_argument("--world-size", type=positive_int, default=2)
    p.add_argument("--cp-cache", type=positive_ints, default="16384,32768", help="global cache lengths of part 2")
    p.add_argument("--cp-batch", type=positive_int, default=1)
    p.add_argument("--timeout", type=positive_seconds, default=900)
    p.add_argument("--json", type=json_path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device (a CPU build, or no GPU)")
    if args.heads % args.heads_kv:
        p.error(f"--heads-kv {args.heads_kv} must divide --heads {args.heads}")
    # part 2's zigzag split, checked before part 1 runs (and only where part 2 runs)
    for length in (args.cp_cache if not args.no_cp and args.device == "cpu" else ()):
        if length % (2 * args.world_size):
            p.error(f"--cp-cache {length}: zigzag over --world-size {args.world_size} needs a "
                    f"multiple of {2 * args.world_size}")
    return args


def _ints(values):
    return list(values)  # (parsed by positive_ints)


def _attention(q, k, v, scale, dtype):
    """Plain attention of one query row per head, computed in ``dtype``: q (h, d); k, v
    (length, h_kv, d), their heads repeated for GQA. Returns (h, d) in ``dtype``."""
    g = q.shape[0] // k.shape[1]
    k, v = (t.to(dtype).repeat_interleave(g, dim=1) for t in (k, v))  # (length, h, d)
    s = torch.einsum("hd,khd->hk", q.to(dtype), k) * scale
    return torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v)


def _check(out, sdpa_out, q, kc, vc, length, scale):
    """(ringseq's, SDPA's and plain same-dtype attention's max |error| against float64) over
    every sequence of the batch (before: the first sequence only, so a wrong sequence 1
    passed; and SDPA's error was the bound, unchecked itself)."""
    err = err_sdpa = err_plain = 0.0
    for i in range(q.shape[0]):  # (one sequence's float64 copy of the cache at a time)
        k, v = kc[i, :length], vc[i, :length]  # (length, h_kv, d)
        ref = _attention(q[i, 0], k, v, scale, torch.float64)  # (h, d)
        err = max(err, max_error(out[i, 0], ref))  # (inf for a NaN, which max() keeps)
        err_sdpa = max(err_sdpa, max_error(sdpa_out[i, 0], ref))
        err_plain = max(err_plain, max_error(_attention(q[i, 0], k, v, scale, q.dtype), ref))
    return err, err_sdpa, err_plain


# ------------------------------------------------------------------------------ part 1
def single_device(args):
    dtype = DTYPES[args.dtype]
    dev = torch.device(args.device)
    h, h_kv, d = args.heads, args.heads_kv, args.headdim
    scale = d ** -0.5
    rows = []
    saved_threads = torch.get_num_threads()
    for b in _ints(args.batch):
        for length in _ints(args.cache):
            gen = torch.Generator().manual_seed(length + b)
            cap = length + 16
            kc = torch.randn(b, cap, h_kv, d, generator=gen).to(dev, dtype)  # (b, capacity, h_kv, d)
            vc = torch.randn(b, cap, h_kv, d, generator=gen).to(dev, dtype)
            q = torch.randn(b, 1, h, d, generator=gen).to(dev, dtype)         # (b, 1, h, d)
            seqlens = torch.full((b,), length, dtype=torch.int32, device=dev)
            # SDPA reads the same cache prefix through a strided (b, h_kv, length, d) view
            qt, kt, vt = q.transpose(1, 2), kc[:, :length].transpose(1, 2), vc[:, :length].transpose(1, 2)

            def ours():
                return ringseq.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)

            def sdpa():
                return F.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True).transpose(1, 2)

            for threads in _ints(args.threads) if dev.type == "cpu" else [None]:
                if threads:
                    torch.set_num_threads(threads)
                clock = "cpu" if threads == 1 else "wall"
                row = dict(batch=b, cache=length, threads=threads, clock=clock, load=load_average())
                for name, fn in (("ringseq", ours), ("sdpa", sdpa)):
                    fn()  # untimed: one-time setup (dispatch, pools) is not a step's memory
                    with PeakMemory(dev) as mem:
                        out = fn()
                    row[f"{name}_ms"] = time_ms(fn, dev, warmup=1, repeats=args.repeats, clock=clock)
                    row[f"{name}_peak_mib"] = mib(mem.peak)
                    row[f"{name}_out"] = out
                # decoding reads the whole cache prefix once: GB/s of K and V (TFLOP/s would say
                # little about a memory-bound step)
                kv_bytes = 2 * b * length * h_kv * d * kc.element_size()
                row["ringseq_gb_s"] = kv_bytes / row["ringseq_ms"] / 1e6
                row["sdpa_gb_s"] = kv_bytes / row["sdpa_ms"] / 1e6
                row["ringseq_tok_s"] = b * 1e3 / row["ringseq_ms"]
                row["sdpa_tok_s"] = b * 1e3 / row["sdpa_ms"]
                row["speedup"] = row["sdpa_ms"] / row["ringseq_ms"]
                errors = _check(row.pop("ringseq_out").cpu(), row.pop("sdpa_out").cpu(), q.cpu(),
                                kc.cpu(), vc.cpu(), length, scale)
                row["max_err"], row["sdpa_max_err"], row["plain_err"] = errors
                # an invariant of the benchmark (flash-attn's rule): each within 2x plain
                # same-dtype attention's error, plus the shared floor
                bound = 2 * row["plain_err"] + CHECK_FLOOR[dtype]
                row["check"] = "ok" if row["max_err"] <= bound else "FAIL"
                row["sdpa_check"] = "ok" if row["sdpa_max_err"] <= bound else "FAIL"
                rows.append(row)
                progress(f"b={b} cache={length} threads={threads or '-'}: ringseq {row['ringseq_ms']:.2f} ms "
                         f"({row['ringseq_tok_s']:.0f} tok/s), sdpa {row['sdpa_ms']:.2f} ms, "
                         f"x{row['speedup']:.2f}, load {row['load']}")
            del kc, vc
    torch.set_num_threads(saved_threads)
    return rows


# ------------------------------------------------------------------------------ part 2
_PER_RANK = ("cp_ms", "cp_cpu_ms", "cp_peak_mib", "gather_ms", "gather_peak_mib")


def _decode_data(length, steps, b, h, h_kv, d, dtype):
    """A --cp-cache length's global cache and decoded tokens, the same on every rank (one
    seed) and again when called again: K, V (b, length, h_kv, d); per step q (b, 1, h, d) and
    the new k, v (b, 1, h_kv, d)."""
    gen = torch.Generator().manual_seed(length)
    K = torch.randn(b, length, h_kv, d, generator=gen).to(dtype)
    V = torch.randn(b, length, h_kv, d, generator=gen).to(dtype)
    qs = [torch.randn(b, 1, h, d, generator=gen).to(dtype) for _ in range(steps)]
    kn = [torch.randn(b, 1, h_kv, d, generator=gen).to(dtype) for _ in range(steps)]
    vn = [torch.randn(b, 1, h_kv, d, generator=gen).to(dtype) for _ in range(steps)]
    return K, V, qs, kn, vn


def _cp_rank(args, device):
    """On every rank: a sharded cache of each --cp-cache length; CP decode against float64
    attention over the tokens as generated, and timed against decoding the gathered cache."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    h, h_kv, d, b = args.heads, args.heads_kv, args.headdim, args.cp_batch
    out_rows = []
    for length in _ints(args.cp_cache):
        steps = args.repeats + 1
        K, V, qs, kn, vn = _decode_data(length, steps, b, h, h_kv, d, dtype)
        cap = length // world + steps
        kc = torch.zeros(b, cap, h_kv, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        kc[:, :length // world] = ringseq.layouts.shard_local(K, "zigzag", world, rank)
        vc[:, :length // world] = ringseq.layouts.shard_local(V, "zigzag", world, rank)
        del K, V
        row = dict(cache=length, world=world, batch=b, load=load_average())

        # context parallel: every step appends one token (round-robin) and attends everywhere
        times, cpu_times = [], []

        def decode_step(i):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            out = ringseq.ring_flash_attn_with_kvcache(
                qs[i], kc, vc, length + i, kn[i], vn[i], layout="zigzag", prefill_len=length)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu_times.append((time.thread_time() - c0) * 1e3)
            return out

        decode_step(0)  # warm-up (one-time setup): neither timed nor in the peak
        with PeakMemory("cpu") as mem:
            for i in range(1, steps):
                out_cp = decode_step(i)
        row["cp_ms"] = sorted(times[1:])[len(times[1:]) // 2]
        # the calling thread's CPU time: this rank's work without the wait for its peer
        row["cp_cpu_ms"] = sorted(cpu_times[1:])[len(cpu_times[1:]) // 2]
        row["cp_peak_mib"] = mib(mem.peak)

        # gathered: the shards (now with the decoded tokens) collected on every rank once,
        # then single-device decoding over the whole cache (rank 0 is the one timed)
        dist.barrier()
        t0 = time.perf_counter()
        with PeakMemory("cpu") as gmem:
            parts_k = [torch.empty_like(kc) for _ in range(world)]
            parts_v = [torch.empty_like(vc) for _ in range(world)]
            dist.all_gather(parts_k, kc, group=None)
            dist.all_gather(parts_v, vc, group=None)
            full_k = torch.cat(parts_k, dim=1)  # (b, world * cap, h_kv, d): the gathered cache
            full_v = torch.cat(parts_v, dim=1)
            del parts_k, parts_v
        row["gather_ms"] = (time.perf_counter() - t0) * 1e3
        row["gather_peak_mib"] = mib(gmem.peak)
        # every rank's figures (before: rank 0's alone were reported); the table shows the
        # largest: a token is decoded when the slowest rank is done. A peak that could not be
        # measured (None: no /proc clear_refs) travels as NaN and stays None.
        mine = torch.tensor([math.nan if row[k] is None else row[k] for k in _PER_RANK],
                            dtype=torch.float64)
        ranks = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(ranks, mine)
        per_rank = torch.stack(ranks)  # (world, len(_PER_RANK))
        row["per_rank"] = {k: [None if math.isnan(x) else x for x in per_rank[:, j].tolist()]
                           for j, k in enumerate(_PER_RANK)}
        row.update({k: None if None in v else max(v) for k, v in row["per_rank"].items()})
        # attention over the gathered slots (order does not matter without a mask): every
        # rank's prefill slots and decoded slots, length + steps tokens of world * cap slots
        valid = torch.zeros(world * cap, dtype=torch.bool)
        for r in range(world):
            n_r = length // world + len(range(r, steps, world))
            valid[r * cap:r * cap + n_r] = True
        full_k, full_v = full_k[:, valid].contiguous(), full_v[:, valid].contiguous()
        n_total = full_k.shape[1]
        seqlens = torch.full((b,), n_total, dtype=torch.int32)
        q_last = qs[-1]
        # Invariant, on every rank (each holds the whole output of the last CP step): that
        # output against float64 attention over the cache and tokens as generated (the
        # prefill and every step's new token), within 2x plain same-dtype attention's error
        # plus the floor, as part 1; the worst rank judged by the parent (a rank raising alone
        # left the others waiting). Not over the caches the ranks wrote: an append that wrote
        # wrong keys would be in such a reference too (before: K and V swapped at every
        # append, 0.18 off, passed).
        K, V = _decode_data(length, steps, b, h, h_kv, d, dtype)[:2]
        want_k = torch.cat([K] + kn, dim=1)  # (b, length + steps, h_kv, d)
        want_v = torch.cat([V] + vn, dim=1)
        del K, V
        err = plain = 0.0
        for i in range(b):
            ref = _attention(q_last[i, 0], want_k[i], want_v[i], d ** -0.5, torch.float64)
            err = max(err, max_error(out_cp[i, 0], ref))
            plain = max(plain, max_error(_attention(q_last[i, 0], want_k[i], want_v[i],
                                                    d ** -0.5, dtype), ref))
        del want_k, want_v
        worst = max_over_ranks([err, plain, err - 2 * plain - CHECK_FLOOR[dtype]])
        row["cp_max_err"], row["cp_plain_err"] = worst[0].item(), worst[1].item()
        row["cp_check"] = "ok" if worst[2].item() <= 0 else "FAIL"
        if rank == 0:
            def single():
                return ringseq.flash_attn_with_kvcache(q_last, full_k, full_v, cache_seqlens=seqlens)
            with PeakMemory("cpu") as smem:
                out_single = single()
            row["gathered_ms"] = time_ms(single, "cpu", warmup=1, repeats=args.repeats, clock="wall")
            row["gathered_cpu_ms"] = time_ms(single, "cpu", warmup=0, repeats=args.repeats, clock="cpu")
            row["gathered_peak_mib"] = mib(smem.peak)
            row["cp_vs_gathered_max_diff"] = max_error(out_cp, out_single)
            row["speedup"] = row["gathered_ms"] / row["cp_ms"]
            row["cpu_speedup"] = row["gathered_cpu_ms"] / row["cp_cpu_ms"]
            peak = row["gather_peak_mib"]
            progress(f"CP W={world} cache={length}: {row['cp_ms']:.2f} ms/token sharded vs "
                     f"{row['gathered_ms']:.2f} ms gathered (x{row['speedup']:.2f}; thread CPU time "
                     f"{row['cp_cpu_ms']:.2f} vs {row['gathered_cpu_ms']:.2f} ms); one-time gather "
                     f"{row['gather_ms']:.0f} ms, "
                     + ("peak not measured" if peak is None else f"+{peak:.0f} MiB"))
        dist.barrier()
        out_rows.append(row)
        del kc, vc, full_k, full_v
    return out_rows


def main(argv=None):
    args = parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.device.startswith("cuda"):
        args.no_cp = True  # part 2 spawns CPU ranks
    env = environment(args.device)
    progress(f"decode benchmark: h={args.heads} h_kv={args.heads_kv} d={args.headdim} {args.dtype} on "
             f"{env.get('gpu', env['cpu_model'])}, ISA {ringseq.cpu_isa()}, load {load_average()}")
    rows = single_device(args)
    print(format_table(rows, [("batch", "b", "{}"), ("cache", "cache", "{}"), ("threads", "thr", "{}"),
                              ("ringseq_ms", "ringseq ms", "{:.2f}"), ("sdpa_ms", "sdpa ms", "{:.2f}"),
                              ("speedup", "sdpa/ringseq", "{:.2f}"),
                              ("ringseq_tok_s", "ringseq tok/s", "{:.0f}"), ("sdpa_tok_s", "sdpa tok/s", "{:.0f}"),
                              ("ringseq_gb_s", "ringseq KV GB/s", "{:.1f}"), ("sdpa_gb_s", "sdpa KV GB/s", "{:.1f}"),
                              ("ringseq_peak_mib", "ringseq MiB", "{:.1f}"), ("sdpa_peak_mib", "sdpa MiB", "{:.1f}"),
                              ("max_err", "err", "{:.1e}"), ("sdpa_max_err", "sdpa err", "{:.1e}"),
                              ("plain_err", "plain err", "{:.1e}"), ("check", "check", "{}"),
                              ("load", "load", "{:.1f}")]), flush=True)
    cp_rows = []
    if not args.no_cp:
        progress(f"context parallel: {args.world_size} local ranks, 1 thread each")
        cp_rows = spawn_cpu_ranks(args.world_size, _cp_rank, args, args.timeout, threads=1)
        print(format_table(cp_rows, [("cache", "cache", "{}"), ("world", "W", "{}"),
                                     ("cp_ms", "CP ms/token (max rank)", "{:.2f}"),
                                     ("gathered_ms", "gathered ms/token", "{:.2f}"),
                                     ("speedup", "gathered/CP", "{:.2f}"),
                                     ("cp_cpu_ms", "CP cpu ms (max rank)", "{:.2f}"),
                                     ("gathered_cpu_ms", "gathered cpu ms", "{:.2f}"),
                                     ("cpu_speedup", "cpu ratio", "{:.2f}"),
                                     ("gather_ms", "gather once ms", "{:.0f}"),
                                     ("cp_peak_mib", "CP MiB (max rank)", "{:.1f}"),
                                     ("gather_peak_mib", "gather MiB (max rank)", "{:.1f}"),
                                     ("cp_max_err", "CP err", "{:.1e}"),
                                     ("cp_plain_err", "plain err", "{:.1e}"),
                                     ("cp_check", "check", "{}"),
                                     ("load", "load", "{:.1f}")]), flush=True)
    write_json(args.json, {"environment": env, "args": vars(args),
                           "single_device": rows, "context_parallel": cp_rows})
    for r in rows:
        if r["sdpa_check"] == "FAIL":  # (torch's SDPA failing is warned about, not ours)
            print(f"WARNING: torch SDPA b={r['batch']} cache={r['cache']}: max error "
                  f"{r['sdpa_max_err']:.2e} against float64, more than 2 x plain attention's "
                  f"{r['plain_err']:.2e} + the floor", flush=True)
    wrong = [f"b={r['batch']} cache={r['cache']} threads={r['threads']}: ringseq's max error "
             f"{r['max_err']:.2e} against float64, more than 2 x plain {args.dtype} attention's "
             f"{r['plain_err']:.2e} + {CHECK_FLOOR[DTYPES[args.dtype]]:.0e}"
             for r in rows if r["check"] == "FAIL"]
    wrong += [f"context parallel W={r['world']} cache={r['cache']}: the last step's max error "
              f"{r['cp_max_err']:.2e} against float64 over the generated cache (worst rank), more "
              f"than 2 x plain {args.dtype} attention's {r['cp_plain_err']:.2e} + "
              f"{CHECK_FLOOR[DTYPES[args.dtype]]:.0e}" for r in cp_rows if r["cp_check"] == "FAIL"]
    if wrong:
        print("FAILED: " + "; ".join(wrong), flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
