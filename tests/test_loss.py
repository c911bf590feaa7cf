"""ringseq.sharded_cross_entropy on one process (no group: the local token mean) and what
ranks that disagree get; the multi-rank failure agreement is in tests/test_ring_recovery.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ringseq
from dist_utils import run_ranks
from utils import capture


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


def test_ignore_index_and_logits_are_checked_by_name():
    logits = torch.randn(3, 5)
    with pytest.raises(TypeError, match=r"^sharded_cross_entropy: ignore_index must be an int, "
                                        r"got None"):
        ringseq.sharded_cross_entropy(logits, torch.tensor([0, 1, 2]), ignore_index=None)
    with pytest.raises(ValueError, match=r"^sharded_cross_entropy: logits must be a floating "
                                         r"tensor"):
        ringseq.sharded_cross_entropy(torch.ones(3, 5, dtype=torch.long), torch.tensor([0, 1, 2]))
    # (before: AttributeError 'list' object has no attribute 'shape', and torch's reshape error)
    with pytest.raises(TypeError, match=r"^sharded_cross_entropy: labels must be an integer "
                                        r"tensor \(...\) of class indices, got \[0, 1, 2\] "
                                        r"\(list\)"):
        ringseq.sharded_cross_entropy(logits, [0, 1, 2])
    with pytest.raises(ValueError, match=r"^sharded_cross_entropy: logits must have a "
                                         r"vocabulary of at least one class, got shape \(3, 0\)"):
        ringseq.sharded_cross_entropy(torch.randn(3, 0), torch.tensor([0, 1, 2]))
    labels = torch.tensor([0, -7, 2])
    want = ringseq.sharded_cross_entropy(logits, labels, ignore_index=-7)
    for index in (torch.tensor(-7), __import__("numpy").int64(-7)):  # ints of other kinds
        assert torch.equal(ringseq.sharded_cross_entropy(logits, labels, ignore_index=index),
                           want)


def _worker_disagreeing_ranks():
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    labels = torch.randint(0, 11, (1, 6), generator=g)  # (b, s_local)
    logits = torch.randn(1, 6, 11, generator=g, dtype=torch.float64)  # (b, s_local, vocab)
    res = {
        "ignore_index": capture(lambda: ringseq.sharded_cross_entropy(
            logits, labels, ignore_index=5 if rank == 1 else -100)),
        "dtype": capture(lambda: ringseq.sharded_cross_entropy(
            logits.float() if rank == 1 else logits, labels)),
        "vocab": capture(lambda: ringseq.sharded_cross_entropy(
            torch.cat([logits, logits[..., :2]], -1) if rank == 1 else logits, labels)),
    }
    # the error passed first, as report_step_failure(exc) (before: a TypeError about `group`
    # on rank 1 alone, rank 0 waiting at its loss for the ring timeout)
    if rank == 1:
        ringseq.loss.report_step_failure(RuntimeError("the model failed"))
    else:
        res["positional_report"] = capture(lambda: ringseq.sharded_cross_entropy(logits, labels))
    res["after"] = float(ringseq.sharded_cross_entropy(logits, labels))
    return res


def test_ranks_that_disagree_on_the_loss_arguments_raise_on_every_rank():
    """A different ignore_index, logits dtype or vocabulary on one rank is a RingMismatchError
    on every rank naming the field and each rank's value (before: a loss computed with rank
    1's ignore_index on every rank, 3.0344 against 3.0292, or a loss that differed by rank),
    and the next call is right."""
    ranks = run_ranks(_worker_disagreeing_ranks, 2, timeout=120)
    for res in ranks:
        for key, field in (("ignore_index", "ignore_index (rank 0: -100, rank 1: 5)"),
                           ("dtype", "logits dtype (rank 0: torch.float64, rank 1: "
                                     "torch.float32)"),
                           ("vocab", "vocabulary size (rank 0: 11, rank 1: 13)")):
            kind, message = res[key][:2]
            assert kind == "RingMismatchError", res[key]
            assert message.startswith("ringseq: sharded_cross_entropy: the ranks of the ring "
                                      "were called with different arguments: ") and \
                field in message and "one ignore_index" in message, message
    assert ranks[0]["after"] == ranks[1]["after"]
    kind, message = ranks[0]["positional_report"][:2]
    assert kind == "RingPeerError" and "(rank 1: RuntimeError: the model failed" in message, \
        message


def test_an_ignore_index_beyond_int64_and_integer_logits_are_named():
    logits, labels = torch.randn(3, 5), torch.tensor([0, 1, 2])
    # (before: OverflowError "int too big to convert", naming neither)
    with pytest.raises(ValueError, match=r"^sharded_cross_entropy: ignore_index must be an "
                                         r"int64 \(labels are int64\), got 18446744073709551616"):
        ringseq.sharded_cross_entropy(logits, labels, ignore_index=2**64)
    # (before: the message gave the shape only, which was fine)
    with pytest.raises(ValueError, match=r"got a torch.Tensor of shape \(3, 5\) of dtype "
                                         r"torch.int64$"):
        ringseq.sharded_cross_entropy(torch.ones(3, 5, dtype=torch.long), labels)


def test_the_plugins_loss_names_outputs_without_logits_and_a_batch_without_targets():
    from ringseq.plugin.wrappers import SequenceParallelLoss
    criterion, logits = SequenceParallelLoss(), torch.randn(1, 4, 5)
    # (before: a bare KeyError 'logits', and "argument of type 'NoneType' is not iterable")
    with pytest.raises(ValueError, match=r"^the criterion needs logits .* got dict without "
                                         r"'logits'$"):
        criterion({"loss": torch.zeros(())}, {"shift_labels": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"^the criterion needs the batch's 'shift_labels' .* "
                                         r"got None \(NoneType\)$"):
        criterion(logits, None)
    # a batch is named by its keys, not its values; a Mapping's logits are found as a dict's
    with pytest.raises(ValueError, match=r"got a batch with keys \['input_ids', 'labels'\]$"):
        criterion(logits, {"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 4)})
    from types import MappingProxyType
    targets = torch.zeros(1, 4, dtype=torch.long)
    assert torch.equal(criterion(MappingProxyType({"logits": logits}), targets),
                       criterion(logits, targets))


def test_the_plugins_loss_under_tp_takes_unflattened_logits_and_checks_its_tp_arguments():
    """Under tensor parallelism each tp rank's logits are a share of every row: flattened
    logits (b * s / t, V) and targets (b * s,) pass the length rule but cannot be cut alike
    (before: a contiguous cut of the flat targets, the wrong tokens, no error)."""
    from ringseq.plugin.wrappers import SequenceParallelLoss
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)  # (b, s_local / t, V)
    targets = torch.randint(0, 5, (2, 8), generator=g)  # (b, s_local)
    criterion = SequenceParallelLoss(tp_size=2, tp_rank=1)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, 4:].flatten())
    assert torch.allclose(criterion(logits, targets), want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"^with tp_size=2 the criterion needs logits .*got "
                                         r"logits \(8, 5\).*pass them unflattened$"):
        criterion(logits.flatten(0, 1), targets.flatten())
    with pytest.raises(ValueError, match=r"^SequenceParallelLoss: tp_size must be >= 1 and "
                                         r"tp_rank in \[0, tp_size\), got tp_size=2, "
                                         r"tp_rank=5$"):
        SequenceParallelLoss(tp_size=2, tp_rank=5)
    with pytest.raises(ValueError, match=r"got tp_size=0, tp_rank=0$"):  # (before: as 1)
        SequenceParallelLoss(tp_size=0)
    with pytest.raises(TypeError, match=r"^SequenceParallelLoss: tp_size and tp_rank must be "
                                        r"ints, got tp_size=2.0"):
        SequenceParallelLoss(tp_size=2.0)


def _worker_failing_report_and_loss():
    import time
    rank = torch.distributed.get_rank()
    logits, labels = torch.randn(1, 4, 5), torch.zeros(1, 4, dtype=torch.long)
    res = {}
    # a report given a group that is no process group still unblocks the peer at its loss
    if rank == 1:
        res["bad_group"] = capture(lambda: ringseq.loss.report_step_failure(
            "world", RuntimeError("the model failed")))
    else:
        res["bad_group"] = capture(lambda: ringseq.sharded_cross_entropy(logits, labels))
    ringseq.sharded_cross_entropy(logits, labels)  # the ring is whole again
    # rank 1 refuses its labels while rank 0 is not at its loss: rank 1 still raises its own
    # error, the report's timeout noted on it
    if rank == 0:
        time.sleep(6)
        return res
    try:
        ringseq.sharded_cross_entropy(logits, torch.full((1, 4), 7))
    except ValueError as exc:
        res["own"] = (str(exc), getattr(exc, "__notes__", []))
    return res


def test_a_rank_that_cannot_report_its_loss_failure_still_raises_its_own_error():
    """(Before: rank 1's ValueError came two levels down the context of a RingTimeoutError;
    and a report given a bad group raised TypeError on its rank alone, the peer timing out.)"""
    ranks = run_ranks(_worker_failing_report_and_loss, 2, timeout=120,
                      env={"RINGSEQ_TIMEOUT": "3"})
    kind, message, seconds = ranks[0]["bad_group"]
    assert kind == "RingPeerError" and "report_step_failure: group must be" in message, message
    assert seconds < 2, seconds
    assert ranks[1]["bad_group"][0] == "TypeError", ranks[1]["bad_group"]
    message, notes = ranks[1]["own"]
    assert message.startswith("sharded_cross_entropy: labels must be in [0, 5)"), message
    assert any(n.startswith("ringseq: reporting it to the loss failed too: RingTimeoutError")
               for n in notes), notes
