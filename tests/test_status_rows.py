"""The rows a backward's reduction exchanges after a status vector that marked a rank: each
failed rank's row carries the start of its error, so the ranks whose backward ended can quote
it (tests/test_ring_recovery.py checks them end to end)."""
from __future__ import annotations

import torch

from ringseq.plugin.completion import (STATUS_MESSAGE_BYTES, failed_in, peers_failed_error,
                                       status_rows)


class _NoText(RuntimeError):
    def __str__(self):
        raise ValueError("no text")


def _summed(*errors):
    """The rows every rank sees after the all-reduce: rank r raised ``errors[r]`` (or None)."""
    return sum(status_rows(len(errors), r, "cpu", e) for r, e in enumerate(errors))


def test_each_failed_rank_is_quoted_whole_or_marked_cut():
    fits = "x" * (STATUS_MESSAGE_BYTES - len("ValueError: "))  # exactly the row's bytes
    longer = "é" * STATUS_MESSAGE_BYTES  # two bytes each: cut, and not inside a character
    failed = failed_in(_summed(None, ValueError(fits), MemoryError(longer), _NoText()),
                       [10, 11, 12, 13])
    assert list(failed) == [11, 12, 13]
    assert failed[11] == f"ValueError: {fits}"  # (not marked: nothing was cut)
    assert failed[12].startswith("MemoryError: éé") and failed[12].endswith("é...")
    assert len(failed[12].encode()) <= STATUS_MESSAGE_BYTES + 3
    assert failed[13] == "_NoText"  # (its str() raises: its type still names it)
    assert failed_in(_summed(None, None), [0, 1]) == {}


def test_the_peers_error_names_the_first_ranks_errors():
    err = peers_failed_error({r: f"MemoryError: rank {r}" for r in range(6)})
    assert err.ranks == list(range(6))
    text = str(err)
    assert text.startswith("ringseq: the backward did not end on rank(s) [0, 1, 2, 3, 4, 5] "
                           "(they raise their own errors: rank 0: MemoryError: rank 0; ")
    assert "rank 3: MemoryError: rank 3; and 2 more)" in text and "rank 4:" not in text
    assert text.endswith("booster.reset() on every rank")
    # (the exchange failed, a peer gone: the ranks named, nothing quoted)
    assert "rank(s) [2, 3] (they raise their own errors), so" in str(
        peers_failed_error({2: "", 3: ""}))


def test_the_rows_are_bytes_a_sum_keeps():
    rows = status_rows(4, 1, "cpu", RuntimeError("boom"))
    assert rows.dtype == torch.uint8 and rows.shape == (4, 1 + STATUS_MESSAGE_BYTES)
    assert rows[[0, 2, 3]].eq(0).all() and int(rows[1, 0]) == 1
