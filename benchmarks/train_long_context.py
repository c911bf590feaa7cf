"""Long-context training of a Llama-style transformers model with ring attention.

Builds ``LlamaForCausalLM`` from size flags (random weights, no download), switches it to
ring attention (``ringseq.integrations.transformers.apply``), and runs ``--steps`` AdamW steps
on synthetic tokens of total length ``--seqlen``, sharded over W ranks with
``ringseq.shard_batch``; the loss is ``ringseq.sharded_cross_entropy`` and parameter gradients
are summed over the ring with one all-reduce per step. Reports, on rank 0: tokens/s (global
tokens per median step time), step time, model TFLOP/s per rank, peak memory per rank and, on
GPUs, MFU.

Without a launcher (and without a GPU) it spawns ``--world-size`` local CPU ranks on gloo;
under ``torchrun`` it uses the launcher's ranks (NCCL on GPUs, one GPU per local rank).
Its invariant: the first step's loss (the weights as built) equals the unsharded model's on the
whole sequence, computed once on rank 0 before the steps (transformers' own attention, untimed;
1e-5 relative in fp32, 2e-3 in bf16), and every loss is finite; a run that breaks either prints
FAILED after its report, writes its JSON and exits with status 1.

    python benchmarks/train_long_context.py                       # 2 local CPU ranks, ~1 min
    python benchmarks/train_long_context.py --world-size 4 --seqlen 16384 --checkpointing
    python benchmarks/train_long_context.py --world-size 4 --plugin --sp-size 2   # via Booster
    torchrun --nproc-per-node 8 benchmarks/train_long_context.py --seqlen 131072 \\
        --layers 16 --hidden 2048 --heads 16 --kv-heads 4 --vocab 32000 --checkpointing

FLOPs per step (for TFLOP/s and MFU): 6 x (non-embedding parameters + LM head) x tokens for the
matrix products, plus attention counted as flash-attn does (forward 4·b·h·s²·d / 2 for causal,
backward 2.5x), 1.33x more of everything with ``--checkpointing`` (the forward is recomputed).
MFU = achieved FLOP/s per GPU / ``--peak-tflops`` (default: the dense bf16 peak of A100, H100
or H200 when recognized).

``--plugin`` runs the same training through ``ringseq.plugin.Booster`` with
``RingSequenceParallelPlugin(sp_size=--sp-size, layout=--layout, precision=--dtype)``: the
plugin switches attention, wraps the model in DDP over the (dp, sp) mesh, shards the batches of
its data loader (``--batch`` samples per dp group, so dp x ``--batch`` per step) and supplies
the loss. There ``--dtype`` is the plugin's precision (autocast over float32 weights) rather than
the dtype of the weights, and the run also prints ``plugin.estimate_memory`` (ringseq.memory)
next to the measured peak per rank (on GPUs ``torch.cuda.max_memory_allocated``; on CPUs the
resident-set high-water mark, which is no tensor count: benchmarks/memory_check.py compares the
estimate with MemTracker instead; with a ``--backend`` the estimate does not model it prints
why there is none).

``--sp N --tp T --zero Z --ac`` (any of them implies ``--plugin``) compose tensor parallelism
(DTensor, Megatron sequence parallelism), FSDP2 (zero_stage 2/3) and activation checkpointing
(keeping the ring's output) with ring sequence parallelism on the (dp, sp, tp) mesh, and run
DDP x SP at the same shape next to it in the same spawn: the same model, data and global batch,
the same W ranks per sample (sp = N x T, replicated parameters, no recompute). Reported per
configuration: tokens/s, step time, TFLOP/s per rank and peak memory per rank, then the ratios
against DDP x SP. Both must agree on every step's loss (same weights, same tokens: within 1e-4
relative in fp32, 2e-3 in bf16 / fp16), and every loss must be finite; a run that breaks either
prints FAILED after its report, writes its JSON and exits with status 1 (3: the ranks did not
finish; 2: a bad argument, before any rank starts).

    python benchmarks/train_long_context.py --world-size 4 --sp 2 --tp 2 --zero 3 --ac \
        --seqlen 4096 --layers 2 --hidden 256 --heads 8 --kv-heads 4
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (PeakMemory, attention_flops, environment, format_table, mib,  # noqa: E402
                    init_launched_group, launcher_device, progress, spawn_cpu_ranks,
                    synchronize, threads_per_rank, write_json)

import ringseq  # noqa: E402
from cli_types import (json_path, non_negative_int, positive_float, positive_int,  # noqa: E402
                       positive_seconds)
from ringseq.layouts import get_layout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# dense bf16/fp16 tensor-core peaks, TFLOP/s
PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A800": 312.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=positive_int, default=2,
                   help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--seqlen", type=positive_int, default=8192, help="total (global) sequence length")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="sequences per step (global; split over the data-parallel ranks)")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    p.add_argument("--hidden", type=positive_int, default=256,
                   help="hidden size (a multiple of --heads)")
    p.add_argument("--heads", type=positive_int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=2,
                   help="key/value heads (dividing --heads)")
    p.add_argument("--intermediate", type=positive_int, default=None,
                   help="MLP width (default: 8/3 x hidden rounded up to 64, as Llama)")
    p.add_argument("--vocab", type=positive_int, default=2048, help="vocabulary size")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous", "stripe"),
                   help="how the sequence is split over the ranks (default zigzag)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default fp32 on CPU, bf16 on GPU")
    p.add_argument("--steps", type=positive_int, default=5, help="timed training steps")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW's learning rate")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer")
    p.add_argument("--backend", default=None, help="block kernel backend (default: best)")
    p.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="per-GPU peak for MFU (default: known A100/H100/H200 bf16 peak)")
    p.add_argument("--threads-per-rank", type=positive_int, default=None,
                   help="torch threads per CPU rank (default: cores // world size, at least 1)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="below 2**63")
    p.add_argument("--timeout", type=positive_seconds, default=1800,
                   help="seconds before spawned ranks are killed")
    p.add_argument("--json", type=json_path, default=None, help="write results to this path")
    p.add_argument("--plugin", action="store_true",
                   help="train through ringseq.plugin.Booster + RingSequenceParallelPlugin")
    p.add_argument("--sp-size", "--sp", dest="sp_size", type=positive_int, default=None,
                   help="with --plugin: ranks per ring (default: all / --tp; the rest is data "
                        "parallel)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks (implies --plugin)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 2, 3),
                   help="FSDP2 stage over the dp x sp ranks (implies --plugin)")
    p.add_argument("--ac", action="store_true",
                   help="the plugin's activation checkpointing, keeping the ring's output "
                        "(implies --plugin)")
    p.add_argument("--no-peer", action="store_true",
                   help="with --tp / --zero / --ac: skip the DDP x SP run at the same shape")
    args = p.parse_args(argv)
    args.compose = args.tp > 1 or args.zero > 0 or args.ac
    if args.compose or args.sp_size:
        args.plugin = True
    if args.compose and args.checkpointing:
        p.error("--checkpointing is transformers' recompute without the plugin; use --ac")
    layout = get_layout(args.layout)  # (one of --layout's choices)
    if args.seed >= 2 ** 63:
        p.error(f"--seed must be below 2**63, got {args.seed}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.hidden % args.heads:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden}")
    if (args.hidden // args.heads) % 2:  # (transformers' rotary halves: a raw shape error)
        p.error(f"--hidden {args.hidden} / --heads {args.heads} = head dim "
                f"{args.hidden // args.heads}: Llama's rotary embedding needs an even head dim")
    if args.dtype == "fp16" and not args.plugin:
        p.error("--dtype fp16 needs --plugin (its fp16 precision keeps float32 weights and "
                "scales the loss): AdamW on float16 weights turns the loss into nan; use fp32 "
                "or bf16")
    if args.dtype == "fp16" and args.zero:
        p.error(f"--dtype fp16 with --zero {args.zero}: the plugin's fp16 loss scaling needs "
                f"unsharded gradients (--zero 0); use bf16")
    if args.backend is not None:  # a backend the ranks would refuse, refused before they start
        from common import launcher_device
        from ringseq.kernels import get_backend
        device = launcher_device()[1]  # (and the dtype main() picks for it)
        dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
        try:
            get_backend(args.backend, device, dtype, args.hidden // args.heads)
        except ValueError as exc:
            p.error(f"--backend {args.backend}: {exc}")
    # the world: the launcher's (torchrun) or --world-size spawned ranks
    world = int(os.environ.get("WORLD_SIZE", args.world_size))
    if world % args.tp:
        p.error(f"--tp {args.tp} must divide the world size {world}")
    sp = args.sp_size or world // args.tp
    if world % (sp * args.tp):
        p.error(f"--sp-size {sp} x --tp {args.tp} must divide the world size {world}")
    try:
        local = layout.check_seqlen(args.seqlen, sp)
    except ValueError as exc:
        p.error(f"--seqlen {args.seqlen} over {sp} sequence-parallel ranks: {exc}")
    if local % args.tp:
        p.error(f"--seqlen {args.seqlen}: {local} tokens per sequence-parallel rank cannot be "
                f"split over --tp {args.tp}")
    if args.compose and not args.no_peer:  # (the DDP x sp comparison: sp x tp ranks in a ring)
        try:
            layout.check_seqlen(args.seqlen, sp * args.tp)
        except ValueError as exc:
            p.error(f"--seqlen {args.seqlen} over the {sp * args.tp} ranks of the DDP x "
                    f"sp{sp * args.tp} comparison run (--no-peer leaves it out): {exc}")
    if args.intermediate is None:
        args.intermediate = -(-(8 * args.hidden // 3) // 64) * 64
    if args.tp > 1:  # (the plugin's own rules, before any rank starts)
        from ringseq.parallel.dims import ParallelDims
        try:
            ParallelDims(world, sp, args.tp, args.zero, num_heads=args.heads,
                         num_kv_heads=args.kv_heads)
        except ValueError as exc:
            p.error(f"--tp {args.tp} with --heads {args.heads} --kv-heads {args.kv_heads}: "
                    f"{exc}")
        if args.intermediate % args.tp:
            p.error(f"--tp {args.tp} must divide the MLP width --intermediate "
                    f"{args.intermediate} (column-wise layers split it)")
    return args


def build_model(args, dtype, device, switch=True):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise SystemExit("train_long_context.py needs transformers: pip install 'ringseq[hf]'")
    from ringseq.integrations.transformers import apply

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seqlen, 2048), attention_dropout=0.0,
                      tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return apply(model, layout=args.layout, backend=args.backend) if switch else model


def step_flops(args, model, dp=1):
    """Model FLOPs of one training step over all ranks (see the module docstring); ``dp``
    data-parallel groups each train on ``args.batch`` sequences."""
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    tokens = dp * args.batch * args.seqlen
    dense = 6 * n_matmul * tokens
    attn = args.layers * attention_flops(dp * args.batch, args.heads, args.seqlen, args.seqlen,
                                         args.hidden // args.heads, True, "fwd_bwd")
    total = dense + attn
    if args.checkpointing:
        total *= 4 / 3
    return total, n_matmul


def all_reduce_grads(model, group=None):
    """Sums the gradients over the ring in one flat all-reduce (each rank back-propagated only
    its own tokens, so the sum is the full-sequence gradient)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def plugin_config(args, world):
    """(label, plugin kwargs) of the requested composition and, with --tp / --zero / --ac
    (unless --no-peer), of DDP x SP at the same shape: the same ranks per sample."""
    sp = args.sp_size or world // args.tp
    main = dict(sp_size=sp, tp_size=args.tp, zero_stage=args.zero,
                activation_checkpointing=args.ac)
    label = (f"sp{sp}" + (f" x tp{args.tp}" if args.tp > 1 else "") +
             (f" x zero{args.zero}" if args.zero else "") + (" + ac" if args.ac else ""))
    configs = [(label, main)]
    if args.compose and not args.no_peer:
        configs.append((f"DDP x sp{sp * args.tp}", dict(sp_size=sp * args.tp)))
    return configs


def plugin_setup(args, device, config=None):
    """Model, optimizer, loss and data through Booster; returns a step function, the model
    and dp."""
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    config = dict(config or {"sp_size": args.sp_size or dist.get_world_size()})
    plugin = RingSequenceParallelPlugin(layout=args.layout, precision=args.dtype,
                                        backend=args.backend, device=device, **config)
    booster = Booster(plugin=plugin)
    model = build_model(args, torch.float32, device, switch=False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)
    n = (args.warmup + args.steps) * args.batch * plugin.dp_size
    ids = torch.randint(0, args.vocab, (n, args.seqlen), generator=g)
    dataset = [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]
    loader = plugin.prepare_dataloader(dataset, batch_size=args.batch)
    model, opt, criterion, loader, _ = booster.boost(model, opt, dataloader=loader)
    model.train()
    batches = iter(loader)
    # torch's default AdamW: foreach on CUDA, the for-loop one on CPU
    # the plugin's own sizes (tp, zero, --ac); with --checkpointing (transformers' recompute,
    # which keeps only each layer's input) the estimate keeps the attention output besides:
    # an upper bound by b * s_local * (heads * head_dim * 2 + 4 * heads) bytes per layer
    try:
        estimate = plugin.estimate_memory(
            model, args.seqlen, micro_batch=args.batch,
            optimizer="adamw" if device.type == "cuda" else "adamw_forloop",
            activation_checkpointing=True if args.checkpointing else None)
    except ValueError as exc:  # (a --backend the estimate does not model: the run goes on)
        if dist.get_rank() == 0:
            print(f"# no memory estimate: {exc}", flush=True)
        estimate = None

    def step():
        batch = next(batches)  # on the plugin's device, tagged with its step (STEP_KEY)
        logits = model(**batch).logits
        loss = criterion(logits, batch)
        del logits
        booster.backward(loss, opt)  # gradients summed over dp x sp (DDP hook / FSDP / sync)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model.unwrap(), plugin.dp_size, estimate


def run_rank(args, device):
    dtype = DTYPES[args.dtype]
    rank, world = dist.get_rank(), dist.get_world_size()
    main = rank == 0
    if main:
        progress(f"building the model: {args.layers} layers, hidden {args.hidden}, "
                 f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, {args.dtype}"
                 f"{' (through Booster)' if args.plugin else ''}")
    if args.plugin:
        # libraries loaded before any peak is measured: on CPU the peak is the resident set,
        # which would otherwise charge their code and tables to the first configuration
        for name in ("torch.distributed.checkpoint", "torch.distributed.fsdp",
                     "torch.distributed.tensor.parallel"):
            importlib.import_module(name)
        configs = plugin_config(args, world)
        for label, config in configs:
            # one step of each configuration on a short sequence, unmeasured: DTensor and FSDP
            # build ~100 MiB of per-process state on first use (measured on CPU), which is no
            # part of a training step's memory
            short = argparse.Namespace(**{**vars(args), "seqlen": 4 * world, "warmup": 0})
            plugin_setup(short, device, config)[0]()
            gc.collect()
        runs = []
        for label, config in configs:
            if main:
                progress(f"configuration {label}")
            peak = PeakMemory(device)
            peak.__enter__()
            res = _run_steps(args, device, *plugin_setup(args, device, config),
                             ac=config.get("activation_checkpointing", False), peak=peak)
            gc.collect()  # the previous model and optimizer before the next peak
            if res is not None:
                res["config"], res["plugin_kwargs"] = label, config
            runs.append(res)
        if not main:
            return None
        res = runs[0]
        if len(runs) > 1:
            res["peer"] = runs[1]
            # invariant: the same weights and tokens, so the same loss at every step (within
            # rounding: the meshes sum in other orders, and AdamW carries it on)
            tol = 1e-4 if args.dtype == "fp32" else 2e-3
            for i, (a, b) in enumerate(zip(res["losses"], runs[1]["losses"])):
                if not abs(a - b) <= tol * abs(b):
                    # (numbered as the progress lines: warmup steps, then step 1, 2, ...)
                    step = (f"warmup step {i + 1}" if i < args.warmup else
                            f"step {i + 1 - args.warmup}")
                    res["failed"].append(
                        f"{step}'s losses differ: {res['config']} {a:.6f} vs "
                        f"{runs[1]['config']} {b:.6f} (tolerance {tol:g} relative)")
                    break
        return res
    model = build_model(args, dtype, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)  # the same full batch on every rank
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), generator=g).to(device)
    reference = unsharded_loss(args, dtype, device, ids) if main else None
    dist.barrier()
    batch = ringseq.shard_batch({"input_ids": ids, "labels": ids}, layout=args.layout)
    targets = batch.pop("shift_labels")

    def step():
        logits = model(**batch).logits
        loss = ringseq.sharded_cross_entropy(logits, targets)
        loss.backward()
        del logits
        all_reduce_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    res = _run_steps(args, device, step, model, 1)
    if main:
        # invariant: the first step's loss (the weights as built) is the unsharded model's
        # on the whole sequence (before: only a finite loss was required, and ring attention
        # outputs halved on every rank passed)
        first, tol = res["losses"][0], REFERENCE_TOL[args.dtype]
        res["reference_loss"] = reference
        if not abs(first - reference) <= tol * abs(reference):
            res["failed"].append(
                f"the first step's loss {first:.7f} is not the unsharded model's "
                f"{reference:.7f} on the same weights and tokens (tolerance {tol:g} relative)")
    return res


# the first step's loss against the unsharded model's, relative: rounding only (both sum the
# same logits in the same dtype; measured on CPU fp32 below 1e-6), far below what a wrong ring
# moves it (every attention output halved: 1.6e-4 relative at s = 256, one layer, hidden 64)
REFERENCE_TOL = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3}


@torch.no_grad()
def unsharded_loss(args, dtype, device, ids) -> float:
    """The mean next-token loss of the model as built (same seed, transformers' own attention)
    on the whole ``ids`` (b, seqlen) on one rank: the reference of the first step's loss. The
    LM head and the loss run in chunks of 4096 tokens, so that the full sequence's logits
    (s x vocab) are never held at once."""
    model = build_model(args, dtype, device, switch=False).eval()
    hidden = model.model(input_ids=ids).last_hidden_state  # (b, s, h)
    total, count = 0.0, 0
    for start in range(0, args.seqlen - 1, 4096):
        end = min(start + 4096, args.seqlen - 1)
        logits = model.lm_head(hidden[:, start:end]).float()  # (b, chunk, vocab)
        total += float(torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), ids[:, start + 1:end + 1].flatten(), reduction="sum"))
        count += logits.shape[0] * logits.shape[1]
    del model, hidden
    gc.collect()
    return total / count


def _run_steps(args, device, step_fn, model, dp, estimate=None, ac=False, peak=None):
    """Runs the steps; ``estimate``: the plugin's memory estimate (printed beside the measured
    peak); ``peak``: an entered PeakMemory to close after them (the plugin path opens it before
    building the model, so parameters and optimizer state count too)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    main = rank == 0
    times, losses = [], []
    if peak is None:
        peak = PeakMemory(device)
        peak.__enter__()
    with contextlib.ExitStack() as stack:
        stack.push(peak)
        for step in range(args.warmup + args.steps):
            synchronize(device)
            t0 = time.perf_counter()
            loss = step_fn()
            synchronize(device)
            dt = time.perf_counter() - t0
            losses.append(float(loss.detach()))
            if step >= args.warmup:
                times.append(dt)
            if main:
                tag = "warmup" if step < args.warmup else f"step {step - args.warmup + 1}/{args.steps}"
                progress(f"  {tag}: {dt * 1e3:.0f} ms, loss {losses[-1]:.4f}")
    absolute = None if peak.peak is None else peak.base + peak.peak
    mine = {"rank": rank, "peak_mib": mib(peak.peak), "peak_abs_mib": mib(absolute),
            "median_step_s": statistics.median(times)}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if not main:
        return None
    flops, n_matmul = step_flops(args, model, dp)
    if ac:
        flops *= 4 / 3  # the recomputed forward (the kept ring attention excepted: a bound)
    step_s = max(r["median_step_s"] for r in everyone)  # the ring moves at its slowest rank
    tflops_per_rank = flops / step_s / world / 1e12
    peak_tflops = args.peak_tflops
    if peak_tflops is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return {
        "world_size": world, "seqlen": args.seqlen, "batch": args.batch * dp, "dp": dp,
        "local_seqlen": args.seqlen * dp // world, "layout": args.layout, "dtype": args.dtype,
        "plugin": args.plugin,
        "checkpointing": args.checkpointing, "params": sum(p.numel() for p in model.parameters()),
        "matmul_params": n_matmul, "step_ms": step_s * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "tokens_per_s": dp * args.batch * args.seqlen / step_s,
        "tflops_per_rank": tflops_per_rank,
        "mfu": (tflops_per_rank / peak_tflops) if peak_tflops else None,
        "peak_mib_per_rank": [r["peak_mib"] for r in everyone],
        "peak_abs_mib_per_rank": [r["peak_abs_mib"] for r in everyone],
        "estimate_mib": None if estimate is None else mib(estimate.total),
        "estimate_peak_at": None if estimate is None else estimate.peak_phase,
        # (the first timed step's: "step 1" of the progress lines; losses: warmup included)
        "first_loss": losses[args.warmup], "last_loss": losses[-1], "losses": losses,
        # the run's invariants that failed (main reports them and exits 1)
        "failed": [] if all(math.isfinite(x) for x in losses) else [
            f"a loss is not finite: {losses}"],
    }


def _estimate_line(res, device) -> str:
    """``plugin.estimate_memory`` (ringseq.memory) beside the measured peak per rank."""
    measured = max((m for m in res["peak_abs_mib_per_rank"] if m is not None), default=None)
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
           "resident-set high-water mark: also the interpreter, libraries and allocator "
           "caches, so not comparable to tensor bytes; benchmarks/memory_check.py compares "
           "with MemTracker")
    return (f"peak memory per rank: estimate {res['estimate_mib']:.0f} MiB (ringseq.memory, "
            f"at {res['estimate_peak_at']}) vs measured "
            f"{'-' if measured is None else f'{measured:.0f}'} MiB ({how})")


def report_composition(args, res, device):
    runs = [res] + ([res["peer"]] if "peer" in res else [])
    ac = ("the plugin's (--ac; not in the DDP x SP run)" if args.ac else
          "transformers' recompute (--checkpointing)" if args.checkpointing else "off")
    print(f"# train_long_context: Llama {args.layers} layers, hidden {args.hidden}, heads "
          f"{args.heads}/{args.kv_heads}, MLP {args.intermediate}, vocab {args.vocab} "
          f"({res['params'] / 1e6:.2f} M params), {args.dtype} on {device}, W="
          f"{res['world_size']}, total s={res['seqlen']} x b={res['batch']}, layout "
          f"{res['layout']}; step = forward + backward + gradient reduction + AdamW, median "
          f"of {args.steps} (slowest rank); activation checkpointing: {ac}; peak memory "
          f"above the rank's state before the model was built")
    for r in runs:
        r["peak_max"] = max((m for m in r["peak_mib_per_rank"] if m is not None), default=None)
    columns = [("config", "configuration", "{}"), ("dp", "dp", "{}"),
               ("step_ms", "step ms", "{:.0f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
               ("tflops_per_rank", "TFLOP/s/rank", "{:.4f}"), ("mfu", "MFU", "{:.1%}"),
               ("peak_max", "peak MiB/rank (max)", "{:.0f}")]
    print(format_table(runs, columns))
    for r in runs:
        print(f"{r['config']}: peak memory per rank (MiB): " + ", ".join(
            "-" if m is None else f"{m:.0f}" for m in r["peak_mib_per_rank"]) +
            f"; loss first {r['first_loss']:.4f}, last {r['last_loss']:.4f}")
    for r in runs:  # the plugin's estimate of its own mesh (tp, zero, checkpointing) beside it
        if r.get("estimate_mib") is not None:
            print(f"{r['config']}: {_estimate_line(r, device)}")
    if len(runs) > 1:
        a, b = runs
        mem = ("" if not (a["peak_max"] and b["peak_max"]) else
               f", peak memory per rank x{a['peak_max'] / b['peak_max']:.2f}")
        print(f"{a['config']} vs {b['config']}: tokens/s x"
              f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}{mem}")


def report(args, res, device):
    if "config" in res:
        return report_composition(args, res, device)
    print(f"# train_long_context: Llama {args.layers} layers, hidden {args.hidden}, heads "
          f"{args.heads}/{args.kv_heads}, MLP {args.intermediate}, vocab {args.vocab} "
          f"({res['params'] / 1e6:.2f} M params), {args.dtype} on {device}")
    booster = (f", dp {res['dp']} x sp {res['world_size'] // res['dp']} through Booster"
               if res["plugin"] else "")
    print(f"# total s={res['seqlen']} x b={res['batch']} over W={res['world_size']} "
          f"({res['local_seqlen']} tokens/rank"
          f"{booster}"
          f"), layout {res['layout']}, activation "
          f"checkpointing {'on' if res['checkpointing'] else 'off'}; step = forward + backward "
          f"+ gradient all-reduce + AdamW, median of {args.steps} (slowest rank)")
    row = dict(res)
    row["peak_max"] = max((m for m in res["peak_mib_per_rank"] if m is not None), default=None)
    columns = [("world_size", "W", "{}"), ("seqlen", "seqlen", "{}"),
               ("step_ms", "step ms", "{:.0f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
               ("tflops_per_rank", "TFLOP/s/rank", "{:.4f}"), ("mfu", "MFU", "{:.1%}"),
               ("peak_max", "peak MiB/rank (max)", "{:.0f}")]
    print(format_table([row], columns))
    print("peak memory per rank (MiB): " + ", ".join(
        f"rank {r}: {'-' if m is None else f'{m:.0f}'}"
        for r, m in enumerate(res["peak_mib_per_rank"])))
    if res.get("estimate_mib") is not None:
        print(_estimate_line(res, device))
    print(f"loss: first step {res['first_loss']:.4f}, last step {res['last_loss']:.4f}")


def main(argv=None):
    args = parse_args(argv)
    launched, device = launcher_device()
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    t0 = time.time()
    if launched:
        init_launched_group(device, args.timeout)
        res = run_rank(args, device)
        is_main = dist.get_rank() == 0
    else:
        threads = threads_per_rank(args.threads_per_rank, args.world_size)
        progress(f"spawning {args.world_size} local CPU ranks (gloo); {threads} thread(s) each")
        res = spawn_cpu_ranks(args.world_size, run_rank, args, args.timeout, threads)
        is_main = True
    failed = []
    if is_main:
        report(args, res, device)
        failed = res["failed"] + [f"{res['peer']['config']}: {f}"
                                  for f in res.get("peer", {}).get("failed", [])]
        for f in failed:
            print(f"FAILED: {f}")
        progress(f"done in {time.time() - t0:.0f} s")
        write_json(args.json, {"benchmark": "train_long_context",
                               "environment": environment(device), "args": vars(args),
                               "result": res})
    if launched:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
