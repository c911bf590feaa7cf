"""CPU model of the CUDA backward kernels' tiling (csrc/cuda/flash_bwd_kernel.cuh).

No GPU needed. A float64 numpy emulation runs the same block loops, causal block ranges,
masks, lse/delta guards and operand orientation (S^T = K Q^T in the dK/dV kernel, S = Q K^T in
the dQ kernel) as the kernels and must reproduce dense attention gradients. The range formulas
below are the Python twins of the `bwd_*` helpers in the backward section of csrc/kernel_math.h;
when those helpers are reachable from Python (the fwd engineer's index-math harness), they are
also compared against these twins.
"""
import math

import numpy as np
import pytest

LOG2E = 1.4426950408889634


# --- twins of the kernel_math.h backward helpers ------------------------------------------

def bwd_kv_m_begin(n_block, block_n, block_m, s_q, s_k, causal):
    """km::bwd_first_q_block: first query block that sees any key of kv block `n_block`
    (bottom-right causal); ceil(s_q / block_m), an empty range, when none does."""
    m_all = -(-s_q // block_m)
    if n_block * block_n >= s_k:
        return m_all
    if not causal:
        return 0
    first_row = n_block * block_n - (s_k - s_q)  # smallest query row that sees key n*BN
    if first_row <= 0:
        return 0
    if first_row >= s_q:
        return m_all
    return first_row // block_m


def bwd_q_n_end(m_block, block_m, block_n, s_q, s_k, causal):
    """km::fwd_num_kv_blocks (the dQ kernel's range): one past the last kv block that any
    query of q block `m_block` sees."""
    n_blocks = -(-s_k // block_n)
    if not causal:
        return n_blocks
    last_row = min((m_block + 1) * block_m, s_q) - 1
    last_key = last_row + s_k - s_q
    if last_key < 0:
        return 0
    return min(n_blocks, last_key // block_n + 1)


def bwd_block_needs_mask(m_block, n_block, block_m, block_n, s_q, s_k, causal):
    """km::block_needs_mask: True unless every key of the kv block is in range and visible to
    every row of the q block (rows past s_q are neutralised through lse = +inf)."""
    if (n_block + 1) * block_n > s_k:
        return True
    return causal and (n_block + 1) * block_n - 1 > m_block * block_m + (s_k - s_q)


def swz_offset(row, col, row_elems):
    """km::swz_offset: chunk c of row r stored at chunk c ^ (r & 7)."""
    return row * row_elems + ((col // 8) ^ (row & 7)) * 8 + col % 8


def swz_step(lane_offset, row0, k16, row_elems):
    """km::swz_step."""
    return row0 * row_elems + (lane_offset ^ (16 * k16))


def lse_log2_guard(lse, row, s_q):
    """lse*log2e as the kernels stage it: +inf for rows past s_q and rows that see no key
    (lse = -inf), so P = exp2(s*c - that) is exactly 0 there and never NaN."""
    if row >= s_q or lse == -math.inf:
        return math.inf
    return lse * LOG2E


# --- dense float64 reference ----------------------------------------------------------------

def visible(s_q, s_k, causal):
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    return (j <= i + s_k - s_q) if causal else np.ones((s_q, s_k), bool)


def reference(q, k, v, dout, scale, causal):
    """q (h, s_q, d), k/v (h_kv, s_k, d): out, lse, dq, dk, dv in float64."""
    h, s_q, _ = q.shape
    h_kv, s_k, _ = k.shape
    grp = h // h_kv
    kk = np.repeat(k, grp, axis=0)
    vv = np.repeat(v, grp, axis=0)
    vis = visible(s_q, s_k, causal)
    s = np.einsum("hid,hjd->hij", q, kk) * scale
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    l = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l > 0, np.log(l) + m_safe, -np.inf)[..., 0]
        p = np.where(l > 0, p / np.where(l > 0, l, 1), 0.0)
    out = np.einsum("hij,hjd->hid", p, vv)
    dp = np.einsum("hid,hjd->hij", dout, vv)
    delta = (dout * out).sum(-1)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("hij,hjd->hid", ds, kk) * scale
    dk = np.einsum("hij,hid->hjd", ds, q) * scale
    dv = np.einsum("hij,hid->hjd", p, dout)
    dk = dk.reshape(h_kv, grp, s_k, -1).sum(1)
    dv = dv.reshape(h_kv, grp, s_k, -1).sum(1)
    return out, lse, delta, dq, dk, dv


# --- emulation of the two kernels ---------------------------------------------------------

def _pad_rows(x, rows):
    """Zero-fill past the end, as cp.async with src-size 0 does."""
    out = np.zeros((rows,) + x.shape[1:], x.dtype)
    out[: min(rows, x.shape[0])] = x[:rows]
    return out


def emulate_dkdv(q, k, v, dout, lse, delta, scale, causal, block_m, block_n):
    h, s_q, d = q.shape
    h_kv, s_k, _ = k.shape
    grp = h // h_kv
    c = scale * LOG2E
    dk = np.full(k.shape, np.nan)
    dv = np.full(v.shape, np.nan)
    m_blocks = -(-s_q // block_m)
    for kvh in range(h_kv):
        for n in range(-(-s_k // block_n)):
            kt = _pad_rows(k[kvh, n * block_n:], block_n)
            vt = _pad_rows(v[kvh, n * block_n:], block_n)
            acc_dk = np.zeros((block_n, d))
            acc_dv = np.zeros((block_n, d))
            m_begin = bwd_kv_m_begin(n, block_n, block_m, s_q, s_k, causal)
            n_iter = grp * max(m_blocks - m_begin, 0)
            for it in range(n_iter):  # heads of the group and q blocks flattened, like the kernel
                hq = kvh * grp + it // (m_blocks - m_begin)
                m = m_begin + it % (m_blocks - m_begin)
                qt = _pad_rows(q[hq, m * block_m:], block_m)
                dot = _pad_rows(dout[hq, m * block_m:], block_m)
                rows = m * block_m + np.arange(block_m)
                lse2 = np.array([lse_log2_guard(lse[hq, r] if r < s_q else 0.0, r, s_q)
                                 for r in rows])
                dl = np.array([delta[hq, r] if r < s_q else 0.0 for r in rows])
                st = kt @ qt.T  # S^T: rows = keys, cols = queries
                if bwd_block_needs_mask(m, n, block_m, block_n, s_q, s_k, causal):
                    keys = n * block_n + np.arange(block_n)[:, None]
                    bad = keys >= s_k
                    if causal:
                        bad = bad | (keys > rows[None, :] + s_k - s_q)
                    st = np.where(bad, -np.inf, st)
                with np.errstate(invalid="raise"):
                    pt = np.exp2(st * c - lse2[None, :])
                dpt = vt @ dot.T
                dst = pt * (dpt - dl[None, :])
                acc_dv += pt @ dot
                acc_dk += dst @ qt
            keep = min(block_n, s_k - n * block_n)
            dk[kvh, n * block_n: n * block_n + keep] = acc_dk[:keep] * scale
            dv[kvh, n * block_n: n * block_n + keep] = acc_dv[:keep]
    return dk, dv


def emulate_dq(q, k, v, dout, lse, delta, scale, causal, block_m, block_n):
    h, s_q, d = q.shape
    h_kv, s_k, _ = k.shape
    grp = h // h_kv
    c = scale * LOG2E
    dq = np.full(q.shape, np.nan)
    for hq in range(h):
        kvh = hq // grp
        for m in range(-(-s_q // block_m)):
            qt = _pad_rows(q[hq, m * block_m:], block_m)
            dot = _pad_rows(dout[hq, m * block_m:], block_m)
            rows = m * block_m + np.arange(block_m)
            lse2 = np.array([lse_log2_guard(lse[hq, r] if r < s_q else 0.0, r, s_q) for r in rows])
            dl = np.array([delta[hq, r] if r < s_q else 0.0 for r in rows])
            acc = np.zeros((block_m, d))
            for n in range(bwd_q_n_end(m, block_m, block_n, s_q, s_k, causal)):
                kt = _pad_rows(k[kvh, n * block_n:], block_n)
                vt = _pad_rows(v[kvh, n * block_n:], block_n)
                s = qt @ kt.T
                if bwd_block_needs_mask(m, n, block_m, block_n, s_q, s_k, causal):
                    keys = n * block_n + np.arange(block_n)[None, :]
                    bad = keys >= s_k
                    if causal:
                        bad = bad | (keys > rows[:, None] + s_k - s_q)
                    s = np.where(bad, -np.inf, s)
                with np.errstate(invalid="raise"):
                    p = np.exp2(s * c - lse2[:, None])
                dp = dot @ vt.T
                ds = p * (dp - dl[:, None])
                acc += ds @ kt
            keep = min(block_m, s_q - m * block_m)
            dq[hq, m * block_m: m * block_m + keep] = acc[:keep] * scale
    return dq


CASES = [
    # (s_q, s_k, causal)
    (1, 1, True), (1, 1, False), (1, 70, True), (70, 1, True), (70, 1, False),
    (64, 64, True), (100, 100, True), (100, 37, True), (37, 100, True), (130, 200, False),
    (200, 130, True), (129, 129, True), (65, 191, True), (191, 65, True),
]


@pytest.mark.parametrize("s_q,s_k,causal", CASES)
@pytest.mark.parametrize("tiles", [(64, 64), (64, 128), (128, 64)])
def test_emulated_tiling_matches_dense(s_q, s_k, causal, tiles):
    rng = np.random.default_rng(s_q * 1000 + s_k * 7 + causal)
    h, h_kv, d = 4, 2, 8
    q, dout = rng.standard_normal((2, h, s_q, d))
    k, v = rng.standard_normal((2, h_kv, s_k, d))
    scale = d ** -0.5
    out, lse, delta, dq, dk, dv = reference(q, k, v, dout, scale, causal)
    # the dK/dV kernel owns kv rows (block_n = 16 * warps), the dQ kernel owns q rows
    bm_kv, bn_kv = 64, tiles[1]
    bm_q, bn_q = tiles[0], 64
    dk_e, dv_e = emulate_dkdv(q, k, v, dout, lse, delta, scale, causal, bm_kv, bn_kv)
    dq_e = emulate_dq(q, k, v, dout, lse, delta, scale, causal, bm_q, bn_q)
    for name, got, want in (("dq", dq_e, dq), ("dk", dk_e, dk), ("dv", dv_e, dv)):
        assert np.isfinite(got).all(), f"{name}: NaN/inf or a row never written"
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)
    # rows that see no key: lse = -inf and exactly zero gradient
    no_key = ~visible(s_q, s_k, causal).any(1)
    assert np.all(np.isneginf(lse[:, no_key]))
    assert np.all(dq_e[:, no_key] == 0)


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (64, 128), (128, 64), (16, 64)])
def test_block_ranges_cover_exactly_the_visible_pairs(block_m, block_n):
    """Skipped blocks hold no visible pair, unmasked blocks hold only visible in-range pairs, and
    the dK/dV and dQ loop nests visit the same set of blocks."""
    for s_q in (1, 7, 63, 64, 65, 128, 200):
        for s_k in (1, 9, 64, 65, 127, 200):
            for causal in (False, True):
                vis = visible(s_q, s_k, causal)
                mb, nb = -(-s_q // block_m), -(-s_k // block_n)
                from_kv = {(m, n) for n in range(nb)
                           for m in range(bwd_kv_m_begin(n, block_n, block_m, s_q, s_k, causal), mb)}
                from_q = {(m, n) for m in range(mb)
                          for n in range(bwd_q_n_end(m, block_m, block_n, s_q, s_k, causal))}
                for m in range(mb):
                    for n in range(nb):
                        blk = vis[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
                        if blk.any():
                            assert (m, n) in from_kv and (m, n) in from_q, (s_q, s_k, causal, m, n)
                        if not bwd_block_needs_mask(m, n, block_m, block_n, s_q, s_k, causal):
                            assert blk.shape[1] == block_n and blk.all(), (s_q, s_k, causal, m, n)
                # blocks that are visited although nothing in them is visible only waste time;
                # they may occur only for rows past s_q in the last q block (none here).
                for (m, n) in from_kv | from_q:
                    blk = vis[m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
                    assert blk.any(), ("visited an invisible block", s_q, s_k, causal, m, n)


def test_lse_guard_never_makes_nan():
    c = 0.125 * LOG2E
    for lse in (-math.inf, -50.0, 0.0, 30.0):
        for row_in in (True, False):
            l2 = lse_log2_guard(lse, 0 if row_in else 5, 3)
            for s in (-math.inf, -3.0, 0.0, 4.0):
                p = np.exp2(np.float64(s) * c - l2)
                assert np.isfinite(p)
                if lse == -math.inf or not row_in or s == -math.inf:
                    assert p == 0.0


@pytest.mark.parametrize("row_elems", [64, 128])
def test_swz_step_matches_swizzle(row_elems):
    """The XOR step the backward uses to move ldmatrix lane addresses equals the swizzle helper
    for every lane's (row, col) of an x4 load at every region the kernels visit."""
    for r in range(16):  # ldsm_a_row / ldsm_b_row range
        for col in (0, 8):  # ldsm_a_col / ldsm_b_col values
            off = swz_offset(r, col, row_elems)
            for row0 in range(0, 128, 8):
                for k16 in range(row_elems // 16):
                    assert swz_step(off, row0, k16, row_elems) == \
                        swz_offset(row0 + r, col + 16 * k16, row_elems), (r, col, row0, k16)


def test_kernel_math_helpers_match_twins(index_math_harness):
    """The real csrc/kernel_math.h helpers (tests/cpp/index_math_dump.cpp, mode bwd_blocks)
    against the Python twins above (which the emulation proves correct)."""
    out = index_math_harness("bwd_blocks", json_out=False)
    checked = 0
    for line in out.splitlines():
        kind, *vals = line.split()
        v = list(map(int, vals))
        if kind == "F":
            n, bm, bn, sq, sk, c, got = v
            assert got == bwd_kv_m_begin(n, bn, bm, sq, sk, bool(c)), line
        elif kind == "N":
            m, bm, bn, sq, sk, c, got = v
            assert got == bwd_q_n_end(m, bm, bn, sq, sk, bool(c)), line
        elif kind == "M":
            m, n, bm, bn, sq, sk, c, got = v
            assert bool(got) == bwd_block_needs_mask(m, n, bm, bn, sq, sk, bool(c)), line
        else:
            assert v[-1] == 1, line
        checked += 1
    assert checked > 10000


# --- lane-level emulation of the backward's warp GEMMs --------------------------------------
# ldmatrix and mma.m16n8k16 are implemented here from the PTX ISA text (docs/kernels.md), not from
# kernel_math.h; the kernel's address math (ldsm_a/b lane maps, km::swz_step over the
# km::swz_offset swizzle) and fragment plumbing (prim::c_to_a, the dS^T unpack order) are mirrored
# line by line from flash_bwd_kernel.cuh. Operand order, .trans choice or a fragment index that
# is wrong there shows up as a wrong product here.

def _ldsm_a_off(lane, d):
    return swz_offset((lane & 7) + 8 * ((lane >> 3) & 1), 8 * (lane >> 4), d)


def _ldsm_b_off(lane, d):
    return swz_offset((lane & 7) + 8 * (lane >> 4), 8 * ((lane >> 3) & 1), d)


def _ldmatrix_x4(smem, addr, trans):
    """addr[lane]: element offset of the 8-element row lane supplies (matrix lane // 8).
    Returns regs[lane][j] = (low, high) halves of the .b32 received from matrix j."""
    regs = np.zeros((32, 4, 2))
    for j in range(4):
        mat = np.array([smem[addr[8 * j + r]: addr[8 * j + r] + 8] for r in range(8)])
        for lane in range(32):
            if trans:
                regs[lane, j] = mat[2 * (lane % 4), lane // 4], mat[2 * (lane % 4) + 1, lane // 4]
            else:
                regs[lane, j] = mat[lane // 4, 2 * (lane % 4)], mat[lane // 4, 2 * (lane % 4) + 1]
    return regs


def _mma(c, a, b):
    """c[lane][4] += A B from fragments: a[lane][4 regs][2 halves], b[lane][2 regs][2 halves]."""
    am = np.zeros((16, 16))
    bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            am[g, 2 * t + h] = a[lane][0][h]
            am[g + 8, 2 * t + h] = a[lane][1][h]
            am[g, 2 * t + 8 + h] = a[lane][2][h]
            am[g + 8, 2 * t + 8 + h] = a[lane][3][h]
            bm[2 * t + h, g] = b[lane][0][h]
            bm[2 * t + 8 + h, g] = b[lane][1][h]
    cm = am @ bm
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(4):
            c[lane][e] += cm[g + 8 * (e >> 1), 2 * t + (e & 1)]


def _to_smem(tile, d):
    smem = np.full(tile.shape[0] * d, np.nan)
    for r in range(tile.shape[0]):
        for col in range(d):
            smem[swz_offset(r, col, d)] = tile[r, col]
    return smem


def _gemm_rows_x_tileT(a_smem, a_row0, b_smem, d, loop=64):
    acc = np.zeros((loop // 8, 32, 4))
    for kk in range(d // 16):
        a = _ldmatrix_x4(a_smem, [swz_step(_ldsm_a_off(l, d), a_row0, kk, d) for l in range(32)], False)
        for np_ in range(loop // 16):
            b = _ldmatrix_x4(b_smem, [swz_step(_ldsm_b_off(l, d), 16 * np_, kk, d) for l in range(32)], False)
            _mma(acc[2 * np_], a, b[:, 0:2])
            _mma(acc[2 * np_ + 1], a, b[:, 2:4])
    return acc


def _gemm_frag_x_tile(acc, a_frag, b_smem, d, loop=64):
    for kk in range(loop // 16):
        for dn in range(d // 16):
            b = _ldmatrix_x4(b_smem, [swz_step(_ldsm_a_off(l, d), 16 * kk, dn, d) for l in range(32)], True)
            _mma(acc[2 * dn], a_frag[kk], b[:, 0:2])
            _mma(acc[2 * dn + 1], a_frag[kk], b[:, 2:4])


def _c_to_a(c):
    """c[tile j][lane][4] -> a[k-step][lane][4 regs][2 halves], as prim::c_to_a (km::c_to_a_*)."""
    a = np.zeros((c.shape[0] // 2, 32, 4, 2))
    for kk in range(c.shape[0] // 2):
        a[kk, :, 0] = c[2 * kk][:, 0:2]
        a[kk, :, 1] = c[2 * kk][:, 2:4]
        a[kk, :, 2] = c[2 * kk + 1][:, 0:2]
        a[kk, :, 3] = c[2 * kk + 1][:, 2:4]
    return a


def _gather(c):
    """C fragments of n8 tiles -> the 16 x (8 * tiles) matrix."""
    m = np.zeros((16, 8 * c.shape[0]))
    for j in range(c.shape[0]):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for e in range(4):
                m[g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1)] = c[j][lane][e]
    return m


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("warp_row", [0, 16, 48])
def test_lane_level_dkdv_step(d, warp_row):
    """One step of the dK/dV kernel for one warp: S^T = K Q^T, P^T, dV += P^T dO,
    dP^T = V dO^T, dS^T = P^T (dP^T - delta) through the packed P^T, dK += dS^T Q."""
    rng = np.random.default_rng(d + warp_row)
    own, loop, scale = 64, 64, d ** -0.5
    k, v = rng.standard_normal((2, own, d))
    q, do = rng.standard_normal((2, loop, d))
    lse = rng.standard_normal(loop) + 3.0
    delta = rng.standard_normal(loop)
    ks, vs, qs, dos = (_to_smem(x, d) for x in (k, v, q, do))

    pt = _gemm_rows_x_tileT(ks, warp_row, qs, d)
    for j in range(pt.shape[0]):
        for lane in range(32):
            for e in range(4):
                col = 8 * j + 2 * (lane % 4) + (e & 1)
                pt[j][lane][e] = np.exp2(pt[j][lane][e] * scale * LOG2E - lse[col] * LOG2E)
    a = _c_to_a(pt)
    acc_dv = np.zeros((d // 8, 32, 4))
    _gemm_frag_x_tile(acc_dv, a, dos, d)
    dst = _gemm_rows_x_tileT(vs, warp_row, dos, d)
    for kk in range(loop // 16):
        for lane in range(32):
            for r in range(4):
                j, e0 = 2 * kk + (r >> 1), 2 * (r & 1)
                col = 8 * j + 2 * (lane % 4)
                pv = a[kk][lane][r]
                dst[j][lane][e0] = pv[0] * (dst[j][lane][e0] - delta[col])
                dst[j][lane][e0 + 1] = pv[1] * (dst[j][lane][e0 + 1] - delta[col + 1])
    a = _c_to_a(dst)
    acc_dk = np.zeros((d // 8, 32, 4))
    _gemm_frag_x_tile(acc_dk, a, qs, d)

    kw, vw = k[warp_row:warp_row + 16], v[warp_row:warp_row + 16]
    p_t = np.exp(kw @ q.T * scale - lse[None, :])
    ds_t = p_t * (vw @ do.T - delta[None, :])
    np.testing.assert_allclose(_gather(pt), p_t, rtol=1e-12)
    np.testing.assert_allclose(_gather(acc_dv), p_t @ do, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(_gather(acc_dk), ds_t @ q, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d", [64, 128])
def test_lane_level_dq_step(d):
    """One step of the dQ kernel for one warp: S = Q K^T, dP = dO V^T, dQ += dS K."""
    rng = np.random.default_rng(7 * d)
    own, loop, warp_row = 128, 64, 112
    q, do = rng.standard_normal((2, own, d))
    k, v = rng.standard_normal((2, loop, d))
    qs, dos, ks, vs = (_to_smem(x, d) for x in (q, do, k, v))
    s = _gemm_rows_x_tileT(qs, warp_row, ks, d)
    dp = _gemm_rows_x_tileT(dos, warp_row, vs, d)
    ds = s * dp  # any elementwise map keeps the fragment positions; the product checks both
    acc = np.zeros((d // 8, 32, 4))
    _gemm_frag_x_tile(acc, _c_to_a(ds), ks, d)
    qw, dow = q[warp_row:warp_row + 16], do[warp_row:warp_row + 16]
    np.testing.assert_allclose(_gather(s), qw @ k.T, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(_gather(dp), dow @ v.T, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(_gather(acc), ((qw @ k.T) * (dow @ v.T)) @ k, rtol=1e-10, atol=1e-10)
