"""ringseq.sharded_cross_entropy on one process (no group: the local token mean); the
multi-rank agreement and its errors are in tests/test_ring_recovery.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ringseq


def test_one_process_equals_torch_cross_entropy_with_ignored_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    labels[0, :3] = -100
    loss = ringseq.sharded_cross_entropy(logits, labels)
    want = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
    (got,) = torch.autograd.grad(loss, logits)
    (ref,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_labels_that_are_not_class_indices_are_refused(dtype):
    # a float label such as 2.7 would otherwise be truncated to class 2: a finite, wrong loss
    logits = torch.randn(3, 5)
    labels = torch.tensor([1.9, 2.7, -100.0]).to(dtype)
    with pytest.raises(ValueError, match=f"labels must be an integer tensor .*got {dtype}"):
        ringseq.sharded_cross_entropy(logits, labels)


def test_labels_outside_the_vocabulary_and_shape_mismatch_are_named():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 5\).*got \[5\]"):
        ringseq.sharded_cross_entropy(logits, torch.tensor([0, 5, -100]))
    with pytest.raises(ValueError, match="must agree on the leading dims"):
        ringseq.sharded_cross_entropy(logits, torch.tensor([0, 1]))
