// Index math of the CUDA flash-attention kernels: shared-memory swizzle, tensor-core fragment
// ownership, ldmatrix lane maps, tile configurations and causal block ranges.
//
// Everything here is torch-free and compiles with a plain C++17 host compiler, so the CPU
// tests (tests/test_index_math.py via tests/cpp/index_math_dump.cpp) exercise exactly the
// functions the kernels call. Layout facts follow the PTX ISA (mma.m16n8k16, ldmatrix) as
// summarised in KERNEL.md; a change here must keep those tests green.
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

// ---------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col fragments. lane in [0, 32); `i` indexes the 16-bit
// halves of A (0..7) and B (0..3) or the float registers of C/D (0..3).
// ---------------------------------------------------------------------------------------
RS_HD constexpr int lane_group(int lane) { return lane >> 2; }   // g
RS_HD constexpr int lane_in_group(int lane) { return lane & 3; } // t

// A: 16x16, row-major (m, k).
RS_HD constexpr int mma_a_row(int lane, int i) { return lane_group(lane) + 8 * ((i >> 1) & 1); }
RS_HD constexpr int mma_a_col(int lane, int i) { return 2 * lane_in_group(lane) + (i & 1) + 8 * (i >> 2); }
// B: 16x8 (k, n), "col" operand.
RS_HD constexpr int mma_b_k(int lane, int i) { return 2 * lane_in_group(lane) + (i & 1) + 8 * (i >> 1); }
RS_HD constexpr int mma_b_n(int lane, int /*i*/) { return lane_group(lane); }
// C/D: 16x8 float32.
RS_HD constexpr int mma_c_row(int lane, int i) { return lane_group(lane) + 8 * (i >> 1); }
RS_HD constexpr int mma_c_col(int lane, int i) { return 2 * lane_in_group(lane) + (i & 1); }

// The C fragments of two adjacent n8 tiles (2k, 2k+1) form the A fragment of k-step k of
// the next GEMM (P in P*V, dS in dS*K): half i of that A fragment is register
// c_to_a_reg(i) of n-tile 2k + c_to_a_tile(i).
RS_HD constexpr int c_to_a_tile(int i) { return i >> 2; }
RS_HD constexpr int c_to_a_reg(int i) { return i & 3; }

// ---------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
// Lanes 8j..8j+7 supply the row addresses of matrix j. Each lane receives one .b32 per
// matrix holding two 16-bit elements (h = 0 low half, h = 1 high half).
// ---------------------------------------------------------------------------------------
RS_HD constexpr int ldsm_src_matrix(int lane) { return lane >> 3; }
RS_HD constexpr int ldsm_src_row(int lane) { return lane & 7; }
// Which element of the stored 8x8 matrix lands in half h of a lane's register.
RS_HD constexpr int ldsm_dst_row(int lane, int /*h*/) { return lane >> 2; }
RS_HD constexpr int ldsm_dst_col(int lane, int h) { return 2 * (lane & 3) + h; }
RS_HD constexpr int ldsm_trans_dst_row(int lane, int h) { return 2 * (lane & 3) + h; }
RS_HD constexpr int ldsm_trans_dst_col(int lane, int /*h*/) { return lane >> 2; }

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
// Tile configurations of the forward kernel. config 0 = fast default, 1 = conservative.
// Always 4 warps; a warp owns kBlockM / 4 query rows = 16 * m_tiles rows.
// ---------------------------------------------------------------------------------------
constexpr int kFwdWarps = 4;
constexpr int kFwdThreads = 32 * kFwdWarps;
constexpr int kNumFwdConfigs = 2;

RS_HD constexpr int fwd_block_m(int headdim, int config) {
  return (void)headdim, config == 0 ? 128 : 64;
}
RS_HD constexpr int fwd_block_n(int headdim, int config) {
  return headdim >= 128 && config == 0 ? 32 : 64;
}
// Bytes of dynamic shared memory: Q tile plus one K and one V tile (16-bit elements).
RS_HD constexpr int fwd_smem_bytes(int headdim, int config) {
  return (fwd_block_m(headdim, config) + 2 * fwd_block_n(headdim, config)) * headdim * 2;
}

RS_HD constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// Causal masking, bottom-right aligned: key j is visible to query i iff
// j <= i + seqlen_k - seqlen_q. Keys j >= seqlen_k (ragged tail of the last block) are never
// visible; rows i >= seqlen_q are computed but never stored.
// ---------------------------------------------------------------------------------------
RS_HD constexpr int causal_offset(int seqlen_q, int seqlen_k) { return seqlen_k - seqlen_q; }

// The element mask of the kernels (rows past seqlen_q are not checked: they are not stored).
RS_HD constexpr bool key_visible(int i, int j, int seqlen_q, int seqlen_k, bool causal) {
  return j < seqlen_k && (!causal || j <= i + causal_offset(seqlen_q, seqlen_k));
}
// Full reference predicate including the row bound (used by the backward and the tests).
RS_HD constexpr bool element_visible(int i, int j, int seqlen_q, int seqlen_k, bool causal) {
  return i >= 0 && i < seqlen_q && j >= 0 && key_visible(i, j, seqlen_q, seqlen_k, causal);
}

// Number of kv blocks [0, n) holding a key visible to some row of q tile `m_block`.
// 0 means no row of the tile sees any key (out = 0, lse = -inf).
RS_HD constexpr int fwd_num_kv_blocks(int m_block, int block_m, int block_n, int seqlen_q,
                                      int seqlen_k, bool causal) {
  const int n_all = ceil_div(seqlen_k, block_n);
  if (!causal) return n_all;
  const int last_row = (m_block + 1) * block_m < seqlen_q ? (m_block + 1) * block_m - 1 : seqlen_q - 1;
  const int last_key = last_row + causal_offset(seqlen_q, seqlen_k);
  if (last_key < 0) return 0;
  const int n = last_key / block_n + 1;
  return n < n_all ? n : n_all;
}

// Whether block (m_block, n_block) contains an element that key_visible rejects for some row
// of the tile (rows past seqlen_q included, harmlessly): a ragged key tail or a causal
// diagonal. Blocks that need no mask skip the per-element predicate.
RS_HD constexpr bool block_needs_mask(int m_block, int n_block, int block_m, int block_n,
                                      int seqlen_q, int seqlen_k, bool causal) {
  return (n_block + 1) * block_n > seqlen_k ||
         (causal && (n_block + 1) * block_n - 1 > m_block * block_m + causal_offset(seqlen_q, seqlen_k));
}

// Number of leading kv blocks [0, n) of q tile `m_block` that need no mask. The forward walks
// kv blocks from the last visible one down to 0, so blocks >= this count are masked.
RS_HD constexpr int fwd_num_unmasked_kv_blocks(int m_block, int block_m, int block_n,
                                               int seqlen_q, int seqlen_k, bool causal) {
  const int full = seqlen_k / block_n;  // blocks without a ragged tail
  if (!causal) return full;
  // block n is unmasked iff (n + 1) * block_n - 1 <= first_row + offset
  const int lim = m_block * block_m + causal_offset(seqlen_q, seqlen_k) + 1;
  if (lim < 0) return 0;
  const int n = lim / block_n;
  return n < full ? n : full;
}

// Backward (one CTA per kv block): first q tile that has a row seeing some key of kv block
// `n_block`, i.e. the q tiles [first, ceil(seqlen_q / block_m)) contribute. Returns
// ceil(seqlen_q / block_m) (an empty range) when no row sees the block.
RS_HD constexpr int bwd_first_q_block(int n_block, int block_m, int block_n, int seqlen_q,
                                      int seqlen_k, bool causal) {
  const int m_all = ceil_div(seqlen_q, block_m);
  if (n_block * block_n >= seqlen_k) return m_all;
  if (!causal) return 0;
  // row i sees key n0 iff i >= n0 - offset
  const int first_row = n_block * block_n - causal_offset(seqlen_q, seqlen_k);
  if (first_row <= 0) return 0;
  if (first_row >= seqlen_q) return m_all;
  return first_row / block_m;
}

// Whether the rows of q tile `m_block` run past seqlen_q (the backward must then keep those
// rows out of dK/dV).
RS_HD constexpr bool rows_ragged(int m_block, int block_m, int seqlen_q) {
  return (m_block + 1) * block_m > seqlen_q;
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
