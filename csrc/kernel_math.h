// Index math of the CUDA flash-attention kernels: shared-memory swizzle, tensor-core fragment
// ownership, ldmatrix lane maps, tile configurations, causal block ranges and the row
// alignment their 16-byte copies need.
//
// Everything here is torch-free and compiles with a plain C++17 host compiler, so the CPU
// tests (tests/test_index_math*.py, through tests/cpp/index_math_dump.cpp and a harness of
// their own) run the very functions the kernels and their binding call. The exception is the
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
// Causal masking, bottom-right aligned: key j is visible to query i iff
// j <= i + seqlen_k - seqlen_q. Keys j >= seqlen_k (ragged tail of the last block) are never
// visible; rows i >= seqlen_q are computed but never stored.
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
