"""CPU tests of the CUDA kernels' index math (csrc/kernel_math.h).

The C++ harness tests/cpp/index_math_dump.cpp (conftest.py: index_math_harness) dumps the tables the
kernels use; here they are checked against the PTX ISA layouts as docs/kernels.md states them and
against a reference causal mask. The expectations below are written from the spec, not
copied from the C++.
"""
import itertools

import pytest


# Tile sizes (block_m, block_n) the kernels use or may use: the forward configurations are
# also checked against the harness' own table below.
TILES = [(128, 64), (64, 64), (128, 32), (64, 128), (128, 128), (64, 32)]
# Largest shared-memory opt-in of a block on sm_86/sm_89, the smallest among sm_80+ GPUs.
SM86_SMEM_OPTIN = 99 * 1024
SEQ_CASES = [
    (1, 1), (128, 128), (1000, 1000), (4096, 4096),  # s_q == s_k
    (1, 128), (100, 300), (64, 1000), (128, 4096), (1000, 4096),  # s_q < s_k
    (128, 1), (300, 100), (1000, 64), (4096, 1000), (129, 127),  # s_q > s_k
    (65, 65), (127, 129), (33, 97), (97, 33),  # ragged tails
]


@pytest.fixture(scope="module")
def harness(index_math_harness):
    return index_math_harness


def run(harness, *args, stdin=None):
    return harness(*args, stdin=stdin)


@pytest.fixture(scope="module")
def tables(harness):
    return run(harness, "static")


# ---------------------------------------------------------------------------------------
# Swizzle
# ---------------------------------------------------------------------------------------
def spec_offset(row, col, d):
    """docs/kernels.md: logical 16-byte chunk c of row r is stored at chunk c ^ (r & 7)."""
    chunk, within = divmod(col, 8)
    return row * d + ((chunk ^ (row & 7)) * 8) + within


def wavefronts(byte_addrs, width):
    """Shared-memory wavefronts of one warp access: each lane reads `width` bytes at its
    address; a wavefront serves at most one distinct 4-byte word per bank."""
    words_per_bank = {}
    for a in byte_addrs:
        for w in range(a // 4, (a + width) // 4):
            words_per_bank.setdefault(w % 32, set()).add(w)
    return max(len(s) for s in words_per_bank.values())


@pytest.mark.parametrize("d", [64, 128])
def test_swizzle_matches_spec_and_is_a_row_bijection(tables, d):
    offs = tables[f"swz_offset_{d}"]
    for r, row in enumerate(offs):
        assert row == [spec_offset(r, c, d) for c in range(d)]
        assert sorted(row) == list(range(r * d, (r + 1) * d)), f"row {r} is not a permutation"


@pytest.mark.parametrize("d", [64, 128])
def test_swizzle_is_conflict_free_for_ldmatrix_phases(tables, d):
    offs = tables[f"swz_offset_{d}"]
    for r0 in range(0, 32 - 7):
        for chunk in range(d // 8):
            groups = {(2 * offs[r0 + k][chunk * 8] // 16) % 8 for k in range(8)}
            assert len(groups) == 8, f"rows {r0}..{r0 + 7}, chunk {chunk}: bank groups {groups}"
    # without the swizzle the same phase would hit one bank group 8 times
    assert wavefronts([2 * (k * d) for k in range(8)], 16) == 8


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("order", ["a", "b"])
def test_kernel_ldmatrix_addresses(tables, d, order):
    """The addresses the kernels give ldmatrix (per-lane base + swz_advance steps) are the
    swizzled addresses of the intended logical rows/columns, and each x4 warp access costs
    exactly the minimum of 4 wavefronts (512 bytes over 32 banks of 4 bytes)."""
    offs = tables[f"ldsm_offsets_{order}_{d}"]
    for rs in range(8):
        for cs in range(d // 16):
            addrs = []
            for lane in range(32):
                j, r = divmod(lane, 8)  # lane supplies row r of matrix j
                if order == "a":  # matrix j at (8*(j&1), 8*(j>>1))
                    row, col = 8 * (j & 1) + r, 8 * (j >> 1)
                else:  # matrix j at (8*(j>>1), 8*(j&1))
                    row, col = 8 * (j >> 1) + r, 8 * (j & 1)
                expect = spec_offset(16 * rs + row, 16 * cs + col, d)
                assert offs[lane][rs][cs] == expect, (lane, rs, cs)
                addrs.append(2 * expect)
            assert wavefronts(addrs, 16) == 4
            for j in range(4):  # each 8-lane phase is a single wavefront
                assert wavefronts(addrs[8 * j: 8 * j + 8], 16) == 1


@pytest.mark.parametrize("d", [64, 128])
def test_tile_copy_and_epilogue_patterns_conflict_free(tables, d):
    offs = tables[f"swz_offset_{d}"]
    chunks = d // 8
    # cp.async / 16-byte copies: thread t takes chunk t % chunks of row t // chunks (+ passes)
    for first_row in (0, 8, 16):
        addrs = [2 * offs[first_row + t // chunks][(t % chunks) * 8] for t in range(32)]
        assert wavefronts(addrs, 16) == 4
    # epilogue: lane stores the C pair (row g / g+8, col 8*nt + 2t) as one 4-byte word
    for nt in range(d // 8):
        for half in (0, 8):
            addrs = [2 * offs[half + lane // 4][8 * nt + 2 * (lane % 4)] for lane in range(32)]
            assert wavefronts(addrs, 4) == 1


# ---------------------------------------------------------------------------------------
# mma.m16n8k16 fragments (PTX ISA, as in docs/kernels.md)
# ---------------------------------------------------------------------------------------
def spec_a(lane, i):
    g, t = lane >> 2, lane & 3
    row = g + 8 if i in (2, 3, 6, 7) else g
    col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def spec_b(lane, i):
    g, t = lane >> 2, lane & 3
    return 2 * t + (i & 1) + (8 if i >= 2 else 0), g


def spec_c(lane, i):
    g, t = lane >> 2, lane & 3
    return g + (8 if i >= 2 else 0), 2 * t + (i & 1)


def check_cover(positions, rows, cols):
    assert len(positions) == rows * cols
    assert set(positions) == {(r, c) for r in range(rows) for c in range(cols)}


def test_mma_a_fragment(tables):
    pos = [(tables["a_row"][l][i], tables["a_col"][l][i]) for l in range(32) for i in range(8)]
    assert pos == [spec_a(l, i) for l in range(32) for i in range(8)]
    check_cover(pos, 16, 16)


def test_mma_b_fragment(tables):
    pos = [(tables["b_k"][l][i], tables["b_n"][l][i]) for l in range(32) for i in range(4)]
    assert pos == [spec_b(l, i) for l in range(32) for i in range(4)]
    check_cover(pos, 16, 8)


def test_mma_c_fragment(tables):
    pos = [(tables["c_row"][l][i], tables["c_col"][l][i]) for l in range(32) for i in range(4)]
    assert pos == [spec_c(l, i) for l in range(32) for i in range(4)]
    check_cover(pos, 16, 8)


def test_c_of_two_n8_tiles_is_the_a_fragment(tables):
    """P stays in registers: half i of the A fragment of k-step kk is C register
    c_to_a_reg(i) of n-tile 2*kk + c_to_a_tile(i), at the same (row, col) of the 16x16 block."""
    for lane, i in itertools.product(range(32), range(8)):
        tile, reg = tables["c_to_a_tile"][i], tables["c_to_a_reg"][i]
        assert tile in (0, 1) and reg in range(4)
        row, col = spec_c(lane, reg)
        assert (row, 8 * tile + col) == spec_a(lane, i)
    # the two halves of each packed .b32 come from consecutive registers of one tile
    for j in range(4):
        assert tables["c_to_a_tile"][2 * j] == tables["c_to_a_tile"][2 * j + 1]
        assert tables["c_to_a_reg"][2 * j + 1] == tables["c_to_a_reg"][2 * j] + 1


# ---------------------------------------------------------------------------------------
# ldmatrix x4 / x4.trans
# ---------------------------------------------------------------------------------------
def test_ldmatrix_lane_maps(tables):
    for lane in range(32):
        assert tables["ldsm_src_matrix"][lane] == lane // 8
        assert tables["ldsm_src_row"][lane] == lane % 8
        for h in range(2):
            # each lane receives row lane>>2, columns 2*(lane&3) and +1 of every matrix
            assert (tables["ldsm_dst_row"][lane][h], tables["ldsm_dst_col"][lane][h]) == (lane >> 2, 2 * (lane & 3) + h)
            # .trans delivers the transposed matrix
            assert (tables["ldsm_trans_dst_row"][lane][h], tables["ldsm_trans_dst_col"][lane][h]) == (2 * (lane & 3) + h, lane >> 2)
    # x4 address maps: every lane points at the start of a distinct 16-byte row segment of
    # the 16x16 region
    for order in ("a", "b"):
        pts = {(tables[f"ldsm_{order}_row"][l], tables[f"ldsm_{order}_col"][l]) for l in range(32)}
        assert pts == {(r, c) for r in range(16) for c in (0, 8)}


def received(tables, order, lane, j, h, trans):
    """Tile position of half h of register j received by `lane` from an x4 load whose
    addresses follow `order`, composed from the spec's delivery rule and the harness'
    address maps."""
    if trans:
        srow, scol = 2 * (lane & 3) + h, lane >> 2
    else:
        srow, scol = lane >> 2, 2 * (lane & 3) + h
    src_lane = 8 * j + srow  # the lane that supplied row srow of matrix j
    return tables[f"ldsm_{order}_row"][src_lane], tables[f"ldsm_{order}_col"][src_lane] + scol


def test_ldmatrix_a_order_gives_a_fragment(tables):
    # Q (or dO): row-major (m, k) tile, non-transposed x4 -> the four A registers
    for lane, j, h in itertools.product(range(32), range(4), range(2)):
        assert received(tables, "a", lane, j, h, False) == spec_a(lane, 2 * j + h)


def test_ldmatrix_b_order_gives_b_fragments_of_k(tables):
    # K: row-major (n, k) tile, non-transposed x4 -> B of n-tiles 0 (regs 0,1) and 1 (regs 2,3)
    for lane, j, h in itertools.product(range(32), range(4), range(2)):
        n, k = received(tables, "b", lane, j, h, False)
        kb, nb = spec_b(lane, 2 * (j & 1) + h)
        assert (k, n) == (kb, 8 * (j >> 1) + nb)


def test_ldmatrix_a_order_trans_gives_b_fragments_of_v(tables):
    # V: row-major (k, n) tile, x4.trans -> B of n-tiles 0 (regs 0,1) and 1 (regs 2,3)
    for lane, j, h in itertools.product(range(32), range(4), range(2)):
        k, n = received(tables, "a", lane, j, h, True)
        kb, nb = spec_b(lane, 2 * (j & 1) + h)
        assert (k, n) == (kb, 8 * (j >> 1) + nb)


def test_forward_tile_configs(tables):
    assert tables["fwd_threads"] == 128
    assert tables["max_static_smem"] == 48 * 1024
    seen = {}
    for t in tables["fwd_tiles"]:
        d, m, n = t["headdim"], t["block_m"], t["block_n"]
        assert m % 64 == 0 and n % 16 == 0, t  # 4 warps x 16-row slabs; k16 steps of P V
        assert t["smem"] == (m + 2 * n) * d * 2, t
        # static shared memory where it fits, else dynamic (opt-in) within every sm_8x's limit
        assert t["dynamic"] == (t["smem"] > 48 * 1024), t
        assert t["smem"] <= SM86_SMEM_OPTIN, t
        seen.setdefault(d, {})[t["config"]] = (m, n)
        assert (m, n) in TILES
    assert set(seen) == {64, 128}
    for d, configs in seen.items():
        assert sorted(configs) == [0, 1, 2], d
        assert configs[1] == (64, 64), d  # conservative
        assert configs[2] == (128, 64), d  # the 128 x 64 variant, for every head dim
    assert seen[64][0] == (128, 64) and seen[128][0] == (128, 32)


def spec_rows_aligned(addr, strides, sizes):
    """The kernels copy rows in 16-byte chunks: every row they touch must start on a 16-byte
    boundary. Index 0 is the only one of a size-1 dimension, so its stride is never used."""
    return addr % 16 == 0 and all(n <= 1 or s % 8 == 0 for s, n in zip(strides, sizes))


def test_rows_aligned_ignores_strides_of_size_one_dims(harness):
    cases = []
    for addr in (0, 256, 8, 48):
        for strides in itertools.product((8, 3, 0, 1024, 1), repeat=3):
            for sizes in itertools.product((1, 2, 0), repeat=3):
                cases.append((addr, *strides, *sizes))
    got = run(harness, "aligned", stdin="\n".join(" ".join(map(str, c)) for c in cases) + "\n")
    assert len(got) == len(cases)
    for c, g in zip(cases, got):
        assert g == int(spec_rows_aligned(c[0], c[1:4], c[4:7])), c
    # what torch hands out: a (1, s, h, d) slice of a bigger batch, a (b, 1, h, d) decoding
    # step of a packed qkv, a (b, s, 1, d) view of one kv head
    assert got[cases.index((256, 3, 1024, 8, 1, 2, 2))] == 1
    assert got[cases.index((256, 1024, 3, 8, 2, 1, 2))] == 1
    assert got[cases.index((256, 1024, 8, 3, 2, 2, 1))] == 1
    assert got[cases.index((256, 1024, 8, 3, 2, 2, 2))] == 0
    assert got[cases.index((8, 8, 8, 8, 1, 1, 1))] == 0  # the base must be aligned regardless


# ---------------------------------------------------------------------------------------
# Causal ranges (bottom-right aligned) and the element mask
# ---------------------------------------------------------------------------------------
def visible_prefix(i, s_q, s_k, causal):
    """Reference: row i sees keys [0, lim); lim from j <= i + s_k - s_q and j < s_k."""
    if not causal:
        return s_k
    return max(0, min(s_k, i + s_k - s_q + 1))


@pytest.fixture(scope="module")
def cases(harness):
    lines = [f"{sq} {sk} {bm} {bn} {int(c)}" for sq, sk in SEQ_CASES for bm, bn in TILES for c in (False, True)]
    return run(harness, "cases", stdin="\n".join(lines) + "\n")


def test_causal_block_ranges(cases):
    assert len(cases) == len(SEQ_CASES) * len(TILES) * 2
    for case in cases:
        sq, sk, bm, bn, causal = case["s_q"], case["s_k"], case["block_m"], case["block_n"], case["causal"]
        m_blocks, n_blocks = -(-sq // bm), -(-sk // bn)
        lim = [visible_prefix(i, sq, sk, causal) for i in range(m_blocks * bm)]  # incl. padded rows
        ctx = f"s_q={sq} s_k={sk} tile={bm}x{bn} causal={causal}"
        for m in range(m_blocks):
            rows = range(m * bm, min((m + 1) * bm, sq))  # stored rows
            tile_rows = range(m * bm, (m + 1) * bm)  # computed rows
            most = max(lim[i] for i in rows)
            n_kv = case["num_kv"][m]
            # blocks [0, num_kv) hold every visible key and the last of them holds one
            assert n_kv == (0 if most == 0 else (most - 1) // bn + 1), (ctx, m)
            for n in range(n_blocks):
                masked = any(lim[i] < min((n + 1) * bn, n_blocks * bn) for i in tile_rows) or (n + 1) * bn > sk
                assert case["needs_mask"][m][n] == ("1" if masked else "0"), (ctx, m, n)
            unmasked = case["unmasked"][m]
            assert 0 <= unmasked <= max(n_kv, 0) or n_kv == 0, (ctx, m)
            for n in range(min(unmasked, n_blocks)):
                assert case["needs_mask"][m][n] == "0", (ctx, m, n)
            if unmasked < n_kv:
                assert case["needs_mask"][m][unmasked] == "1", (ctx, m)
            # end to end, per stored row: keys reached by the walk [0, n_kv), unmasked blocks
            # taken whole, masked ones by the element predicate, must be the reference prefix
            for i in rows:
                reach = n_kv * bn
                whole = min(unmasked, n_kv) * bn
                assert whole <= lim[i] <= reach, (ctx, i)
        for n in range(n_blocks):
            first = case["first_q"][n]
            seeing = [m for m in range(m_blocks)
                      if any(lim[i] > n * bn for i in range(m * bm, min((m + 1) * bm, sq)))]
            assert first == (seeing[0] if seeing else m_blocks), (ctx, n)
            if causal:  # later rows see more keys: the range is a suffix
                assert seeing == list(range(first, m_blocks)), (ctx, n)


@pytest.mark.parametrize("s_q,s_k", [(1, 1), (64, 64), (100, 100), (37, 91), (1, 130), (91, 37), (130, 1), (65, 63)])
@pytest.mark.parametrize("causal", [False, True])
def test_element_mask(harness, s_q, s_k, causal):
    pad = 9
    got = run(harness, "mask", s_q, s_k, int(causal), pad)
    for i in range(s_q + pad):
        ref_key = "".join("1" if j < s_k and (not causal or j <= i + s_k - s_q) else "0" for j in range(s_k + pad))
        assert got["key_visible"][i] == ref_key, i
        ref_el = ref_key if i < s_q else "0" * (s_k + pad)
        assert got["element_visible"][i] == ref_el, i
