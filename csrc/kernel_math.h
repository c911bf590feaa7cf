// Index math of the CUDA flash-attention kernels: shared-memory swizzle, tensor-core fragment
// ownership, ldmatrix lane maps, tile configurations, causal block ranges and the row
// alignment their 16-byte copies need.
//
// Everything here is torch-free and compiles with a plain C++17 host compiler, so the CPU
// tests (tests/test_index_math*.py and tests/test_cpu_causal_ranges.py, through the one harness
// tests/cpp/index_math_dump.cpp) run the very functions the kernels and their binding call. The exception is the
// section "Hardware layouts" at the end: it restates the PTX ISA (mma.m16n8k16, ldmatrix; see
// docs/kernels.md) for the tests, which check the kernel-called maps against it, and no kernel
// calls it. A change here must keep those tests green.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RS_HD __host__ __device__
#else
#define RS_HD
#endif

namespace ringseq {
namespace km {

// ---------------------------------------------------------------------------------------
// Shared-memory swizzle.
//
// A tile row of 16-bit elements is a sequence of 16-byte chunks (8 elements each; 8 chunks
// for d=64, 16 for d=128). Eight lanes of an ldmatrix phase read the same logical chunk of 8
// consecutive rows; without a swizzle those 8 addresses share one 16-byte bank group (row
// pitch is a multiple of 128 bytes) and serialize 8-way. XOR-ing the low 3 bits of the chunk
// index with the row spreads them over all 8 bank groups. Every smem write and read of a
// swizzled tile goes through swz_offset so the two can never disagree.
// ---------------------------------------------------------------------------------------
constexpr int kChunkBytes = 16;
constexpr int kChunkElems = 8;  // 16-bit elements per 16-byte chunk

RS_HD constexpr int swz_chunk(int row, int chunk) { return chunk ^ (row & 7); }

// Element offset of logical (row, col) in a swizzled row-major tile with `row_elems`
// elements per row (a multiple of 64, i.e. at least 8 chunks).
RS_HD constexpr int swz_offset(int row, int col, int row_elems) {
  return row * row_elems + swz_chunk(row, col / kChunkElems) * kChunkElems + (col % kChunkElems);
}

// Offset of (row + row_delta, col + col_delta) from the offset of (row, col), without
// recomputing the swizzle: valid when row_delta % 8 == 0 (same row & 7) and the chunk bits of
// col and col_delta do not overlap (then + and ^ agree on the chunk index). Unrolled loops
// use it so that every shared address is one register XOR/ADD away from a per-lane base
// (compile-time deltas), instead of a hoisted register per address.
RS_HD constexpr int swz_advance(int offset, int row_delta, int col_delta, int row_elems) {
  return (offset ^ col_delta) + row_delta * row_elems;
}

// Whether every row of a (b, s, h, d) view (d contiguous) starts on a 16-byte boundary, as the
// 16-byte cp.async copies and vector stores need: a 16-byte aligned base and, for each of
// the b, s and h dimensions, a stride that is a multiple of kChunkElems elements. A dimension
// of size 1 is exempt: its only index is 0, so its stride never enters an address (torch
// gives such dimensions arbitrary strides, e.g. a sliced or unsqueezed view).
RS_HD constexpr bool rows_aligned(uint64_t addr, int64_t stride_b, int64_t stride_s, int64_t stride_h,
                                  int64_t size_b, int64_t size_s, int64_t size_h) {
  return addr % kChunkBytes == 0 && (size_b <= 1 || stride_b % kChunkElems == 0) &&
         (size_s <= 1 || stride_s % kChunkElems == 0) && (size_h <= 1 || stride_h % kChunkElems == 0);
}

// ---------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col fragments. lane in [0, 32); `i` indexes the float
// registers of C/D (0..3) or the 16-bit halves of an A fragment (0..7).
// ---------------------------------------------------------------------------------------
RS_HD constexpr int lane_group(int lane) { return lane >> 2; }   // g
RS_HD constexpr int lane_in_group(int lane) { return lane & 3; } // t

// C/D: 16x8 float32.
RS_HD constexpr int mma_c_row(int lane, int i) { return lane_group(lane) + 8 * (i >> 1); }
RS_HD constexpr int mma_c_col(int lane, int i) { return 2 * lane_in_group(lane) + (i & 1); }

// The C fragments of two adjacent n8 tiles (2k, 2k+1) form the A fragment of k-step k of
// the next GEMM (P in P*V, dS in dS*K, P^T in P^T*dO ...): half i of that A fragment is
// register c_to_a_reg(i) of n-tile 2k + c_to_a_tile(i). Every kernel packs (and the
// backward unpacks) through prim::c_to_a / these two maps only.
RS_HD constexpr int c_to_a_tile(int i) { return i >> 2; }
RS_HD constexpr int c_to_a_reg(int i) { return i & 3; }

// ---------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 address maps (lanes 8j..8j+7 supply the
// row addresses of matrix j; what each lane receives is in "Hardware layouts" below).
// ---------------------------------------------------------------------------------------
// Address maps for one x4 load covering a 16x16 region of a row-major smem tile: which
// (row, col) of the region lane `lane` points at (the start of a 16-byte row segment).
//
// "A order": matrix j sits at row offset 8*(j&1), col offset 8*(j>>1). Non-transposed this
// yields the four registers of an m16n8k16 A fragment (Q for Q*K^T, dO for dO*V^T ...).
// Transposed on a (k rows, n cols) tile it yields the B fragments of two n8 tiles: regs
// {0,1} for cols 0..7 and {2,3} for cols 8..15 (V for P*V, K for dS*K, Q/dO for dS^T*Q ...).
RS_HD constexpr int ldsm_a_row(int lane) { return (lane & 7) + 8 * ((lane >> 3) & 1); }
RS_HD constexpr int ldsm_a_col(int lane) { return 8 * (lane >> 4); }
// "B order": matrix j sits at row offset 8*(j>>1), col offset 8*(j&1). Non-transposed on an
// (n rows, k cols) tile it yields the B fragments of two n8 tiles: regs {0,1} for rows 0..7
// and {2,3} for rows 8..15 (K for Q*K^T, V for dO*V^T ...).
RS_HD constexpr int ldsm_b_row(int lane) { return (lane & 7) + 8 * (lane >> 4); }
RS_HD constexpr int ldsm_b_col(int lane) { return 8 * ((lane >> 3) & 1); }

// ---------------------------------------------------------------------------------------
// Tile configurations of the forward kernel (the ops' tile_config argument):
//   0 = fast default: 128 x 64 for d=64; 128 x 32 for d=128, the largest tile whose Q, K and V
//       fit the 48 KB of static shared memory;
//   1 = conservative: 64 x 64;
//   2 = 128 x 64 for every head dim. For d=128: 64 KB of dynamic shared memory (opt-in
//       through cudaFuncSetAttribute) and half of config 0's cp.async waits and barriers per
//       key, but S is formed one 16-row slab at a time to fit 255 registers, so K is read from
//       shared memory once per slab. For d=64 it is config 0's tile. Which d=128 tile is
//       faster is for a GPU measurement to decide (benchmarks/gpu_check.sh times every config).
//       Calls with spans or a soft-cap run config 0's tile for d=128 (no register to spare for
//       the span state; csrc/cuda/flash_fwd_kernel.cuh, run_flash_fwd).
// Always 4 warps; a warp owns kBlockM / 4 query rows = 16 * m_tiles rows.
// ---------------------------------------------------------------------------------------
constexpr int kFwdWarps = 4;
constexpr int kFwdThreads = 32 * kFwdWarps;
constexpr int kNumFwdConfigs = 3;
// A kernel may declare at most this much static shared memory; more must be dynamic.
constexpr int kMaxStaticSmemBytes = 48 * 1024;

RS_HD constexpr int fwd_block_m(int headdim, int config) {
  return (void)headdim, config == 1 ? 64 : 128;
}
RS_HD constexpr int fwd_block_n(int headdim, int config) {
  return headdim >= 128 && config == 0 ? 32 : 64;
}
// Bytes of shared memory of a block_m x block_n tile: Q plus one K and one V tile (16-bit
// elements).
RS_HD constexpr int fwd_tile_smem_bytes(int block_m, int block_n, int headdim) {
  return (block_m + 2 * block_n) * headdim * 2;
}
RS_HD constexpr int fwd_smem_bytes(int headdim, int config) {
  return fwd_tile_smem_bytes(fwd_block_m(headdim, config), fwd_block_n(headdim, config), headdim);
}
// Whether the tile's shared memory is dynamic (launched with an opt-in) instead of static.
RS_HD constexpr bool fwd_smem_dynamic(int headdim, int config) {
  return fwd_smem_bytes(headdim, config) > kMaxStaticSmemBytes;
}

RS_HD constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// Spans and bands (docs/kernels.md, "Spans, bands and softcap"). A kernel call computes one
// or more spans; span t attends q rows [q_start, q_start + q_len) to kv rows
// [k_start, k_start + k_len), and in span-local coordinates (0 <= i < q_len, 0 <= j < k_len)
// key j is visible to query i iff band_lo <= j - i <= band_hi. Dense causal is one span with
// band (-inf, s_k - s_q]; a sliding window or a document is a band or a span of its own.
//
// Every helper below takes the band clamped by band_clamp into [-q_len, k_len]: that leaves
// the visible set unchanged (j - i lies in [1 - q_len, k_len - 1]) and keeps every sum below
// within 32 bits for the CUDA kernels (q_len, k_len < 2^30, csrc/cuda/flash_api.cu). Ranges
// are half-open and normalised: an empty one has begin == end. The helpers are templates on
// the index type: int on CUDA, int64_t in the CPU kernels.
//
// Row tiles cover the valid rows only, [r0, min(r0 + block_m, q_len)): rows past q_len are
// neutralised by the kernels themselves (never stored in the forward and the dQ kernel; P = 0
// through lse = +inf in the dK/dV kernel). Key tiles are not clipped: keys j >= k_len (the
// ragged tail) are never visible, so a tile that reaches past k_len needs the element mask.
// ---------------------------------------------------------------------------------------
template <typename I>
struct Range {
  I begin;
  I end;
  RS_HD constexpr bool empty() const { return begin >= end; }
  RS_HD constexpr I size() const { return end > begin ? end - begin : I(0); }
};

template <typename I>
RS_HD constexpr I min_of(I a, I b) { return a < b ? a : b; }
template <typename I>
RS_HD constexpr I max_of(I a, I b) { return a < b ? b : a; }
// floor(a / b) and ceil(a / b) for b > 0 and any sign of a (C++ division truncates to zero).
template <typename I>
RS_HD constexpr I floor_div(I a, I b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
template <typename I>
RS_HD constexpr I ceil_div_any(I a, I b) { return -floor_div(-a, b); }
template <typename I>
RS_HD constexpr Range<I> make_range(I begin, I end) { return {begin, end > begin ? end : begin}; }

// A band bound clamped into [-q_len, k_len] (the binding applies it once per span).
template <typename I>
RS_HD constexpr I band_clamp(I bound, I q_len, I k_len) {
  return bound < -q_len ? -q_len : (bound > k_len ? k_len : bound);
}
// The band of dense attention: unbounded below, causal (bottom-right) or unbounded above.
template <typename I>
RS_HD constexpr I dense_band_lo(I q_len) { return -q_len; }
template <typename I>
RS_HD constexpr I dense_band_hi(I q_len, I k_len, bool causal) { return causal ? k_len - q_len : k_len; }

// The element mask (rows past q_len are not checked: the kernels neutralise them).
template <typename I>
RS_HD constexpr bool band_visible(I i, I j, I k_len, I lo, I hi) {
  return j < k_len && j - i >= lo && j - i <= hi;
}

// Keys visible to some row of [r0, r1) (0 <= r0 < r1 <= q_len): row i sees
// [i + lo, i + hi] ∩ [0, k_len), and consecutive rows' intervals overlap or touch (hi >= lo),
// so their union is the one interval [r0 + lo, r1 - 1 + hi] ∩ [0, k_len).
template <typename I>
RS_HD constexpr Range<I> band_key_range(I r0, I r1, I k_len, I lo, I hi) {
  return make_range(max_of(I(0), r0 + lo), min_of(k_len, r1 + hi));
}
// Rows of [0, q_len) that see some key of [c0, c1) (keys past k_len do not count).
template <typename I>
RS_HD constexpr Range<I> band_row_range(I c0, I c1, I q_len, I k_len, I lo, I hi) {
  const I c_end = min_of(c1, k_len);
  return c_end <= c0 ? Range<I>{0, 0} : make_range(max_of(I(0), c0 - hi), min_of(q_len, c_end - lo));
}
// Whether every key of [c0, c1) is visible to every row of [r0, r1) (both non-empty): then
// the block needs no element mask. The extreme differences j - i are c0 - (r1 - 1) and
// (c1 - 1) - r0.
template <typename I>
RS_HD constexpr bool band_block_full(I r0, I r1, I c0, I c1, I k_len, I lo, I hi) {
  return c1 <= k_len && c0 - (r1 - 1) >= lo && (c1 - 1) - r0 <= hi;
}

// Tile versions: q tile m holds valid rows [m * block_m, min((m + 1) * block_m, q_len)), kv tile
// n holds keys [n * block_n, (n + 1) * block_n). Only blocks in these ranges are visited:
// the work of a span grows with its visible area, not with q_len * k_len.
//
// kv tiles [begin, end) of q tile m that hold a key some row of the tile sees.
template <typename I>
RS_HD constexpr Range<I> band_kv_blocks(I m, I block_m, I block_n, I q_len, I k_len, I lo, I hi) {
  const Range<I> keys = band_key_range(m * block_m, min_of((m + 1) * block_m, q_len), k_len, lo, hi);
  return keys.empty() ? Range<I>{0, 0} : Range<I>{keys.begin / block_n, (keys.end + block_n - 1) / block_n};
}
// q tiles [begin, end) with a row that sees some key of kv tile n.
template <typename I>
RS_HD constexpr Range<I> band_q_blocks(I n, I block_m, I block_n, I q_len, I k_len, I lo, I hi) {
  const Range<I> rows = band_row_range(n * block_n, (n + 1) * block_n, q_len, k_len, lo, hi);
  return rows.empty() ? Range<I>{0, 0} : Range<I>{rows.begin / block_m, (rows.end + block_m - 1) / block_m};
}
// Whether block (m, n) has an element the mask rejects (a band edge or the ragged key tail).
template <typename I>
RS_HD constexpr bool band_block_needs_mask(I m, I n, I block_m, I block_n, I q_len, I k_len, I lo, I hi) {
  return !band_block_full(m * block_m, min_of((m + 1) * block_m, q_len), n * block_n, (n + 1) * block_n,
                          k_len, lo, hi);
}
// kv tiles of q tile m that need no mask: exactly the n in [begin, end) (an interval, since
// band_block_full is monotone in n on each side). With rows [r0, r1): n * block_n >= r1 - 1 + lo,
// (n + 1) * block_n - 1 <= r0 + hi and (n + 1) * block_n <= k_len. The forward walks its kv
// tiles from the last one down and masks the ones outside this interval.
template <typename I>
RS_HD constexpr Range<I> band_unmasked_kv_blocks(I m, I block_m, I block_n, I q_len, I k_len, I lo, I hi) {
  const I r0 = m * block_m, r1 = min_of((m + 1) * block_m, q_len);
  return make_range(max_of(I(0), ceil_div_any(r1 - 1 + lo, block_n)),
                    min_of(k_len / block_n, floor_div(r0 + hi + 1, block_n)));
}

// ---------------------------------------------------------------------------------------
// KV-cache decoding (attn_params.h KvCache; docs/kernels.md, "KV-cache decoding").
//
// kvcache_span: the span of one batch row. Its valid keys are [leftpad, seqlen) of its cache
// row (leftpad clamped into [0, seqlen]); causal masking and the window (left, right; -1 =
// unbounded on that side) are bottom-right aligned to them, as in flash-attn: query i of q_len
// sees key j (0-based from leftpad, k_len = seqlen - leftpad) iff
// k_len - q_len + i - left <= j <= k_len - q_len + i + right, and j <= k_len - q_len + i when
// causal. heads_as_rows: the q_len rows are the query heads of ONE query at the last
// position (gqa_rows_view), so every row sees the same keys: the window becomes a key range
// [k_len - 1 - left, k_len) and the band is unbounded. The band comes clamped (band_clamp).
template <typename I>
struct KvSpan {
  I k_start;
  I k_len;
  I lo;
  I hi;
};
template <typename I>
RS_HD constexpr KvSpan<I> kvcache_span(I q_len, I leftpad, I seqlen, bool causal, I left, I right,
                                       bool heads_as_rows) {
  const I end = max_of(seqlen, I(0));
  const I start = min_of(max_of(leftpad, I(0)), end);
  const I k_len = end - start;
  if (heads_as_rows) {
    const I skip = left < 0 ? I(0) : max_of(I(0), k_len - 1 - left);
    return {start + skip, k_len - skip, -q_len, k_len - skip};
  }
  const I off = k_len - q_len;
  const I lo = left < 0 ? -q_len : off - left;
  I hi = right < 0 ? k_len : off + right;
  if (causal) hi = min_of(hi, off);
  return {start, k_len, band_clamp(lo, q_len, k_len), band_clamp(hi, q_len, k_len)};
}

// Key splits (split-KV decoding, FwdParams::num_splits). A call splits only when its rows fit
// one q tile per (batch, head) -- decoding a few tokens, where batch x heads alone leaves
// parallel workers idle -- and has fewer than `target` work items (q tiles x heads x batch):
// then into enough splits to give `target` items, each keeping at least `min_tiles` key tiles.
// requested > 0 (flash-attn's num_splits) is honoured up to one split per key tile. Depends on
// the shape only, so results do not depend on the machine's thread count.
template <typename I>
RS_HD constexpr I kv_splits(I requested, I q_tiles, I items, I key_tiles, I target, I min_tiles,
                            I max_splits) {
  if (requested > 0) return max_of(I(1), min_of(min_of(requested, key_tiles), max_splits));
  if (q_tiles != 1 || items <= 0 || items >= target || key_tiles < 2 * min_tiles) return I(1);
  const I want = (target + items - 1) / items;
  return max_of(I(1), min_of(min_of(want, key_tiles / min_tiles), max_splits));
}
// Split `split` of `n_splits` of a tile's key tiles [blocks.begin, blocks.end): consecutive
// ranges of ceil(size / n_splits) tiles (the last ones may be shorter or empty).
template <typename I>
RS_HD constexpr Range<I> split_blocks(Range<I> blocks, I split, I n_splits) {
  const I per = (blocks.size() + n_splits - 1) / n_splits;
  const I b = blocks.begin + split * per;
  return make_range(min_of(b, blocks.end), min_of(b + per, blocks.end));
}
// CUDA launch constants of the split-KV forward: its tile configuration (64 x 64: decoding
// rows are few, and the span state needs registers), items to aim for (about two CTAs per SM
// of an H100/H200, 132 SMs), the fewest key tiles of a split, the most splits.
constexpr int kSplitConfig = 1;
constexpr int kCudaSplitTarget = 264;
constexpr int kCudaSplitMinTiles = 1;
constexpr int kMaxSplits = 128;
// Floats of the CUDA split scratch: per split and (batch, head, row) d partial outputs and one
// lse, laid out [split][batch][head][row][d] then [split][batch][head][row].
RS_HD constexpr int64_t split_scratch_floats(int64_t n_splits, int64_t batch, int64_t heads,
                                             int64_t rows, int64_t headdim) {
  return n_splits * batch * heads * rows * (headdim + 1);
}

// ---------------------------------------------------------------------------------------
// Causal masking, bottom-right aligned: key j is visible to query i iff
// j <= i + seqlen_k - seqlen_q. The dense special case of the band helpers above (one span,
// band (-inf, s_k - s_q] or unbounded); tests/test_index_math*.py check these against brute
// force, which covers the band helpers on that case.
// ---------------------------------------------------------------------------------------
RS_HD constexpr int causal_offset(int seqlen_q, int seqlen_k) { return seqlen_k - seqlen_q; }

// The element mask of the kernels (rows past seqlen_q are not checked: they are not stored).
RS_HD constexpr bool key_visible(int i, int j, int seqlen_q, int seqlen_k, bool causal) {
  return j < seqlen_k && (!causal || j <= i + causal_offset(seqlen_q, seqlen_k));
}

// Number of kv blocks [0, n) holding a key visible to some row of q tile `m_block`.
// 0 means no row of the tile sees any key (out = 0, lse = -inf).
RS_HD constexpr int fwd_num_kv_blocks(int m_block, int block_m, int block_n, int seqlen_q,
                                      int seqlen_k, bool causal) {
  return band_kv_blocks(m_block, block_m, block_n, seqlen_q, seqlen_k, dense_band_lo(seqlen_q),
                        dense_band_hi(seqlen_q, seqlen_k, causal)).end;
}

// Whether block (m_block, n_block) contains an element that key_visible rejects for some row
// of the tile: a ragged key tail or a causal diagonal.
RS_HD constexpr bool block_needs_mask(int m_block, int n_block, int block_m, int block_n,
                                      int seqlen_q, int seqlen_k, bool causal) {
  return band_block_needs_mask(m_block, n_block, block_m, block_n, seqlen_q, seqlen_k,
                               dense_band_lo(seqlen_q), dense_band_hi(seqlen_q, seqlen_k, causal));
}

// Number of leading kv blocks [0, n) of q tile `m_block` that need no mask.
RS_HD constexpr int fwd_num_unmasked_kv_blocks(int m_block, int block_m, int block_n,
                                               int seqlen_q, int seqlen_k, bool causal) {
  return band_unmasked_kv_blocks(m_block, block_m, block_n, seqlen_q, seqlen_k, dense_band_lo(seqlen_q),
                                 dense_band_hi(seqlen_q, seqlen_k, causal)).end;
}

// Backward (one CTA per kv block): first q tile that has a row seeing some key of kv block
// `n_block`, i.e. the q tiles [first, ceil(seqlen_q / block_m)) contribute. Returns
// ceil(seqlen_q / block_m) (an empty range) when no row sees the block.
RS_HD constexpr int bwd_first_q_block(int n_block, int block_m, int block_n, int seqlen_q,
                                      int seqlen_k, bool causal) {
  return band_q_blocks(n_block, block_m, block_n, seqlen_q, seqlen_k, dense_band_lo(seqlen_q),
                       dense_band_hi(seqlen_q, seqlen_k, causal)).empty()
             ? ceil_div(seqlen_q, block_m)
             : band_q_blocks(n_block, block_m, block_n, seqlen_q, seqlen_k, dense_band_lo(seqlen_q),
                             dense_band_hi(seqlen_q, seqlen_k, causal)).begin;
}

// ---------------------------------------------------------------------------------------
// Backward section (flash_bwd_kernel.cuh; tested in tests/test_index_math_bwd.py).
// ---------------------------------------------------------------------------------------

// Moving an ldmatrix lane address by k16 steps of 16 columns, or by a multiple of 8 rows,
// without recomputing the swizzle: for row_elems a power of two >= 64, row0 % 8 == 0,
// col < 16 and col + 16 * k16 < row_elems,
//   swz_offset(row0 + r, col + 16 * k16, row_elems)
//     == row0 * row_elems + (swz_offset(r, col, row_elems) ^ (16 * k16)).
// The 16-column step only flips chunk bits above the one `col` sets, and the swizzle only
// depends on row & 7. One XOR with an immediate instead of a per-step address register keeps
// the backward's d=128 tiles within 255 registers.
RS_HD constexpr int swz_step(int lane_offset, int row0, int k16, int row_elems) {
  return row0 * row_elems + (lane_offset ^ (16 * k16));
}

// ---------------------------------------------------------------------------------------
// Hardware layouts (test-only: no kernel calls these). The PTX ISA's A/B fragment ownership
// and ldmatrix source/destination maps, restated so that the tests can check the kernel-called
// maps above (ldsm_*_row/col, c_to_a_*, mma_c_*) against the hardware's behaviour.
// ---------------------------------------------------------------------------------------
// mma A: 16x16, row-major (m, k); i indexes the halves a0..a7.
RS_HD constexpr int mma_a_row(int lane, int i) { return lane_group(lane) + 8 * ((i >> 1) & 1); }
RS_HD constexpr int mma_a_col(int lane, int i) { return 2 * lane_in_group(lane) + (i & 1) + 8 * (i >> 2); }
// mma B: 16x8 (k, n), "col" operand; i indexes the halves b0..b3.
RS_HD constexpr int mma_b_k(int lane, int i) { return 2 * lane_in_group(lane) + (i & 1) + 8 * (i >> 1); }
RS_HD constexpr int mma_b_n(int lane, int /*i*/) { return lane_group(lane); }
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8j..8j+7 supply the row addresses
// of matrix j; each lane receives one .b32 per matrix holding two 16-bit elements (h = 0 low
// half, h = 1 high half), namely element (dst_row, dst_col) of the stored 8x8 matrix.
RS_HD constexpr int ldsm_src_matrix(int lane) { return lane >> 3; }
RS_HD constexpr int ldsm_src_row(int lane) { return lane & 7; }
RS_HD constexpr int ldsm_dst_row(int lane, int /*h*/) { return lane >> 2; }
RS_HD constexpr int ldsm_dst_col(int lane, int h) { return 2 * (lane & 3) + h; }
RS_HD constexpr int ldsm_trans_dst_row(int lane, int h) { return 2 * (lane & 3) + h; }
RS_HD constexpr int ldsm_trans_dst_col(int lane, int /*h*/) { return lane >> 2; }
// The attention mask with the row bound included: the reference the kernels' key_visible
// (which leaves rows past seqlen_q to the caller) is tested against.
RS_HD constexpr bool element_visible(int i, int j, int seqlen_q, int seqlen_k, bool causal) {
  return i >= 0 && i < seqlen_q && j >= 0 && key_visible(i, j, seqlen_q, seqlen_k, causal);
}

}  // namespace km
}  // namespace ringseq

// =======================================================================================
// CPU kernel section (csrc/cpu/; tested in tests/test_cpu_causal_ranges.py through
// tests/cpp/cpu_ranges_dump.cpp). Element-exact causal ranges in 64-bit indices: the CPU
// kernels cut tiles at any row and key, not only at block multiples. Same convention as the
// causal section above (bottom-right aligned: key j visible to query i iff
// j <= i + causal_offset(seqlen_q, seqlen_k)).
// =======================================================================================
namespace ringseq {
namespace km {

RS_HD constexpr int64_t causal_offset64(int64_t seqlen_q, int64_t seqlen_k) { return seqlen_k - seqlen_q; }

// One past the last key visible to some row of [0, row_end), row_end >= 1 (clamped to
// [0, seqlen_k]; rows see a prefix of the keys, so this is the number row_end - 1 sees): the
// keys a query tile ending at row_end must visit. Not causal: every key.
RS_HD constexpr int64_t causal_kv_end(int64_t row_end, int64_t seqlen_q, int64_t seqlen_k, bool causal) {
  if (!causal) return seqlen_k;
  const int64_t end = row_end + causal_offset64(seqlen_q, seqlen_k);
  return end < 0 ? 0 : (end > seqlen_k ? seqlen_k : end);
}

// First query row that sees key `key` (clamped to [0, seqlen_q]; seqlen_q: no row does).
// Rows [causal_first_row(key), seqlen_q) see it. Not causal: row 0.
RS_HD constexpr int64_t causal_first_row(int64_t key, int64_t seqlen_q, int64_t seqlen_k, bool causal) {
  if (!causal) return 0;
  const int64_t row = key - causal_offset64(seqlen_q, seqlen_k);
  return row < 0 ? 0 : (row > seqlen_q ? seqlen_q : row);
}

// Whether rows [row0, ...) x keys [.., key_end) of a causal block hide some key from row row0,
// i.e. the block needs an element mask (the block's later rows see at least what row0 sees).
RS_HD constexpr bool causal_block_masked(int64_t row0, int64_t key_end, int64_t seqlen_q,
                                         int64_t seqlen_k, bool causal) {
  return causal && key_end - 1 > row0 + causal_offset64(seqlen_q, seqlen_k);
}

}  // namespace km
}  // namespace ringseq
// =============================================================== end of the CPU kernel section
