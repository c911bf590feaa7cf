"""ringseq.parallel.grad_sync.ReplicatedGradSync on one process: one reduction per backward,
also after a backward that raised before its end (the multi-rank sums are in
tests/test_compose.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ringseq.parallel.grad_sync import ReplicatedGradSync


class _Marks:
    """Stands in for plugin.wrappers.ReducedGrads: counts the reductions."""

    def __init__(self):
        self.count = 0

    def mark(self):
        self.count += 1


class _FailOnce(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            raise RuntimeError("injected failure in the backward")
        return g


def test_every_backward_reduces_once_even_after_a_failed_one():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.Sequential(first, second)
    marks = _Marks()
    sync = ReplicatedGradSync(model, group=None, reduced=marks)
    x = torch.randn(3, 4)

    def loss():
        # the failure comes after the second layer's gradients were accumulated (their hooks
        # queued the reduction) and before the backward's end
        return second(_FailOnce.apply(first(x))).sum()

    model(x).sum().backward()
    assert marks.count == 1
    with pytest.raises(RuntimeError, match="injected failure"):
        loss().backward()
    assert marks.count == 1  # the failed backward never reached its end
    _FailOnce.armed = False
    try:
        loss().backward()
        loss().backward()
    finally:
        _FailOnce.armed = True
    assert marks.count == 3  # each later backward reduced once
    with sync.no_sync():
        model(x).sum().backward()
    assert marks.count == 3  # no reduction inside no_sync


def test_a_nested_no_sync_leaves_the_sum_off_until_the_outer_block_ends():
    """As DDP's no_sync (before: the inner block's end turned the sum on, the next backward
    inside the outer block summed, and the step refused "2 backward passes summed")."""
    model = nn.Linear(4, 1)
    marks = _Marks()
    sync = ReplicatedGradSync(model, group=None, reduced=marks)
    x = torch.randn(3, 4)
    with sync.no_sync():
        with sync.no_sync():
            model(x).sum().backward()
        model(x).sum().backward()  # (inside the outer block)
        assert marks.count == 0
    model(x).sum().backward()
    assert marks.count == 1
