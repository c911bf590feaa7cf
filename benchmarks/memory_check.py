"""Estimated vs measured peak memory of one training step (ringseq.memory against MemTracker).

Each configuration is the keyword arguments of ``RingSequenceParallelPlugin`` plus the
precision, the sequence length and the model; one line of ``CONFIGS`` per configuration.
Every configuration trains a tiny transformers model (random init, no download) through
``Booster`` on spawned gloo ranks (one spawn per world size, all its configurations in it):
two warm-up steps (AdamW states, DDP's rebuilt buckets and the ring's cached exchange buffers
then exist, as in any later step), then one tracked step (forward, loss, backward,
``optimizer.step()``; with ``micro_batches`` > 1 that many forwards and backwards before the
step, all but the last under ``booster.no_sync``); the measured peak is the largest per-rank
peak of that step, the estimate ``plugin.estimate_memory(model, seqlen)`` (the plugin's own
tp_size, zero_stage, sp_mode and activation_checkpointing). Also reported, not checked: the
forward's own peak (right after the model's forward returns) against the estimate's forward
moments (one micro-batch per step only: with more, the tracked peak spans the earlier
micro-batches).

How the peak is measured. ``torch.distributed._tools.mem_tracker.MemTracker`` (a
TorchDispatchMode; runs on CPU) follows every tensor storage created under it. It cannot see
inside a custom operator (a mode is switched off while an operator it intercepted runs), and
every attention call is one (``ringseq::attention``): its K/V exchange buffers and float32
accumulators would be missing. ``StepTracker`` therefore registers, with
``torch.library.register_torch_dispatch``, a rule for every ``ringseq::`` operator that runs
the operator's kernel with the tracker switched back on, so their allocations are tracked as
well. The tracker is entered before the model is boosted (DDP's buckets are then tracked) and
stays entered over the warm-up; leaving and re-entering it for the tracked step resets its peak
to what is live (MemTracker.__enter__), and ``reset_mod_stats`` between steps is MemTracker's
rule for repeated iterations.

    python benchmarks/memory_check.py              # every configuration, table + JSON
    python benchmarks/memory_check.py --only tp2   # configurations whose name contains tp2
    python benchmarks/memory_check.py --quick      # those tests/test_memory.py asserts

Under torchrun on GPUs (``torchrun --nproc-per-node 4 benchmarks/memory_check.py``; 8 for the
W8 lines) the configurations of that world size run on NCCL and the measured peak is
``torch.cuda.max_memory_allocated`` of the tracked step instead (see docs/memory.md for what
differs there).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the rank spawner shared with the tests (not part of the library)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from dist_utils import RankError, RankTimeout, run_ranks  # noqa: E402

# Tiny models whose peaks fall on different moments of the step: A's vocabulary is large
# against its layers (the loss's backward holds the peak), B's MLP is wide (the final norm's
# or a decoder layer's MLP backward), C has many heads on a narrow residual stream (the
# attention's backward).
MODELS = {
    "A": dict(family="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
              tie_word_embeddings=False),
    "B": dict(family="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              tie_word_embeddings=True),
    "C": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=64,
              tie_word_embeddings=True),
}


def _cfg(name, model, precision, seqlen, quick=False, world=4, micro_batches=1, **plugin):
    return dict(name=name, model=model, plugin=plugin, precision=precision, seqlen=seqlen,
                quick=quick, world=world, micro_batches=micro_batches)


# One configuration per line: the plugin's keyword arguments (sp_size, sp_mode, tp_size,
# zero_stage, activation_checkpointing, ...), precision, sequence length, model, ranks.
# quick: in tests/test_memory.py (4 ranks; the rest only here, for docs/memory.md): each model,
# sp mode, mesh kind (sp only, tp, zero 2, zero 3, tp x zero 3), checkpointing and kind of peak
# moment at least once, ~80 s on 2 cores (all 16 that were once quick took ~130 s). Together
# they cover sp 1/2/4/8, tp 1/2, zero 0/2/3, checkpointing off/on, fp32/bf16, ring / Ulysses /
# hybrid and two sequence lengths per model; names start with the model and the mesh (dp is
# W / (sp x tp)). micro_batches > 1: gradient accumulation (booster.no_sync).
CONFIGS = [
    # -- DDP (zero 0), no tensor parallelism
    _cfg("A sp1 fp32 s1024", "A", "fp32", 1024, quick=True, sp_size=1),
    _cfg("A sp2 ring fp32 s2048", "A", "fp32", 2048, sp_size=2),
    _cfg("A sp4 ring bf16 s2048", "A", "bf16", 2048, sp_size=4),
    _cfg("A sp4 ring bf16 s4096", "A", "bf16", 4096, sp_size=4),
    _cfg("A sp2 ulysses bf16 s2048", "A", "bf16", 2048, sp_size=2, sp_mode="ulysses"),
    _cfg("A sp4 ulysses fp32 s2048", "A", "fp32", 2048, sp_size=4, sp_mode="ulysses"),
    _cfg("A sp4 ring bf16 s64", "A", "bf16", 64, quick=True, sp_size=4),
    _cfg("B sp1 bf16 s1024", "B", "bf16", 1024, sp_size=1),
    _cfg("B sp2 ring bf16 s2048", "B", "bf16", 2048, sp_size=2),
    _cfg("B sp4 ring fp32 s2048", "B", "fp32", 2048, quick=True, sp_size=4),
    _cfg("B sp2 ulysses bf16 s2048", "B", "bf16", 2048, sp_size=2, sp_mode="ulysses"),
    _cfg("C sp1 bf16 s1024", "C", "bf16", 1024, sp_size=1),
    _cfg("C sp4 ring fp32 s2048", "C", "fp32", 2048, sp_size=4),
    _cfg("C sp2 ulysses bf16 s2048", "C", "bf16", 2048, sp_size=2, sp_mode="ulysses"),
    _cfg("C sp4 hybrid(u2) bf16 s2048", "C", "bf16", 2048, quick=True, sp_size=4,
         sp_mode="hybrid", ulysses_size=2),
    # -- the plugin's activation checkpointing (keeps ringseq::attention's outputs)
    _cfg("A sp2 ring bf16 s2048 ckpt", "A", "bf16", 2048, quick=True, sp_size=2,
         activation_checkpointing=True),
    _cfg("B sp4 ring bf16 s2048 ckpt", "B", "bf16", 2048, sp_size=4,
         activation_checkpointing=True),
    _cfg("C sp2 ulysses fp32 s2048 ckpt", "C", "fp32", 2048, quick=True, sp_size=2,
         sp_mode="ulysses", activation_checkpointing=True),
    # -- tensor parallelism (DTensor, Megatron sequence parallelism), zero 0
    _cfg("A sp2 tp2 bf16 s2048", "A", "bf16", 2048, quick=True, sp_size=2, tp_size=2),
    _cfg("B sp2 tp2 fp32 s2048", "B", "fp32", 2048, sp_size=2, tp_size=2),
    _cfg("C sp2 ulysses tp2 bf16 s2048", "C", "bf16", 2048, sp_size=2, sp_mode="ulysses",
         tp_size=2),
    _cfg("A sp2 tp2 bf16 s2048 ckpt", "A", "bf16", 2048, sp_size=2, tp_size=2,
         activation_checkpointing=True),
    # (the forward's peak at down_proj's reduce-scatter; the recompute at the rotary
    # embedding: both once 3-9 % below the measurement)
    _cfg("C tp4 bf16 s2048", "C", "bf16", 2048, quick=True, sp_size=1, tp_size=4),
    _cfg("C tp4 bf16 s2048 ckpt", "C", "bf16", 2048, quick=True, sp_size=1, tp_size=4,
         activation_checkpointing=True),
    # -- FSDP2: zero 2 and zero 3 over dp x sp
    _cfg("A dp2 sp2 zero2 bf16 s2048", "A", "bf16", 2048, quick=True, sp_size=2, zero_stage=2),
    _cfg("A dp2 sp2 zero3 fp32 s2048", "A", "fp32", 2048, quick=True, sp_size=2, zero_stage=3),
    _cfg("A sp4 zero3 bf16 s4096", "A", "bf16", 4096, sp_size=4, zero_stage=3),
    _cfg("B sp4 zero2 fp32 s2048", "B", "fp32", 2048, sp_size=4, zero_stage=2),
    _cfg("B sp4 zero3 bf16 s2048", "B", "bf16", 2048, sp_size=4, zero_stage=3),
    _cfg("B dp2 sp2 zero2 bf16 s1024", "B", "bf16", 1024, sp_size=2, zero_stage=2),
    _cfg("C sp4 zero3 bf16 s2048 ckpt", "C", "bf16", 2048, sp_size=4, zero_stage=3,
         activation_checkpointing=True),
    # -- tensor parallelism x FSDP2
    _cfg("A sp2 tp2 zero3 bf16 s2048", "A", "bf16", 2048, sp_size=2, tp_size=2,
         zero_stage=3),
    _cfg("B sp2 tp2 zero3 fp32 s2048", "B", "fp32", 2048, sp_size=2, tp_size=2, zero_stage=3),
    _cfg("B sp2 tp2 zero3 bf16 s2048 ckpt", "B", "bf16", 2048, quick=True, sp_size=2,
         tp_size=2, zero_stage=3, activation_checkpointing=True),
    _cfg("A sp2 tp2 zero2 fp32 s4096", "A", "fp32", 4096, sp_size=2, tp_size=2, zero_stage=2),
    # -- gradient accumulation: micro-batches per optimizer step, all but the last no_sync
    _cfg("A sp2 ring bf16 s2048 accum2", "A", "bf16", 2048, quick=True, sp_size=2,
         micro_batches=2),
    _cfg("A sp2 ring fp32 s2048 accum3", "A", "fp32", 2048, sp_size=2, micro_batches=3),
    _cfg("A sp2 tp2 bf16 s2048 accum2", "A", "bf16", 2048, sp_size=2, tp_size=2,
         micro_batches=2),
    _cfg("A dp2 sp2 zero2 bf16 s2048 accum2", "A", "bf16", 2048, quick=True, sp_size=2,
         zero_stage=2, micro_batches=2),
    _cfg("A dp2 sp2 zero3 fp32 s2048 accum2", "A", "fp32", 2048, sp_size=2, zero_stage=3,
         micro_batches=2),
    _cfg("B sp4 zero3 bf16 s2048 ckpt accum2", "B", "bf16", 2048, sp_size=4, zero_stage=3,
         activation_checkpointing=True, micro_batches=2),
    # (a tied embedding under DDP / tp: the LM head's gradient pending to the embedding's)
    _cfg("B sp2 ring bf16 s2048 accum2", "B", "bf16", 2048, sp_size=2, micro_batches=2),
    _cfg("B sp2 tp2 bf16 s2048 accum2", "B", "bf16", 2048, sp_size=2, tp_size=2,
         micro_batches=2),
    # -- the double ring: the inner rings keep exchange buffers of their own
    _cfg("C sp4 double ring (inner 2) fp32 s2048", "C", "fp32", 2048, quick=True, sp_size=4,
         inner_ring_size=2),
    _cfg("A sp4 double ring (inner 2) bf16 s8192 ckpt", "A", "bf16", 8192, sp_size=4,
         inner_ring_size=2, activation_checkpointing=True),
    # -- 8 ranks (the full table only)
    _cfg("A W8 dp2 sp2 tp2 zero3 bf16 s2048", "A", "bf16", 2048, world=8, sp_size=2,
         tp_size=2, zero_stage=3),
    _cfg("B W8 sp8 zero3 bf16 s4096 ckpt", "B", "bf16", 4096, world=8, sp_size=8,
         zero_stage=3, activation_checkpointing=True),
    _cfg("A W8 sp8 ring bf16 s4096", "A", "bf16", 4096, world=8, sp_size=8),
    _cfg("C W8 sp8 double ring (inner 2) bf16 s4096", "C", "bf16", 4096, world=8, sp_size=8,
         inner_ring_size=2),
    _cfg("C W8 sp8 hybrid(u2) double ring (inner 2) bf16 s4096", "C", "bf16", 4096, world=8,
         sp_size=8, sp_mode="hybrid", ulysses_size=2, inner_ring_size=2),
]


# ---------------------------------------------------------------- the tracker
_TOTAL = "Total"  # MemTracker's key of a snapshot's total


def _tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker that also sees the allocations inside ringseq's operators."""

        def _update_peak_stats(self, peak_state):
            # Only the global peak is read here. MemTracker also updates the peak of every
            # module it tracks on every operator (a loop over all modules per operator), which
            # makes the tracked steps about a third slower; the global part is kept as is.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL]:
                    self._peak_mem[dev] = snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(snap)

    def inside(mode, func, types, args, kwargs):
        # Run the operator's own kernel (below the Python dispatch key) with the tracker on.
        key = (torch._C.DispatchKey.CUDA if any(
            isinstance(a, torch.Tensor) and a.is_cuda for a in args) else torch._C.DispatchKey.CPU)
        with mode:
            return func.redispatch(torch._C.DispatchKeySet(key), *args, **(kwargs or {}))

    import ringseq  # noqa: F401  (registers the ringseq:: operators)
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("ringseq::"):
            torch.library.register_torch_dispatch(name, StepTracker, inside)
    return StepTracker


def _release_ring_buffers():
    # Every configuration starts without cached exchange buffers (an earlier configuration's
    # could be reused and would then be created before the tracker sees them).
    from ringseq.engine import ring
    for r in list(ring._RINGS.values()) + list(ring._LOCAL.values()):
        r.release_buffers()


def _model(spec, seqlen):
    import transformers
    spec = dict(spec)
    family = spec.pop("family")
    cls_cfg, cls_model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    cfg = cls_cfg(max_position_embeddings=max(seqlen, 256), attention_dropout=0.0,
                  use_cache=False, **spec)
    torch.manual_seed(0)
    return cls_model(cfg)


def _peak(tracker, cuda: bool) -> int:
    """The peak so far in the tracked step (bytes; the largest device's)."""
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return max(snap[_TOTAL] for snap in tracker.get_tracker_snapshot("peak").values())


class _NoTracker(contextlib.nullcontext):
    """Stands in for the tracker on CUDA, where the caching allocator keeps the peak."""

    def reset_mod_stats(self):
        pass


def measure(configs, steps_before=2):
    """Rank side: the measured peak (bytes) and the estimate of every configuration. On CPU
    ranks the peak is MemTracker's; on CUDA ranks (NCCL) ``torch.cuda.max_memory_allocated``
    of the tracked step (the caching allocator counts every tensor, inside operators too)."""
    import transformers  # noqa: F401
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    cuda = str(dist.get_backend()) == "nccl" and torch.cuda.is_available()
    tracker_cls = None if cuda else _tracker_class()
    out = []
    for i, c in enumerate(configs):
        t0, c0 = time.perf_counter(), time.process_time()
        if dist.get_rank() == 0:  # progress: a 4-rank spawn measures dozens in turn
            print(f"  [{i + 1}/{len(configs)}] {c['name']} ...", flush=True)
        _release_ring_buffers()
        gc.collect()
        plugin = RingSequenceParallelPlugin(precision=c["precision"], **c["plugin"])
        booster = Booster(plugin)
        model = _model(MODELS[c["model"]], c["seqlen"])
        # foreach: torch's default AdamW on CUDA (on CPU the default is the for-loop one)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        g = torch.Generator().manual_seed(1)
        m = c.get("micro_batches", 1)  # per optimizer step, the first m - 1 under no_sync
        n = (steps_before + 1) * plugin.dp_size * m
        ids = torch.randint(0, model.config.vocab_size, (n, c["seqlen"]), generator=g)
        loader = plugin.prepare_dataloader([{"input_ids": i, "labels": i} for i in ids],
                                           batch_size=1)
        if cuda:
            tracker = _NoTracker()
        else:
            tracker = tracker_cls()
            tracker.track_external(model, opt)
        with tracker:
            model, opt, criterion, loader, _ = booster.boost(model, opt, dataloader=loader)
            batches = iter(loader)

            forward_peak = []

            def step():
                for j in range(m):
                    batch = next(batches)
                    with (booster.no_sync(model, opt) if j < m - 1
                          else contextlib.nullcontext()):
                        out = model(**batch)
                        forward_peak.append(_peak(tracker, cuda))  # the forward, logits made
                        loss = criterion(out, batch)
                        del out
                        booster.backward(loss, opt)
                    if j < m - 1:
                        tracker.reset_mod_stats()  # (one module pass per record)
                opt.step()
                opt.zero_grad(set_to_none=True)
                tracker.reset_mod_stats()  # MemTracker tracks one iteration per record

            for _ in range(steps_before):
                step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            measured, peak = _peak(tracker, cuda), {}
        else:
            with tracker:  # re-entering resets the peak to what is live now
                step()
            peak = tracker.get_tracker_snapshot("peak")
            measured = _peak(tracker, cuda)
        # the plugin's own sizes: tp_size, zero_stage, activation_checkpointing, sp_mode
        est = plugin.estimate_memory(model, c["seqlen"], optimizer="adamw",
                                     gradient_accumulation_steps=m)
        out.append({"name": c["name"], "measured": measured, "estimate": est.total,
                    # (with accumulation the tracked peak spans the earlier micro-batches)
                    "forward_measured": forward_peak[-1] if m == 1 else None,
                    "forward_estimate": max(v for n, v in est.moments if n.startswith("forward")),
                    "peak_phase": est.peak_phase, "seconds": time.perf_counter() - t0,
                    "cpu_seconds": time.process_time() - c0,
                    "breakdown": {str(k): v for snap in peak.values() for k, v in snap.items()}})
        del model, opt, criterion, loader, batches, booster, plugin, tracker
    return out


def run(configs, timeout=600.0):
    """Spawns gloo ranks (one spawn per world size among ``configs``), measures every
    configuration; returns one row per config, in the given order (measured = the largest
    rank's peak) with the estimate and the relative error."""
    rows = {}
    for world in sorted({c["world"] for c in configs}):
        mine = [c for c in configs if c["world"] == world]
        for c, row in zip(mine, _rows(mine, run_ranks(measure, world, mine, timeout=timeout))):
            rows[c["name"]] = row
    return [rows[c["name"]] for c in configs]


def _rows(configs, per_rank):
    rows = []
    for i, c in enumerate(configs):
        ranks = [r[i] for r in per_rank]
        measured = max(r["measured"] for r in ranks)
        est = ranks[0]["estimate"]
        fwd = (None if ranks[0]["forward_measured"] is None
               else max(r["forward_measured"] for r in ranks))
        rows.append({"name": c["name"], "estimate": est, "measured": measured,
                     "error": est / measured - 1, "peak_phase": ranks[0]["peak_phase"],
                     "forward_estimate": ranks[0]["forward_estimate"],
                     "forward_measured": fwd,
                     "forward_error": (None if fwd is None
                                       else ranks[0]["forward_estimate"] / fwd - 1),
                     "seconds": max(r["seconds"] for r in ranks),
                     "cpu_seconds": sum(r["cpu_seconds"] for r in ranks),
                     "rank_spread": max(r["measured"] for r in ranks)
                     - min(r["measured"] for r in ranks)})
    return rows


def main(argv=None):
    # (imported here: benchmarks/common.py tunes malloc on import, which tests that import
    # this module for run() should not inherit)
    from cli_types import json_path, positive_seconds
    from common import environment, format_table, progress, write_json
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="configurations whose name contains this")
    p.add_argument("--quick", action="store_true", help="only those tests/test_memory.py runs")
    p.add_argument("--json", type=json_path, default=None, help="write the rows to this path")
    p.add_argument("--timeout", type=positive_seconds, default=900)
    args = p.parse_args(argv)
    configs = [c for c in CONFIGS if (args.only is None or args.only in c["name"])
               and (c["quick"] or not args.quick)]
    if not configs:
        p.error(f"--only {args.only!r}" + (" with --quick: no quick configuration" if args.quick
                                           else ": no configuration") + " name contains it")
    t0 = time.time()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched and not torch.cuda.is_available():
        p.error("under a launcher (torchrun) memory_check measures on GPUs (NCCL, "
                "max_memory_allocated); on CPUs run it without one: it spawns gloo ranks")
    if launched:  # torchrun on GPUs: NCCL, one GPU per local rank, max_memory_allocated
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        world = dist.get_world_size()
        configs = [c for c in configs if c["world"] == world]
        if not configs:
            p.error(f"no configuration runs on {world} ranks; the table has "
                    f"{sorted({c['world'] for c in CONFIGS})}")
        mine = measure(configs)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
        rows = _rows(configs, everyone)
    else:
        progress(f"{len(configs)} configuration(s) on "
                 f"{'/'.join(str(w) for w in sorted({c['world'] for c in configs}))} gloo "
                 f"ranks (load {os.getloadavg()[0]:.1f})")
        device = torch.device("cpu")
        try:
            rows = run(configs, args.timeout)
        except (RankError, RankTimeout) as exc:
            # exit status 3, as the other scripts' (1 is an estimate outside the tolerance);
            # the ranks' own report (their tracebacks) goes to stderr
            print(f"memory_check.py: the local ranks did not finish ({type(exc).__name__}):\n"
                  f"{exc}", file=sys.stderr, flush=True)
            return 3
    for r in rows:
        r["estimate_mib"], r["measured_mib"] = r["estimate"] / 2**20, r["measured"] / 2**20
    print(format_table(rows, [("name", "configuration", "{}"),
                              ("estimate_mib", "estimate MiB", "{:.2f}"),
                              ("measured_mib", "measured MiB", "{:.2f}"),
                              ("error", "error", "{:+.2%}"), ("peak_phase", "peak at", "{}"),
                              ("forward_error", "forward peak error", "{:+.2%}"),
                              ("seconds", "s", "{:.1f}"),
                              ("cpu_seconds", "CPU s (all ranks)", "{:.1f}")]))
    progress(f"done in {time.time() - t0:.0f} s")
    write_json(args.json, {"benchmark": "memory_check",
                           "world_sizes": sorted({c["world"] for c in configs}),
                           "measured_with": ("torch.cuda.max_memory_allocated" if launched
                                             else "MemTracker"),
                           "environment": environment(device), "rows": rows})
    bad = [r["name"] for r in rows if abs(r["error"]) > 0.10]
    if bad:
        print(f"estimate off by more than 10 %: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
