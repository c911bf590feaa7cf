"""Cross-entropy over a sequence sharded across ranks, without gathering the logits."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._dist import group_info

__all__ = ["report_step_failure", "sharded_cross_entropy"]


def _reduce_with_status(values: torch.Tensor, failed: bool, group) -> torch.Tensor:
    """all_reduce(SUM) of ``values`` (float64, 1-D) together with one failure flag per rank;
    raises on every rank when any rank reported a failure instead of its values."""
    world, rank = group_info(group)
    flags = torch.zeros(world, dtype=torch.float64, device=values.device)
    flags[rank] = float(failed)
    packed = torch.cat([values, flags])
    dist.all_reduce(packed, group=group)
    bad = packed[values.numel():].nonzero().flatten().tolist()
    if bad and not failed:
        raise RuntimeError(f"ringseq: rank(s) {bad} of the loss group failed in this step (in "
                           f"the model or the loss; see their errors): the loss of this step is "
                           f"not computed on any rank")
    return packed[:values.numel()]


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) whose backward is the identity.

    Every rank computes the same loss from the global sum, and each rank back-propagates only
    its own copy of it: d(loss)/d(local sum) is grad_output itself. Reducing the gradient as
    well (what a differentiable all_reduce does) would count it W times. The reduction carries
    a failure flag per rank (see :func:`report_step_failure`).
    """

    @staticmethod
    def forward(ctx, x, group):
        return _reduce_with_status(x.double(), False, group).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def report_step_failure(group=None, device=None) -> None:
    """Joins the loss reduction of :func:`sharded_cross_entropy` on ``group`` in place of a
    loss, from a rank whose step failed before its loss (the plugin calls it when the model
    raises): every other rank of the group then raises at its loss instead of waiting for this
    rank. ``device``: where the reduction lives (the logits' device; under NCCL a CUDA
    device). Collective."""
    world, _ = group_info(group)
    if world == 1:
        return
    if device is None:
        device = (torch.device("cuda", torch.cuda.current_device())
                  if str(dist.get_backend(group)) == "nccl" else torch.device("cpu"))
    _reduce_with_status(torch.zeros(2, dtype=torch.float64, device=device), True, group)


def sharded_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None,
                          ignore_index: int = -100) -> torch.Tensor:
    """Token-mean cross-entropy over the whole sharded sequence, the same on every rank.

    Args:
        logits: (..., vocab) this rank's logits, any float dtype (computed in float32, or
            float64 for float64 logits).
        labels: (...) int64 targets aligned with ``logits`` -- already shifted, e.g. the
            ``shift_labels`` of ``ringseq.shard_batch``; ``ignore_index`` marks no target.
        group: the ring's process group (None: default group; local without one).
        ignore_index: label value excluded from the sum and from the count.

    Returns a float32 (float64 for float64 logits) scalar: (sum over all ranks of the
    per-token losses) / (number of non-ignored targets over all ranks), from one all-reduce of a (sum, count) pair -- the
    logits are never gathered. A batch without any target gives 0 (not NaN), so a step on it
    is a no-op. Differentiable: the gradient reaching this rank's logits is
    d(global mean)/d(local logits). The model's parameters are replicated and each rank
    back-propagates through its own tokens only, so their gradients must be SUMMED over the
    group (``all_reduce(SUM)``; not averaged) to equal the single-process gradient -- divide
    by the data-parallel size only, as usual.

    Raises ValueError when the leading shapes of ``logits`` and ``labels`` differ or a label is
    outside the vocabulary; then every other rank of ``group`` raises RuntimeError at its
    reduction (this rank joins it as a failure) instead of waiting.
    """
    world_size, _ = group_info(group)
    # float32 at least: bf16 log-softmax over a large vocabulary loses the loss's digits
    acc = torch.promote_types(logits.dtype, torch.float32)
    try:
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"sharded_cross_entropy: logits (..., vocab) and labels (...) must "
                             f"agree on the leading dims, got logits {tuple(logits.shape)} and "
                             f"labels {tuple(labels.shape)}")
        flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
        bad = (flat_labels != ignore_index) & ((flat_labels < 0) | (flat_labels >= logits.shape[-1]))
        if bool(bad.any()):
            raise ValueError(f"sharded_cross_entropy: labels must be in [0, {logits.shape[-1]}) "
                             f"(the vocabulary) or ignore_index={ignore_index}, got "
                             f"{flat_labels[bad][:4].tolist()}")
        flat_logits = logits.reshape(-1, logits.shape[-1]).to(acc)
        local_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index,
                                    reduction="sum")
        local_count = (flat_labels != ignore_index).sum().to(acc)
    except Exception:
        # This rank cannot give its numbers: it still joins the reduction (as a failure), so
        # the others raise there instead of waiting, and no later collective pairs wrongly.
        if world_size > 1:
            report_step_failure(group, logits.device)
        raise
    if world_size > 1:
        # one collective for both numbers; the count carries no gradient
        packed = torch.stack([local_sum, local_count.detach()])
        total = _SumAcrossRanks.apply(packed, group)
        global_sum, global_count = total[0], total[1].detach()
    else:
        global_sum, global_count = local_sum, local_count
    return global_sum / global_count.clamp(min=1.0)
