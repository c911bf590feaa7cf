"""The boosted optimizer's step after gradient accumulation, clipping and fp16 loss scaling:
what it refuses (on every rank, before any parameter moves) and what it applies.

- A step after micro-batches that all ran inside ``booster.no_sync`` is refused under DDP,
  tensor parallelism at zero 0 and FSDP: nothing was summed over the ranks (before, DDP and tp
  replicas drifted apart; FSDP stepped on nothing and its held gradients went into the next
  step). Clearing drops what FSDP holds.
- A ``no_sync`` micro-batch after gradients the user's own module cleared is no refusal.
- fp16: the boosted optimizers share one grad scaler, updated once per iteration (before:
  at each step, so the first one's overflow halved the scale and the second stepped with
  twice its gradient), also for one loss over two models; gradients cleared through the
  model after a clip are unscaled at the next step
  (before: applied times 65536); a second clip before the step works as in fp32; a step
  without gradients steps nothing, as in fp32 (before: torch's assertion, then every later
  step refused).
- DDP without ``find_unused_parameters`` and a parameter no rank uses: the backward raises
  ValueError on every rank naming the option (before: partly unsummed gradients, silently).
- Under tensor parallelism a shard the plan cannot split is refused before any collective,
  and the group stays usable (before: booster.reset() refused).
Updates are compared with SGD on the same gradients (float32, the bounds are float32
rounding of one update).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

LR = 1e-3
_TIMEOUT = {"RINGSEQ_TIMEOUT": "20"}


def _tiny_llama(seed=0, unused=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    if unused:  # a parameter no forward uses
        model.model.never = torch.nn.Linear(4, 4)
    return model


def _boosted(plugin_kwargs, seed=0, unused=False, prepare=lambda inner: None):
    """(booster, model, optimizer, criterion, batches): SGD at LR, 4 batches of one sample;
    ``prepare(inner)`` before boosting."""
    from ringseq.plugin import Booster, RingSequenceParallelPlugin
    plugin = RingSequenceParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    inner = _tiny_llama(seed, unused)
    prepare(inner)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    loader = plugin.prepare_dataloader([{"input_ids": i, "labels": i} for i in ids],
                                       batch_size=1)
    model, opt, crit, loader, _ = booster.boost(inner, torch.optim.SGD(inner.parameters(),
                                                                       lr=LR),
                                                dataloader=loader)
    return booster, model, opt, crit, list(loader)


def _whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(exc).__name__}: {exc}"
    return None


def _worker_no_sync_only(plugin_kwargs):
    import ringseq
    booster, model, opt, crit, batches = _boosted(plugin_kwargs)
    before = [_whole(p) for p in model.unwrap().parameters()]

    def micro_batches(synced_last, synced_first=False):
        for i, b in enumerate(batches[:2]):
            if (i == 1 and synced_last) or (i == 0 and synced_first):
                booster.backward(crit(model(**b), b), opt)
                continue
            with booster.no_sync(model, opt):
                booster.backward(crit(model(**b), b), opt)
        opt.step()
    refused = _error(lambda: micro_batches(synced_last=False))
    moved = max(float((_whole(p) - b).abs().max())
                for p, b in zip(model.unwrap().parameters(), before))
    opt.zero_grad()
    # the same micro-batches the documented way, from cleared gradients: they step, and equal
    # a run that never accumulated in vain (nothing of the refused step is left over)
    micro_batches(synced_last=True)
    after = [_whole(p) for p in model.unwrap().parameters()]
    opt.zero_grad()
    # the last micro-batch inside no_sync after a summed one: refused too, named as such
    refused_after_summed = _error(lambda: micro_batches(synced_last=False, synced_first=True))
    opt.zero_grad()

    # three micro-batches, the first two inside no_sync: the first inside a nested block or
    # not; the gradients before the step, and what the step raised
    def three(nested):
        with booster.no_sync(model, opt):
            if nested:
                with booster.no_sync(model, opt):
                    booster.backward(crit(model(**batches[0]), batches[0]), opt)
            else:
                booster.backward(crit(model(**batches[0]), batches[0]), opt)
            booster.backward(crit(model(**batches[1]), batches[1]), opt)  # (in the outer)
        booster.backward(crit(model(**batches[0]), batches[0]), opt)  # (a rank has 2 at dp 2)
        grads = [_whole(p.grad) for p in model.unwrap().parameters() if p.grad is not None]
        return grads, _error(opt.step) if nested else opt.zero_grad()
    flat, _ = three(nested=False)
    nested, nested_step = three(nested=True)
    ringseq.reset_ring()
    return {"refused": refused, "moved": moved, "after": after,
            "refused_after_summed": refused_after_summed,
            "nested": (len(flat) == len(nested) and max(
                float((a - b).abs().max()) for a, b in zip(flat, nested)), nested_step)}


@pytest.mark.parametrize("plugin_kwargs", [
    {"sp_size": 2}, {"sp_size": 1, "tp_size": 2}, {"sp_size": 2, "zero_stage": 2}],
    ids=["ddp", "tp", "fsdp"])
def test_a_step_after_no_sync_micro_batches_only_is_refused(plugin_kwargs):
    res = run_ranks(_worker_no_sync_only, 4, plugin_kwargs, timeout=200, env=_TIMEOUT)
    fsdp = plugin_kwargs.get("zero_stage", 0) >= 2
    for r in res:
        # (under FSDP one message for both: before, a no_sync backward after a reduced one
        # was said to be "every backward since the last step")
        only = ("ValueError: OptimizerWrapper.step: FSDP holds gradients that were never "
                "reduced over the ranks" if fsdp
                else "ValueError: OptimizerWrapper.step: every backward since the last step "
                     "or zero_grad ran inside booster.no_sync(model)")
        after_summed = only if fsdp else (
            "ValueError: OptimizerWrapper.step: a backward inside booster.no_sync(model) "
            "followed the backward that summed the gradients over the ranks")
        assert r["refused"] is not None and r["refused"].startswith(only), r["refused"]
        assert "un the LAST micro-batch" in r["refused"]
        if fsdp:  # (FSDP cannot tell no_sync's gradients from a failed step's: both named)
            assert "booster.no_sync(model)" in r["refused"], r["refused"]
            assert "optimizer.zero_grad() and booster.reset()" in r["refused"], r["refused"]
        assert r["refused_after_summed"] is not None and \
            r["refused_after_summed"].startswith(after_summed), r["refused_after_summed"]
        # a nested block leaves the sum off until the outer one ends, as DDP's own no_sync
        # (before, tp at zero 0: the inner block's end turned it on, and the step refused "2
        # backward passes summed"; FSDP reduced once more)
        assert r["nested"] == (0.0, None), r["nested"]
        assert r["moved"] == 0.0
    fresh = run_ranks(_worker_accumulation_only, 4, plugin_kwargs, timeout=200, env=_TIMEOUT)
    for r, f in zip(res, fresh):
        for got, want in zip(r["after"], f):
            assert torch.equal(got, want)


def _worker_accumulation_only(plugin_kwargs):
    import ringseq
    booster, model, opt, crit, batches = _boosted(plugin_kwargs)
    with booster.no_sync(model, opt):
        booster.backward(crit(model(**batches[0]), batches[0]), opt)
    booster.backward(crit(model(**batches[1]), batches[1]), opt)
    opt.step()
    ringseq.reset_ring()
    return [_whole(p) for p in model.unwrap().parameters()]


def _worker_steps_w2(tmp):
    import ringseq
    out = {}
    # a no_sync micro-batch after the user's own module cleared the reduced gradients
    booster, model, opt, crit, batches = _boosted({"sp_size": 2})
    booster.backward(crit(model(**batches[0]), batches[0]), opt)
    model.unwrap().zero_grad()  # the loop skips that step
    with booster.no_sync(model, opt):
        booster.backward(crit(model(**batches[1]), batches[1]), opt)
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    out["after a manual clear"] = _error(opt.step)

    # fp16: two optimizers; model A's gradients overflow, B's are finite
    booster, a, opt_a, crit, batches = _boosted({"sp_size": 2, "precision": "fp16"})
    inner_b = _tiny_llama(1)
    b, opt_b, *_ = booster.boost(inner_b, torch.optim.SGD(inner_b.parameters(), lr=LR))
    hook = a.unwrap().model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * math.inf)
    booster.backward(crit(a(**batches[0]), batches[0]), opt_a)
    hook.remove()
    booster.backward(crit(b(**batches[0]), batches[0]), opt_b)
    out["one scaler"] = opt_a.scaler is opt_b.scaler
    out["two optimizers"] = _sgd_error(opt_b, b, lambda: (opt_a.step(), opt_b.step()))
    # ... and one loss over both models, through one optimizer's backward: the next
    # iteration's scale is halved once (A overflowed), and B steps with its true gradient
    opt_a.zero_grad()
    opt_b.zero_grad()
    booster.backward(crit(a(**batches[1]), batches[1]) + crit(b(**batches[1]), batches[1]),
                     opt_a)
    out["halved once"] = float(opt_a.scaler.get_scale())
    out["one loss"] = _sgd_error(opt_b, b, lambda: (opt_a.step(), opt_b.step()))
    # ... and A's clip raising on its overflow (error_if_nonfinite) leaves B's step at the
    # scale B's gradients were scaled with, B clipping after it or before it (before, with
    # the first fix: the scale halved at the raise, B's update 2x, or 1/32768 of, the true)
    # ... and A saved after it raised (before: the save's copy of the scaler updated the live
    # records, and B's step skipped on the writing rank alone)
    for case in ("B clips after A raised", "B clipped before A raised", "A saved after it raised"):
        opt_a.zero_grad()
        opt_b.zero_grad()
        hook = a.unwrap().model.layers[0].mlp.up_proj.weight.register_hook(
            lambda g: g * math.inf)
        booster.backward(crit(a(**batches[2]), batches[2]), opt_a)
        hook.remove()
        booster.backward(crit(b(**batches[2]), batches[2]), opt_b)
        if case != "B clips after A raised":
            opt_b.clip_grad_by_norm(1e9)
        out[case + ": A"] = _error(lambda: opt_a.clip_grad_by_norm(1.0, error_if_nonfinite=True))
        if case == "A saved after it raised":
            booster.save_optimizer(opt_a, f"{tmp}/a_after_raise.pt")
        opt_a.zero_grad()
        if case == "B clips after A raised":
            opt_b.clip_grad_by_norm(1e9)
        out[case] = _sgd_error(opt_b, b, opt_b.step, clipped=True)

    # fp16: clip, a refused step, gradients cleared through the model, a new backward, a
    # second clip (as fp32 allows), the step
    booster, model, opt, crit, batches = _boosted({"sp_size": 2, "precision": "fp16"})
    for _ in range(2):
        booster.backward(crit(model(**batches[0]), batches[0]), opt)
    opt.clip_grad_by_norm(1.0)
    out["summed twice"] = _error(opt.step)
    model.zero_grad()
    booster.backward(crit(model(**batches[1]), batches[1]), opt)
    norms = [float(opt.clip_grad_by_norm(1e9)), float(opt.clip_grad_by_norm(1e9))]
    out["two clips"] = norms
    out["after model.zero_grad"] = _sgd_error(opt, model, opt.step, clipped=True)

    # fp16: gradients changed in place after the clip (torch's own clip, say) are still the
    # unscaled ones (before, with the first fix: unscaled again, the update 65536x too small)
    opt.zero_grad()
    booster.backward(crit(model(**batches[1]), batches[1]), opt)
    opt.clip_grad_by_norm(1e9)
    for p in model.unwrap().parameters():
        if p.grad is not None:
            p.grad.mul_(1.0)
    out["in place after a clip"] = _sgd_error(opt, model, opt.step, clipped=True)

    # fp16: a clip and a step, both refused (every backward inside no_sync), then the last
    # micro-batch: the step equals the same micro-batches without the refusals (before: the
    # clip ran, and the first micro-batch's gradients were unscaled twice)
    def accumulated(clip_and_refuse):
        booster, model, opt, crit, batches = _boosted({"sp_size": 2, "precision": "fp16"})
        with booster.no_sync(model, opt):
            booster.backward(crit(model(**batches[0]), batches[0]), opt)
        if clip_and_refuse:
            refused = _error(lambda: opt.clip_grad_by_norm(1e9))
            assert refused.startswith("ValueError: clip_grad_by_norm: every backward"), refused
            # (DDP: the forward decides; before, the clip's text named the backward alone)
            assert "(under DDP: its forward did, which decides)" in refused, refused
            assert "(its forward and backward outside no_sync)" in refused, refused
            refused = _error(opt.step)
            assert refused.startswith("ValueError: OptimizerWrapper.step: every backward")
        booster.backward(crit(model(**batches[1]), batches[1]), opt)
        opt.step()
        return [p.detach().clone() for p in model.unwrap().parameters()]
    out["clip, refused, more"] = max(float((a - b).abs().max()) for a, b in zip(
        accumulated(True), accumulated(False)))

    # fp16: a rollback (the optimizer loaded after its next step) goes on stepping (before,
    # with the first fix: torch's "step() has already been called", on every later step)
    booster.save_optimizer(opt, f"{tmp}/rollback.pt")
    opt.zero_grad()
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    opt.step()
    booster.load_optimizer(opt, f"{tmp}/rollback.pt")
    opt.zero_grad()
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    out["after a rollback"] = _error(opt.step)

    # fp16: gradients no booster.backward scaled (a plain loss.backward()) are refused
    opt.zero_grad()
    crit(model(**batches[3]), batches[3]).backward()
    out["plain backward"] = _error(opt.step)
    opt.zero_grad()
    # ... also after a scaled backward cleared by zero_grad (before: its flag let the step
    # apply 1/65536 of the plain gradients, and the clip return the norm 65536 times too small)
    booster.backward(crit(model(**batches[3]), batches[3]), opt)
    opt.zero_grad()
    crit(model(**batches[3]), batches[3]).backward()
    out["plain backward after a cleared one"] = (_error(lambda: opt.clip_grad_by_norm(1.0)),
                                                 _error(opt.step))
    opt.zero_grad()
    # ... and cleared through the model (before, with the first fix: stepped)
    booster.backward(crit(model(**batches[3]), batches[3]), opt)
    model.zero_grad()
    crit(model(**batches[3]), batches[3]).backward()
    out["plain backward after model.zero_grad"] = (
        _error(lambda: opt.clip_grad_by_norm(1.0)), _error(opt.step))
    opt.zero_grad()
    # ... and through the model with set_to_none=False: the same tensors, zeroed in place
    # (before: stepped, applying 1/65536 of the plain gradients)
    booster.backward(crit(model(**batches[3]), batches[3]), opt)
    model.zero_grad(set_to_none=False)
    crit(model(**batches[3]), batches[3]).backward()
    out["plain backward after model.zero_grad(set_to_none=False)"] = (
        _error(lambda: opt.clip_grad_by_norm(1.0)), _error(opt.step))
    opt.zero_grad()
    # fp16: gradients replaced out of place after a clip are refused naming that (before:
    # "no loss was scaled ... run the backward through booster.backward", which it was)
    booster.backward(crit(model(**batches[3]), batches[3]), opt)
    opt.clip_grad_by_norm(1e9)
    for p in model.unwrap().parameters():
        if p.grad is not None:
            p.grad = p.grad.clamp(-10.0, 10.0)
    out["replaced after a clip"] = _error(opt.step)
    opt.zero_grad()
    # fp16: gradients that overflow, clipped with error_if_nonfinite=True: raised naming the
    # loss scale, which comes down for the next backward (before: no step recorded the
    # overflow, the scale stayed, and every iteration raised the same)
    weight = model.unwrap().model.layers[0].mlp.up_proj.weight
    hook = weight.register_hook(lambda g: g * math.inf)
    scales = []
    for i in range(3):
        booster.backward(crit(model(**batches[3]), batches[3]), opt)
        scales.append(float(opt.scaler.get_scale()))
        out[f"overflow clip {i}"] = _error(
            lambda: opt.clip_grad_by_norm(1.0, error_if_nonfinite=True))
        if i == 2:  # a step all the same skips itself, and the scale comes down once
            out["step after the raise"] = _error(opt.step)
        opt.zero_grad()
    hook.remove()
    booster.backward(crit(model(**batches[3]), batches[3]), opt)
    out["overflow scales"] = scales + [float(opt.scaler.get_scale())]
    out["after the overflows"] = _sgd_error(opt, model, opt.step)
    opt.zero_grad()

    # fp16: a step without gradients steps nothing, and the next one steps
    opt.zero_grad()
    out["empty step"] = _error(opt.step)
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    out["after an empty step"] = _sgd_error(opt, model, opt.step)

    # DDP without find_unused_parameters, a parameter no rank uses
    booster, model, opt, crit, batches = _boosted({"sp_size": 2}, unused=True)
    out["unused"] = _error(lambda: booster.backward(crit(model(**batches[0]), batches[0]), opt))
    opt.zero_grad()
    booster.reset()

    # ... and one rank 0 alone uses (an expert no token of rank 1 routes to): rank 1 raises,
    # rank 0 hears it (before: gloo aborted a process, or every rank waited for the timeout)
    def rank_0_only(inner):
        inner.model.extra = torch.nn.Linear(32, 32)
        inner.model.norm.register_forward_hook(
            lambda m, a, y: y + inner.model.extra(y) if dist.get_rank() == 0 else y)
    booster, model, opt, crit, batches = _boosted({"sp_size": 2}, prepare=rank_0_only)
    out["used on rank 0"] = _error(lambda: booster.backward(crit(model(**batches[0]),
                                                                 batches[0]), opt))
    opt.zero_grad()
    booster.reset()

    # fp16, two optimizers, one loss: saving an optimizer between the two steps leaves the
    # scale's trajectory as it was, the same on every rank (before, with the first fix: the
    # save updated the scale on the writing rank only)
    def scales(save):
        booster, a, opt_a, crit, batches = _boosted({"sp_size": 2, "precision": "fp16"})
        inner_b = _tiny_llama(1)
        b, opt_b, *_ = booster.boost(inner_b, torch.optim.SGD(inner_b.parameters(), lr=LR))
        opt_a.scaler.set_growth_interval(2)
        seen = []
        for batch in batches:
            booster.backward(crit(a(**batch), batch) + crit(b(**batch), batch), opt_a)
            seen.append(float(opt_a.scaler.get_scale()))
            for name, opt in (("a", opt_a), ("b", opt_b)):
                opt.step()
                opt.zero_grad()
                if save:
                    booster.save_optimizer(opt, f"{tmp}/{name}.pt")
        return seen
    out["scales"] = (scales(save=False), scales(save=True))

    # a probe parameter whose gradient is zero itself is no sign of cleared gradients: a
    # no_sync backward between two summed ones is refused (before, with the first fix: not)
    def zero_gradient_probe(inner):
        inner.model.alpha = torch.nn.Parameter(torch.ones(1))  # (the smallest: the probe)
        inner.model.norm.register_forward_hook(lambda m, a, y: y + inner.model.alpha * 0.0)
    out["zero probe"] = _summed_no_sync_summed(*_boosted({"sp_size": 2},
                                                         prepare=zero_gradient_probe))

    # DDP's static graph is recorded in its first backward, which may not be inside no_sync
    # (torch's DDP asserts there; a failure there aborted a process)
    booster, model, opt, crit, batches = _boosted({"sp_size": 2,
                                                   "ddp_kwargs": {"static_graph": True}})
    out["static graph"] = _error(lambda: booster.no_sync(model, opt))
    booster.backward(crit(model(**batches[0]), batches[0]), opt)
    opt.step()
    opt.zero_grad()
    with booster.no_sync(model, opt):  # (after the first reduced backward: fine)
        booster.backward(crit(model(**batches[1]), batches[1]), opt)
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    out["static graph later"] = _error(opt.step)

    # DDP with find_unused_parameters and that unused parameter the smallest (the probe of
    # the gradients' state): a no_sync backward between two summed ones is refused (before,
    # with the first fix: taken for gradients the user cleared, and summed twice)
    out["no_sync between summed"] = _summed_no_sync_summed(*_boosted(
        {"sp_size": 2, "ddp_kwargs": {"find_unused_parameters": True}}, unused=True))

    # a torch.autograd.grad probe through one boosted model, then another's backward
    booster, a, opt_a, crit, batches = _boosted({"sp_size": 2})
    inner_b = _tiny_llama(1)
    b, opt_b, *_ = booster.boost(inner_b, torch.optim.SGD(inner_b.parameters(), lr=LR))
    probe = torch.autograd.grad(crit(a(**batches[0]), batches[0]),
                                a.unwrap().lm_head.weight)[0]
    out["after a probe"] = (bool(probe.abs().sum() > 0), _error(
        lambda: booster.backward(crit(b(**batches[0]), batches[0]), opt_b)))
    ringseq.reset_ring()
    return out


def _summed_no_sync_summed(booster, model, opt, crit, batches):
    """What the step after a summed micro-batch, one inside no_sync and a summed one raised
    (``_error``); the gradients cleared after it."""
    booster.backward(crit(model(**batches[0]), batches[0]), opt)
    with booster.no_sync(model, opt):
        booster.backward(crit(model(**batches[1]), batches[1]), opt)
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    refused = _error(opt.step)
    opt.zero_grad()
    return refused


def _sgd_error(opt, model, step, clipped=False):
    """max |weight after step() - (weight - LR x true gradient)| over the parameters with a
    gradient, and the largest update; the gradients are read before the step (unscaled
    already after a clip, else scaled by the optimizer's scale)."""
    scale = 1.0 if clipped else float(opt.scaler.get_scale())
    params = [p for p in model.unwrap().parameters() if p.grad is not None]
    want = [p.detach() - LR * p.grad / scale for p in params]
    largest = max(float((LR * p.grad / scale).abs().max()) for p in params)
    step()
    return max(float((p.detach() - w).abs().max()) for p, w in zip(params, want)), largest


def test_steps_after_clears_clips_and_fp16_scaling(tmp_path):
    res = run_ranks(_worker_steps_w2, 2, str(tmp_path), timeout=300, env=_TIMEOUT)
    for r in res:
        assert r["after a manual clear"] is None, r
        assert r["one scaler"] and r["halved once"] == 32768.0, r
        assert r["summed twice"].startswith("ValueError: OptimizerWrapper.step: 2 backward")
        assert r["empty step"] is None, r
        for case in ("two optimizers", "one loss", "after model.zero_grad",
                     "in place after a clip", "after an empty step", "after the overflows",
                     "B clips after A raised", "B clipped before A raised",
                     "A saved after it raised"):
            err, largest = r[case]
            # (one float32 rounding of the weight; before: 2x, and 65536x, the update)
            assert largest > 0 and err <= 1e-2 * largest, (case, err, largest)
        first, second = r["two clips"]
        assert math.isfinite(first) and first == pytest.approx(second, rel=1e-5), r
        # (the parameters named: before, the user could not tell which one to freeze)
        assert r["unused"] is not None and r["unused"].startswith(
            "ValueError: booster.backward: DDP did not sum every gradient of this backward "
            "over the ranks: a parameter that requires a gradient got none "
            "(model.never.weight, model.never.bias)"), r["unused"]
        assert "find_unused_parameters" in r["unused"]
        assert r["no_sync between summed"].startswith(
            "ValueError: OptimizerWrapper.step: a backward inside booster.no_sync(model) "
            "followed the backward that summed"), r["no_sync between summed"]
        assert r["after a probe"] == (True, None), r["after a probe"]
        assert r["clip, refused, more"] == 0.0, r["clip, refused, more"]
        assert r["after a rollback"] is None, r["after a rollback"]
        assert r["plain backward"].startswith("ValueError: OptimizerWrapper.step: "
                                              "precision='fp16', but no loss was scaled"), r
        for case in ("plain backward after a cleared one",
                     "plain backward after model.zero_grad",
                     "plain backward after model.zero_grad(set_to_none=False)"):
            clip, step = r[case]
            assert clip.startswith("ValueError: clip_grad_by_norm: precision='fp16', but no "
                                   "loss was scaled through this optimizer since its last "
                                   "step"), (case, clip)
            assert step.startswith("ValueError: OptimizerWrapper.step: precision='fp16', but "
                                   "no loss was scaled"), (case, step)
        assert r["replaced after a clip"].startswith(
            "ValueError: OptimizerWrapper.step: precision='fp16', and the gradients are not the "
            "tensors booster.backward left (replaced since, as by p.grad = p.grad.clamp(...) "
            "after a clip"), r["replaced after a clip"]
        scales = r["overflow scales"]
        assert scales == [scales[0] / 2 ** i for i in range(4)], scales
        assert r["step after the raise"] is None, r["step after the raise"]
        for case in ("B clips after A raised", "B clipped before A raised",
                     "A saved after it raised"):
            assert r[case + ": A"].startswith("RuntimeError: clip_grad_by_norm: the total norm"), r
        for i, scale in enumerate(scales[:3]):
            assert r[f"overflow clip {i}"] == (
                f"RuntimeError: clip_grad_by_norm: the total norm of order 2.0 of the gradients "
                f"is nan, so they cannot be clipped: with precision='fp16' the loss scale "
                f"{scale:g} overflowed them (or the loss is not finite); the grad scaler lowers "
                f"it to {scale / 2:g} for the next backward. Skip this step "
                f"(optimizer.zero_grad()), or pass error_if_nonfinite=False: the step then "
                f"skips itself"), r[f"overflow clip {i}"]
        unsaved, saved = r["scales"]
        assert saved == unsaved == [65536.0, 65536.0, 131072.0, 131072.0], r["scales"]
        assert r["zero probe"].startswith("ValueError: OptimizerWrapper.step: a backward "
                                          "inside booster.no_sync(model) followed"), r
        assert r["static graph"].startswith("ValueError: no_sync: DDP with static_graph=True "
                                            "needs one reduced backward"), r["static graph"]
        assert r["static graph later"] is None, r["static graph later"]
    own, peer = res[1]["used on rank 0"], res[0]["used on rank 0"]
    assert own.startswith("ValueError: booster.backward: DDP did not sum every gradient"), own
    assert peer.startswith("RingPeerError: ringseq: the backward did not end on rank(s) [1]")
    assert "rank 1: ValueError: booster.backward: DDP did not sum" in peer, peer


def _worker_fp16_refused_clip_and_one_rank_inf(tmp):
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    booster, model, opt, crit, batches = _boosted({"sp_size": 2, "precision": "fp16"})
    # a step one rank refuses (a failed step's mark, as where only one rank reloaded), then the
    # checkpoint the refusal asks for on every rank, then the step on the same gradients
    booster.save_optimizer(opt, os.path.join(tmp, "opt.pt"))
    booster.backward(crit(model(**batches[0]), batches[0]), opt)
    if rank == 1:
        opt.failed_step = "the optimizer step raised on this rank"
    out["refused step"] = _error(opt.step)
    booster.load_optimizer(opt, os.path.join(tmp, "opt.pt"))
    out["step after a reload"] = _sgd_error(opt, model, opt.step)
    opt.zero_grad()
    booster.backward(crit(model(**batches[0]), batches[0]), opt)
    out["refused"] = _error(lambda: opt.clip_grad_by_norm(1.0 + rank))  # (ranks differ)
    out["retry"] = _error(lambda: opt.clip_grad_by_norm(1.0))
    model.unwrap().zero_grad()  # (the user's own module: the optimizer sees new tensors)
    booster.backward(crit(model(**batches[1]), batches[1]), opt)
    out["step after a refused clip"] = _sgd_error(opt, model, opt.step)
    # an inf in rank 1's gradients after their sum (a gradient touched there)
    opt.zero_grad()
    booster.backward(crit(model(**batches[2]), batches[2]), opt)
    if rank == 1:
        grad = next(p.grad for p in model.unwrap().parameters() if p.grad is not None)
        grad.view(-1)[0] = float("inf")
    before = [_whole(p) for p in model.unwrap().parameters()]
    scale = float(opt.scaler.get_scale())
    opt.step()
    out["stepped"] = any(not torch.equal(_whole(p), b)
                         for p, b in zip(model.unwrap().parameters(), before))
    opt.zero_grad()
    booster.backward(crit(model(**batches[3]), batches[3]), opt)  # (the update comes first)
    out["scales"] = (scale, float(opt.scaler.get_scale()))
    out["by value"] = _error(lambda: opt.clip_grad_by_value(1.0))
    return out


def test_fp16_a_refused_clip_and_an_inf_on_one_rank_leave_the_ranks_alike(tmp_path):
    """A clip the ranks' agreement refused had unscaled the gradients without marking them:
    a retry raised torch's "unscale_() has already been called", and a step after new
    gradients applied them 65536 times too large. An inf in one rank's gradients after their
    sum made that rank alone skip and halve its scale: the replicas parted, and every later
    sum mixed two scales. Now every rank retries, steps by LR x the gradient, skips alike and
    halves alike."""
    for rank, r in enumerate(run_ranks(_worker_fp16_refused_clip_and_one_rank_inf, 2,
                                       str(tmp_path), timeout=300, env=_TIMEOUT)):
        assert r["refused step"].startswith("ValueError" if rank else "RingPeerError"), r
        for case in ("step after a reload", "step after a refused clip"):
            err, largest = r[case]  # (a review's first version: 1/65536 of it on rank 0)
            assert largest > 0 and err <= 1e-2 * largest, (rank, case, err, largest)
        assert r["refused"].startswith("RingMismatchError") and "max_norm" in r["refused"], r
        assert r["retry"] is None, r["retry"]
        assert not r["stepped"], (rank, r)
        assert r["scales"] == (65536.0, 32768.0), (rank, r["scales"])
        # (before: "'SGD' object has no attribute", naming the wrapped optimizer)
        assert r["by value"].startswith("AttributeError: OptimizerWrapper (the boosted SGD) has "
                                        "no attribute 'clip_grad_by_value'"), r["by value"]


def _worker_odd_shard_under_tp(sp_size, one_replica):
    """sp ``sp_size`` x tp 2: the boosted model called with a shard one token short (every
    rank alike, or only on the ranks of dp index 0, whose peers step as usual), then
    booster.reset() and a good step."""
    import ringseq
    booster, model, opt, crit, batches = _boosted({"sp_size": sp_size, "tp_size": 2})
    b = batches[0]
    n = b["input_ids"].shape[1] - 1
    if not one_replica or booster.plugin.dp_rank == 0:
        out = {"odd": _error(lambda: model(input_ids=b["input_ids"][:, :n],
                                           position_ids=b["position_ids"][:, :n]))}
    else:
        out = {"odd": _error(lambda: booster.backward(crit(model(**b), b), opt))}
    out["reset"] = _error(booster.reset)
    out["after"] = _error(lambda: (booster.backward(crit(model(**b), b), opt), opt.step()))
    ringseq.reset_ring()
    return out


@pytest.mark.parametrize("sp_size, one_replica", [(2, False), (1, True)],
                         ids=["every rank", "one replica"])
def test_a_shard_that_tp_cannot_split_is_refused_before_any_collective(sp_size, one_replica):
    """(before: refused inside the plan's split, after the forward's collectives began: every
    rank raised RingBrokenError with a note to restart the processes, and booster.reset()
    refused.) The other replica, stepping as usual, hears of it at its loss."""
    res = run_ranks(_worker_odd_shard_under_tp, 4, sp_size, one_replica, timeout=200,
                    env=_TIMEOUT)
    n = 16 // sp_size - 1
    for rank, r in enumerate(res):
        if one_replica and rank >= 2:
            assert r["odd"].startswith("RingPeerError: ringseq: rank(s) [0, 1] of the group "
                                       "failed where this rank did not"), r["odd"]
        else:
            assert r["odd"] == (
                f"ValueError: LlamaForCausalLM: a sequence shard of {n} tokens cannot be split "
                f"over tp_size=2 ranks (the tensor-parallel plan splits it at the input "
                f"embedding); its length must be a multiple of 2 (the boosted loader's "
                f"batches are)"), r["odd"]
        assert r["reset"] is None and r["after"] is None, r


def _worker_inference_mode_under_tp():
    """sp 1 x tp 2: the boosted model's logits of two rows under no_grad and under
    inference_mode."""
    import ringseq
    booster, model, opt, crit, batches = _boosted({"sp_size": 1, "tp_size": 2})
    b = {k: torch.cat([batches[0][k], batches[1][k]]) for k in ("input_ids", "position_ids")}
    with torch.no_grad():
        plain = model(**b).logits
    with torch.inference_mode():
        inference = model(**b).logits
    ringseq.reset_ring()
    return plain.clone(), inference.clone()


def test_inference_mode_under_tp_gives_the_logits_of_no_grad():
    """(before: inference_mode laid the tensor-parallel plan's outputs out otherwise: the
    logits came back split over the batch, the plugin's criterion refused them naming the
    model's plan)"""
    for plain, inference in run_ranks(_worker_inference_mode_under_tp, 2, timeout=200,
                                      env=_TIMEOUT):
        assert inference.shape == plain.shape and torch.equal(inference, plain)
