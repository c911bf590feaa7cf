"""The replicated (zero stage 0, tp 1) gradient reduction through DDP: a SUM over the dp x sp
ranks, and what keeps a backward that raised on some ranks from leaving the others waiting.

DDP all-reduces its gradient buckets in index order, each when its gradients are ready, and
waits for all of them at the end of the backward. A rank whose backward raised (an error in
the model after its last ring call, or a ring call that raised because a peer reported one)
never reaches its remaining buckets, so every other rank would wait in DDP's all-reduce until
the process group's timeout. Here every bucket's all-reduce is counted as it starts; a rank
whose backward raised runs the all-reduces it did not reach itself, on zeros
(:func:`complete_after_failure`), and the last bucket carries a status vector in which such a
rank marks itself; where one did, the ranks then exchange the start of its error. Every rank
thus makes the same collectives, and the ranks whose backward ended see who did not finish
(:meth:`DdpSum.after_success`): their summed gradients are invalid, and they raise instead of
stepping.
"""
from __future__ import annotations

import datetime
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .._dist import ring_timeout
from .completion import (Completion, completion_failed_note, exchange_errors, peers_failed_error,
                         quote_marked, status_vector)

__all__ = ["DdpSum", "complete_after_failure", "sum_allreduce_hook"]


class DdpSum(Completion):
    """The state of the plugin's DDP communication hook on one rank, for one boosted model.

    ``ddp``: the DistributedDataParallel module. ``reduced``: the plugin's count of reduced
    backward passes (``ReducedGrads``), marked at each backward's first bucket. ``expecting``:
    the model's last forward prepared DDP for a reduced backward that has not ended.
    ``launched``: the buckets this backward has sent so far. ``status``: the last bucket's
    status vector once it completed, (world,) int64, 1 where a rank did not finish its
    backward; None before."""

    def __init__(self, ddp, reduced):
        # (weakly: DDP's reducer holds this hook state from C++, where the garbage collector
        # cannot see the cycle, so a strong reference kept the model alive for good)
        self._ddp, self.reduced = weakref.ref(ddp), reduced
        self.expecting = False
        self.launched = 0
        self.status: Optional[torch.Tensor] = None
        self.completed = 0  # reduced backward passes that ended

    @property
    def ddp(self):
        """The DistributedDataParallel module (alive while its reducer calls this hook)."""
        return self._ddp()

    def forward_ran(self) -> None:
        """After the boosted model's forward ended: whether DDP now waits for a reduced
        backward (not inside ``no_sync``). A forward under no_grad leaves DDP as it was."""
        if torch.is_grad_enabled():
            self.expecting = self.ddp.require_backward_grad_sync
            self.launched = 0
            self.status = None

    def reset(self) -> None:
        """On every rank (the plugin's reset): DDP's reducer forgets the backward that raised
        (it would refuse the next forward: "Expected to have finished reduction") and, on
        every rank alike, rebuilds its buckets after the next backward."""
        self.ddp.reducer._reset_state()
        self.expecting, self.launched, self.status = False, 0, None

    def status_vector(self, device, failed: bool) -> torch.Tensor:
        return status_vector(dist.get_world_size(), dist.get_rank(), device, failed)

    def after_failure(self, timeout: float, error: BaseException) -> Optional[str]:
        """This rank's backward raised: completes DDP's collectives (see the module doc).
        Returns a note for this rank's error when they could not be completed (never raises:
        the rank's own error is what it raises)."""
        if not self.expecting:
            return None
        self.expecting = False
        if getattr(self.ddp, "static_graph", False) and not self.completed:
            # DDP's first static-graph iteration reduces at its end in an order of its own
            return ("ringseq: DDP's gradient reduction was not completed for the other ranks "
                    "(static_graph's first iteration): they wait for the process group's "
                    "timeout")
        try:
            complete_after_failure(self.ddp, self, timeout, error)
        except Exception as exc:  # noqa: BLE001 - a peer gone, or too slow to answer
            return completion_failed_note("DDP's gradient reduction", exc)
        return None

    def after_success(self) -> None:
        """This rank's backward ended: raises RingPeerError when another rank's did not (its
        gradients are zeros in this rank's sums). Reads the status vector once (one host
        synchronization on a GPU); where a rank is marked, the ranks exchange the start of
        its error (``completion.exchange_errors``), which the RingPeerError quotes."""
        if self.status is None:  # not reduced in this backward (no_sync, another model's)
            return
        status, self.status = self.status, None
        failed = quote_marked(status, None, range(dist.get_world_size()), dist.get_rank(),
                              None, ring_timeout())
        if failed:
            raise peers_failed_error(failed)


def sum_allreduce_hook(state: DdpSum, bucket):
    # DDP's default hook divides by the group size; the plugin's loss is already the global
    # token mean, so the exact gradient is the plain SUM (see RingSequenceParallelPlugin's
    # docstring). A sum is not idempotent: `reduced` counts the reduced backward passes (bucket
    # 0 is reduced once in each) and the optimizer refuses to step on gradients summed twice.
    if bucket.index() == 0:
        state.reduced.mark()
    state.launched = bucket.index() + 1
    buffer = bucket.buffer()
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    if not bucket.is_last():
        return fut.then(lambda f: f.value()[0])
    status = state.status_vector(buffer.device, failed=False)  # (world,)
    status_fut = dist.all_reduce(status, async_op=True).get_future()

    def done(futures):
        state.status, state.expecting = status, False
        state.completed += 1
        return futures.value()[0].value()[0]
    return torch.futures.collect_all([fut, status_fut]).then(done)


def complete_after_failure(ddp, state: DdpSum, timeout: float, error: BaseException) -> None:
    """On a rank whose backward raised ``error``: the all-reduces of the buckets DDP did not
    send, on zeros, the last with this rank marked in the status vector, so that the other
    ranks' backward ends (and raises RingPeerError there), then the exchange of the errors
    (quoting ``error``). Waits at most ``timeout``
    seconds (a peer that died does not answer); the caller re-raises its own error either
    way. Uses DDP's own (private) list of its buckets, the one its join mode replays."""
    buckets = ddp.reducer._get_zeros_like_grad_buckets()  # in the order DDP sends them
    launched = state.launched
    works = []
    with torch.no_grad():
        for bucket in buckets:
            if bucket.index() < state.launched:
                continue
            buffer = bucket.buffer()
            works.append(dist.all_reduce(buffer, async_op=True))
            if bucket.is_last():
                works.append(dist.all_reduce(state.status_vector(buffer.device, failed=True),
                                             async_op=True))
        # DDP's all-reduce of the used-parameter map follows its last bucket (sent by DDP
        # itself when every bucket was)
        if ddp.find_unused_parameters and state.launched < len(buckets):
            used = ddp.reducer._get_local_used_map()
            works.append(dist.all_reduce(torch.zeros_like(used), async_op=True))
    state.launched = len(buckets)
    for work in works:
        work.wait(datetime.timedelta(seconds=timeout))
    if any(b.is_last() for b in buckets if b.index() >= launched):  # (the status was sent)
        exchange_errors(None, range(dist.get_world_size()), dist.get_rank(),
                        buckets[-1].buffer().device, error, timeout)
