"""Layouts as data: shard/unshard inverses, positions, and schedules that cover the mask.

Everything here simulates the ranks in one process (no spawning)."""
from __future__ import annotations

import re

import pytest
import torch

import ringseq
from dist_utils import run_ranks
from ringseq.layouts import (LAYOUTS, BlockTask, get_layout, positions_local,
                             shard_local, unshard_local)

NAMES = ["contiguous", "zigzag", "stripe"]
WORLD_SIZES = [1, 2, 3, 4, 5, 8]


def _lengths(name, w):
    m = get_layout(name).multiple(w)
    return [m, 3 * m, 7 * m]  # includes lengths that are not powers of two


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("w", WORLD_SIZES)
def test_shard_unshard_inverse_and_positions(name, w):
    for s in _lengths(name, w):
        x = torch.randn(2, s, 3, 4)
        parts = [shard_local(x, name, w, r) for r in range(w)]
        assert all(p.shape == (2, s // w, 3, 4) for p in parts)
        assert all(p.is_contiguous() for p in parts)
        assert torch.equal(unshard_local(parts, name), x)
        pos = [positions_local(s, name, w, r) for r in range(w)]
        # positions say where each local token came from, and together they are a permutation
        for r in range(w):
            assert pos[r].dtype == torch.int64 and pos[r].shape == (s // w,)
            assert torch.equal(parts[r], x[:, pos[r]])
        assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(s))
        # other dims, negative dim
        y = torch.randn(s, 5)
        ys = [shard_local(y, name, w, r, dim=0) for r in range(w)]
        assert torch.equal(unshard_local(ys, name, dim=0), y)
        z = torch.randn(3, s)
        zs = [shard_local(z, name, w, r, dim=-1) for r in range(w)]
        assert torch.equal(unshard_local(zs, name, dim=-1), z)


def test_bad_dims_parts_and_lengths_are_refused():
    """torch's wrap-around of an out-of-range dim would pick another dimension silently; a
    list of parts of unequal or impossible lengths would scatter garbage (uninitialized rows,
    dropped tokens); a float length would give float positions."""
    x = torch.randn(2, 8, 3)
    for dim in (3, -4):
        with pytest.raises(ValueError, match=rf"^shard_local: dim={dim} is out of range for a "
                                             rf"tensor of shape \(2, 8, 3\)"):
            shard_local(x, "zigzag", 2, 0, dim=dim)
    with pytest.raises(ValueError, match="^shard_local: the tensor must have a sequence dimension"):
        shard_local(torch.tensor(1.0), "contiguous", 2, 0, dim=0)
    with pytest.raises(ValueError, match="layout 'zigzag' needs local shards"):
        unshard_local([torch.zeros(1, 3), torch.zeros(1, 3)], "zigzag")
    with pytest.raises(ValueError, match="^unshard_local: every part must have one shape"):
        unshard_local([torch.zeros(1, 2), torch.zeros(1, 6)], "zigzag")
    with pytest.raises(ValueError, match="^unshard_local: parts must be a non-empty list"):
        unshard_local([], "zigzag")
    with pytest.raises(ValueError, match="^unshard_local: dim=2 is out of range"):
        unshard_local([torch.zeros(1, 2)] * 2, "zigzag", dim=2)
    with pytest.raises(TypeError, match="layout 'zigzag': seqlen must be an int, got 16.0"):
        positions_local(16.0, "zigzag", 2, 0)


def test_a_custom_layout_whose_positions_have_the_wrong_shape_is_refused():
    from ringseq.layouts import Layout

    class Short(Layout):
        name = "test_short_positions"

        def multiple(self, world_size):
            return world_size

        def _positions(self, seqlen, world_size, rank):
            return torch.arange(rank, seqlen, world_size + 1)  # too few

    with pytest.raises(ValueError, match=r"_positions\(8, 2, 0\) must return an int64 tensor "
                                         r"of shape \(4,\), got torch.int64 of shape \(3,\)"):
        shard_local(torch.zeros(1, 8), Short(), 2, 0)


class _ReversedWithinRank(__import__("ringseq").layouts.Layout):
    """Contiguous chunks, each rank's held in reverse order (one rank too)."""
    name = "test_reversed_within_rank"

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        return torch.arange((rank + 1) * n - 1, rank * n - 1, -1)

    def _tasks(self, rank, src, world_size, s_local):  # unused: the masked path schedules
        raise AssertionError("not used by these tests")


def test_a_custom_layout_keeps_its_own_order_on_one_rank():
    """shard / unshard follow positions() at world size 1 too (before: a copy and a no-op,
    so a layout that reorders one rank's tokens gave attention 2.5 off and position ids
    that did not belong to their tokens)."""
    lay = _ReversedWithinRank()
    x = torch.arange(6.0).view(1, 6)  # (b, s)
    want = x[:, [5, 4, 3, 2, 1, 0]]
    assert torch.equal(positions_local(6, lay, 1, 0), torch.tensor([5, 4, 3, 2, 1, 0]))
    assert torch.equal(shard_local(x, lay, 1, 0), want)
    assert torch.equal(ringseq.shard(x, lay), want)  # no process group: world size 1
    assert torch.equal(ringseq.unshard(want, lay), x)
    assert torch.equal(unshard_local([want], lay), x)
    batch = ringseq.shard_batch({"input_ids": x.long()}, layout=lay)
    assert torch.equal(batch["input_ids"], want.long())
    assert torch.equal(batch["position_ids"], torch.tensor([[5, 4, 3, 2, 1, 0]]))
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    ref = ringseq.flash_attn_func(q, k, v, causal=True, window_size=(2, 0), backend="reference")
    out = ringseq.ring_flash_attn_func(*(ringseq.shard(t, lay) for t in (q, k, v)), causal=True,
                                       window_size=(2, 0), layout=lay, backend="reference")
    assert torch.allclose(ringseq.unshard(out, lay), ref, atol=1e-12, rtol=0)
    # the built-in layouts are one rank's tokens in order: copies, and unshard returns its input
    y = torch.randn(1, 4, 3)
    for name in NAMES:
        assert torch.equal(shard_local(y, name, 1, 0), y) and ringseq.unshard(y, name) is y


def test_a_custom_layouts_positions_must_be_a_permutation():
    """Positions listed twice or out of range are refused, naming the layout (before: shard
    dropped tokens silently and unshard returned uninitialized memory)."""
    from ringseq.layouts import Layout

    class Twice(Layout):
        name = "test_twice"

        def _positions(self, seqlen, world_size, rank):
            return torch.arange(seqlen // world_size)  # every rank claims the first tokens

    class Outside(Twice):
        name = "test_outside"

        def _positions(self, seqlen, world_size, rank):
            return torch.arange(seqlen // world_size) + 100

    with pytest.raises(ValueError, match=r"^shard_local: layout 'test_twice': "
                                         r"_positions\(8, 2, rank\) over the ranks must list "
                                         r"every position of \[0, 8\) exactly once \(a "
                                         r"permutation\), but position 0 is listed 2 times"):
        shard_local(torch.zeros(1, 8), Twice(), 2, 1)
    with pytest.raises(ValueError, match=r"^unshard_local: layout 'test_twice'"):
        unshard_local([torch.zeros(1, 4)] * 2, Twice())
    with pytest.raises(ValueError, match=r"^positions_local: layout 'test_outside': "
                                         r"_positions\(8, 2, rank\) must give positions in "
                                         r"\[0, 8\), got 100"):
        positions_local(8, Outside(), 2, 0)

    class Duplicated(Twice):  # one rank's order reversed, one position twice
        name = "test_duplicated"

        def _positions(self, seqlen, world_size, rank):
            p = torch.arange(seqlen).flip(0)
            p[0] = p[1]
            return p

    # at world size 1 too, unshard as shard (before: unshard returned its input as it was)
    for fn in (ringseq.shard, ringseq.unshard):
        with pytest.raises(ValueError, match=rf"^{fn.__name__}: layout 'test_duplicated': "
                                             r"_positions\(8, 1, rank\) over the ranks must list "
                                             r"every position"):
            fn(torch.zeros(1, 8), Duplicated())


def _unshard_with_another_number_of_dims():
    import torch.distributed as dist
    from utils import error_text
    x = torch.zeros(2, 4, 3) if dist.get_rank() == 0 else torch.zeros(2, 4, 3, 1)
    # dtypes gloo has no type for travel as bytes (before: its bare "Invalid scalar type")
    whole = torch.arange(-8, 8, dtype=torch.float32).view(1, 16) / 4  # (1, 16)
    exact = {str(dt): bool(torch.equal(ringseq.unshard(ringseq.shard(whole.to(dt), "zigzag"),
                                                       "zigzag").view(torch.uint8),
                                       whole.to(dt).view(torch.uint8)))
             for dt in (torch.uint16, torch.float8_e4m3fn, torch.bool, torch.complex64)}
    from ringseq.layouts import Documents
    docs = Documents((0, 5, 24) if dist.get_rank() == 0 else (0, 7, 24))
    # a (b, s, 1) shard made by a transpose: "contiguous", its last dim's stride not 1 (the
    # first byte view refused it)
    odd = torch.arange(8.0).view(2, 1, 4).transpose(1, 2) + dist.get_rank()  # (2, 4, 1)
    base = torch.arange(8.0).view(2, 4, 1)
    exact["odd stride"] = bool(torch.equal(ringseq.unshard(odd), torch.cat([base, base + 1], 1)))
    # a last dim of size 0 (before: torch's "self.stride(1) must be divisible by 4" after the
    # all-gather, on every rank)
    empty = torch.zeros(2, 8, 0, requires_grad=True)
    gathered = ringseq.unshard(ringseq.shard(empty, "zigzag"), "zigzag")
    gathered.sum().backward()
    exact["empty last dim"] = gathered.shape == (2, 8, 0) and empty.grad.shape == (2, 8, 0)
    return (error_text(lambda: ringseq.unshard(x)), exact,
            error_text(lambda: ringseq.unshard(torch.zeros(1, 12), docs)))


def test_unshard_names_a_different_number_of_dims_and_carries_every_dtype():
    """(before: the fields after the shape were compared one place apart, and the message
    showed a dtype torch.bits16 and a dim 201034069 nobody passed, differently per rank)"""
    errors, exact, documents = zip(*run_ranks(_unshard_with_another_number_of_dims, 2))
    assert errors[0] == errors[1], errors  # the same verdict on every rank
    assert all(all(e.values()) for e in exact), exact
    # documents' boundaries by value (before: "layout #1351998109" and "layout #175476331")
    for error in documents:
        assert error.startswith("RingMismatchError") and "layout documents (cu_seqlens)" in \
            error and "[0, 5, 24]" in error and "[0, 7, 24]" in error, error
        assert "layout #" not in error and "layout (" not in error, error
    assert errors[0].startswith("RingMismatchError: ringseq: unshard: the ranks of the ring were "
                                "called with different arguments: ndim (rank 0: 3, rank 1: 4); "
                                "shape[3] (rank 0: -1, rank 1: 1). "), errors[0]


def test_a_custom_layout_is_checked_where_a_ring_call_takes_it():
    """Tasks past the shard (before: cut short by slicing, keys dropped without a word), tasks
    that are not BlockTasks, a missing method, a multiple of 0 and positions that are not a
    permutation (before: accepted by a plain ring) are refused, naming the call and the
    layout; so are tasks that do not give every query the keys it sees exactly once (full
    blocks where causal ones are due, a block listed twice, blocks left out, other keys of the
    right number, a built-in layout's tasks under positions of the user's) and tasks with kernel
    spans (before: outputs 0.3-2.6 off without a word, and a kernel error naming neither the
    call nor the layout)."""
    from ringseq.layouts import BlockTask, Contiguous, Layout

    class TooLong(Contiguous):
        name = "test_too_long"

        def _tasks(self, rank, src, world_size, s):
            if src == rank:
                return [BlockTask(slice(0, s), slice(0, s), True)]
            return [BlockTask(slice(0, s), slice(s // 2, s + s // 2), False)] if src < rank else []

    class Tuples(Contiguous):
        name = "test_tuples"

        def _tasks(self, rank, src, world_size, s):
            return [(slice(0, s), slice(0, s), True)] if src == rank else []

    class NoTasks(Layout):
        name = "test_no_tasks"

        def _positions(self, seqlen, world_size, rank):
            n = seqlen // world_size
            return torch.arange(rank * n, (rank + 1) * n)

    class NoMultiple(Contiguous):
        name = "test_no_multiple"

        def multiple(self, world_size):
            return 0

    class Twice(Contiguous):
        name = "test_twice"

        def _positions(self, seqlen, world_size, rank):
            return torch.arange(seqlen // world_size)

    np = pytest.importorskip("numpy")

    class Loose(Contiguous):  # open slices, NumPy's ints and bools (taken before the checks)
        name = "test_loose"

        def _tasks(self, rank, src, world_size, s):
            if src == rank:
                return [BlockTask(slice(None, None), slice(np.int64(0), s), np.True_)]
            return [BlockTask(slice(0, s), slice(None), False)] if src < rank else []

    def tasks_layout(name, make):  # contiguous shards, its causal tasks made by ``make``
        return type(name, (Contiguous,), {"name": name, "_tasks": lambda self, rank, src, w, s:
                                          make(rank, src, s)})

    def whole(s, causal):
        return [BlockTask(slice(0, s), slice(0, s), causal)]
    all_full = tasks_layout("test_all_full", lambda r, src, s: whole(s, False))
    listed_twice = tasks_layout("test_twice_listed", lambda r, src, s: whole(s, True) * 2
                                if src == r else whole(s, False) if src < r else [])
    left_out = tasks_layout("test_left_out", lambda r, src, s: whole(s, True) if src == r else [])
    # (each row of the diagonal given as many keys as it sees, but the last ones)
    other_keys = tasks_layout("test_other_keys", lambda r, src, s: [
        BlockTask(slice(i, i + 1), slice(s - 1 - i, s), False) for i in range(s)]
        if src == r else whole(s, False) if src < r else [])
    # contiguous's tasks under chunks in reverse rank order
    positions_only = type("PositionsOnly", (Contiguous,), {
        "name": "test_positions_only", "_positions": _ReversedChunks._positions})
    spans = tasks_layout("test_spans", lambda r, src, s: [BlockTask(
        slice(0, s), slice(0, s), False, spans=((0, 99, 0, 99, -5, 0),))] if src == r else [])
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64)  # (b, s, h, d)
    out = ringseq.simulate_ring(q, q, q, Loose(), 2, causal=True, backend="reference")[0]
    ref = ringseq.flash_attn_func(q, q, q, causal=True, backend="reference")
    assert float((out - ref).abs().max()) < 1e-12
    cases = [
        (TooLong(), True, ValueError, r"layout 'test_too_long': _tasks\(1, 0, 2, 8\) must return "
                                      r"tasks whose q and kv rows are slices of ints inside the "
                                      r"shard, \[0, 8\), got slice\(4, 12, None\)"),
        (Tuples(), True, ValueError, r"layout 'test_tuples': _tasks\(0, 0, 2, 8\) must return a "
                                     r"list of BlockTask, got a tuple"),
        (NoTasks(), True, NotImplementedError, r"layout 'test_no_tasks' \(.*NoTasks\) must "
                                               r"define _tasks\(rank, src, world_size, s_local\)"),
        (NoMultiple(), False, ValueError, r"layout 'test_no_multiple': multiple\(2\) must be a "
                                          r"positive int multiple of the world size, got 0"),
        (Twice(), True, ValueError, r"layout 'test_twice': _positions\(16, 2, rank\) over the "
                                    r"ranks must list every position"),
        (all_full(), True, ValueError, r"layout 'test_all_full': _tasks\(0, 0, 2, 8\) must return "
                                       r"tasks that give each query row the keys of rank 0's "
                                       r"shard at positions up to its own \(causal attention\) "
                                       r"exactly once, got tasks that give local row 0 "
                                       r"\(position 0\) 8 keys where it sees 1$"),
        (listed_twice(), True, ValueError, r"layout 'test_twice_listed': _tasks\(0, 0, 2, 8\) .* "
                                           r"local row 0 \(position 0\) 2 keys where it sees 1$"),
        (left_out(), True, ValueError, r"layout 'test_left_out': _tasks\(1, 0, 2, 8\) .* local "
                                       r"row 0 \(position 8\) 0 keys where it sees 8$"),
        (other_keys(), True, ValueError, r"layout 'test_other_keys': _tasks\(0, 0, 2, 8\) .* "
                                         r"local row 0 \(position 0\) 1 keys where it sees 1 "
                                         r"\(not those it sees\)$"),
        (positions_only(), True, ValueError, r"layout 'test_positions_only': _tasks\(0, 1, 2, 8\) "
                                            r".* local row 0 \(position 8\) 0 keys where it "
                                            r"sees 8$"),
        (spans(), True, ValueError, r"layout 'test_spans': _tasks\(0, 0, 2, 8\) must return tasks "
                                    r"without spans \(windows and documents are masks: pass "
                                    r"window_size or the documents\), got spans "
                                    r"\(\(0, 99, 0, 99, -5, 0\),\)$"),
    ]
    for layout, causal, kind, message in cases:
        with pytest.raises(kind, match="^simulate_ring: " + message):
            ringseq.simulate_ring(q, q, q, layout, 2, causal=causal, backend="reference")


def _ranks_given_different_parameters():
    import torch.distributed as dist
    from custom_layout import Rotated
    from utils import error_text
    rank = dist.get_rank()
    lay = Rotated(rank)  # rank 0: Rotated(0), rank 1: Rotated(1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64)  # (b, s, h, d)
    same = Rotated(1)
    ring = ringseq.ring_flash_attn_func(*(ringseq.shard(q, same),) * 3, layout=same)
    want = ringseq.shard(ringseq.flash_attn_func(q, q, q, backend="reference"), same)
    # equal layouts still pair: a copy of a used one, one edited after use (before, with the
    # code cached on the instance: RingMismatchError), one holding attributes of other kinds
    # (not compared; before: a dict or a meta tensor crashed the call)
    import copy
    used = Rotated(0)
    ringseq.unshard(ringseq.shard(q, used), used)
    edited = copy.copy(used) if rank == 0 else Rotated(1)
    edited.k = 1
    edited.table, edited.buffer = {"a": torch.float32, 1: "x"}, torch.empty(2, device="meta")

    def equal_layouts():
        out = ringseq.ring_flash_attn_func(*(ringseq.shard(q, edited),) * 3, layout=edited)
        return float((out - want).abs().max())
    return {"ring": error_text(lambda: ringseq.ring_flash_attn_func(
                *(ringseq.shard(q, lay),) * 3, layout=lay)),
            "unshard": error_text(lambda: ringseq.unshard(ringseq.shard(q, lay), lay)),
            "same parameters": float((ring - want).abs().max()),
            "equal layouts": equal_layouts(),
            "codes": (Rotated(0).code != Rotated(1).code, Rotated(1).code == same.code)}


def test_ranks_given_one_layout_class_with_different_parameters_raise_everywhere():
    """A user's layout compares its instance's parameters (``self.k``) across the ranks.
    Before: name and class only, and ranks given Rotated(0) and Rotated(1) got an unshard
    holding one chunk twice and ring outputs off by 1.19, without a word. The message shows
    every rank's layout, class and parameters (before: "layout #<hash>" per rank)."""
    shown = ("rank 0: rotated_test@custom_layout.Rotated(k=0), "
             "rank 1: rotated_test@custom_layout.Rotated(k=1)")
    for r in run_ranks(_ranks_given_different_parameters, 2):
        assert r["codes"] == (True, True), r
        for call in ("ring", "unshard"):
            assert r[call].startswith("RingMismatchError") and f"layout ({shown})" in r[call], \
                r[call]
        assert r["same parameters"] < 1e-12 and r["equal layouts"] < 1e-12, r


class _ReversedChunks(ringseq.layouts.Contiguous):
    """A user's layout written by subclassing a built-in: contiguous chunks in reverse rank
    order, its own ``_positions`` and ``_tasks``."""
    name = "test_reversed_chunks"

    def _positions(self, seqlen, world_size, rank):
        n = seqlen // world_size
        return torch.arange((world_size - 1 - rank) * n, (world_size - rank) * n)

    def _tasks(self, rank, src, world_size, s_local):
        if src == rank:
            return [BlockTask(slice(0, s_local), slice(0, s_local), True)]
        return [BlockTask(slice(0, s_local), slice(0, s_local), False)] if src > rank else []


class _StripeBackwards(ringseq.layouts.Zigzag):
    """A user's subclass of zigzag that places tokens as a stripe from the end: rank r holds
    positions s - 1 - r - W * i (its own ``_positions`` only; tasks refused, masks only)."""
    name = "test_stripe_backwards"

    def _positions(self, seqlen, world_size, rank):
        return torch.arange(seqlen - 1 - rank, -1, -world_size)


@pytest.mark.parametrize("layout", [_ReversedChunks(), _StripeBackwards()], ids=lambda l: l.name)
def test_a_subclass_of_a_built_in_layout_is_placed_by_its_own_positions(layout):
    """Runs, shard and unshard follow the subclass's ``_positions``, not the built-in's fast
    paths (before: the built-in's placement under the subclass's tasks, 2.33 off without a
    word), and the ring is exact under every mask it takes."""
    from masks_reference import global_mask, masked_attention
    s, w = 16, 4
    x = torch.arange(s)[None]  # (1, s)
    for r in range(w):
        pos = layout.positions(s, w, r)
        assert torch.equal(positions_local(s, layout, w, r), pos)
        assert torch.equal(ringseq.layouts.shard_local(x, layout, w, r)[0], pos)
        runs = layout.runs(s, w, r)
        assert [p for run in runs for p in range(run.start, run.start + run.length * run.stride,
                                                   run.stride)] == pos.tolist(), runs
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    masks = [(False, (-1, -1), None), (True, (3, -1), None), (False, (2, 2), None),
             (True, (-1, -1), (0, 5, 16))]
    if isinstance(layout, _ReversedChunks):
        masks.append((True, (-1, -1), None))  # (plain causal: the subclass's own tasks)
    for causal, window, cu in masks:
        out = ringseq.simulate_ring(q, k, v, layout, w, causal=causal, window_size=window,
                                    cu_seqlens=cu, backend="reference")[0]
        ref, _ = masked_attention(q, k, v, global_mask(s, s, causal, window, cu))
        assert float((out - ref).abs().max()) < 1e-12, (causal, window, cu)


def _edited_after_a_call(number: str):
    """A user's layout (compared by identity) used in a causal ring call at k=0, then edited
    to k=1 on every rank, then back to k=0 on rank 1 only, k a Python int, NumPy's int64 or a
    0-d NumPy array (``number``): (errors against float64 of the calls, the error text of the
    last)."""
    import numpy as np
    import torch.distributed as dist
    from custom_layout import RotatedCausal
    from utils import error_text
    kind = {"int": int, "numpy.int64": np.int64, "numpy 0-d array": np.array}[number]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    lay, errors = RotatedCausal(kind(0)), []
    for shift in (0, 1):
        lay.k = kind(shift)
        out = ringseq.ring_flash_attn_func(*(ringseq.shard(t, lay) for t in (q, k, v)),
                                           causal=True, layout=lay)
        want = ringseq.flash_attn_func(q, k, v, causal=True, backend="reference")
        errors.append(float((out - ringseq.shard(want, lay)).abs().max()))
    if dist.get_rank() == 1:
        lay.k = kind(0)
    return errors, error_text(lambda: ringseq.ring_flash_attn_func(
        *(ringseq.shard(t, lay) for t in (q, k, v)), causal=True, layout=lay))


@pytest.mark.parametrize("number", ["int", "numpy.int64", "numpy 0-d array"])
def test_a_layout_edited_after_a_call_is_planned_and_compared_by_its_new_values(number):
    """(before: the plan and schedules of its first call's values were kept: outputs off by
    2.41 without a word, and ranks holding k=1 and k=0 paired; with NumPy's int64 values, until
    they were compared as the ints they equal, still so: 2.38 off and no error)"""
    pytest.importorskip("numpy")
    for errors, text in run_ranks(_edited_after_a_call, 2, number):
        assert max(errors) < 1e-12, errors
        assert text.startswith("RingMismatchError") and (
            "layout (rank 0: rotated_causal_test@custom_layout.RotatedCausal(k=1), "
            "rank 1: rotated_causal_test@custom_layout.RotatedCausal(k=0))") in text, text


def _edited_in_a_double_ring():
    """:func:`_edited_after_a_call` through usp_attn_func's double ring (2 inner rings of 2)."""
    import torch.distributed as dist
    from custom_layout import RotatedCausal
    from utils import error_text
    sp = ringseq.make_sp_groups(1, 2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = ringseq.flash_attn_func(q, k, v, causal=True, backend="reference")
    lay, errors = RotatedCausal(0), []

    def call():
        return ringseq.usp_attn_func(*(sp.shard(t, lay) for t in (q, k, v)), causal=True,
                                     sp=sp, layout=lay)
    for shift in (0, 1):
        lay.k = shift
        errors.append(float((call() - sp.shard(want, lay)).abs().max()))
    if dist.get_rank() == 1:
        lay.k = 0
    return errors, error_text(call)


def test_a_layout_edited_after_a_double_ring_call_is_planned_by_its_new_values():
    """(before: the outer ring's plan, cached by the layout object, kept its first laps: 2.18
    off, and a rank edited alone paired)"""
    for errors, text in run_ranks(_edited_in_a_double_ring, 4, timeout=120):
        assert max(errors) < 1e-12, errors
        assert text.startswith("RingMismatchError") and "RotatedCausal(k=0)" in text, text


def test_a_copy_of_a_used_layout_edited_gets_its_own_schedule():
    """``copy.copy`` shares the instance's schedule cache (before: the copy edited to k=1 ran
    the schedule of k=0, 2.41 off); so do three world sizes in one process."""
    import copy

    from custom_layout import RotatedCausal
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    want = ringseq.flash_attn_func(q, k, v, causal=True, backend="reference")
    used = RotatedCausal(0)
    for w in (2, 3, 4):
        ringseq.simulate_ring(q, k, v, used, w, causal=True, backend="reference")
        edited = copy.copy(used)
        for shift in (1, 2):
            edited.k = shift
            out = ringseq.simulate_ring(q, k, v, edited, w, causal=True, backend="reference")[0]
            assert float((out - want).abs().max()) < 1e-12, (w, shift)


@pytest.mark.parametrize("layout, args, error", [
    ("zigzag", (8, 2, -1), "rank -1 is outside a world of size 2"),
    ("zigzag", (8, 2, 2), "rank 2 is outside a world of size 2"),
    ("zigzag", (7, 2, 0), "layout 'zigzag' with world size 2 needs a sequence length that is "
                          "a positive multiple of 4; got 7"),
    ("contiguous", (8, 0, 0), "world_size must be a positive int, got 0"),
    ("stripe", (8.0, 2, 0), "layout 'stripe': seqlen must be an int, got 8.0 (float)"),
    ("documents", (8, 2, -1), "rank -1 is outside a world of size 2"),
    ("documents", (8, 2, 2), "rank 2 is outside a world of size 2"),
    ("documents", (9, 2, 0), "layout 'documents' was built for a packed sequence of 8 "
                           "tokens (cu_seqlens), got 9"),
    ("documents_zigzag", (8, 2, -1), "rank -1 is outside a world of size 2"),
])
def test_runs_refuses_what_positions_refuses(layout, args, error):
    """``Layout.runs`` (public, and ``Documents(...).runs`` in the README): before, rank -1 gave
    rank W - 1's runs, rank W a bare IndexError, and zigzag's runs of length 7 left 3 tokens
    out."""
    from ringseq.layouts import Documents, DocumentsZigzag, get_layout
    docs = [0, 3, 8]
    lay = {"documents": Documents(docs), "documents_zigzag": DocumentsZigzag([0, 4, 8])}.get(
        layout) or get_layout(layout)
    with pytest.raises((ValueError, TypeError)) as info:
        lay.runs(*args)
    assert str(info.value).startswith(error), info.value
    with pytest.raises(type(info.value), match=re.escape(error)):
        lay.positions(*args)


def test_a_layout_field_shows_what_tells_layouts_apart():
    """What a mismatch shows for each rank's layout (exchanged between the ranks): a built-in
    layout's name; the plugin's documents layout (its code holds the boundaries) with its
    boundaries and code (a review's repro: shown as 'documents' on every rank); a user's
    layout by class and parameters, cut at 200 characters with its code (a first version
    showed two long layouts alike)."""
    from custom_layout import Rotated

    from ringseq.layouts import Documents, get_layout, layout_field
    assert layout_field("l", get_layout("zigzag"))[3] == "'zigzag'"
    docs = Documents([0, 8, 16])
    assert layout_field("l", docs, docs.code)[3] == \
        f"'documents' of documents (0, 8, 16) (code {docs.code})"
    assert layout_field("l", docs)[3] == "'documents'"  # (the ring compares them apart)
    long = [Rotated(1), Rotated(1)]
    for i, lay in enumerate(long):
        lay.table = tuple(range(100)) + (i,)
    texts = [layout_field("l", lay)[3] for lay in long]
    assert texts[0] != texts[1] and all(t.startswith("rotated_test@custom_layout.Rotated(k=1, "
                                                     "table=(0, 1, 2") for t in texts), texts
    assert all(t.endswith(f"...) (code {lay.code})") for t, lay in zip(texts, long)), texts


def test_a_backward_runs_its_forwards_layout_after_the_name_is_registered_again():
    """(before: the backward looked a registered layout up by name, and ran the plan of one
    registered under that name after the forward: wrong gradients, no error)"""
    from ringseq.layouts import BlockTask, Layout, register_layout

    class Causal(Layout):
        name = "test_registered_again"

        def _positions(self, seqlen, world_size, rank):
            n = seqlen // world_size
            return torch.arange(rank * n, (rank + 1) * n)

        def _tasks(self, rank, src, world_size, s):
            every = [BlockTask(slice(0, s), slice(0, s), src == rank)]
            return every if src <= rank else []

    class Full(Causal):  # the same name, another schedule
        def _tasks(self, rank, src, world_size, s):
            return [BlockTask(slice(0, s), slice(0, s), False)]

    q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))  # (b, s, h, d)
    try:
        register_layout(Causal())
        out = ringseq.ring_flash_attn_func(q, k, v, causal=True, layout=Causal.name)
        register_layout(Full())
        got = torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        LAYOUTS.pop(Causal.name, None)
    ref = ringseq.flash_attn_func(q, k, v, causal=True, backend="reference")
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    assert all(float((g - w).abs().max()) < 1e-12 for g, w in zip(got, want))


def test_layouts_that_share_a_name_are_told_apart_and_built_in_names_are_kept():
    """The ranks compare layouts by code: two classes that kept one name get different codes
    (before: equal codes, and ranks holding different layouts paired silently); a built-in
    name cannot be registered over, nor the base class's placeholder name."""
    from ringseq.layouts import Layout, register_layout

    class A(Layout):
        def _positions(self, seqlen, world_size, rank):
            n = seqlen // world_size
            return torch.arange(rank * n, (rank + 1) * n)

    class B(A):
        pass

    assert A().name == B().name and A().code != B().code
    from ringseq._hash import stable_code
    for name in NAMES:  # the built-in layouts' codes are their names' as before
        assert get_layout(name).code == stable_code(name)
    zig = type("zigzag_again", (A,), {"name": "zigzag"})()
    with pytest.raises(ValueError, match=r"^register_layout: 'zigzag' is a built-in layout"):
        register_layout(zig)
    assert LAYOUTS["zigzag"] is get_layout("zigzag")
    assert type(LAYOUTS["zigzag"]).__name__ == "Zigzag"
    with pytest.raises(ValueError, match=r"^register_layout: a layout's name must be .* got '\?'"):
        register_layout(A())


def test_what_is_not_a_hashable_layout_instance_is_refused_where_it_is_given():
    """(before: a class registered fine and failed at shard with a missing argument; a plain
    @dataclass layout sharded fine and failed in the ring call with weakref's 'unhashable
    type', naming no function; a multiple that is no multiple of W sharded fine and made
    unshard(shard(x)) fail)"""
    import dataclasses

    from ringseq.layouts import Layout, register_layout

    class Rev(Layout):
        name = "rev_demo"
        _positions = _ReversedWithinRank._positions

    with pytest.raises(TypeError, match=r"^register_layout: layout must be a "
                                        r"ringseq.layouts.Layout instance, got .*Rev'> \(type\) "
                                        r"\(a class: register an instance of it"):
        register_layout(Rev)

    @dataclasses.dataclass
    class Shifted(Rev):
        shift: int = 0

    for call in (lambda: register_layout(Shifted()),
                 lambda: ringseq.RingAttention(layout=Shifted())):
        with pytest.raises(TypeError, match=r"layout Shifted must be hashable \(its plans are "
                                            r"cached by it\).*frozen=True"):
            call()
    frozen = dataclasses.dataclass(frozen=True)(type("Frozen", (Rev,), {}))
    assert ringseq.RingAttention(layout=frozen()).layout == frozen()

    @dataclasses.dataclass(frozen=True)
    class Listed(Rev):
        cuts: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match=r"^RingAttention: layout Listed must be hashable .*"
                                        r"hash\(\) raised: unhashable type: 'list'"):
        ringseq.RingAttention(layout=Listed())

    class Thirds(Rev):
        def multiple(self, world_size):
            return 3

    with pytest.raises(ValueError, match=r"^shard: layout 'rev_demo': multiple\(2\) must be a "
                                         r"positive int multiple of the world size, got 3"):
        shard_local(torch.zeros(1, 6), Thirds(), 2, 0, fn="shard")
    # the kv-cache ring decode resolves layouts as the other entry points (before: a bare
    # "unhashable type" TypeError, and ZeroDivisionError for a multiple of 0)
    q, cache = torch.zeros(1, 1, 2, 8), torch.zeros(1, 8, 2, 8)

    class Nothing(Rev):
        def multiple(self, world_size):
            return 0

    with pytest.raises(TypeError, match=r"^ring_flash_attn_with_kvcache: layout Listed must be "
                                        r"hashable"):
        ringseq.ring_flash_attn_with_kvcache(q, cache, cache, 8, layout=Listed(), prefill_len=8)
    with pytest.raises(ValueError, match=r"^ring_flash_attn_with_kvcache: layout 'rev_demo': "
                                         r"multiple\(1\) must be a positive int multiple of the "
                                         r"world size, got 0"):
        ringseq.ring_flash_attn_with_kvcache(q, cache, cache, 8, layout=Nothing(), prefill_len=8)


def test_a_zigzag_shard_is_contiguous_whatever_the_inputs_strides():
    """(before: a (b, s, h, d) input whose sequence dim has stride 1 gave a strided shard)"""
    x = torch.randn(2, 4, 3, 8).permute(0, 3, 2, 1)  # (2, 8, 3, 4), strides (96, 1, 4, 12)
    part = shard_local(x, "zigzag", 2, 1)
    assert part.is_contiguous() and torch.equal(part, x[:, [2, 3, 4, 5]])


def test_what_the_new_layout_checks_still_take():
    """Valid uses the session's checks first refused (a regression hunt found them): a
    script's layout class on the launching process (module __main__) and on spawned ranks
    (__mp_main__) has one code; a NumPy world size; unshard on one process returns a length
    the user's layout cannot hold as it is, as the built-ins do; a built-in layout registered
    again as a fresh instance of its own class."""
    from ringseq.layouts import Layout, register_layout

    def script_class(module):
        return type("Rev", (Layout,), {"name": "rev", "__module__": module,
                                       "_positions": _ReversedWithinRank._positions,
                                       "multiple": lambda self, w: 2 * w})

    assert script_class("__main__")().code == script_class("__mp_main__")().code
    assert script_class("__main__")().code != script_class("my_module")().code
    np = pytest.importorskip("numpy")
    assert shard_local(torch.arange(8.0)[None], "zigzag", np.int64(2), 1).tolist() == [[2, 3, 4, 5]]
    odd = torch.arange(3.0)[None]  # (1, 3): no shard of a layout whose lengths are even
    assert ringseq.unshard(odd, script_class("my_module")()) is odd
    original = LAYOUTS["zigzag"]
    try:
        again = type(original)()
        assert register_layout(again) is again and LAYOUTS["zigzag"] is again
    finally:
        LAYOUTS["zigzag"] = original


def test_local_helpers_refuse_a_world_size_below_one():
    for call, fn in ((lambda: shard_local(torch.zeros(1, 4), "contiguous", 0, 0), "shard_local"),
                     (lambda: positions_local(4, "contiguous", 0, 0), "positions_local")):
        with pytest.raises(ValueError, match=rf"^{fn}: world_size must be a positive int, got 0"):
            call()
    with pytest.raises(ValueError, match=r"^unshard_local: unknown layout 'zigzg'"):
        unshard_local([torch.zeros(1, 4)] * 2, "zigzg")
    # a rank that is no int (before: 0.5 blamed the layout for a float32 result, True was 1)
    for rank, shown in ((0.5, r"0\.5 \(float\)"), (True, r"True \(bool\)")):
        with pytest.raises(TypeError, match=rf"^positions_local: rank must be an int, got "
                                            rf"{shown}"):
            positions_local(8, "contiguous", 2, rank)
        with pytest.raises(TypeError, match=r"^shard_local: rank must be an int"):
            shard_local(torch.zeros(1, 8), "zigzag", 2, rank)


def test_shard_is_differentiable_and_copies():
    x = torch.randn(1, 12, 2, requires_grad=True)
    part = shard_local(x, "zigzag", 3, 1)
    part.sum().backward()
    expected = torch.zeros(12)
    expected[positions_local(12, "zigzag", 3, 1)] = 1
    assert torch.equal(x.grad[0, :, 0], expected)
    # a shard never aliases the input, whatever the layout and world size
    before = x.detach().clone()
    for name in NAMES:
        for w in (1, 2, 3):
            shard_local(x.detach(), name, w, 0).add_(1)
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("name,w,bad,multiple", [
    ("zigzag", 4, 3820, 8), ("zigzag", 3, 100, 6), ("contiguous", 4, 3817, 4),
    ("stripe", 3, 100, 3), ("contiguous", 2, 0, 2)])
def test_length_errors_name_the_multiple(name, w, bad, multiple):
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        shard_local(torch.zeros(1, bad), name, w, 0)
    with pytest.raises(ValueError, match=f"multiple of {multiple}"):
        positions_local(bad, name, w, 0)


def test_local_length_check_and_unknown_layout():
    get_layout("zigzag").check_local_seqlen(10, 4)
    with pytest.raises(ValueError, match="multiple of 2"):
        get_layout("zigzag").check_local_seqlen(9, 4)
    with pytest.raises(ValueError, match="unknown layout"):
        get_layout("spiral")
    with pytest.raises(ValueError, match="rank 3 is outside"):
        shard_local(torch.zeros(1, 6), "contiguous", 3, 3)


def test_sharding_errors_name_the_function():
    """The layout's own errors come with the public function's name (before: "unknown layout
    'bogus' ..." from shard, unshard and positions alike, and an AttributeError from
    shard_batch for a batch that is not a mapping)."""
    import ringseq
    x = torch.zeros(1, 8, 2, 4)
    for fn, call in (("shard", lambda: ringseq.shard(x, "bogus")),
                     ("unshard", lambda: ringseq.unshard(x, "bogus")),
                     ("positions", lambda: ringseq.positions(8, "bogus"))):
        with pytest.raises(ValueError, match=rf"^{fn}: unknown layout 'bogus'"):
            call()
    with pytest.raises(ValueError, match=r"^shard: layout 'zigzag' .* got 7"):
        ringseq.shard(x[:, :7], "zigzag")
    with pytest.raises(TypeError, match=r"^positions: layout 'contiguous': seqlen must be an int"):
        ringseq.positions(8.0)
    with pytest.raises(TypeError, match=r"^shard_batch: batch must be a mapping .* got list"):
        ringseq.shard_batch([torch.zeros(1, 8, dtype=torch.long)])


@pytest.mark.parametrize("key, value", [
    ("labels", torch.zeros(3, 8, dtype=torch.long)),  # another batch size
    ("labels", torch.zeros(2, 8, 5, dtype=torch.long)),  # another rank
    ("attention_mask", torch.ones(3, 8)),
    ("token_type_ids", torch.zeros(2, 8, 1, dtype=torch.long)),
    ("position_ids", torch.arange(8).repeat(3, 1)),  # neither (b, s) nor (1, s)
])
def test_shard_batch_refuses_tensors_of_another_batch_or_rank(key, value):
    """(before: only the sequence dim was checked, so a (3, 8) labels beside (2, 8) input_ids
    came back as (3, 4) shift_labels and failed in the loss, naming the logits)"""
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"^shard_batch: batch\['{key}'\] must have shape "
                                         rf"\(2, 8\)(?: or \(1, 8\))? \(batch 2 and sequence "
                                         rf"length 8 from batch\['input_ids'\]\), got a "
                                         rf"torch.Tensor of shape "
                                         rf"{re.escape(str(tuple(value.shape)))}"):
        ringseq.shard_batch({"input_ids": ids, key: value}, layout="contiguous")
    # what is right passes: (1, s) position ids broadcast over the batch
    out = ringseq.shard_batch({"input_ids": ids, "position_ids": torch.arange(8)[None],
                               "labels": ids, "attention_mask": torch.ones(2, 8)})
    assert out["shift_labels"].shape == (2, 8) and out["position_ids"].shape == (2, 8)


def test_shard_batch_gives_int64_targets_and_positions_whatever_their_dtype():
    """As documented: ``shift_labels`` and ``position_ids`` (b, s // W) int64 (before: the
    given dtype, and uint8 labels turned the "no target" -100 into class 156 at every
    document's end)."""
    ids = torch.tensor([[10, 20, 30, 40, 50, 60, 70, 80]])
    out = ringseq.shard_batch({"input_ids": ids, "labels": ids.to(torch.uint8),
                               "cu_seq_lens_q": torch.tensor([0, 4, 8], dtype=torch.int32)},
                              layout="contiguous")
    assert out["shift_labels"].dtype == torch.int64
    assert out["shift_labels"].tolist() == [[20, 30, 40, -100, 60, 70, 80, -100]]
    two = ids.repeat(2, 1)
    out = ringseq.shard_batch({"input_ids": two, "shift_labels": two.to(torch.int32),
                               "position_ids": torch.arange(8, dtype=torch.int32)[None]})
    assert out["shift_labels"].dtype == out["position_ids"].dtype == torch.int64
    assert out["position_ids"].tolist() == [list(range(8))] * 2
    halves = torch.arange(8) / 2  # (fractional positions are kept as given)
    out = ringseq.shard_batch({"input_ids": ids, "position_ids": halves[None]})
    assert torch.equal(out["position_ids"], halves[None])
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(ValueError, match=rf"^shard_batch: batch\['labels'\] must hold "
                                             rf"integer class ids \(int64\), got dtype "
                                             rf"{dtype}"):
            ringseq.shard_batch({"input_ids": ids, "labels": ids.to(dtype)})


@pytest.mark.parametrize("batch, kwargs, kind, message", [
    # (before: True / 0.5 became class 1 / 0 at every sequence's end, a real target)
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long),
      "labels": torch.zeros(2, 8, dtype=torch.long)},
     {"ignore_index": True}, TypeError,
     "shard_batch: ignore_index must be an int, got True (bool)"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long)},
     {"ignore_index": -100.7}, TypeError, "shard_batch: ignore_index must be an int, got -100.7"),
    # (before: a tokenizer's (1, s) rows collated to (2, 1, 8) were blamed on the length, 1)
    ({"input_ids": torch.zeros(2, 1, 8, dtype=torch.long)}, {}, ValueError,
     "shard_batch: batch['input_ids'] must be a tensor of shape (b, s) (a batch dimension "
     "first), got a torch.Tensor of shape (2, 1, 8)"),
    # (before: torch's "cannot reshape tensor of 0 elements")
    ({"input_ids": torch.zeros(1, 0, dtype=torch.long), "position_ids": torch.zeros(1, 0)}, {},
     ValueError, "shard_batch: batch['input_ids'] holds no tokens (shape (1, 0))"),
    # (before: float ids were sharded and failed in the model's embedding)
    ({"input_ids": torch.zeros(1, 8)}, {}, ValueError,
     "shard_batch: batch['input_ids'] must hold integer token ids (int64), got dtype "
     "torch.float32"),
    # (before: the caller's shift_labels were replaced by the shifted labels without a word)
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8).long(),
      "shift_labels": torch.full((1, 8), 7)}, {}, ValueError,
     "shard_batch: the batch has both 'labels' and 'shift_labels'; give 'labels'"),
    # (before: 0.5 passed as "no padding")
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.full((1, 8), .5)},
     {}, ValueError, "shard_batch: attention_mask must hold 0 (padding) and 1 (tokens), got "
                     "other values, e.g. 0.5"),
])
def test_shard_batch_refuses_an_ignore_index_or_ids_it_would_misread(batch, kwargs, kind,
                                                                      message):
    with pytest.raises(kind, match="^" + re.escape(message)):
        ringseq.shard_batch(batch, **kwargs)


def test_without_process_group_world_size_is_one():
    x = torch.randn(2, 10, 3)
    assert torch.equal(ringseq.shard(x, "zigzag"), x)
    assert torch.equal(ringseq.unshard(x, "stripe"), x)
    assert torch.equal(ringseq.positions(10, "zigzag"), torch.arange(10))
    with pytest.raises(ValueError, match="multiple of 2"):
        ringseq.shard(torch.zeros(1, 7), "zigzag")


def _block_visible(t: BlockTask, n_q: int, n_k: int) -> torch.Tensor:
    """(n_q, n_k) bool: which pairs of the block task are computed (bottom-right causal)."""
    i = torch.arange(n_q)[:, None]
    j = torch.arange(n_k)[None, :]
    return (j <= i + (n_k - n_q)) if t.causal else torch.ones(n_q, n_k, dtype=torch.bool)


def _coverage(layout, w, s, causal):
    """Counts how often each global (query, key) pair is computed by the schedule."""
    lay = get_layout(layout)
    count = torch.zeros(s, s, dtype=torch.int64)
    pos = [positions_local(s, lay, w, r) for r in range(w)]
    s_local = s // w
    for r in range(w):
        steps = lay.schedule(r, w, s_local, causal)
        assert len(steps) == w
        for i, tasks in enumerate(steps):
            src = (r - i) % w
            for t in tasks:
                qpos = pos[r][t.q]
                kpos = pos[src][t.kv]
                vis = _block_visible(t, len(qpos), len(kpos))
                qq, kk = torch.nonzero(vis, as_tuple=True)
                count.index_put_((qpos[qq], kpos[kk]), torch.ones_like(qq), accumulate=True)
    return count


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("w", WORLD_SIZES)
@pytest.mark.parametrize("causal", [True, False])
def test_schedule_covers_mask_exactly_once(name, w, causal):
    for s in _lengths(name, w)[:2]:
        count = _coverage(name, w, s, causal)
        if causal:
            expected = torch.tril(torch.ones(s, s, dtype=torch.int64))
        else:
            expected = torch.ones(s, s, dtype=torch.int64)
        assert torch.equal(count, expected), f"{name} W={w} s={s} causal={causal}"


@pytest.mark.parametrize("w", [2, 4, 8])
def test_causal_work_balance(w):
    """zigzag balances causal work exactly; contiguous does not (what zigzag is for)."""
    s = 2 * w * 16

    def work(name, r):
        lay = get_layout(name)
        total = 0
        for tasks in lay.schedule(r, w, s // w, True):
            for t in tasks:
                n_q = len(range(*t.q.indices(s // w)))
                n_k = len(range(*t.kv.indices(s // w)))
                total += int(_block_visible(t, n_q, n_k).sum())
        return total

    zig = [work("zigzag", r) for r in range(w)]
    con = [work("contiguous", r) for r in range(w)]
    stripe = [work("stripe", r) for r in range(w)]
    assert max(zig) == min(zig)
    assert max(con) > 1.5 * min(con)
    assert max(stripe) - min(stripe) <= (s // w) * (w - 1)


def test_custom_layout_is_data():
    """A new layout is a Layout subclass (here: contiguous in reverse rank order), no new loop."""

    from custom_layout import ReversedContiguous

    lay = ReversedContiguous()
    for w in (2, 3):
        count = _coverage(lay, w, 6 * w, True)
        assert torch.equal(count, torch.tril(torch.ones(6 * w, 6 * w, dtype=torch.int64)))
        q = torch.randn(1, 6 * w, 2, 8, dtype=torch.float64)
        k, v = torch.randn_like(q), torch.randn_like(q)
        out, lse = ringseq.simulate_ring(q, k, v, lay, w, causal=True, backend="reference")
        ref, ref_lse = ringseq.flash_attn_func(q, k, v, causal=True, return_lse=True,
                                               backend="reference")
        assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)
    assert "reversed_test" not in LAYOUTS


# ---------------------------------------------------------------- windows and documents
from ringseq.masks import AttnMask  # noqa: E402


def _visible(mask: AttnMask, s: int) -> torch.Tensor:
    """(s, s) int64: the brute-force global mask (1 where key j is visible to query i)."""
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    left, right = mask.window
    vis = torch.ones(s, s, dtype=torch.bool)
    if mask.causal:
        vis &= j <= i
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    if mask.cu_seqlens is not None:
        doc = torch.bucketize(torch.arange(s), torch.tensor(mask.cu_seqlens[1:]), right=True)
        vis &= doc[:, None] == doc[None, :]
    return vis.long()


def _coverage_masked(layout, w, s, mask):
    """Counts how often each global pair is computed by the (span) schedule of ``mask``;
    also checks that every batch's spans have disjoint q rows and disjoint kv rows."""
    lay = get_layout(layout)
    count = torch.zeros(s, s, dtype=torch.int64)
    pos = [positions_local(s, lay, w, r) for r in range(w)]
    s_local = s // w
    for r in range(w):
        for i, tasks in enumerate(lay.schedule(r, w, s_local, mask)):
            src = (r - i) % w
            for t in tasks:
                qpos, kpos = pos[r][t.q], pos[src][t.kv]
                spans = t.spans or [(0, len(qpos), 0, len(kpos),
                                     -(len(qpos) - 1),
                                     len(kpos) - len(qpos) if t.causal else len(kpos) - 1)]
                qrows, krows = set(), set()
                for q0, nq, k0, nk, lo, hi in spans:
                    assert not (qrows & set(range(q0, q0 + nq))), "q rows overlap in a task"
                    assert not (krows & set(range(k0, k0 + nk))), "kv rows overlap in a task"
                    qrows |= set(range(q0, q0 + nq))
                    krows |= set(range(k0, k0 + nk))
                    a = torch.arange(nq)[:, None]
                    b = torch.arange(nk)[None, :]
                    vis = (b - a >= lo) & (b - a <= hi)
                    qq, kk = torch.nonzero(vis, as_tuple=True)
                    count.index_put_((qpos[q0 + qq], kpos[k0 + kk]), torch.ones_like(qq),
                                     accumulate=True)
    return count


MASKS = [AttnMask(causal=True, window=(0, -1)), AttnMask(causal=True, window=(5, -1)),
         AttnMask(causal=False, window=(3, 2)), AttnMask(causal=True, window=(17, -1)),
         AttnMask(causal=False, cu_seqlens=(0, 1, 3, 20, 24)),
         AttnMask(causal=True, cu_seqlens=(0, 1, 3, 20, 24)),
         AttnMask(causal=True, window=(4, -1), cu_seqlens=(0, 7, 24))]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_masked_schedule_covers_the_mask_exactly_once(name, w, mask):
    s = 24 if 24 % get_layout(name).multiple(w) == 0 else 2 * get_layout(name).multiple(w) * 3
    if mask.cu_seqlens is not None and mask.cu_seqlens[-1] != s:
        mask = AttnMask(mask.causal, mask.window, mask.cu_seqlens[:-1] + (s,))
    assert torch.equal(_coverage_masked(name, w, s, mask), _visible(mask, s)), (name, w, mask)


def test_schedule_cache_keeps_the_recent_masks_only():
    """A packed batch brings new cu_seqlens at every step: a long run must not grow a shared
    layout's cache without bound, and a schedule computed again after it was dropped is the
    same."""
    from ringseq.layouts.base import SCHEDULE_CACHE_ENTRIES
    lay = get_layout("zigzag")
    first = AttnMask(causal=True, cu_seqlens=(0, 1, 32))
    want = (lay.schedule(1, 2, 16, first), lay.hops(2, 16, first), lay.kv_rows(2, 16, first))
    for cut in range(2, 32):
        for w in range(2, 12):
            mask = AttnMask(causal=True, cu_seqlens=(0, cut, 32))
            lay.schedule(0, 2, 16, mask)
            lay.hops(2, 16, AttnMask(causal=True, window=(w, -1), cu_seqlens=(0, cut, 32)))
    assert len(lay.__dict__["_schedules"]) <= SCHEDULE_CACHE_ENTRIES
    assert (lay.schedule(1, 2, 16, first), lay.hops(2, 16, first),
            lay.kv_rows(2, 16, first)) == want


def test_short_window_needs_one_hop_on_contiguous_shards():
    lay = get_layout("contiguous")
    for w in (2, 3, 4, 8):
        assert lay.hops(w, 64, AttnMask(causal=True, window=(63, -1))) == 1
        assert lay.hops(w, 64, AttnMask(causal=True, window=(64, -1))) == 1
        assert lay.hops(w, 64, AttnMask(causal=True, window=(65, -1))) == min(2, w - 1)
        assert lay.hops(w, 64, AttnMask(causal=True)) == w - 1


@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("docs", [(1, 2, 17, 4), (24,), (1,) * 24, (5, 1, 1, 17)])
@pytest.mark.parametrize("causal", [True, False])
def test_documents_layout_is_exact_and_balanced(w, docs, causal):
    """Any document lengths (1 included), only the total divisible by W: every rank holds
    total / W tokens, and the schedule computes exactly the block-diagonal mask."""
    from ringseq.layouts import Documents
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    lay = Documents(cu)
    s = cu[-1]
    if s % w:
        pytest.skip("total not divisible by W")
    parts = [positions_local(s, lay, w, r) for r in range(w)]
    assert all(len(p) == s // w for p in parts)
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(s))
    x = torch.randn(2, s, 3)
    assert torch.equal(unshard_local([shard_local(x, lay, w, r) for r in range(w)], lay), x)
    mask = lay.mask(causal)
    assert torch.equal(_coverage_masked(lay, w, s, causal), _visible(mask, s))
