"""CPU tests of the band helpers of csrc/kernel_math.h (spans, windows, documents).

tests/cpp/index_math_dump.cpp (band32 / band64) dumps, for one span and one tile size, the
element mask, the kv tiles each q tile visits, the tiles that need the element mask, the q
tiles each kv tile visits and the element-exact ranges of the CPU kernels, for the int (CUDA)
and int64_t (CPU) instantiations. Everything is checked here against a brute-force mask
written from the definition (key j visible to query i iff band_lo <= j - i <= band_hi, with
0 <= i < q_len, 0 <= j < k_len), not from the C++.
"""
import itertools

import numpy as np
import pytest


INF = 2 ** 62  # "unbounded" in the spans' convention
LENS = [(1, 1), (2, 5), (5, 2), (17, 17), (64, 64), (65, 130), (130, 65), (200, 77), (77, 200)]
# CUDA forward / dQ / dK-dV tiles and CPU-like tiles, plus odd sizes
TILES = [(128, 64), (64, 64), (128, 32), (64, 128), (16, 16), (3, 5)]


def bands(q_len, k_len):
    """Unbounded, causal, flash-attn windows (bottom-right), shifted bands with empty rows."""
    off = k_len - q_len
    out = [(-INF, INF), (-INF, off)]
    for left, right in ((0, 0), (1, 0), (17, 0), (q_len - 1, 0), (q_len, 0), (3, 5), (0, 17)):
        out.append((off - left, off + right))
    out += [(5, 9), (-7, -3), (k_len - 1, INF), (-INF, -(q_len - 1)), (k_len + 3, INF), (-INF, -q_len - 2)]
    return out


@pytest.fixture(scope="module")
def harness(index_math_harness):
    return index_math_harness


def dump(harness, mode, lines):
    return harness(mode, stdin="\n".join(lines) + "\n")


def brute(q_len, k_len, lo, hi, pad=0):
    i = np.arange(q_len)[:, None]
    j = np.arange(k_len + pad)[None, :]
    return (j < k_len) & (j - i >= lo) & (j - i <= hi)


def span_range(flags):
    """[first, last + 1) of the True entries, (0, 0) when none; asserts they are contiguous."""
    idx = np.flatnonzero(flags)
    if idx.size == 0:
        return [0, 0]
    assert idx.size == idx[-1] - idx[0] + 1, f"not an interval: {idx}"
    return [int(idx[0]), int(idx[-1]) + 1]


def as_range(r):
    return [0, 0] if r[0] >= r[1] else list(r)


def check_case(c):
    q_len, k_len, bm, bn, lo, hi = (c[x] for x in ("q_len", "k_len", "block_m", "block_n", "lo_raw", "hi_raw"))
    ctx = f"q_len={q_len} k_len={k_len} tile={bm}x{bn} band=[{lo}, {hi}]"
    assert -q_len <= c["lo"] <= k_len and -q_len <= c["hi"] <= k_len, ctx  # band_clamp
    vis_pad = brute(q_len, k_len, lo, hi, pad=3)
    assert c["visible"] == ["".join("1" if x else "0" for x in row) for row in vis_pad], ctx
    vis = vis_pad[:, :k_len]
    m_blocks, n_blocks = -(-q_len // bm), -(-k_len // bn)
    # tile view: rows padded with invisible rows (past q_len), keys with invisible keys
    pv = np.zeros((m_blocks * bm, n_blocks * bn), bool)
    pv[:q_len, :k_len] = vis
    valid_rows = np.zeros(m_blocks * bm, bool)
    valid_rows[:q_len] = True
    tiles = pv.reshape(m_blocks, bm, n_blocks, bn)
    any_vis = tiles.any(axis=(1, 3))  # (m, n): some element visible
    rows_ok = valid_rows.reshape(m_blocks, bm)
    for m in range(m_blocks):
        assert c["kv_blocks"][m] == span_range(any_vis[m]), (ctx, m)
        # a tile needs the mask iff some valid row misses some key of the (unclipped) kv tile
        full = [bool(tiles[m][rows_ok[m]][:, n].all()) for n in range(n_blocks)]
        assert c["needs_mask"][m] == "".join("0" if f else "1" for f in full), (ctx, m)
        u = c["unmasked"][m]
        assert u[0] <= u[1], (ctx, m)
        assert [n for n in range(n_blocks) if u[0] <= n < u[1]] == [n for n in range(n_blocks) if full[n]], (ctx, m)
        # element exact (CPU): keys seen by some row of the tile, walked from its first key
        r0, r1 = m * bm, min((m + 1) * bm, q_len)
        kb, ke, flags = c["key_range"][m]
        assert as_range([kb, ke]) == span_range(vis[r0:r1].any(axis=0)), (ctx, m)
        steps = list(range(kb, ke, bn)) if kb < ke else []
        assert flags == "".join("1" if vis[r0:r1, c0:min(c0 + bn, ke)].all() else "0" for c0 in steps), (ctx, m)
    for n in range(n_blocks):
        assert c["q_blocks"][n] == span_range(any_vis[:, n]), (ctx, n)
        c0, c1 = n * bn, min((n + 1) * bn, k_len)
        assert as_range(c["row_range"][n]) == span_range(vis[:, c0:c1].any(axis=1)), (ctx, n)


@pytest.mark.parametrize("mode", ["band32", "band64"])
def test_band_helpers_against_brute_force(harness, mode):
    lines = [f"{sq} {sk} {bm} {bn} {lo} {hi}" for sq, sk in LENS for bm, bn in TILES
             for lo, hi in bands(sq, sk)]
    cases = dump(harness, mode, lines)
    assert len(cases) == len(lines)
    for c in cases:
        check_case(c)


def test_band_helpers_random(harness):
    rng = np.random.default_rng(7)
    lines = []
    for _ in range(300):
        sq, sk = (int(x) for x in rng.integers(1, 90, 2))
        bm, bn = (int(x) for x in rng.choice([1, 2, 3, 7, 16, 32, 64], 2))
        lo = int(rng.integers(-sq - 4, sk + 4))
        hi = lo + int(rng.integers(0, sq + sk + 4))
        lines.append(f"{sq} {sk} {bm} {bn} {lo} {hi}")
    for c in dump(harness, "band32", lines):
        check_case(c)


def visited_blocks(harness, q_len, k_len, bm, bn, lo, hi):
    c = dump(harness, "band32", [f"{q_len} {k_len} {bm} {bn} {lo} {hi}"])[0]
    return sum(e - b for b, e in c["kv_blocks"]), sum(e - b for b, e in c["q_blocks"]), c


def test_work_grows_with_the_visible_area(harness):
    """The CUDA tile loops (forward/dQ: kv tiles per q tile; dK/dV: q tiles per kv tile) visit
    O(s * w) tiles for a window w, not O(s^2): at most the tiles a band of width w + block_m
    crosses."""
    s, w = 8192, 256
    for bm, bn in ((128, 64), (64, 64), (128, 32)):
        m_blocks, n_blocks = s // bm, s // bn
        full = m_blocks * n_blocks
        fwd, bwd, c = visited_blocks(harness, s, s, bm, bn, -w, 0)
        per_row_tile = -(-(bm + w) // bn) + 1
        assert fwd <= m_blocks * per_row_tile and fwd < full // 8, (bm, bn, fwd, full)
        assert bwd == fwd  # the same (q tile, kv tile) pairs from the other side
        masked = sum(ch == "1" for m, row in enumerate(c["needs_mask"])
                     for n, ch in enumerate(row) if c["kv_blocks"][m][0] <= n < c["kv_blocks"][m][1])
        assert masked <= 2 * m_blocks * (-(-bm // bn) + 1), (bm, bn, masked)  # only the edges
    # documents: one causal span each; the tiles visited add up per document, so packing 16
    # documents of 512 tokens costs 1/16 of the causal work of one 8192-token sequence
    doc_tiles = {n: visited_blocks(harness, n, n, 128, 64, -INF, 0)[0] for n in (1, 2, 17, 255, 512)}
    for n, t in doc_tiles.items():
        assert t <= -(-n // 128) * -(-n // 64), n
    whole = visited_blocks(harness, 8192, 8192, 128, 64, -INF, 0)[0]
    assert 16 * doc_tiles[512] * 16 <= whole * 2, (doc_tiles, whole)


def test_band_clamp_keeps_the_visible_set(harness):
    """Raw bounds far outside the span (±2^62, or just past its edges) give the same mask and
    ranges as the clamped ones, in both instantiations."""
    lines = []
    for sq, sk in ((7, 9), (9, 7)):
        for lo, hi in itertools.product((-INF, -sq - 1, -sq, -sq + 1, 0, sk - 1, sk, sk + 1),
                                        (-sq - 1, -sq, 0, sk - 1, sk, INF)):
            if lo <= hi:
                lines.append(f"{sq} {sk} 4 4 {lo} {hi}")
    for mode in ("band32", "band64"):
        for c in dump(harness, mode, lines):
            check_case(c)
