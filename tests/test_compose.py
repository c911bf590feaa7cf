"""dp x sp x tp on one mesh (FSDP2, DTensor TP with Megatron sequence parallelism, ring SP):
the plugin's compositions against single-process training, on 4 spawned gloo ranks (CPU).

One spawn carries everything:

* parity: 3 AdamW steps of tiny transformers models (random init, no downloads) -- Llama
  (untied, GQA 4:2) and Qwen2 (tied embeddings, q/k/v biases) -- as sp2 x zero3 (dp2),
  sp2 x tp2 (zero 0), sp2 x tp2 x zero3, and Qwen3 (per-head q_norm / k_norm) as sp2 x tp2 x
  zero2 with activation checkpointing; a plain nn.Module through ``tp_plan=`` names;
* the per-rank parameter bytes of the sharded runs (exactly the sharded share);
* resume across a mesh change (both checkpoint formats, both directions);
* activation checkpointing: ring exchanges per step counted at the transport, with and without;
* no_sync accumulation and gradient clipping under FSDP and the zero-0 tensor-parallel sync;
  a bf16 step with FSDP's mixed precision;
* the misconfigurations, each raised on every rank.

A second spawn (marked slow) trains dp2 x sp2 x tp2 with zero 3 on 8 ranks.

Parity bar: loss and every weight within 1e-5 relative (per tensor: max |w - w_ref| /
max |w_ref|) of single-process float32 training on the whole global batch. The optimizer is
AdamW with two param groups and eps=1e-5, the model initialized N(0, 0.05) (norms around 1):
Adam's first steps divide the float32 rounding of near-zero gradient entries by eps, so plain
single-process float32 training is itself that far from float64 after 3 steps -- measured with
this init: up to 1.9e-5 (Qwen3) with the default eps=1e-8, above the bar, and at most 5.2e-6
with eps=1e-5 (with transformers' own init, zero biases, and lr 1e-2: 1.9e-3). With eps=1e-5
the bar separates a wrong gradient from rounding; the measured worst here is 4.1e-6.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from dist_utils import run_ranks  # noqa: E402
from utils import (SwitchableAttention, assert_close_per_design, error_text,  # noqa: E402
                   token_dataset)

WORLD, SEQLEN, GLOBAL_BATCH, STEPS, VOCAB = 4, 32, 4, 3, 128
REL = 1e-5
PARITY = {  # (family, plugin kwargs)
    "llama/sp2_zero3_dp2": ("llama", dict(sp_size=2, zero_stage=3)),
    "llama/sp2_tp2": ("llama", dict(sp_size=2, tp_size=2)),
    "llama/sp2_tp2_zero3": ("llama", dict(sp_size=2, tp_size=2, zero_stage=3)),
    "qwen2/sp2_zero3_dp2": ("qwen2", dict(sp_size=2, zero_stage=3)),
    "qwen2/sp2_tp2": ("qwen2", dict(sp_size=2, tp_size=2)),
    "qwen2/sp2_tp2_zero3": ("qwen2", dict(sp_size=2, tp_size=2, zero_stage=3)),
    "qwen3/sp2_tp2_zero2_ac": ("qwen3", dict(sp_size=2, tp_size=2, zero_stage=2,
                                             activation_checkpointing=True)),
}
ACCUMULATE = {"sp2_tp2": dict(sp_size=2, tp_size=2),              # grad_sync
              "sp2_tp2_zero3": dict(sp_size=2, tp_size=2, zero_stage=3),
              "sp2_zero2_dp2": dict(sp_size=2, zero_stage=2)}
RESUME_FROM = "llama/sp2_tp2_zero3"  # saves after step 2 (sharded optimizer: DCP directory)
RESUMES = {  # name: (plugin kwargs, checkpoint made by)
    "dcp_into_dp2_sp2_zero2": (dict(sp_size=2, zero_stage=2), RESUME_FROM),
    "dcp_into_sp4_ddp": (dict(sp_size=4), RESUME_FROM),
    "plain_into_sp2_tp2_zero3": (dict(sp_size=2, tp_size=2, zero_stage=3), "llama/sp4_ddp"),
}


def _model(family):
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=256, attention_dropout=0.0)
    if family == "llama":
        cfg, cls = transformers.LlamaConfig(**common, tie_word_embeddings=False), \
            transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common, tie_word_embeddings=True), \
            transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False), \
            transformers.Qwen3ForCausalLM
    model = cls(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0  # norms near 1, everything else near 0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))
    return model


def _dataset(n=GLOBAL_BATCH * STEPS, seqlen=SEQLEN):
    return token_dataset(n, seqlen, VOCAB, ignored=(5, 13))


def _optimizer(model):
    """AdamW with two groups: matrices (decay) and vectors (no decay, another lr)."""
    mats = [p for p in model.parameters() if p.dim() >= 2]
    vecs = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": mats}, {"params": vecs, "lr": 2e-3,
                                                 "weight_decay": 0.0}],
                             lr=1e-3, weight_decay=0.01, eps=1e-5)


# ---------------------------------------------------------------- rank side
def _full(model):
    from ringseq.plugin.sharded_checkpoint import full_model_state_dict
    return full_model_state_dict(model)  # collective; rank 0 holds it


def _local_numels(model, tp):
    """name -> (local numel, full shape, the dim tp shards or None)."""
    from torch.distributed.tensor import DTensor, Shard
    out = {}
    for n, p in model.named_parameters():
        last = p.placements[-1] if isinstance(p, DTensor) else None
        tp_dim = last.dim if tp > 1 and type(last) is Shard else None
        out[n] = (p.to_local().numel() if isinstance(p, DTensor) else p.numel(),
                  tuple(p.shape), tp_dim)
    return out


def _boosted(family, cfg, first=0):
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    plugin = RingSequenceParallelPlugin(**cfg)
    booster = Booster(plugin=plugin)
    model = _model(family)
    opt = _optimizer(model)
    data = _dataset()[first * GLOBAL_BATCH:]
    loader = plugin.prepare_dataloader(data, batch_size=GLOBAL_BATCH // plugin.dp_size)
    user_opt = opt
    model, opt, criterion, loader, _ = booster.boost(model, opt, dataloader=loader)
    assert opt.unwrap() is user_opt  # the same object, now over the sharded parameters
    return plugin, booster, model, opt, criterion, loader


def _train(name, family, cfg, ckpt_dir, steps=STEPS, save_at=None, resume=None, first=0,
           evaluate_between=False):
    plugin, booster, model, opt, criterion, loader = _boosted(family, cfg, first)
    if resume is not None:
        booster.load_model(model, os.path.join(ckpt_dir, resume, "model.pt"))
        booster.load_optimizer(opt, os.path.join(ckpt_dir, resume, "optim"))
    losses = []
    for batch in loader:
        loss = criterion(model(**batch), batch)
        booster.backward(loss, opt)
        if evaluate_between:  # (a validation forward between the backward and the step)
            with torch.no_grad():
                model(**batch)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if len(losses) == save_at:
            where = os.path.join(ckpt_dir, name)
            booster.save_model(model, os.path.join(where, "model.pt"))
            booster.save_optimizer(opt, os.path.join(where, "optim"))
        if len(losses) == steps:
            break
    inner = model.unwrap()
    out = {"losses": losses, "weights": _full(inner),
           "numels": _local_numels(inner, plugin.tp_size),
           "groups": [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])}
                      for g in opt.param_groups], "repr": repr(plugin)}
    if name == "qwen2/sp2_tp2_zero3":  # tied embeddings, sharded: HF-style shards too
        booster.save_model(model, os.path.join(ckpt_dir, "shards"), max_shard_size="20KB")
    return out


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(32), SwitchableAttention(32)
        self.norm2, self.mlp = nn.LayerNorm(32), _Mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Mixer(nn.Module):
    """SwitchableAttention's computation without its ringseq_switch (nothing marks it as an
    attention: its layer switches it)."""
    sdpa = staticmethod(F.scaled_dot_product_attention)
    forward = SwitchableAttention.forward


class _SwitchingLayer(_Layer):
    """A decoder layer that switches the attention it holds (ringseq_switch on the layer)."""

    def ringseq_switch(self, group, layout, backend=None):
        from ringseq.plugin import sdpa_on_ring
        self.attn.sdpa = sdpa_on_ring(group, layout, backend)


def _switching_lm():
    model = _PlainLM()
    for layer in model.layers:
        layer.__class__, layer.attn.__class__ = _SwitchingLayer, _Mixer
    return model


class _PlainLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, VOCAB)

    def forward(self, input_ids, position_ids=None):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


PLAIN_PLAN = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
              "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise",
              "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}


def _plain_tp(ids, labels):
    """One SGD step of _PlainLM as sp2 x tp2 with tp_plan names."""
    import ringseq
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    plugin = RingSequenceParallelPlugin(sp_size=2, tp_size=2, layout="zigzag",
                                        tp_plan=PLAIN_PLAN)
    booster = Booster(plugin=plugin)
    model = _PlainLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, criterion, *_ = booster.boost(model, opt, nn.CrossEntropyLoss())
    batch = ringseq.shard_batch({"input_ids": ids, "labels": labels}, group=plugin.sp_group,
                                layout=plugin.data_layout)
    loss = criterion(model(batch["input_ids"]), batch)
    booster.backward(loss, opt)
    opt.step()
    return {"loss": float(loss.detach()), "weights": _full(model.unwrap())}


def _ring_counts(ac, evaluate=False):
    """One forward + backward of Llama as sp2 x tp2 (zero 0): ring calls and exchanges at
    the transport, bytes saved for backward outside recomputed regions, loss and gradients.
    ``evaluate``: a forward under no_grad of a batch twice as long between the loss and the
    backward (the recompute must not check or agree on its inputs again)."""
    from torch.distributed.tensor import DTensor

    from ringseq import get_comm, shard_batch
    cfg = dict(sp_size=2, tp_size=2, activation_checkpointing=ac)
    plugin, booster, model, opt, criterion, loader = _boosted("llama", cfg)
    comm = get_comm(plugin.sp_group)
    exchanges = [0]
    inner_exchange = comm.transport.exchange

    def counted(*args, **kwargs):
        exchanges[0] += 1
        return inner_exchange(*args, **kwargs)

    comm.transport.exchange = counted
    saved = {}
    params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
              for p in model.unwrap().parameters()}

    def pack(t):  # activations only: parameters are held anyway
        storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    batch = next(iter(loader))
    calls0 = comm.calls
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = criterion(model(**batch), batch)
    fwd_calls, fwd_exchanges = comm.calls - calls0, exchanges[0]
    if evaluate:
        g = torch.Generator().manual_seed(3)
        longer = torch.randint(0, VOCAB, (2, 2 * SEQLEN), generator=g)
        with torch.no_grad():
            model(**shard_batch({"input_ids": longer}, group=plugin.sp_group,
                                layout=plugin.data_layout))
    booster.backward(loss, opt)
    del comm.transport.exchange
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.unwrap().named_parameters()}
    return {"calls": comm.calls - calls0, "exchanges": exchanges[0],
            "fwd_calls": fwd_calls, "fwd_exchanges": fwd_exchanges,
            "saved_bytes": sum(saved.values()), "loss": float(loss.detach()), "grads": grads,
            "local": (batch["input_ids"].shape, model.unwrap().config.num_hidden_layers)}


def _accumulate(cfg):
    """Global batches 0 and 1 as two micro-batches, the first under no_sync; then the clipped
    norm of the accumulated gradients (a no-op clip: max_norm far above it)."""
    from torch.distributed.tensor import DTensor
    plugin, booster, model, opt, criterion, loader = _boosted("llama", cfg)
    batches = iter(loader)
    with booster.no_sync(model, opt):
        batch = next(batches)
        booster.backward(criterion(model(**batch), batch), opt)
    batch = next(batches)
    booster.backward(criterion(model(**batch), batch), opt)
    norm = opt.clip_grad_by_norm(1e9)  # a plain tensor: the total over all shards
    return {"grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                      for n, p in model.unwrap().named_parameters()}, "norm": float(norm)}


def _tp_only_accumulation():
    """W=2 as tp 2 alone (dp x sp = 1: nothing is summed over ranks): global batches 0 and 1
    as two backward passes without no_sync, then a step."""
    from torch.distributed.tensor import DTensor
    plugin, booster, model, opt, criterion, loader = _boosted("llama", dict(sp_size=1,
                                                                            tp_size=2))
    batches = iter(loader)
    for _ in range(2):
        batch = next(batches)
        booster.backward(criterion(model(**batch), batch), opt)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.unwrap().named_parameters()}
    return {"grads": grads, "step": error_text(opt.step)}


def test_tensor_parallelism_alone_accumulates_without_no_sync():
    """With tp alone no gradient is summed over ranks, so backward passes accumulate exactly
    without no_sync, as on one process, and the step takes them (before: refused, "2 backward
    passes summed the gradients over the ranks ... W times too large")."""
    ref = _accumulated_grads()
    for r in run_ranks(_tp_only_accumulation, 2, timeout=300):
        assert r["step"] == "no error", r["step"]
        for name, g in ref["grads"].items():
            assert _rel(r["grads"][name], g) <= REL, name


def _checkpoints_around_the_steps(ckpt_dir):
    """W=2 as sp 2 x zero 2: an optimizer checkpoint before the first step, then one step, an
    evaluation forward under no_grad (FSDP2 at zero 2 keeps the gathered parameters until a
    backward), and every checkpoint call after it."""
    plugin, booster, model, opt, criterion, loader = _boosted("llama", dict(sp_size=2,
                                                                          zero_stage=2))
    out = {}
    initial = os.path.join(ckpt_dir, "initial_optim")
    booster.save_optimizer(opt, initial)
    out["state after saving a fresh optimizer"] = len(opt.unwrap().state)
    batch = next(iter(loader))
    booster.backward(criterion(model(**batch), batch), opt)
    opt.step()
    opt.zero_grad()
    out["step counts after one step"] = sorted({float(s["step"])
                                                for s in opt.unwrap().state.values()})
    before, after = (os.path.join(ckpt_dir, f"{name}.pt") for name in ("before", "after"))
    booster.save_model(model, before)
    with torch.no_grad():
        model(**batch)  # a validation forward
    booster.save_model(model, after)
    booster.save_optimizer(opt, os.path.join(ckpt_dir, "optim"))
    booster.load_model(model, before)
    booster.load_optimizer(opt, os.path.join(ckpt_dir, "optim"))
    out["step counts after the round trip"] = sorted({float(s["step"])
                                                      for s in opt.unwrap().state.values()})
    booster.load_optimizer(opt, initial)  # back to no state at all
    out["state after loading the initial checkpoint"] = len(opt.unwrap().state)
    partial = os.path.join(ckpt_dir, "lm_head.pt")
    if torch.distributed.get_rank() == 0:
        torch.save({"lm_head.weight": torch.load(before)["lm_head.weight"]}, partial)
    torch.distributed.barrier()
    keys = booster.load_model(model, partial, strict=False)
    out["keys a partial load reports"] = (keys.missing_keys, keys.unexpected_keys)
    return out


def _evaluated_between_backward_and_step(ckpt_dir):
    return {zero: _train(f"eval_zero{zero}", "llama", dict(sp_size=2, zero_stage=zero),
                         ckpt_dir, evaluate_between=True) for zero in (2, 3)}


def test_a_forward_between_the_backward_and_the_step_leaves_training_exact(tmp_path):
    """A validation forward after booster.backward and before optimizer.step, at zero stages 2
    and 3 (W=2, sp 2): training matches the single process (before: FSDP kept the units that
    forward gathered, the step updated the shards only, and the next step computed with the
    parameters of before the step: its loss and gradients 10-44 % off, without a word)."""
    ref = _single_process("llama")
    results = run_ranks(_evaluated_between_backward_and_step, 2, str(tmp_path), timeout=300)
    for zero, got in results[0].items():  # (rank 0 holds the full weights)
        _assert_parity(got, ref, f"zero {zero}, evaluated between backward and step")
    for zero, got in results[1].items():
        assert got["losses"] == results[0][zero]["losses"], (zero, got["losses"])


def test_checkpoints_after_an_evaluation_forward_and_before_the_first_step(tmp_path):
    """An optimizer saved before its first step (an initial checkpoint) stays without state
    (before: torch's lr-0 step stayed in it: step counts of 2 after one step, a different
    second loss) and loads back as none; after an evaluation forward at zero 2 the model saves
    as full tensors that load into the plain model (before: DTensor shards in the "full"
    file, save_optimizer's KeyError: 0, load_model's mixed Tensor and DTensor error); a
    partial load with strict=False lists the missing keys as on one process."""
    results = run_ranks(_checkpoints_around_the_steps, 2, str(tmp_path), timeout=300)
    before = torch.load(tmp_path / "before.pt", weights_only=True)
    for r in results:
        assert r == {"state after saving a fresh optimizer": 0,
                     "step counts after one step": [1.0],
                     "step counts after the round trip": [1.0],
                     "state after loading the initial checkpoint": 0,
                     # (before: none listed under sharding, as if every key had matched)
                     "keys a partial load reports": (sorted(set(before) - {"lm_head.weight"}),
                                                     [])}, r
    after = torch.load(tmp_path / "after.pt", weights_only=True)
    assert before.keys() == after.keys()
    for key, value in after.items():
        assert type(value) is torch.Tensor and torch.equal(value, before[key]), key
    _model("llama").load_state_dict(after)


def _boosted_from_different_weights():
    """W=2: rank 1 builds other initial weights (no common seed); each rank's view of every
    parameter after boost (DTensors made full: a replicated one shows this rank's copy)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    views = {}
    for name, cfg in (("sp2_zero3", dict(sp_size=2, zero_stage=3)),
                      ("tp2", dict(sp_size=1, tp_size=2))):
        model = _model("llama")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * dist.get_rank())
        model, *_ = Booster(plugin=RingSequenceParallelPlugin(**cfg)).boost(model)
        views[name] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in model.unwrap().named_parameters()}
    return views


def test_every_mesh_starts_from_rank_0s_weights():
    """Ranks that built different initial weights train rank 0's model on every mesh, as DDP
    makes them (before: FSDP trained a mix of each rank's shards, 0.12 from rank 0's model,
    and tp ranks kept their own replicated norms and embedding while the checkpoint showed
    rank 0's)."""
    want = dict(_model("llama").named_parameters())
    for rank, views in enumerate(run_ranks(_boosted_from_different_weights, 2, timeout=300)):
        for mesh, params in views.items():
            assert params.keys() == want.keys(), (rank, mesh)
            for n, p in params.items():
                assert torch.equal(p, want[n].detach()), (rank, mesh, n)


def _frozen_under_tp():
    """W=2 as tp 2: a model frozen whole (a teacher) and one with a frozen embedding and
    final norm, boosted; which of their parameters require a gradient afterwards; then the
    student's final norm unfrozen and one backward: its gradient's placement (summed over
    tp by the gradient sync: Replicate)."""
    from ringseq import shard_batch
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    out = {}
    for name, frozen in (("teacher", None), ("student", ("model.embed_tokens.weight",
                                                         "model.norm.weight"))):
        model = _model("llama")
        for n, p in model.named_parameters():
            p.requires_grad_(frozen is not None and n not in frozen)
        plugin = RingSequenceParallelPlugin(sp_size=1, tp_size=2)
        boosted, _, criterion, _, _ = Booster(plugin=plugin).boost(model)
        out[name] = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    out["all"] = sorted(n for n, _ in model.named_parameters())
    model.model.norm.weight.requires_grad_(True)
    ids = torch.randint(0, VOCAB, (1, SEQLEN), generator=torch.Generator().manual_seed(4))
    batch = shard_batch({"input_ids": ids, "labels": ids}, group=plugin.sp_group)
    criterion(boosted(**batch), batch).backward()
    out["unfrozen_grad"] = str(model.model.norm.weight.grad.placements)
    return out


def test_tensor_parallelism_keeps_frozen_parameters_frozen():
    """torch's replicating styles replace each parameter with one that requires a gradient:
    before, a frozen teacher came back training its norms, embedding and LM head (and its
    forward then waited for a backward that never came). A parameter frozen at boost and
    unfrozen later is reduced like the others."""
    for r in run_ranks(_frozen_under_tp, 2, timeout=300):
        assert r["teacher"] == r["all"], r["teacher"]
        assert r["student"] == ["model.embed_tokens.weight", "model.norm.weight"], r
        # (frozen at boost, unfrozen later: still summed over tp by the gradient sync)
        assert r["unfrozen_grad"] == "(Replicate(),)", r["unfrozen_grad"]


def _bf16_step():
    """One bf16 step of sp2 x tp2 x zero3 (FSDP's MixedPrecisionPolicy, float32 reduction)."""
    from torch.distributed.tensor import DTensor
    plugin, booster, model, opt, criterion, loader = _boosted(
        "llama", dict(sp_size=2, tp_size=2, zero_stage=3, precision="bf16"))
    batch = next(iter(loader))
    out = model(**batch)
    loss = criterion(out, batch)
    booster.backward(loss, opt)
    grad_dtypes = {str(p.grad.dtype) for p in model.unwrap().parameters()}
    # every gradient whole, in the same order on every rank (full_tensor is collective)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).double()
             for n, p in model.unwrap().named_parameters()}
    opt.step()
    params = [p.to_local() if isinstance(p, DTensor) else p for p in model.unwrap().parameters()]
    return {"loss": float(loss.detach()), "logits_dtype": str(out.logits.dtype), "grads": grads,
            "grad_dtypes": grad_dtypes, "param_dtypes": {str(p.dtype) for p in params},
            "finite": all(bool(torch.isfinite(p).all()) for p in params)}


def _errors(ckpt_dir):
    from ringseq.plugin import Booster, RingSequenceParallelPlugin as P
    out = {"tp3": error_text(lambda: P(sp_size=1, tp_size=3)),
           "sp_x_tp": error_text(lambda: P(sp_size=4, tp_size=2)),
           "zero1": error_text(lambda: P(sp_size=2, zero_stage=1)),
           "fp16_sharded": error_text(lambda: P(sp_size=2, zero_stage=3, precision="fp16"))}
    llama = _model("llama")
    out["heads_tp"] = error_text(lambda: Booster(plugin=P(sp_size=1, tp_size=4)).boost(llama))
    out["heads_untouched"] = llama.config._attn_implementation != "ringseq"
    plain = _PlainLM()
    out["no_plan"] = error_text(lambda: Booster(plugin=P(sp_size=2, tp_size=2)).boost(plain))
    out["bad_plan"] = error_text(lambda: Booster(plugin=P(
        sp_size=2, tp_size=2, tp_plan={"layers.*.attn.q": "colwise_sideways"})).boost(_PlainLM()))
    # a plan of the MLPs only: the attention would run replicated on a tp rank's share of
    # the tokens (before: a wrong loss, silently)
    mlp_only = {"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}
    out["attention_outside_blocks"] = error_text(lambda: Booster(plugin=P(
        sp_size=2, tp_size=2, tp_plan=mlp_only)).boost(_PlainLM()))
    # ... but a decoder layer whose ringseq_switch switches the attention it holds is fine
    out["switch_on_layer"] = error_text(lambda: Booster(plugin=P(
        sp_size=2, tp_size=2, tp_plan=PLAIN_PLAN)).boost(_switching_lm()))
    # ... unless a linear layer under it lies in no block (its attention's, here: before, the
    # layer holding the planned MLP passed, and the attention ran on a tp rank's tokens)
    out["switch_on_layer_mlp_only"] = error_text(lambda: Booster(plugin=P(
        sp_size=2, tp_size=2, tp_plan=mlp_only)).boost(_switching_lm()))
    # ParallelStyles for the linear layers only: refused before the model is modified
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    styles = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel()
              for k, v in PLAIN_PLAN.items()}
    half = _PlainLM()
    out["styles_uncovered"] = error_text(lambda: Booster(plugin=P(
        sp_size=2, tp_size=2, tp_plan=styles)).boost(half))
    out["styles_untouched"] = not any(isinstance(p, DTensor) for p in half.parameters())
    # a 0-dim parameter under FSDP2: refused before any unit is sharded (before: torch's
    # error after the decoder layers were sharded in place)
    scalar = _PlainLM()
    scalar.temperature = nn.Parameter(torch.tensor(1.0))
    out["scalar_fsdp"] = error_text(lambda: Booster(plugin=P(sp_size=2, zero_stage=2)).boost(
        scalar))
    out["scalar_untouched"] = not any(isinstance(p, DTensor) for p in scalar.parameters())
    # plans of one length that differ between ranks (before: a wait for the ring timeout)
    rank_plan = dict(PLAIN_PLAN) if torch.distributed.get_rank() % 2 else {
        k.replace("*", "0") if "mlp" in k else k: v for k, v in PLAIN_PLAN.items()}
    out["plan_differs"] = error_text(lambda: P(sp_size=2, tp_size=2, tp_plan=rank_plan))
    out["plan_key"] = error_text(lambda: P(sp_size=2, tp_size=2, tp_plan={1: "colwise"}))
    # styles of one type whose options differ between ranks (before: agreed on by type alone)
    out["style_options_differ"] = error_text(lambda: P(sp_size=2, tp_size=2, tp_plan={
        "layers.*.mlp.up": ColwiseParallel(
            use_local_output=bool(torch.distributed.get_rank() % 2))}))
    stepped = _model("llama")
    opt = _optimizer(stepped)
    stepped(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(
        1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    out["stepped_optimizer"] = error_text(lambda: Booster(plugin=P(
        sp_size=2, zero_stage=3)).boost(stepped, opt))
    # the user's module a sharded boost returned the wrapper of (its parameters are DTensors
    # now): a second boost is refused in words (before: FSDP's AssertionError)
    twice = _model("llama")
    Booster(plugin=P(sp_size=2, zero_stage=2)).boost(twice)
    out["boosted_twice"] = error_text(lambda: Booster(plugin=P(sp_size=2, zero_stage=2)).boost(
        twice))
    # 34 tokens: contiguous over sp=2 is fine, but 17 per sp shard cannot split over tp=2
    plugin = P(sp_size=2, tp_size=2, layout="contiguous")
    bad = plugin.prepare_dataloader(_dataset(2, seqlen=34), batch_size=2)
    out["bad_len"] = error_text(lambda: next(iter(bad)))
    return out


def _worker(ckpt_dir, plain_ids, plain_labels):
    import torch.distributed as dist
    res = {}
    for name, (family, cfg) in PARITY.items():
        res[name] = _train(name, family, cfg, ckpt_dir,
                           save_at=2 if name == RESUME_FROM else None)
    res["llama/sp4_ddp"] = _train("llama/sp4_ddp", "llama", dict(sp_size=4), ckpt_dir,
                                  steps=2, save_at=2)
    for name, (cfg, source) in RESUMES.items():
        res["resume/" + name] = _train(name, "llama", cfg, ckpt_dir, steps=1, resume=source,
                                       first=2)
    res["plain_tp"] = _plain_tp(plain_ids, plain_labels)
    res["ac_off"], res["ac_on"] = _ring_counts(False), _ring_counts(True)
    res["ac_evaluated"] = _ring_counts(True, evaluate=True)
    res["accumulate"] = {name: _accumulate(cfg) for name, cfg in ACCUMULATE.items()}
    res["bf16"] = _bf16_step()
    res["errors"] = _errors(ckpt_dir)
    dist.barrier()  # every rank is alive and in step after all the errors
    return res


# ---------------------------------------------------------------- parent side
def _accumulated_grads():
    model = _model("llama")
    data = _dataset()
    for step in range(2):
        chunk = data[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        model(input_ids=torch.stack([d["input_ids"] for d in chunk]),
              labels=torch.stack([d["labels"] for d in chunk]), use_cache=False).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                 for g in grads.values()]))
    return {"grads": grads, "norm": float(norm)}


def _single_process(family, steps=STEPS):
    model = _model(family)
    opt = _optimizer(model)
    data = _dataset()
    losses = []
    for step in range(steps):
        chunk = data[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
        loss = model(input_ids=torch.stack([d["input_ids"] for d in chunk]),
                     labels=torch.stack([d["labels"] for d in chunk]), use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": model.state_dict()}


def _plain_single(ids, labels):
    model = _PlainLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    loss = F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    opt.step()
    return {"loss": float(loss.detach()), "weights": model.state_dict()}


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("compose"))
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100
    ranks = run_ranks(_worker, WORLD, ckpt_dir, ids, labels, timeout=600)
    return {"ranks": ranks, "ckpt_dir": ckpt_dir,
            "ref": {f: _single_process(f) for f in ("llama", "qwen2", "qwen3")},
            "plain": _plain_single(ids, labels), "accumulated": _accumulated_grads()}


def _assert_parity(got, ref, what, steps=STEPS, first=0):
    for i, (loss, want) in enumerate(zip(got["losses"], ref["losses"][first:first + steps])):
        assert abs(loss - want) <= REL * abs(want), \
            f"{what}: step {first + i} loss {loss} vs {want}"
    assert set(got["weights"]) == set(ref["weights"]), what
    worst = max((_rel(got["weights"][k], w), k) for k, w in ref["weights"].items())
    assert worst[0] <= REL, f"{what}: {worst[1]} off by {worst[0]:.2e} (relative)"
    return worst[0]


@pytest.mark.parametrize("case", list(PARITY))
def test_training_parity_with_single_process(run, case):
    family = PARITY[case][0]
    got = run["ranks"][0][case]
    worst = _assert_parity(got, run["ref"][family], case)
    # the user's optimizer object (asserted on the ranks), pointed at the sharded
    # parameters: groups and hyperparameters unchanged
    groups = got["groups"]
    assert [(g["lr"], g["weight_decay"], g["eps"]) for g in groups] == \
        [(1e-3, 0.01, 1e-5), (2e-3, 0.0, 1e-5)], groups
    n_params = len(list(_model(family).parameters()))
    assert sum(g["n"] for g in groups) == n_params
    print(f"\n{case}: {got['repr']}: max relative weight error {worst:.2e}")


@pytest.mark.parametrize("case, tp, zero", [("llama/sp2_zero3_dp2", 1, 3),
                                            ("llama/sp2_tp2", 2, 0),
                                            ("llama/sp2_tp2_zero3", 2, 3),
                                            ("qwen2/sp2_tp2_zero3", 2, 3)])
def test_each_rank_holds_its_sharded_share(run, case, tp, zero):
    """Rank r = (dp x sp index) * tp + tp index holds, of every parameter, its tp shard (the
    dim ColwiseParallel / RowwiseParallel splits, nothing for replicated ones) and of that
    FSDP's dim-0 chunk (torch.chunk sizes over the dp x sp ranks) -- no more."""
    shards = WORLD // tp if zero else 1
    per_param = {}
    for r, res in enumerate(run["ranks"]):
        for name, (local, shape, tp_dim) in res[case]["numels"].items():
            shape = list(shape)
            if tp_dim is not None:
                shape[tp_dim] //= tp
            if zero:
                rows = [len(c) for c in torch.arange(shape[0]).chunk(shards)]
                shape[0] = rows[r // tp] if r // tp < len(rows) else 0
            assert local == torch.Size(shape).numel(), (case, r, name, local, shape)
            per_param[name] = per_param.get(name, 0) + local
    # over all ranks: a tp-sharded parameter exists once per dp x sp replica group of
    # ranks that does not shard it, a tp-replicated one once per tp rank on top
    for name, (_, shape, tp_dim) in run["ranks"][0][case]["numels"].items():
        copies = (1 if zero else WORLD // tp) * (1 if tp_dim is not None else tp)
        assert per_param[name] == torch.Size(shape).numel() * copies, (case, name)


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_across_a_mesh_change_continues_exactly(run, name):
    got = run["ranks"][0]["resume/" + name]
    # step 3 (global batch 2) after loading the step-2 checkpoint of another mesh equals the
    # third step of uninterrupted single-process training
    _assert_parity(got, run["ref"]["llama"], name, steps=1, first=2)


def test_checkpoints_load_without_ringseq(run):
    ckpt = run["ckpt_dir"]
    # one file, from the sharded sp2 x tp2 x zero3 run (saved after step 2)
    plain = _model("llama")
    plain.load_state_dict(torch.load(os.path.join(ckpt, RESUME_FROM, "model.pt"),
                                     weights_only=True))
    assert plain.config._attn_implementation != "ringseq"
    # transformers-style shards of the tied Qwen2 (sp2 x tp2 x zero3), read with plain torch
    folder = os.path.join(ckpt, "shards")
    with open(os.path.join(folder, "pytorch_model.bin.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    state = {}
    for name in files:
        state.update(torch.load(os.path.join(folder, name), weights_only=True))
    qwen = _model("qwen2")
    qwen.load_state_dict(state)
    final = run["ranks"][0]["qwen2/sp2_tp2_zero3"]["weights"]
    for k, w in qwen.state_dict().items():
        assert torch.equal(w, final[k]), k
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight  # still tied
    # the sharded optimizer state is a torch.distributed.checkpoint directory
    assert os.path.exists(os.path.join(ckpt, RESUME_FROM, "optim", ".metadata"))


def test_plain_module_through_tp_plan_names(run):
    single = run["plain"]
    for r in run["ranks"]:
        got = r["plain_tp"]
        assert abs(got["loss"] - single["loss"]) <= REL * abs(single["loss"])
    got = run["ranks"][0]["plain_tp"]
    for name, w in single["weights"].items():
        assert _rel(got["weights"][name], w) <= REL, name


def test_activation_checkpointing_repeats_no_ring_communication(run):
    for r in run["ranks"]:
        off, on = r["ac_off"], r["ac_on"]
        layers = off["local"][1]
        # a forward ring call and a backward ring call per layer, with or without recompute
        assert off["fwd_calls"] == on["fwd_calls"] == layers
        assert off["calls"] == on["calls"] == 2 * layers, (off["calls"], on["calls"])
        assert off["exchanges"] == on["exchanges"] > 0, (off["exchanges"], on["exchanges"])
        assert off["fwd_exchanges"] == on["fwd_exchanges"]
        assert abs(off["loss"] - on["loss"]) <= 1e-6 * abs(off["loss"])
        for name, g in off["grads"].items():
            assert _rel(on["grads"][name], g) <= REL, name
        # activations held for backward: the recomputed layers hold only what checkpointing
        # keeps (ring output + lse, (b, s/sp, h/tp, d) + (b, h/tp, s/sp) float32 per layer)
        b, s_local = off["local"][0]
        kept = layers * (b * s_local * 2 * 16 * 4 + b * 2 * s_local * 4)
        assert on["saved_bytes"] + kept < off["saved_bytes"] / 2, (on["saved_bytes"], kept,
                                                                   off["saved_bytes"])
        # an evaluation forward of a longer batch between the loss and the backward changes
        # nothing (before: the recompute checked the layers' inputs again and raised)
        evaluated = r["ac_evaluated"]
        assert evaluated["loss"] == on["loss"]
        for name, g in on["grads"].items():
            assert torch.equal(evaluated["grads"][name], g), name


@pytest.mark.parametrize("case", list(ACCUMULATE))
def test_no_sync_accumulates_and_clipping_sees_the_global_norm(run, case):
    ref = run["accumulated"]
    for r in run["ranks"]:
        got = r["accumulate"][case]
        for name, g in ref["grads"].items():
            assert _rel(got["grads"][name], g) <= REL, (case, name)
        assert abs(got["norm"] - ref["norm"]) <= REL * ref["norm"], (got["norm"], ref["norm"])


def _first_batch_grads(dtype):
    """The single process's gradients of the first batch's loss, the model in ``dtype`` (the
    loss in float64 or float32 from its logits), as float64."""
    model = _model("llama").to(dtype)
    chunk = _dataset()[:GLOBAL_BATCH]
    ids, labels = (torch.stack([d[key] for d in chunk]) for key in ("input_ids", "labels"))
    logits = model(input_ids=ids, use_cache=False).logits
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    F.cross_entropy(logits.to(acc).reshape(-1, VOCAB), targets.reshape(-1)).backward()
    return {n: p.grad.double() for n, p in model.named_parameters()}


def test_bf16_with_fsdp_mixed_precision(run):
    fp32_first = run["ref"]["llama"]["losses"][0]
    want, plain = _first_batch_grads(torch.float64), _first_batch_grads(torch.bfloat16)
    for r in run["ranks"]:
        got = r["bf16"]
        assert got["finite"] and got["logits_dtype"] == "torch.bfloat16", got
        # float32 master weights and float32 gradient shards (reduce_dtype)
        assert got["param_dtypes"] == {"torch.float32"} == got["grad_dtypes"], got
        assert abs(got["loss"] - fp32_first) < 0.05, (got["loss"], fp32_first)
        # every gradient against float64, within 3x the single process's bf16 error (the
        # design rule for gradients; before, no gradient was compared: a sum over the ranks
        # divided by 4 passed this test)
        for name, g in got["grads"].items():
            assert_close_per_design(g, want[name], plain[name], f"bf16 grad {name}", 3.0,
                                    1e-3 * float(want[name].abs().max()))


def _raised(run, key):
    return [r["errors"][key] for r in run["ranks"]]


def test_a_layer_switching_its_attention_fits_a_plan_of_names(run):
    for r in run["ranks"]:
        assert r["errors"]["switch_on_layer"] == "no error", r["errors"]["switch_on_layer"]
        e = r["errors"]["switch_on_layer_mlp_only"]
        assert e.startswith("ValueError: boost: tensor parallelism: the attention 'layers.0' "
                            "(_SwitchingLayer)"), e


@pytest.mark.parametrize("key, words", [
    ("tp3", ["ValueError", "tp_size=3", "[1, 2, 4]"]),
    ("sp_x_tp", ["ValueError", "sp_size=4 x tp_size=2", "[1, 2]"]),
    ("zero1", ["ValueError", "zero_stage=1", "[0, 2, 3]"]),
    ("fp16_sharded", ["ValueError", "fp16", "bf16"]),
    ("heads_tp", ["ValueError", "tp_size=4", "num_key_value_heads=2", "[1, 2]"]),
    # (the plan's refusals name boost: before, "tp_size=2 needs ..." named no function)
    ("no_plan", ["ValueError: boost: tp_size=2", "base_model_tp_plan", "tp_plan"]),
    ("bad_plan", ["ValueError: boost: ", "colwise_sideways", "supported"]),
    ("attention_outside_blocks", ["ValueError: boost: tensor parallelism: the attention "
                                  "'layers.0.attn'", "no tensor-parallel block", "'colwise'"]),
    ("styles_uncovered", ["ValueError: boost: ", "without a style", "'emb'",
                          "'layers.0.norm1'"]),
    ("plan_differs", ["RingMismatchError", "tp_plan (rank 0: "]),
    ("style_options_differ", ["RingMismatchError", "tp_plan (rank 0: "]),
    ("plan_key", ["TypeError: RingSequenceParallelPlugin: tp_plan keys must be module name "
                  "patterns (str), got [1]"]),
    ("scalar_fsdp", ["ValueError: boost: zero_stage=2", "0-dim", "['temperature']"]),
    ("stepped_optimizer", ["ValueError", "already has state"]),
    ("boosted_twice", ["ValueError: boost: this FSDPLlamaForCausalLM was already boosted",
                       "boost a fresh model"]),
    ("bad_len", ["ValueError", "34 tokens", "multiple of 4"]),
])
def test_bad_sizes_raise_on_every_rank(run, key, words):
    for e in _raised(run, key):
        assert all(w in e for w in words), e
    if key == "heads_tp":
        assert all(r["errors"]["heads_untouched"] for r in run["ranks"])
    if key in ("styles_uncovered", "scalar_fsdp"):
        untouched = key.partition("_")[0] + "_untouched"
        assert all(r["errors"][untouched] for r in run["ranks"])


# ---------------------------------------------------------------- W = 8
def _worker8():
    return {"llama/dp2_sp2_tp2_zero3": _train("w8", "llama", dict(sp_size=2, tp_size=2,
                                                                    zero_stage=3), None)}


@pytest.mark.slow  # 99 s wall at load 15 on the shared 2-core machine (51 s of CPU time)
def test_eight_ranks_dp2_sp2_tp2_zero3():
    """The full mesh: dp 2 x sp 2 x tp 2, FSDP (zero 3) over the 4 dp x sp ranks of each tp
    index; 3 AdamW steps equal single-process training."""
    got = run_ranks(_worker8, 8, timeout=600)
    first = got[0]["llama/dp2_sp2_tp2_zero3"]
    assert "dp=2, sp=2, tp=2, zero_stage=3" in first["repr"], first["repr"]
    worst = _assert_parity(first, _single_process("llama"), "dp2_sp2_tp2_zero3")
    print(f"\ndp2 x sp2 x tp2, zero 3: max relative weight error {worst:.2e}")
