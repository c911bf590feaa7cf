"""Cross-entropy over a sequence sharded across ranks, without gathering the logits."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._args import check_ignore_index, given
from ._dist import add_note
from .engine.integrity import fit_message
from .engine.ring import get_ring, group_info_or_refuse
from .spec import dtype_code

__all__ = ["report_own_failure", "report_step_failure", "sharded_cross_entropy"]


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) whose backward is the identity.

    Every rank computes the same loss from the global sum, and each rank back-propagates only
    its own copy of it: d(loss)/d(local sum) is grad_output itself. Reducing the gradient as
    well (what a differentiable all_reduce does) would count it W times.
    """

    @staticmethod
    def forward(ctx, x, group):
        total = x.double()
        dist.all_reduce(total, group=group)
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


_LOSS = "the loss of this step is not computed on any rank"


#: in a step failure's report to the loss: the rank's failure report also waits on its
#: attention ring (the plugin's ring peers that meet it at their loss take it there)
RING_REPORT_WAITS = "[its failure report waits on its attention ring]"


def report_step_failure(group=None, error: BaseException = None, *,
                        ring_report_waits: bool = False) -> None:
    """Meets the loss's agreement of :func:`sharded_cross_entropy` on ``group`` in place of a
    loss, from a rank whose step failed before its loss (the plugin calls it when the model
    raises): every other rank of the group then raises ``RingPeerError`` at its loss, naming
    this rank and ``error``, instead of waiting for it. Returns on this rank (which re-raises
    its own error). Collective, on the group's control channel. An exception passed first,
    ``report_step_failure(exc)``, is the error on the default group (a bad argument here
    would leave the peers waiting: this function is what unblocks them).
    ``ring_report_waits``: the plugin's, see :data:`RING_REPORT_WAITS`."""
    if isinstance(group, BaseException) and error is None:
        group, error = None, group
    # (a group that is no process group is refused where the peers wait: the default ring's
    # loss agreement)
    if group_info_or_refuse(group, "report_step_failure", "loss")[0] > 1:
        message = f"{type(error).__name__}: {error}" if error is not None else "failed"
        text = f"{message} ({_LOSS})"
        if ring_report_waits:  # (the marker must survive the message's cut to its bytes)
            text = fit_message(text, f" {RING_REPORT_WAITS}")
        get_ring(group).agree(False, text, raise_own=False, about="loss")


def report_own_failure(group, error: BaseException, *, ring_report_waits: bool = False) -> None:
    """:func:`report_step_failure` from a rank about to re-raise its own ``error``: never
    raises. Where the report fails too (the peers are not at their loss: a timeout), that is
    noted on ``error``, which stays what this rank's user sees."""
    try:
        report_step_failure(group, error, ring_report_waits=ring_report_waits)
    except Exception as report_exc:  # noqa: BLE001 - this rank's own error wins
        add_note(error, f"ringseq: reporting it to the loss failed too: "
                        f"{type(report_exc).__name__}: {report_exc}")


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
    logits are never gathered. A batch without any target gives 0 (not NaN) and a zero
    gradient; a stateful optimizer (weight decay, momentum, Adam's moments) still moves the
    parameters on a step after it, so skip the step where that matters. Differentiable: the gradient reaching this rank's logits is
    d(global mean)/d(local logits). The model's parameters are replicated and each rank
    back-propagates through its own tokens only, so their gradients must be SUMMED over the
    group (``all_reduce(SUM)``; not averaged) to equal the single-process gradient -- divide
    by the data-parallel size only, as usual.

    Raises ValueError when the leading shapes of ``logits`` and ``labels`` differ, ``logits``
    is not a floating tensor or has no class, ``labels`` is not an integer tensor (float,
    bool) or a label is outside the vocabulary, TypeError when ``ignore_index`` is not an int
    or ``labels`` not a tensor; then every other
    rank of ``group`` raises ``RingPeerError`` naming this rank and the error (the ranks
    agree on the control channel before the reduction). ``RingMismatchError`` (a ValueError)
    on every rank when the ranks' ``ignore_index``, vocabulary sizes or logits dtypes differ.
    """
    world_size, _ = group_info_or_refuse(group, "sharded_cross_entropy", "loss")
    try:
        ignore_index = check_ignore_index("sharded_cross_entropy", ignore_index)
        if not torch.is_tensor(logits) or not logits.is_floating_point() or logits.dim() < 1:
            dtype = f" of dtype {logits.dtype}" if torch.is_tensor(logits) else ""
            raise ValueError(f"sharded_cross_entropy: logits must be a floating tensor "
                             f"(..., vocab), got {given(logits)}{dtype}")
        if logits.shape[-1] == 0:
            raise ValueError(f"sharded_cross_entropy: logits must have a vocabulary of at "
                             f"least one class, got shape {tuple(logits.shape)}")
        if not torch.is_tensor(labels):
            raise TypeError(f"sharded_cross_entropy: labels must be an integer tensor (...) "
                             f"of class indices, got {given(labels)}")
        on_meta = [n for n, t in (("logits", logits), ("labels", labels)) if t.is_meta]
        if on_meta:
            raise ValueError(f"sharded_cross_entropy: logits and labels must be tensors with "
                             f"data (CPU or CUDA), got {' and '.join(on_meta)} on the meta "
                             f"device")
        # float32 at least: bf16 log-softmax over a large vocabulary loses the loss's digits
        acc = torch.promote_types(logits.dtype, torch.float32)
        if logits.shape[:-1] != labels.shape:
            raise ValueError(f"sharded_cross_entropy: logits (..., vocab) and labels (...) must "
                             f"agree on the leading dims, got logits {tuple(logits.shape)} and "
                             f"labels {tuple(labels.shape)}")
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            # .to(long) would truncate 2.7 to class 2 and give a finite, wrong loss
            raise ValueError(f"sharded_cross_entropy: labels must be an integer tensor (class "
                             f"indices, int64), got {labels.dtype}")
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
    except BaseException as exc:  # (SystemExit too)
        # This rank cannot give its numbers: it meets the others' agreement as a failure, so
        # they raise there instead of waiting, and no later collective pairs wrongly.
        report_own_failure(group, exc)
        raise
    if world_size > 1:
        # Every rank agrees that it has its numbers first (the control channel, where a rank
        # that failed earlier in the step reports), then one collective for both numbers;
        # the count carries no gradient.
        # The ranks compare what makes their numbers one loss: the same ignored label, the
        # same vocabulary and one accumulation dtype (else a loss that differs by rank).
        get_ring(group).agree(
            True, "", about="loss", called="sharded_cross_entropy",
            fields=(("ignore_index", ignore_index), ("vocabulary size", logits.shape[-1]),
                    ("logits dtype", dtype_code(logits.dtype), "dtype")),
            hint="Every rank of the group must pass logits of one dtype and vocabulary size, "
                 "and one ignore_index.")
        packed = torch.stack([local_sum, local_count.detach()])
        total = _SumAcrossRanks.apply(packed, group)
        global_sum, global_count = total[0], total[1].detach()
    else:
        global_sum, global_count = local_sum, local_count
    return global_sum / global_count.clamp(min=1.0)
