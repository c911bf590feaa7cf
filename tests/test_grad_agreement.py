"""The agreement before every ``booster.backward`` (ringseq/plugin/grad_agreement.py), on 2
spawned gloo ranks:

* a parameter used on one rank only (a token-dependent branch, as a mixture of experts'
  routing) under FSDP (zero 3) and tensor parallelism (tp 2, zero 0): every gradient equals
  single-process float64 training's within 1e-5 relative (before: the ranks' reductions
  differed in size and gloo aborted a process: "Received data size doesn't match");
  a parameter no rank uses keeps no gradient; at W = 4 (sp 2 x tp 2) a tensor-parallel
  branch (column-wise then row-wise, whose bias is replicated but no partial sum) used by
  one tp group only;
* ranks that disagree on ``booster.no_sync`` under FSDP (zero 2) and DDP: RingMismatchError
  on every rank at once, naming no_sync and each rank's state (before: gloo aborted a process
  under FSDP; DDP waited for the ring timeout); after zero_grad and reset, a step is exact;
* a backward that fails on one rank at the step where a parameter is used for the first time
  (it went without a gradient at the last reduction), or no longer used on any rank: the
  failing rank's completion of the reductions carries that parameter, or leaves it out, as
  the others' reductions do, and training goes on exactly (before: its completion did as the
  last reduction had, and the ranks' reductions differed in size: gloo aborted);
* the plugin holds each boosted model's reduction (what the agreement and a failure's
  completion use) only as long as it lives: a model trained and dropped with its plugin and
  booster is freed, under DDP, FSDP and tp (before: under DDP never, as DDP's reducer held the
  hook state, which held the model, from C++ where the garbage collector cannot see it).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import run_ranks
from utils import SwitchableAttention

V, H, B, S = 64, 16, 2, 16
TP_PLAN = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
           "layers.*.attn.v": "colwise", "layers.*.attn.o": "rowwise"}


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(H), SwitchableAttention(H)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class _BranchLM(nn.Module):
    """``extra`` runs on the tokens the ranks in ``used_on`` hold (a token-dependent branch);
    ``never`` on no rank. At W=2 rank r holds tokens [r S/2, (r + 1) S/2) of the activations
    (the contiguous layout; tensor parallelism's sequence shards between its layers): the
    single-process reference runs the branch there."""

    def __init__(self, used_on=(0,)):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList([_Layer()])
        self.extra, self.never = nn.Linear(H, H), nn.Linear(H, H)
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, V)
        self.used_on = used_on

    def forward(self, input_ids, position_ids=None):
        import torch.distributed as dist
        x = self.layers[0](self.emb(input_ids))
        if dist.is_initialized():
            if dist.get_rank() in self.used_on:
                x = x + self.extra(x)
        else:
            for r in self.used_on:
                a, b = r * S // 2, (r + 1) * S // 2
                x = torch.cat([x[:, :a], x[:, a:b] + self.extra(x[:, a:b]), x[:, b:]], 1)
        return self.head(self.norm(x))


class _MlpBranchLM(_BranchLM):
    """``extra`` as a column-wise then row-wise pair under tensor parallelism."""

    def __init__(self, used_on=(0,)):
        super().__init__(used_on)
        torch.manual_seed(7)
        self.extra = nn.Sequential(nn.Linear(H, 2 * H), nn.Linear(2 * H, H))


def _batch():
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def _boosted(cfg, used_on, earlier=(), model_type=_BranchLM):
    """``earlier``: models boosted first by the same plugin, each frozen (which has no
    reduction: True) or not (False), and dropped."""
    import ringseq
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    ringseq.set_ring_timeout(30)
    plugin = RingSequenceParallelPlugin(layout="contiguous", **cfg)
    booster = Booster(plugin=plugin)
    for frozen in earlier:
        booster.boost(_BranchLM(used_on).requires_grad_(not frozen))
    model = model_type(used_on)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, crit, *_ = booster.boost(model, opt, nn.CrossEntropyLoss())
    ids, labels = _batch()
    batch = ringseq.shard_batch({"input_ids": ids, "labels": labels}, group=plugin.sp_group,
                                layout=plugin.data_layout)

    def backward():
        booster.backward(crit(model(batch["input_ids"], batch["position_ids"]), batch), opt)
    return booster, model, opt, backward


def _reference_grads(used_on=(0,), model_type=_BranchLM):
    """Single-process float64 gradients of the mean next-token loss."""
    model = model_type(used_on).double()
    ids, labels = _batch()
    logits = model(ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _full_grads(model):
    from torch.distributed.tensor import DTensor
    return {n: None if p.grad is None else
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).double()
            for n, p in model.named_parameters()}


def _steps(cfg, disagree_on_no_sync, used_on=(0,), earlier=(), model_type=_BranchLM):
    """One backward of the branch model boosted with ``cfg``; with ``disagree_on_no_sync``
    rank 0 runs it inside booster.no_sync, then every rank clears, resets and runs it again.
    Returns (the error the first backward raised or None, the gradients of the last one)."""
    import torch.distributed as dist
    booster, model, opt, backward = _boosted(cfg, used_on, earlier, model_type)
    error = None
    if disagree_on_no_sync:
        try:
            if dist.get_rank() == 0:
                with booster.no_sync(model, opt):
                    backward()
            else:
                backward()
        except ValueError as exc:
            error = f"{type(exc).__name__}: {exc}"
        opt.zero_grad()
        booster.reset()
    backward()
    return error, _full_grads(model.unwrap())


CASES = {"sp2 zero3": dict(sp_size=2, zero_stage=3),
         "tp2 zero0": dict(sp_size=1, tp_size=2, tp_plan=TP_PLAN)}
# (W = 4: global ranks 0 and 1, the tp group of sp rank 0, hold the first half of the tokens)
MLP_CASE = dict(sp_size=2, tp_size=2,
                tp_plan=dict(TP_PLAN, **{"extra.0": "colwise", "extra.1": "rowwise"}))


@pytest.mark.parametrize("case", sorted(CASES) + ["sp2 tp2 tensor-parallel branch"])
def test_a_parameter_used_on_one_rank_only_gets_the_exact_gradient(case):
    world, used_on, model_type, cfg = 2, (0,), _BranchLM, CASES.get(case)
    if cfg is None:
        world, used_on, model_type, cfg = 4, (0, 1), _MlpBranchLM, MLP_CASE
    ref = _reference_grads((0,), model_type)
    for rank, (error, grads) in enumerate(run_ranks(_steps, world, cfg, False, used_on, (),
                                                    model_type, timeout=240)):
        assert error is None
        assert grads["never.weight"] is None and grads["never.bias"] is None, rank
        assert all(grads[n] is not None for n in ref if n.startswith("extra.")), rank
        for name, want in ref.items():
            if want is None:
                continue
            rel = float((grads[name] - want).abs().max() / want.abs().max().clamp_min(1e-3))
            assert rel < 1e-5, f"{case} rank {rank} {name}: {rel:.2e}"


def _use_changing_at_a_failing_step(cfg, before, after):
    """Step 1: ``extra`` used on the ranks ``before``. Step 2: on the ranks ``after``, and rank
    1's backward raises: in the final norm's backward (before ``extra``'s gradient is made)
    where ``extra`` is used, else at the embedding's output (after every ring call of the
    backward, which the peers then finish). Step 3, after zero_grad and reset: on the ranks
    ``after``. Returns (step 2's outcome as (type name, message, seconds), step 3's
    gradients)."""
    import time

    import torch.distributed as dist
    booster, model, opt, backward = _boosted(cfg, before)
    inner = model.unwrap()
    failing = {"on": False}

    def fail_on_rank_1(*_):
        if failing["on"] and dist.get_rank() == 1:
            raise MemoryError("injected: out of memory")
    def fail_at_the_embedding(_module, _args, out):
        if out.requires_grad:
            out.register_hook(lambda _grad: fail_on_rank_1())
    if after:
        inner.norm.register_full_backward_hook(fail_on_rank_1)
    else:
        inner.emb.register_forward_hook(fail_at_the_embedding)
    backward()
    opt.zero_grad()
    inner.used_on, failing["on"] = after, True
    start = time.perf_counter()
    try:
        backward()
        outcome = ("ok", "", 0.0)
    except Exception as exc:  # (each rank's own: the injected one, or the peers' report)
        outcome = (type(exc).__name__, str(exc), time.perf_counter() - start)
    failing["on"] = False
    opt.zero_grad()
    booster.reset()
    backward()
    return outcome, _full_grads(inner)


@pytest.mark.parametrize("before, after", [((), (0, 1)), ((0, 1), ())],
                         ids=["first used", "no longer used"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_backward_failing_where_a_parameters_use_changes_completes_and_recovers(
        case, before, after):
    ref = _reference_grads(after)
    for rank, ((kind, message, seconds), grads) in enumerate(
            run_ranks(_use_changing_at_a_failing_step, 2, CASES[case], before, after,
                      timeout=240)):
        assert seconds < 20, (rank, kind, message, seconds)  # (not after a timeout)
        if rank == 1:
            assert kind == "MemoryError" and "injected" in message, (kind, message)
        else:
            # (its reduction's status, or its ring call's under sp: the ring broke there)
            assert (kind == "RingPeerError" and "rank(s) [1]" in message or
                    kind == "RingBrokenError" and "rank 1 failed" in message), (kind, message)
        for name, want in ref.items():
            if want is None:  # (unused on every rank: no gradient, as single-process)
                assert grads[name] is None, (rank, name)
                continue
            rel = float((grads[name] - want).abs().max() / want.abs().max().clamp_min(1e-3))
            assert rel < 1e-5, f"{case} rank {rank} {name}: {rel:.2e}"


def _trained_and_dropped(cfg):
    """Two rounds of: a plugin, a booster, a model, one step, everything dropped. Returns
    whether each round's model was freed."""
    import gc
    import weakref
    freed = []
    for _ in range(2):
        booster, model, opt, backward = _boosted(cfg, (0, 1))
        ref = weakref.ref(model.unwrap())
        backward()
        opt.step()
        del booster, model, opt, backward
        gc.collect()
        freed.append(ref() is None)
    return freed


@pytest.mark.parametrize("case", ["sp2 ddp"] + sorted(CASES))
def test_a_dropped_plugin_lets_its_models_go(case):
    # (DDP with find_unused_parameters: the model's branch unused on every rank otherwise
    # leaves its bucket unsent, which booster.backward refuses)
    cfg = CASES.get(case, dict(sp_size=2, ddp_kwargs={"find_unused_parameters": True}))
    assert run_ranks(_trained_and_dropped, 2, cfg, timeout=240) == [[True, True]] * 2


# (DDP: `never` needs find_unused_parameters, and the branch is taken on every rank here;
# models boosted first: the message numbers the models in boost order; 12 of them, with the
# agreement's per-model fields, overflowed a control vector: "at most 24 control fields")
_DDP = dict(sp_size=2, ddp_kwargs={"find_unused_parameters": True})


@pytest.mark.parametrize("cfg, earlier, what", [
    (dict(sp_size=2, zero_stage=2), (), "booster.no_sync (FSDP)"),
    (_DDP, (), "booster.no_sync (DDP)"),
    (_DDP, (True,), "booster.no_sync of boosted model 1 (DDP)"),
    (_DDP, (False,) * 12, "booster.no_sync of boosted model 12 (DDP)")],
    ids=["fsdp", "ddp", "after a frozen model", "after 12 models"])
def test_ranks_that_disagree_on_no_sync_raise_before_any_reduction(cfg, earlier, what):
    ref = _reference_grads((0, 1))
    for rank, (error, grads) in enumerate(run_ranks(_steps, 2, cfg, True, (0, 1), earlier,
                                                    timeout=240)):
        assert error is not None and error.startswith("RingMismatchError"), (rank, error)
        assert f"{what} (rank 0: True, rank 1: False)" in error, error
        for name, want in ref.items():  # the step after zero_grad and reset
            if want is None:
                continue
            rel = float((grads[name] - want).abs().max() / want.abs().max().clamp_min(1e-3))
            assert rel < 1e-5, f"{what} rank {rank} {name}: {rel:.2e}"


def _frozen_on_rank_0(cfg):
    """``extra.weight`` frozen on rank 0 alone after boost: the backward's error; then unfrozen,
    cleared and reset, the gradients of the next backward."""
    import torch.distributed as dist
    booster, model, opt, backward = _boosted(cfg, (0, 1))
    backward()  # (a first step: FSDP's lazy init, DDP's buckets)
    opt.zero_grad()
    extra = dict(model.unwrap().named_parameters())["extra.weight"]
    if dist.get_rank() == 0:
        extra.requires_grad_(False)
    try:
        backward()
        error = None
    except ValueError as exc:
        error = f"{type(exc).__name__}: {exc}"
    extra.requires_grad_(True)
    opt.zero_grad()
    booster.reset()
    backward()
    return error, _full_grads(model.unwrap())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_parameter_frozen_on_one_rank_only_is_named_on_every_rank(case):
    """(before: the frozen rank left the parameter out of its reduce-scatter / all-reduce, and
    gloo aborted a process on the size mismatch)"""
    ref = _reference_grads((0, 1))
    for rank, (error, grads) in enumerate(run_ranks(_frozen_on_rank_0, 2, CASES[case],
                                                    timeout=240)):
        assert error is not None and error.startswith(
            "RingMismatchError: ringseq: booster.backward: parameter(s) ['extra.weight'] are "
            "frozen (requires_grad=False) on some ranks only (extra.weight: frozen on rank(s) "
            "[0], not on rank(s) [1])"), (rank, error)
        for name, want in ref.items():  # the step after unfreezing, zero_grad and reset
            if want is None:
                continue
            rel = float((grads[name] - want).abs().max() / want.abs().max().clamp_min(1e-3))
            assert rel < 1e-5, f"{case} rank {rank} {name}: {rel:.2e}"
