"""The replicated (zero stage 0, tp 1) gradient reduction through DDP: a SUM over the dp x sp
ranks, and what keeps a backward that raised on some ranks from leaving the others waiting.

DDP all-reduces its gradient buckets in index order, each when its gradients are ready, and
waits for all of them at the end of the backward. A rank whose backward raised (an error in
the model after its last ring call, or a ring call that raised because a peer reported one)
never reaches its remaining buckets, so every other rank would wait in DDP's all-reduce until
the process group's timeout. Here every bucket's all-reduce is counted as it starts; a rank
whose backward raised runs the all-reduces it did not reach itself, on zeros
(:func:`complete_after_failure`). Every ``booster.backward`` of the model then ends with a
status all-reduce (``completion.agree_on_status``) in which a rank whose backward raised marks
itself, also inside ``no_sync`` (no bucket is sent there, and without it the others went on
to their next step) and after DDP sent its last bucket (a failure in an autograd callback).
Every rank thus makes the same collectives, and the ranks whose backward ended see who did not
finish (:meth:`DdpSum.after_success`): their summed gradients are invalid, and they raise
instead of stepping.
"""
from __future__ import annotations

import datetime
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp._common_utils import collect_grad_tensors

from .._dist import ring_timeout
from .completion import Completion, agree_on_status, bounded, peers_failed_error

__all__ = ["DdpSum", "complete_after_failure", "sum_allreduce_hook"]


class DdpSum(Completion):
    """The state of the plugin's DDP communication hook on one rank, for one boosted model.

    ``ddp``: the DistributedDataParallel module. ``reduced``: the plugin's count of reduced
    backward passes (``ReducedGrads``), marked at each backward's first bucket. ``expecting``:
    the model's last forward with gradients waits for a backward that has not ended (inside
    ``no_sync`` too); ``synced``: that backward reduces (DDP prepared for it: not inside
    ``no_sync``). ``launched``: the buckets this backward has sent so far. A backward that
    does not run through ``booster.backward`` (a plain ``loss.backward()``) ends the wait when
    DDP's last bucket completes; inside ``no_sync`` nothing tells its end, and a later failure
    on this rank would complete it again."""

    def __init__(self, ddp, reduced):
        # (weakly: DDP's reducer holds this hook state from C++, where the garbage collector
        # cannot see the cycle, so a strong reference kept the model alive for good)
        self._ddp, self.reduced = weakref.ref(ddp), reduced
        self.expecting = self.synced = False
        self.launched = 0
        self.last_sent = False  # this backward sent DDP's last bucket
        self.completed = 0  # reduced backward passes that ended
        self._hooked = False  # the running forward's outputs carry _backward_began
        self._in_backward = False  # the backward since the last forward reached the outputs
        self._watching = False  # inside booster.backward
        ddp.register_forward_hook(self._hook_outputs)

    @property
    def ddp(self):
        """The DistributedDataParallel module (alive while its reducer calls this hook)."""
        return self._ddp()

    def forward_started(self) -> None:
        self._hooked = False

    def _hook_outputs(self, module, args, out) -> None:
        if torch.is_grad_enabled():
            tensors = collect_grad_tensors(out)
            for t in tensors:  # the backward reached this model, not another one only
                t.register_hook(self._backward_began)
            self._hooked = bool(tensors)

    def _backward_began(self, grad):
        # (only inside booster.backward: a torch.autograd.grad probe through the outputs is
        # no backward the ranks reduce)
        if self._watching:
            self._in_backward = True
        return grad

    def forward_ran(self) -> None:
        """After the boosted model's forward ended: whether a backward is now due (one DDP
        reduces unless inside ``no_sync``). A forward under no_grad leaves the wait as it
        was."""
        if torch.is_grad_enabled():
            self.synced = bool(self.ddp.require_backward_grad_sync)
            self.expecting = self._hooked or self.synced
            self.launched, self._in_backward, self.last_sent = 0, False, False

    def backward_started(self) -> None:
        self._watching = True

    def backward_ended(self) -> None:
        self._watching = False

    def reset(self) -> None:
        """On every rank (the plugin's reset): DDP's reducer forgets the backward that raised
        (it would refuse the next forward: "Expected to have finished reduction") and, on
        every rank alike, rebuilds its buckets after the next backward."""
        self.ddp.reducer._reset_state()
        self.expecting = self.synced = self._in_backward = self.last_sent = False
        self.launched = 0

    def after_failure(self, timeout: float, error: BaseException) -> Optional[str]:
        """This rank's backward raised ``error``: completes DDP's collectives (see the module
        doc), then the status all-reduce with this rank marked and the exchange of the errors.
        Returns a note for this rank's error when they could not be completed (never raises:
        the rank's own error is what it raises)."""
        if not self.expecting:
            return None
        self.expecting, self._in_backward = False, False
        if self.synced and getattr(self.ddp, "static_graph", False) and not self.completed:
            # DDP's first static-graph iteration reduces at its end in an order of its own
            return ("ringseq: DDP's gradient reduction was not completed for the other ranks "
                    "(static_graph's first iteration): they wait for the process group's "
                    "timeout")
        return self._complete(timeout, error)

    def _complete(self, timeout: float, error: BaseException) -> Optional[str]:
        """The buckets DDP did not send (when this backward reduces), on zeros, then the
        status all-reduce with this rank marked; a note when they could not be completed."""
        def replay():
            if self.synced:
                complete_after_failure(self.ddp, self, timeout)
            self._status(error, timeout)
        return bounded(replay, [dist.group.WORLD], timeout, "DDP's gradient reduction")

    def after_success(self) -> None:
        """This rank's backward of this model ended: raises RingPeerError when another rank's
        did not (its gradients are zeros in this rank's sums). One all-reduce of W int64 per
        backward, read once on the host (``completion.agree_on_status``; one more after a
        failure, which the RingPeerError quotes)."""
        if not (self.expecting and self._in_backward):
            return  # (a backward of another model only)
        self.expecting, self._in_backward = False, False
        error = None
        if self.synced and not self.last_sent:
            # DDP waits for every parameter's gradient before it sends a bucket: one that
            # got none left its bucket (and those after it) unsent, and the backward ended
            # without an error, the gradients partly unsummed. The unsent buckets go as
            # zeros first: ranks that used the parameter wait in their all-reduce.
            # (named where they show: no gradient at all, as after zero_grad(set_to_none);
            # under accumulation an earlier micro-batch's gradient hides them)
            unused = [n for n, p in self.ddp.module.named_parameters()
                      if p.requires_grad and p.grad is None]
            named = (f" ({', '.join(unused[:5])}{', ...' if len(unused) > 5 else ''})"
                     if unused else "")
            error = ValueError(
                "booster.backward: DDP did not sum every gradient of this backward over the "
                f"ranks: a parameter that requires a gradient got none{named} (unused in the "
                "forward), so its bucket was never sent and the gradients are partly this "
                "rank's own. Skip the step (optimizer.zero_grad() and booster.reset() on "
                "every rank) and pass ddp_kwargs={'find_unused_parameters': True} to "
                "RingSequenceParallelPlugin, or freeze the parameter (requires_grad=False) "
                "before boosting")
            note = self._complete(ring_timeout(), error)
            if note:
                error.add_note(note)
            raise error
        failed = self._status(None, ring_timeout())
        if failed:
            raise peers_failed_error(failed)

    def _status(self, error: Optional[BaseException], timeout: float):
        """The status all-reduce over every rank, this rank marked when ``error`` is given,
        then the errors' exchange where a rank is; returns the ranks marked, with the start
        of their errors."""
        return agree_on_status(None, range(dist.get_world_size()), dist.get_rank(),
                               self.ddp.device, error, timeout)


def sum_allreduce_hook(state: DdpSum, bucket):
    # DDP's default hook divides by the group size; the plugin's loss is already the global
    # token mean, so the exact gradient is the plain SUM (see RingSequenceParallelPlugin's
    # docstring). A sum is not idempotent: `reduced` counts the reduced backward passes (bucket
    # 0 is reduced once in each) and the optimizer refuses to step on gradients summed twice.
    if bucket.index() == 0:
        state.reduced.mark()
    state.launched = bucket.index() + 1
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    if not bucket.is_last():
        return fut.then(lambda f: f.value()[0])
    state.last_sent = True

    def done(f):
        state.completed += 1
        if not state._watching:  # (a plain loss.backward(): no status follows it)
            state.expecting = False
        return f.value()[0]
    return fut.then(done)


def complete_after_failure(ddp, state: DdpSum, timeout: float) -> None:
    """On a rank whose backward raised: the all-reduces of the buckets DDP did not send, on
    zeros, so that the other ranks' backward ends (the status all-reduce that follows tells
    them it raised here). Waits at most ``timeout`` seconds for each (a peer that died does
    not answer); the caller re-raises its own error either way. Uses DDP's own (private) list
    of its buckets, the one its join mode replays."""
    buckets = ddp.reducer._get_zeros_like_grad_buckets()  # in the order DDP sends them
    works = []
    with torch.no_grad():
        for bucket in buckets:
            if bucket.index() >= state.launched:
                works.append(dist.all_reduce(bucket.buffer(), async_op=True))
        # DDP's all-reduce of the used-parameter map follows its last bucket (sent by DDP
        # itself when every bucket was)
        if ddp.find_unused_parameters and state.launched < len(buckets):
            used = ddp.reducer._get_local_used_map()
            works.append(dist.all_reduce(torch.zeros_like(used), async_op=True))
    state.launched = len(buckets)
    for work in works:
        work.wait(datetime.timedelta(seconds=timeout))
