"""Sliding windows, soft-capping and packed documents through the ring engine.

In-process (``ringseq.simulate_ring``: the very plan and loops of the distributed ring, ranks
as threads) against float64 attention over the whole sequence with the global mask
(``masks_reference.masked_attention``), for every layout, world sizes 1-8, windows from 0 to
longer than the sequence, causal and not, GQA, odd lengths and document mixes; the block
kernel is ``DenseSpanBackend`` (the span contract by dense math) so that these tests check the
schedules, hops and exchange counts on their own. The optimized kernels are checked against
the same oracle in tests/test_kernel_cpu.py; the spawned multi-rank checks are in
tests/test_masked_ring.py.
"""
from __future__ import annotations

import functools
import random
import re

import pytest
import torch

import ringseq
from ringseq.layouts import Documents, get_layout
from ringseq.masks import AttnMask

from masks_reference import DenseSpanBackend, global_mask, masked_attention
from utils import max_err

DENSE = DenseSpanBackend()
LAYOUTS = ["contiguous", "zigzag", "stripe"]


def _qkv(seed, b, s, h, h_kv, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, n, d, generator=g, dtype=dtype) for n in (h, h_kv, h_kv, h)]


def _reference(q, k, v, dout, mask, softcap=0.0):
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = masked_attention(qd, kd, vd, mask, softcap=softcap)
    out.backward(dout)
    return [out.detach(), lse.detach(), qd.grad, kd.grad, vd.grad]


def _check(got, want, tol=1e-10):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert max_err(a, b) < tol, (name, max_err(a, b))


def _length(layout, w, k):
    return get_layout(layout).multiple(w) * k + (0 if layout == "zigzag" else 0)


WINDOWS = [0, 1, 17, "s_local-1", "s_local", "3s_local+5", -1]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_windows_every_layout_and_world_size(layout, w, causal):
    mult = get_layout(layout).multiple(w)
    s = mult * (5 if mult < 8 else 3)  # never a power of two
    s_local = s // w
    for i, win in enumerate(WINDOWS):
        left = {"s_local-1": s_local - 1, "s_local": s_local, "3s_local+5": 3 * s_local + 5}.get(
            win, win)
        window = (left, -1 if causal else min(left, 3) if left >= 0 else -1)
        q, k, v, dout = _qkv(10 * i + w, 2, s, 4, 2)
        got = ringseq.simulate_ring(q, k, v, layout, w, causal, backend=DENSE, dout=dout,
                                    window_size=window)
        want = _reference(q, k, v, dout, global_mask(s, s, causal, window))
        _check(got, want)


class _ZigzagWithoutRuns(ringseq.layouts.Layout):
    """zigzag's placement and tasks without its ``runs``: the generic runs then differ in
    stride between ranks (rank 0 of W = 2 at s = 4 holds positions 0 and 3, rank 1 holds 1 and
    2), as a user's layout that defines only positions and tasks would."""
    name = "zigzag_without_runs_test"
    multiple = ringseq.layouts.Zigzag.multiple
    _positions = ringseq.layouts.Zigzag._positions
    _tasks = ringseq.layouts.Zigzag._tasks


class _HalfStriped(ringseq.layouts.Layout):
    """First half striped over the ranks, second half in contiguous chunks: runs of stride W
    and of stride 1 on every rank."""
    name = "half_striped_test"

    def multiple(self, world_size):
        return 2 * world_size

    def _positions(self, seqlen, world_size, rank):
        half = seqlen // 2
        n = half // world_size
        return torch.cat([torch.arange(rank, half, world_size),
                          torch.arange(half + rank * n, half + (rank + 1) * n)])

    def _tasks(self, rank, src, world_size, s_local):  # only masked schedules are used here
        raise NotImplementedError


@pytest.mark.parametrize("layout", [_ZigzagWithoutRuns(), _HalfStriped()], ids=lambda l: l.name)
@pytest.mark.parametrize("w", [2, 4])
def test_custom_layouts_runs_of_different_strides_under_masks(layout, w):
    """A window or document mask on a layout whose ranks' runs have different strides: the
    pairs between such runs are computed too (one query row at a time), exactly."""
    s = layout.multiple(w) * 3
    q, k, v, dout = _qkv(w, 1, s, 2, 1)
    for window, cu in (((5, -1), None), ((-1, -1), [0, s]), ((-1, -1), [0, 5, s])):
        got = ringseq.simulate_ring(q, k, v, layout, w, True, backend=DENSE, dout=dout,
                                    window_size=window, cu_seqlens=cu)
        _check(got, _reference(q, k, v, dout, global_mask(s, s, True, window, cu_seqlens=cu)))


def test_softcap_with_windows():
    for layout, w in (("contiguous", 4), ("zigzag", 2), ("stripe", 3)):
        s = get_layout(layout).multiple(w) * 4
        q, k, v, dout = _qkv(7, 1, s, 4, 1)
        q = q * 3  # large logits: the cap matters
        for cap in (5.0, 50.0):
            got = ringseq.simulate_ring(q, k, v, layout, w, True, backend=DENSE, dout=dout,
                                        window_size=(5, -1), softcap=cap)
            _check(got, _reference(q, k, v, dout, global_mask(s, s, True, (5, -1)), cap))


@pytest.mark.parametrize("w", [2, 3, 4, 8])
def test_short_windows_move_less(w):
    """Contiguous shards, window < s_local: one forward hop instead of W-1, and the block
    carries only the keys the next rank's queries see (the last `left` rows), so the own
    block's dK/dV accumulator need not travel either: 1 forward exchange, 2 backward ones
    (the accumulator's hop out with the K/V of no later step, and home). A window of a whole
    shard needs every row: the plain one-hop schedule, 3 backward exchanges."""
    s_local = 12
    s = s_local * w
    q, k, v, dout = _qkv(3, 1, s, 2, 2)
    lay = get_layout("contiguous")
    for left, fwd, bwd, rows in ((s_local - 1, 1, 2, (1, s_local)), (5, 1, 2, (s_local - 5, s_local)),
                                 (s_local, 1, 3, None)):
        ex = []
        got = ringseq.simulate_ring(q, k, v, "contiguous", w, True, backend=DENSE, dout=dout,
                                    window_size=(left, -1), exchanges=ex)
        _check(got, _reference(q, k, v, dout, global_mask(s, s, True, (left, -1))))
        assert ex == [(fwd, bwd)] * w, (left, ex)
        kv_rows = lay.kv_rows(w, s_local, AttnMask(causal=True, window=(left, -1)))
        if rows is None:
            assert kv_rows is None
        else:  # every shard but the last (whose keys no later rank sees) sends `rows`
            assert kv_rows == ((rows,),) * (w - 1) + ((),), kv_rows
    ex = []
    ringseq.simulate_ring(q, k, v, "contiguous", w, True, backend=DENSE, dout=dout,
                          exchanges=ex)
    assert ex == [(w - 1, w + 1)] * w  # the full lap without a window
    # zigzag spreads every window over the whole ring: no saving (why contiguous is the
    # layout for short windows)
    ex = []
    ringseq.simulate_ring(q, k, v, "zigzag", w, True, backend=DENSE, dout=dout,
                          window_size=(s_local - 1, -1), exchanges=ex)
    assert ex[0][0] == w - 1


DOC_MIXES = [(1, 2, 17, 255, 37), (3816,), (1,) * 40, (17, 1, 1, 2, 96, 3), (255, 1)]


@pytest.mark.parametrize("docs", DOC_MIXES, ids=lambda d: f"{len(d)}docs-{sum(d)}")
@pytest.mark.parametrize("w", [1, 2, 3, 4, 8])
def test_documents_layout_exact(docs, w):
    total = sum(docs)
    total -= total % w  # the Documents layout needs the total divisible by W: trim the last
    lens = list(docs)
    while sum(lens) > total:
        lens[-1] -= min(lens[-1], sum(lens) - total)
        if lens[-1] == 0:
            lens.pop()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cu[-1] == 0:
        pytest.skip("nothing left")
    for causal in (True, False):
        q, k, v, dout, want = _documents_case(tuple(cu), causal)
        got = ringseq.simulate_ring(q, k, v, Documents(cu), w, causal, backend=DENSE,
                                    dout=dout)
        _check(got, want)


@functools.lru_cache(maxsize=16)
def _documents_case(cu, causal):
    """Inputs and float64 reference of one document mix, shared by the world sizes that keep
    the same total (the reference at 3,816 tokens takes seconds; every W divides 3,816)."""
    total = cu[-1]
    heavy = total > 1000
    q, k, v, dout = _qkv(total, 1, total, 2 if heavy else 4, 1 if heavy else 2,
                         d=4 if heavy else 8)
    return q, k, v, dout, _reference(q, k, v, dout, global_mask(total, total, causal,
                                                                cu_seqlens=list(cu)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_documents_on_other_layouts(layout):
    """The document mask is exact on every layout (only balance differs)."""
    w = 4
    s = get_layout(layout).multiple(w) * 6
    cu = [0, 1, 18, 19, s - 5, s]
    q, k, v, dout = _qkv(5, 1, s, 4, 2)
    got = ringseq.simulate_ring(q, k, v, layout, w, True, backend=DENSE, dout=dout,
                                cu_seqlens=cu, window_size=(7, -1))
    _check(got, _reference(q, k, v, dout, global_mask(s, s, True, (7, -1), cu)))


def test_property_random_document_mixes():
    rng = random.Random(0)
    for trial in range(12):
        w = rng.choice([2, 3, 4])
        lens = [rng.choice([1, 2, 3, 7, 17, 40]) for _ in range(rng.randint(1, 8))]
        total = sum(lens) + (-sum(lens)) % w
        lens[-1] += total - sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        causal = rng.random() < 0.7
        window = rng.choice([(-1, -1), (rng.randint(0, 9), -1 if causal else rng.randint(0, 9))])
        q, k, v, dout = _qkv(trial, 1, total, 2, 1)
        got = ringseq.simulate_ring(q, k, v, Documents(cu), w, causal, backend=DENSE,
                                    dout=dout, window_size=window)
        _check(got, _reference(q, k, v, dout, global_mask(total, total, causal, window, cu)))


@pytest.mark.parametrize("w", [2, 4, 8])
def test_documents_balance_visible_work(w):
    """Per-rank visible causal pairs, max / mean, for seeded mixes and long tails; and how
    many documents the layout keeps whole (it splits only as many as balance needs)."""
    from ringseq.layouts import positions_local
    rng = random.Random(3 + w)
    mixes = {"seeded": [rng.randint(200, 4000) for _ in range(8)],
             "long tail": [8192] + [rng.randint(16, 300) for _ in range(40)]}
    for t in range(4):
        mixes[f"random {t}"] = [rng.randint(1, 3000) for _ in range(rng.randint(3, 30))]
    for name, lens in mixes.items():
        total = sum(lens) + (-sum(lens)) % w
        lens[-1] += total - sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        lay = Documents(cu)
        work, whole = [], 0
        for r in range(w):
            pos = positions_local(total, lay, w, r)
            assert pos.numel() == total // w
            starts = torch.tensor(cu[:-1])
            doc = torch.bucketize(pos, starts, right=True) - 1
            work.append(int((pos - starts[doc] + 1).sum()))  # keys each query sees (causal)
            whole += sum(1 for run in lay.runs(total, w, r)
                         if any(a == run.start and b - a == run.length
                                for a, b in zip(cu, cu[1:])))
        ratio = max(work) / (sum(work) / w)
        assert ratio <= 1.05, (name, w, round(ratio, 4), work)
        if name == "long tail":  # the one long document is split, the short ones stay whole
            assert whole >= len(lens) - 1 - w, (name, w, whole)


@pytest.mark.parametrize("w", [2, 4])
def test_documents_blocks_carry_only_what_other_ranks_see(w):
    """With most documents whole, a K/V block carries only the rows of documents that other
    ranks also hold (split or cut ones), and the ring stays exact."""
    lens = [350, 45, 60, 30, 1500, 22, 100, 40, 1150, 16, 75, 35]
    total = sum(lens) + (-sum(lens)) % w
    lens[-1] += total - sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    lay, s_local = Documents(cu), total // w
    kv_rows = lay.kv_rows(w, s_local, True)
    carried_rows = [sum(b - a for a, b in m) for m in kv_rows]
    assert max(carried_rows) < s_local and min(carried_rows) < s_local / 2, carried_rows
    docs_of = []  # per rank: document index of every local row
    starts = torch.tensor(cu[:-1])
    for r in range(w):
        pos = ringseq.layouts.positions_local(total, lay, w, r)
        docs_of.append(torch.bucketize(pos, starts, right=True) - 1)
    for r in range(w):
        shared = {int(d) for o in range(w) if o != r for d in docs_of[o]}
        carried = torch.zeros(s_local, dtype=torch.bool)
        for a, b in kv_rows[r]:
            carried[a:b] = True
        for row in range(s_local):  # a carried row belongs to a document another rank holds
            if carried[row]:
                assert int(docs_of[r][row]) in shared, (r, row)
    q, k, v, dout = _qkv(7, 1, total, 2, 1, d=4)
    ex = []
    got = ringseq.simulate_ring(q, k, v, lay, w, True, backend=DENSE, dout=dout, exchanges=ex)
    _check(got, _reference(q, k, v, dout, global_mask(total, total, True, cu_seqlens=cu)))


def test_bad_cu_seqlens_raise():
    q, k, v, _ = _qkv(0, 1, 12, 2, 2)
    with pytest.raises(ValueError, match="never decrease"):
        ringseq.simulate_ring(q, k, v, "contiguous", 2, True, backend=DENSE,
                              cu_seqlens=[0, 8, 4, 12])
    with pytest.raises(ValueError, match="GLOBAL document boundaries"):
        ringseq.simulate_ring(q, k, v, "contiguous", 2, True, backend=DENSE,
                              cu_seqlens=[0, 4, 10])
    with pytest.raises(ValueError, match="multiple of 2"):
        ringseq.simulate_ring(q[:, :11], k[:, :11], v[:, :11], Documents([0, 5, 11]), 2, True,
                              backend=DENSE)
    with pytest.raises(ValueError, match="window_size"):
        ringseq.ring_flash_attn_func(q, k, v, window_size=(-3, 0))


class _MyDocuments(Documents):
    """A user's subclass of Documents that keeps its code."""

    name = "my_documents"


def _documents_that_differ():
    import torch.distributed as dist

    from utils import error_text
    r = dist.get_rank()
    q = torch.randn(12, 2, 8, generator=torch.Generator().manual_seed(0))  # (s_local, h, d)
    return {
        # the default layout ("documents") on both ranks, other boundaries on rank 1
        "boundaries": error_text(lambda: ringseq.ring_flash_attn_varlen_func(
            q, q, q, [0, 10, 24] if r == 0 else [0, 11, 24], causal=True)),
        # the same boundaries, another documents layout on rank 1
        "layouts": error_text(lambda: ringseq.ring_flash_attn_varlen_func(
            q, q, q, [0, 10, 24], causal=True, layout=None if r == 0 else "documents_contiguous")),
        # a user's subclass, other boundaries on rank 1 (with its attributes compared in its
        # code, the boundaries appeared a second time as a layout difference)
        "subclass": error_text(lambda: ringseq.ring_flash_attn_func(
            q[None], q[None], q[None], causal=True,
            layout=_MyDocuments([0, 10, 24] if r == 0 else [0, 11, 24]))),
    }


def test_a_documents_mismatch_names_the_boundaries_and_the_layouts():
    """(Before: both showed "layout #<hash>" per rank, and differing boundaries were also
    reported as a layout difference that no rank made.)"""
    from dist_utils import run_ranks
    for res in run_ranks(_documents_that_differ, 2, timeout=120, env={"RINGSEQ_TIMEOUT": "20"}):
        assert res["boundaries"].startswith("RingMismatchError"), res
        assert "documents (cu_seqlens) (rank 0: [0, 10, 24]" in res["boundaries"], res
        assert "layout" not in res["boundaries"].split("different arguments:")[1].split(".")[0], res
        assert "layout (rank 0: 'documents', rank 1: 'documents_contiguous')" in res["layouts"], res
        assert "#" not in res["layouts"], res
        mine = res["subclass"]
        assert mine.startswith("RingMismatchError") and "[0, 11, 24]" in mine, res
        assert "layout" not in mine.split("different arguments:")[1].split(".")[0], res


class _ShiftedContiguous(ringseq.layouts.DocumentsContiguous):
    """A user's documents layout with a parameter of its own in its code (as Layout.code asks):
    rank r holds chunk (r + shift) % W of each document."""

    def __init__(self, cu, shift):
        super().__init__(cu)
        self.shift = shift

    def chunks(self, rank, world_size):
        return ((rank + self.shift) % world_size,)

    @property
    def code(self):
        from ringseq._hash import stable_code
        return stable_code(f"{self.name}{self.cu_seqlens}shift={self.shift}")


def _shifted_documents():
    import torch.distributed as dist

    from utils import error_text
    r, w = dist.get_rank(), dist.get_world_size()
    lay = _ShiftedContiguous([0, 16, 32], r)  # other shifts on the two ranks
    q = torch.randn(1, 32, 2, 8, generator=torch.Generator().manual_seed(0))  # (b, s, h, d)
    part = q[:, lay.positions(32, w, r)]
    return error_text(lambda: ringseq.ring_flash_attn_func(part, part, part, layout=lay))


def test_a_documents_layout_with_parameters_of_its_own_is_compared_whole():
    """The signature names a documents layout by kind only where its code is the boundaries'
    (a review's repro: a subclass whose code adds a shift paired silently, errors of 1.42)."""
    from dist_utils import run_ranks
    for res in run_ranks(_shifted_documents, 2, timeout=120, env={"RINGSEQ_TIMEOUT": "20"}):
        # each rank's layout shown with its parameters (before: "layout #<hash>")
        assert res.startswith("RingMismatchError") and re.search(
            r"layout \(rank 0: documents_contiguous@test_masks\._ShiftedContiguous\(.*shift=0\) "
            r"\(code \d+\), rank 1: .*shift=1\) \(code \d+\)\)", res), res


def _hybrid_documents_forms():
    import torch.distributed as dist

    from ringseq.layouts import DocumentsContiguous, DocumentsZigzag
    from utils import error_text
    r = dist.get_rank()
    sp = ringseq.make_sp_groups(2)  # Ulysses 2 x ring 2
    cu = [0, 8, 24, 32]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4, 8, generator=g, dtype=torch.float64)  # (b, s, h, d)
    pos = sp.positions(32, Documents(cu))
    # the same documents, bound on ranks 0 and 1, by name with cu_seqlens on 2 and 3
    out = ringseq.usp_attn_func(q[:, pos], q[:, pos], q[:, pos], causal=True, sp=sp,
                                **(dict(layout=Documents(cu)) if r < 2 else
                                   dict(layout="documents", cu_seqlens=cu)))
    want, _ = masked_attention(q, q, q, global_mask(32, 32, causal=True, cu_seqlens=tuple(cu)))
    kinds = DocumentsContiguous(cu) if r < 2 else DocumentsZigzag(cu)
    return {"err": float((out - want[:, pos]).abs().max()),
            "kinds": error_text(lambda: ringseq.usp_attn_func(
                q[:, pos], q[:, pos], q[:, pos], causal=True, sp=sp, layout=kinds))}


def test_hybrid_calls_compare_documents_layouts_by_kind_and_boundaries():
    """(Before: the equivalent forms were refused as a "ring layout" mismatch of two hashes,
    and other kinds were named by hashes.)"""
    from dist_utils import run_ranks
    for res in run_ranks(_hybrid_documents_forms, 4, timeout=180, env={"RINGSEQ_TIMEOUT": "20"}):
        assert res["err"] < 1e-12, res
        assert "ring layout (rank 0: 'documents_contiguous', rank 1: 'documents_contiguous', " \
               "rank 2: 'documents_zigzag', rank 3: 'documents_zigzag')" in res["kinds"], res
