"""``OptimizerWrapper.clip_grad_by_norm`` on 4 spawned gloo ranks (CPU), for gradients that are
replicated (DDP), sharded by FSDP2, split by tensor parallelism and both (a 2-D mesh):

* the norm it returns is the norm of the whole model's gradients, for the orders 1, 2 and inf,
  against the gathered gradients in float64, the same on every rank; the gradients it leaves
  have the norm ``max_norm``;
* a rank that fails computing its part (out of memory, say) raises its own error and the others
  RingPeerError naming it, within seconds, with no gradient clipped anywhere; the next step
  clips on every rank (before: under FSDP or tensor parallelism the others waited in the
  norm's all-reduce, and their next collectives paired with the failed rank's).
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from dist_utils import run_ranks
from utils import error_text

TIMEOUT = 20  # the ring timeout of these ranks: an agreement that waits for it fails the test
FAST = 10     # seconds: every error must arrive within this
MESHES = {"ddp_sp2": dict(sp_size=2), "zero2_sp2": dict(sp_size=2, zero_stage=2),
          "tp2": dict(sp_size=1, tp_size=2), "zero3_sp2_tp2": dict(sp_size=2, tp_size=2,
                                                                   zero_stage=3)}


def _whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to(torch.float64)


def _worker():
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    import ringseq
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    rank, out = dist.get_rank(), {}
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, options in MESHES.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
        plugin = RingSequenceParallelPlugin(**options)
        booster = Booster(plugin=plugin)
        model, opt, criterion, _, _ = booster.boost(model, torch.optim.SGD(model.parameters(),
                                                                           lr=0.1))
        loader = plugin.prepare_dataloader([{"input_ids": i, "labels": i} for i in ids],
                                           batch_size=1)
        batch = next(iter(loader))

        def backward():
            booster.backward(criterion(model(**batch), batch), opt)

        def grads():
            return [_whole(p.grad) for g in opt.param_groups for p in g["params"]]

        res = out[name] = {}
        backward()
        before = grads()
        for order in (1.0, 2.0, math.inf):
            want = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g, order) for g in before]), order))
            got = float(opt.clip_grad_by_norm(1e9, norm_type=order))  # (no clipping)
            res[f"norm {order}"] = (got, want)
        # the forms torch's clip takes too (before: refused as "not a finite number")
        res["tensor and 'inf' forms"] = float(opt.clip_grad_by_norm(torch.tensor(1e9),
                                                                    norm_type="inf"))
        res["unchanged by a norm below max_norm"] = all(torch.equal(a, b)
                                                      for a, b in zip(before, grads()))
        norm = float(opt.clip_grad_by_norm(0.5))
        after = grads()
        res["clipped"] = (norm, float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in after]))))
        opt.zero_grad()

        # one rank fails computing its part of the norm
        backward()
        before = grads()
        foreach_norm = torch._foreach_norm

        def oom(*args, **kwargs):
            raise MemoryError("injected: out of memory computing a gradient's norm")
        if rank == 1:
            torch._foreach_norm = oom
        start = time.monotonic()
        try:
            res["failure"] = error_text(lambda: opt.clip_grad_by_norm(0.5),
                                        catch=(Exception, MemoryError))
        finally:
            torch._foreach_norm = foreach_norm
        res["seconds"] = time.monotonic() - start
        res["nothing clipped"] = all(torch.equal(a, b) for a, b in zip(before, grads()))
        opt.zero_grad()
        booster.reset()
        backward()
        res["next step"] = error_text(lambda: (opt.clip_grad_by_norm(0.5), opt.step()))
        opt.zero_grad()

        # a NaN in one gradient: the norm is NaN and every gradient becomes NaN, as torch's
        # clip makes them (before: left unclipped), or RuntimeError on every rank
        backward()
        first = opt.param_groups[0]["params"][0].grad
        with torch.no_grad():
            (first.to_local() if hasattr(first, "to_local") else first).view(-1)[0] = math.nan
        res["nonfinite raises"] = error_text(
            lambda: opt.clip_grad_by_norm(0.5, error_if_nonfinite=True))
        res["nan norm"] = float(opt.clip_grad_by_norm(0.5))
        res["every gradient nan"] = all(bool(torch.isnan(g).all()) for g in grads())
        opt.zero_grad()

        # the max norm with a NaN in rank 1's gradients only (before: gloo's MAX dropped it,
        # the norm finite and rank 1's NaN left in place)
        backward()
        first = opt.param_groups[0]["params"][0].grad
        if rank == 1:
            with torch.no_grad():
                (first.to_local() if hasattr(first, "to_local") else first).view(-1)[0] = math.nan
        res["inf norm, nan on rank 1"] = error_text(
            lambda: opt.clip_grad_by_norm(0.5, norm_type=math.inf, error_if_nonfinite=True))
        opt.zero_grad()

        # the max norm with an infinite gradient on rank 1 only (before: the shared norm was
        # float64's largest finite value, so error_if_nonfinite did not raise)
        backward()
        first = opt.param_groups[0]["params"][0].grad
        if rank == 1:
            with torch.no_grad():
                (first.to_local() if hasattr(first, "to_local") else first).view(-1)[0] = -math.inf
        res["inf norm, inf on rank 1"] = error_text(
            lambda: opt.clip_grad_by_norm(0.5, norm_type=math.inf, error_if_nonfinite=True))
        res["inf norm value"] = float(opt.clip_grad_by_norm(0.5, norm_type=math.inf))
        opt.zero_grad()

        # arguments that differ between the ranks (before: rank 0 raised alone and the others
        # waited for the ring timeout; valid values that differ clipped each rank by its own
        # factor, the replicas drifting apart without a word)
        backward()
        start = time.monotonic()
        res["bad on rank 0"] = error_text(
            lambda: opt.clip_grad_by_norm(-1.0 if rank == 0 else 1.0))
        res["bad on rank 0 seconds"] = time.monotonic() - start
        res["different"] = error_text(lambda: opt.clip_grad_by_norm(0.01 if rank == 0 else 100.0))
        opt.zero_grad()
        booster.reset()
        # inside gradient accumulation the gradients are not summed yet: their norm is not
        # the step's (before: each rank's own norm, or 0 where FSDP held them)
        with booster.no_sync(model):
            backward()
        res["inside accumulation"] = error_text(lambda: opt.clip_grad_by_norm(1.0))
        opt.zero_grad()
        booster.reset()
        backward()
        res["after accumulation refused"] = error_text(
            lambda: (opt.clip_grad_by_norm(0.5), opt.step()))
        opt.zero_grad()
        # a forward inside no_sync, its backward outside: torch's DDP decided at the forward
        # not to sum (before: taken as summed, and every rank stepped with its own
        # gradients); FSDP and tensor parallelism decide at the backward, which sums
        with booster.no_sync(model):
            loss = criterion(model(**batch), batch)
        booster.backward(loss, opt)
        res["forward inside no_sync"] = error_text(opt.step)
        opt.zero_grad()
        booster.reset()
    # fp16 before any backward: no gradient, nothing to unscale (before: GradScaler's
    # "Attempted unscale_ but _scale is None")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    booster = Booster(plugin=RingSequenceParallelPlugin(sp_size=2, precision="fp16"))
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["fp16 without gradients"] = error_text(
        lambda: out.__setitem__("fp16 norm", float(opt.clip_grad_by_norm(1.0))))
    ringseq.reset_ring()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 4, timeout=300, env={"RINGSEQ_TIMEOUT": str(TIMEOUT)})


@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_norm_is_the_whole_models_on_every_rank(ranks, mesh):
    for r in ranks:
        res = r[mesh]
        for order in ("1.0", "2.0", "inf"):
            got, want = res[f"norm {order}"]
            # float32 gradients summed in another order: a few float32 ulps of the total
            assert got == pytest.approx(want, rel=1e-5), (mesh, order, got, want)
            assert got == ranks[0][mesh][f"norm {order}"][0]  # the same float everywhere
        assert res["tensor and 'inf' forms"] == res["norm inf"][0], res
        assert res["unchanged by a norm below max_norm"]
        norm, left = res["clipped"]
        assert norm > 0.5 and left == pytest.approx(0.5, rel=1e-5), (mesh, norm, left)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_rank_failing_its_part_raises_on_every_rank(ranks, mesh):
    for rank, r in enumerate(ranks):
        res = r[mesh]
        if rank == 1:
            assert res["failure"].startswith("MemoryError: injected"), res["failure"]
        else:
            assert res["failure"].startswith("RingPeerError"), res["failure"]
            assert "[1]" in res["failure"] and "MemoryError: injected" in res["failure"], \
                res["failure"]
        assert res["seconds"] < FAST, (mesh, rank, res["seconds"])
        assert res["nothing clipped"]
        assert res["next step"] == "no error", res["next step"]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_ranks_must_clip_alike_and_after_the_accumulation(ranks, mesh):
    for rank, r in enumerate(ranks):
        res = r[mesh]
        bad = res["bad on rank 0"]
        if rank == 0:
            assert bad == ("ValueError: clip_grad_by_norm: max_norm must be a finite number >= "
                           "0, got -1.0"), bad
        else:
            assert bad.startswith("RingPeerError") and "max_norm must be" in bad, bad
        assert res["bad on rank 0 seconds"] < FAST, (mesh, rank, res["bad on rank 0 seconds"])
        different = res["different"]
        assert different.startswith("RingMismatchError") and "clip_grad_by_norm" in different \
            and "max_norm (rank 0: 0.01, rank 1: 100.0" in different, different
        assert res["inf norm, nan on rank 1"].startswith(
            "RuntimeError: clip_grad_by_norm: the total norm of order inf of the gradients is "
            "nan"), (mesh, rank, res["inf norm, nan on rank 1"])
        assert res["inf norm, inf on rank 1"].startswith(
            "RuntimeError: clip_grad_by_norm: the total norm of order inf of the gradients is "
            "inf"), (mesh, rank, res["inf norm, inf on rank 1"])
        assert res["inf norm value"] == math.inf, (mesh, rank, res["inf norm value"])
        assert res["inside accumulation"].startswith("ValueError: clip_grad_by_norm: ") and \
            "not summed over the ranks yet" in res["inside accumulation"], \
            (mesh, res["inside accumulation"])
        assert res["after accumulation refused"] == "no error", res["after accumulation refused"]
        inside = res["forward inside no_sync"]
        if mesh == "ddp_sp2":
            assert inside.startswith("ValueError: OptimizerWrapper.step: every backward since "
                                     "the last step or zero_grad ran inside "
                                     "booster.no_sync(model) (under DDP: its forward did"), inside
        else:
            assert inside == "no error", (mesh, inside)


def test_fp16_clip_without_gradients_clips_nothing(ranks):
    for r in ranks:
        assert r["fp16 without gradients"] == "no error" and r["fp16 norm"] == 0.0, r


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_nan_gradient_makes_every_gradient_nan_or_raises(ranks, mesh):
    for r in ranks:
        res = r[mesh]
        assert res["nonfinite raises"].startswith("RuntimeError: clip_grad_by_norm: the total "
                                                  "norm of order 2.0 of the gradients is nan"), \
            res["nonfinite raises"]
        assert math.isnan(res["nan norm"]) and res["every gradient nan"], res
