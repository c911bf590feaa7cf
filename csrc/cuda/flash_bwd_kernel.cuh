// Flash-attention backward on mma.sync, deterministic (no atomics): two kernels.
//
//   dK/dV kernel: a CTA owns kOwn kv rows of one kv head and walks every (query head of its
//     GQA group, visible q block) pair, so dK/dV of a kv row are summed in one fixed order by
//     one thread and GQA needs no expanded buffers.
//   dQ kernel:    a CTA owns kOwn query rows of one head and walks the visible kv blocks.
//
// Both recompute P = exp2(S * scale * log2e - lse * log2e) from the caller's lse (the global
// one of a ring step) and use the caller's delta = rowsum(dO * O), so per-block gradients of a
// ring simply add up.
//
// Spans and bands (docs/kernels.md): a CTA owns rows of one span and walks only the blocks of
// the other side its band reaches (km::band_q_blocks / km::band_kv_blocks), masking per
// element only blocks that straddle a band edge or the ragged tail. Soft-cap (kSoftcap, a
// template flag so that the kernels without it keep their registers): S becomes
// t = tanh(S * scale / softcap), P = exp2(t * softcap * log2e - lse * log2e), and dS is
// multiplied by dt = 1 - t^2 before dQ/dK, which keep the factor softmax_scale.
//
// Warp layout: every warp owns 16 rows of the CTA's own side, so a row's fragments never
// leave one warp. The dK/dV kernel computes S^T = K Q^T (rows = keys): P^T and dS^T then come
// out of the MMA in the C layout, which is the A layout of dV += P^T dO and dK += dS^T Q, and
// no transpose through shared memory is needed. The loop side is always 64 rows.
//
// Configs (params.config, same meaning as the forward: 0 = fast default, 1 = conservative;
// the forward's config 2 has no backward of its own and runs config 0):
//   0: 8 warps, kOwn = 128. Each Q/dO (or K/V) tile streamed through shared memory is reused
//      by twice as many owned rows, halving the smem->register and L2 traffic per MMA; a warp's
//      registers are the same as in config 1 because a warp still owns 16 rows.
//   1: 4 warps, kOwn = 64 (64 x 64 tiles), the smallest shared-memory footprint.
// The streamed side is double-buffered with cp.async: tile i+1 is in flight while tile i is
// consumed.
//
// Known costs, left until the first GPU measurement says which matters (issue 16): the dQ
// kernel recomputes S and dP (7 GEMM-sized products per block pair against 5 for a fused
// kernel with atomic dQ); `#pragma unroll 1` over the k16 steps of S/dP (gemm_rows_x_tileT)
// keeps d=128 within 255 registers but stops ldmatrix/mma pipelining across steps; the dK/dV
// grid (ceil(s_k / kOwn) x h_kv x b CTAs) under-fills 132 SMs when b * h_kv is small.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../attn_params.h"
#include "../kernel_math.h"
#include "launch.h"
#include "primitives.cuh"

namespace ringseq {
namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim_, int kNWarps_>
struct Cfg {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = 32 * kNWarps;
  static constexpr int kOwn = 16 * kNWarps;      // rows one CTA owns (kv rows / q rows)
  static constexpr int kLoop = 64;               // rows per step on the streamed side
  static constexpr int kDTiles = kHeadDim / 8;   // n8 tiles across the head dim
  static constexpr int kDSteps = kHeadDim / 16;  // k16 steps across the head dim
  static constexpr int kLTiles = kLoop / 8;      // n8 tiles across a streamed block
  static constexpr int kLSteps = kLoop / 16;     // k16 steps across a streamed block
  static constexpr int kOwnTile = kOwn * kHeadDim;    // elements of an owned-side tile
  static constexpr int kLoopTile = kLoop * kHeadDim;  // elements of a streamed tile
  // dK/dV: K, V (owned) + 2 stages of Q, dO + 2 stages of lse, delta (float).
  static constexpr int kSmemDkdv = (2 * kOwnTile + 4 * kLoopTile) * 2 + 4 * kLoop * 4;
  // dQ: Q, dO (owned) + 2 stages of K, V.
  static constexpr int kSmemDq = (2 * kOwnTile + 4 * kLoopTile) * 2;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128");
  static_assert(2 * kLoop <= kThreads, "one thread per lse/delta element of a stage");
};

// 4-byte cp.async (lse/delta rows are float and not necessarily 16-byte aligned at the tile
// start); size 0 zero-fills, like prim::cp_async_16.
__device__ __forceinline__ void cp_async_4(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}

// lse * log2e as P = exp2(s * c - it) needs it, with +inf for rows past s_q and rows that see
// no key (lse = -inf): P is then exactly 0 for every key, masked (-inf) or not, and no
// (-inf) - (-inf) can arise.
__device__ __forceinline__ float lse_log2(float lse, bool row_valid) {
  return (row_valid && lse != -INFINITY) ? lse * kLog2e : INFINITY;
}

// Per-lane element offsets of the x4 ldmatrix of the 16x16 region at (0, 0) of a swizzled
// tile; km::swz_step moves them to any (row0 % 8 == 0, 16 * k16) region.
// A order: A fragments; with .trans, B fragments of a (k rows, n cols) tile.
// B order: B fragments of two n8 tiles from an (n rows, k cols) tile.
template <int kCols>
__device__ __forceinline__ int ldsm_off_a(int lane) {
  return km::swz_offset(km::ldsm_a_row(lane), km::ldsm_a_col(lane), kCols);
}
template <int kCols>
__device__ __forceinline__ int ldsm_off_b(int lane) {
  return km::swz_offset(km::ldsm_b_row(lane), km::ldsm_b_col(lane), kCols);
}

// acc[kLTiles][4] = A(16 rows at a_row0 of tile a) * B^T where B is the kLoop x kHeadDim tile b
// (rows = n index): S = Q K^T, S^T = K Q^T, dP = dO V^T, dP^T = V dO^T all have this shape.
template <typename C, typename T>
__device__ __forceinline__ void gemm_rows_x_tileT(float (&acc)[C::kLTiles][4], uint32_t a_base,
                                                  int a_row0, uint32_t b_base, int off_a,
                                                  int off_b) {
#pragma unroll
  for (int j = 0; j < C::kLTiles; ++j) {
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  }
  // Not unrolled: unrolled, ptxas hoists the ldmatrix of every k-step ahead of the MMAs and
  // runs out of registers next to the dK/dV accumulators (d=128).
#pragma unroll 1
  for (int kk = 0; kk < C::kDSteps; ++kk) {
    uint32_t a[4];
    prim::ldmatrix_x4(a, a_base + 2u * km::swz_step(off_a, a_row0, kk, C::kHeadDim));
#pragma unroll
    for (int np = 0; np < C::kLTiles / 2; ++np) {
      uint32_t b[4];
      prim::ldmatrix_x4(b, b_base + 2u * km::swz_step(off_b, 16 * np, kk, C::kHeadDim));
      prim::mma_16816<T>(acc[2 * np], a, b[0], b[1]);
      prim::mma_16816<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc[kDTiles][4] += A (16 x kLoop, register fragments) * tile (kLoop x kHeadDim, rows = k):
// dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <typename C, typename T>
__device__ __forceinline__ void gemm_frag_x_tile(float (&acc)[C::kDTiles][4],
                                                 const uint32_t (&a)[C::kLSteps][4],
                                                 uint32_t b_base, int off_a) {
#pragma unroll
  for (int kk = 0; kk < C::kLSteps; ++kk) {
#pragma unroll
    for (int dn = 0; dn < C::kDSteps; ++dn) {
      uint32_t b[4];
      prim::ldmatrix_x4_trans(b, b_base + 2u * km::swz_step(off_a, 16 * kk, dn, C::kHeadDim));
      prim::mma_16816<T>(acc[2 * dn], a[kk], b[0], b[1]);
      prim::mma_16816<T>(acc[2 * dn + 1], a[kk], b[2], b[3]);
    }
  }
}

// Writes a warp's 16 x kHeadDim float accumulator into rows row_base + row0 + g (+ 8) of head
// `head` of batch `b` of a (b, s, h, d) gradient, rows >= rows_valid skipped (row0 and
// rows_valid are span-local, row_base the span's first row). accumulate: adds
// into float32; otherwise stores element type T. Each CTA owns its rows, so the
// read-modify-write is race-free and the summation order fixed.
template <typename C, typename T>
__device__ __forceinline__ void store_rows(const float (&acc)[C::kDTiles][4], float scale,
                                           void* grad, const RowStrides& strides, int b, int head,
                                           int64_t row_base, int row0, int rows_valid,
                                           bool accumulate, int lane) {
  const int64_t base = b * strides.batch + head * strides.head + row_base * strides.row;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + km::lane_group(lane) + 8 * half;
    if (row >= rows_valid) continue;
    if (accumulate) {
      float* dst = static_cast<float*>(grad) + base + row * strides.row + 2 * km::lane_in_group(lane);
#pragma unroll
      for (int j = 0; j < C::kDTiles; ++j) {
        float2 v = *reinterpret_cast<float2*>(dst + 8 * j);
        v.x += acc[j][2 * half] * scale;
        v.y += acc[j][2 * half + 1] * scale;
        *reinterpret_cast<float2*>(dst + 8 * j) = v;
      }
    } else {
      T* dst = static_cast<T*>(grad) + base + row * strides.row + 2 * km::lane_in_group(lane);
#pragma unroll
      for (int j = 0; j < C::kDTiles; ++j) {
        *reinterpret_cast<uint32_t*>(dst + 8 * j) =
            prim::pack2<T>(acc[j][2 * half] * scale, acc[j][2 * half + 1] * scale);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// dK/dV. Grid (ceil(longest k_len / kOwn) x spans, h_kv, b).
// ---------------------------------------------------------------------------------------
template <typename C, typename T, bool kSpans, bool kSoftcap>
__global__ void __launch_bounds__(C::kThreads, 1) flash_bwd_dkdv_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + C::kOwnTile;
  T* sQ = sV + C::kOwnTile;            // [2][kLoop][d]
  T* sdO = sQ + 2 * C::kLoopTile;      // [2][kLoop][d]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * C::kLoopTile);  // [2][kLoop], raw lse
  float* sDelta = sLse + 2 * C::kLoop;                              // [2][kLoop]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp_row = 16 * (tid >> 5);
  // The span and its kv block (the first blocks, the heaviest under a causal band, first).
  // Rows and keys below are span-local.
  const prim::SpanTile sp =
      prim::load_span_tile<kSpans>(p.spans, p.shape, C::kOwn, /*q_side=*/false, /*last_first=*/false);
  if (!sp.valid) return;
  const int n_block = sp.block;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int s_q = sp.q_len;
  const int s_k = sp.k_len;
  const int grp = static_cast<int>(p.shape.nheads / p.shape.nheads_kv);
  const float c = p.consts.sm_scale_log2;  // softmax scale (softcap when capping) * log2(e)

  const km::Range<int> q_blocks = km::band_q_blocks(n_block, C::kLoop, C::kOwn, s_q, s_k, sp.lo, sp.hi);
  const int m_first = q_blocks.begin;
  const int per_head = q_blocks.size();
  const int n_iter = grp * per_head;  // (query head, q block) pairs, head-major

  float acc_dk[C::kDTiles][4];
  float acc_dv[C::kDTiles][4];
#pragma unroll
  for (int j = 0; j < C::kDTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;
  }
  if (n_iter <= 0 && p.accumulate) return;  // nothing to add

  const int kv_row0 = n_block * C::kOwn;
  if (n_iter > 0) {
    // Uniform bases; the span's first q row is added per copy (one register live across the
    // loop instead of four 64-bit pointers).
    const T* q = static_cast<const T*>(p.q) + b * p.q_strides.batch;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_strides.batch;
    const float* lse = static_cast<const float*>(p.lse) + b * p.lse_strides.batch;
    const float* delta = static_cast<const float*>(p.delta) + b * p.delta_strides.batch;
    const int head0 = kvh * grp;
    const int q_start = sp.q_start;

    // Issues the Q/dO/lse/delta copies of iteration `it` into stage `st` (no commit).
    auto issue_stream = [&](int it, int st) {
      const int hq = head0 + it / per_head;
      const int row0 = (m_first + it % per_head) * C::kLoop;  // span-local
      const int64_t grow = q_start + row0;                    // in the tensor
      prim::copy_tile_g2s_async<C::kLoop, C::kHeadDim, C::kThreads>(
          sQ + st * C::kLoopTile, q + hq * p.q_strides.head + grow * p.q_strides.row,
          p.q_strides.row, s_q - row0, tid);
      prim::copy_tile_g2s_async<C::kLoop, C::kHeadDim, C::kThreads>(
          sdO + st * C::kLoopTile, dout + hq * p.dout_strides.head + grow * p.dout_strides.row,
          p.dout_strides.row, s_q - row0, tid);
      if (tid < 2 * C::kLoop) {
        const bool is_lse = tid < C::kLoop;
        const int r = is_lse ? tid : tid - C::kLoop;
        const bool valid = row0 + r < s_q;
        const float* src = is_lse ? lse + hq * p.lse_strides.head : delta + hq * p.delta_strides.head;
        float* dst = (is_lse ? sLse : sDelta) + st * C::kLoop + r;
        cp_async_4(prim::smem_addr(dst), valid ? src + grow + r : src, valid);
      }
    };

    prim::copy_tile_g2s_async<C::kOwn, C::kHeadDim, C::kThreads>(
        sK, static_cast<const T*>(p.k) + b * p.k_strides.batch + kvh * p.k_strides.head +
                (sp.k_start + kv_row0) * p.k_strides.row,
        p.k_strides.row, s_k - kv_row0, tid);
    prim::copy_tile_g2s_async<C::kOwn, C::kHeadDim, C::kThreads>(
        sV, static_cast<const T*>(p.v) + b * p.v_strides.batch + kvh * p.v_strides.head +
                (sp.k_start + kv_row0) * p.v_strides.row,
        p.v_strides.row, s_k - kv_row0, tid);
    issue_stream(0, 0);
    prim::cp_async_commit();

    const uint32_t k_base = prim::smem_addr(sK);
    const uint32_t v_base = prim::smem_addr(sV);
    const int key_lane0 = kv_row0 + warp_row + km::lane_group(lane);  // + 8 for c2, c3
    const int col_lane = 2 * km::lane_in_group(lane);                  // + 8 j (+ 1 for c1, c3)
    const int off_a = ldsm_off_a<C::kHeadDim>(lane);
    const int off_b = ldsm_off_b<C::kHeadDim>(lane);

    for (int it = 0; it < n_iter; ++it) {
      const int st = it & 1;
      // The stage written here was last read in iteration it - 1, which ended with a barrier.
      if (it + 1 < n_iter) issue_stream(it + 1, st ^ 1);
      prim::cp_async_commit();  // possibly empty, keeps the group count uniform
      prim::cp_async_wait<1>();
      __syncthreads();

      const int m_block = m_first + it % per_head;
      const int q_row0 = m_block * C::kLoop;
      const uint32_t q_base = prim::smem_addr(sQ + st * C::kLoopTile);
      const uint32_t do_base = prim::smem_addr(sdO + st * C::kLoopTile);
      const float* lse_s = sLse + st * C::kLoop;
      const float* delta_s = sDelta + st * C::kLoop;

      // P^T = exp2(K Q^T * c - lse * log2e): rows = keys, columns = queries.
      float pt[C::kLTiles][4];
      gemm_rows_x_tileT<C, T>(pt, k_base, warp_row, q_base, off_a, off_b);
      const bool need_mask =
          km::band_block_needs_mask(m_block, n_block, C::kLoop, C::kOwn, s_q, s_k, sp.lo, sp.hi);
      // dV += P^T dO straight away so the float P^T dies here; dS^T below reuses the 16-bit
      // P^T the MMA consumed (dS^T is rounded to 16 bits right after anyway). This keeps the
      // d=128 tiles within 255 registers without spills.
#pragma unroll
      for (int j = 0; j < C::kLTiles; ++j) {
        const int col = 8 * j + col_lane;
        const float2 l = *reinterpret_cast<const float2*>(lse_s + col);
        const float l2[2] = {lse_log2(l.x, q_row0 + col < s_q), lse_log2(l.y, q_row0 + col + 1 < s_q)};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float s = pt[j][e];
          // the soft-cap before the mask: tanh(-inf) would be finite
          if constexpr (kSoftcap) s = prim::fast_tanh(s * p.consts.cap_pre);
          if (need_mask && !km::band_visible(q_row0 + col + (e & 1), key_lane0 + 8 * (e >> 1), s_k,
                                             sp.lo, sp.hi)) {
            s = -INFINITY;
          }
          pt[j][e] = prim::fast_exp2(fmaf(s, c, -l2[e & 1]));
        }
      }
      uint32_t a[C::kLSteps][4];
      prim::c_to_a<T>(a, pt);
      gemm_frag_x_tile<C, T>(acc_dv, a, do_base, off_a);

      // dS^T = P^T * (V dO^T - delta), delta per query (column).
      float dst[C::kLTiles][4];
      gemm_rows_x_tileT<C, T>(dst, v_base, warp_row, do_base, off_a, off_b);
#pragma unroll
      for (int kk = 0; kk < C::kLSteps; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          // a[kk][r] packs halves 2r and 2r + 1 of the A fragment (prim::c_to_a): registers
          // e0, e1 (columns col_lane, col_lane + 1) of n-tile j.
          const int j = 2 * kk + km::c_to_a_tile(2 * r);
          const int e0 = km::c_to_a_reg(2 * r);
          const int e1 = km::c_to_a_reg(2 * r + 1);
          float2 pv = prim::unpack2<T>(a[kk][r]);
          const float2 dl = *reinterpret_cast<const float2*>(delta_s + 8 * j + col_lane);
          if constexpr (kSoftcap) {
            // dS^T also takes dt = 1 - t^2. t is recovered from the 16-bit P^T the MMA used,
            // t = (log2(P) + lse * log2e) / c, rather than kept: P^T and t (or P^T dt) next
            // to each other do not fit 255 registers for d=128. Its error is that of P's
            // rounding divided by c (~2^-9 / (softcap * ln 2) for bf16), below that of the
            // 16-bit dS^T; P = 0 (masked, underflow, rows past q_len) contributes 0 anyway.
            const int col = 8 * j + col_lane;
            const float2 l = *reinterpret_cast<const float2*>(lse_s + col);
            const float l2[2] = {lse_log2(l.x, q_row0 + col < s_q), lse_log2(l.y, q_row0 + col + 1 < s_q)};
            const float tx = (log2f(pv.x) + l2[0]) * p.consts.inv_sm_scale_log2;
            const float ty = (log2f(pv.y) + l2[1]) * p.consts.inv_sm_scale_log2;
            pv.x = pv.x > 0.f ? pv.x * ((1.f - tx) * (1.f + tx)) : 0.f;
            pv.y = pv.y > 0.f ? pv.y * ((1.f - ty) * (1.f + ty)) : 0.f;
          }
          dst[j][e0] = pv.x * (dst[j][e0] - dl.x);
          dst[j][e1] = pv.y * (dst[j][e1] - dl.y);
        }
      }
      prim::c_to_a<T>(a, dst);
      gemm_frag_x_tile<C, T>(acc_dk, a, q_base, off_a);   // dK += dS^T Q
      __syncthreads();  // stage st is refilled by the next iteration's prefetch
    }
  }

  store_rows<C, T>(acc_dk, p.consts.softmax_scale, p.dk, p.dk_strides, b, kvh,
                   sp.k_start, kv_row0 + warp_row, s_k, p.accumulate, lane);
  store_rows<C, T>(acc_dv, 1.f, p.dv, p.dv_strides, b, kvh, sp.k_start, kv_row0 + warp_row, s_k,
                   p.accumulate, lane);
}

// ---------------------------------------------------------------------------------------
// dQ. Grid (ceil(longest q_len / kOwn) x spans, h, b).
// ---------------------------------------------------------------------------------------
template <typename C, typename T, bool kSpans, bool kSoftcap>
__global__ void __launch_bounds__(C::kThreads, 1) flash_bwd_dq_kernel(const BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + C::kOwnTile;
  T* sK = sdO + C::kOwnTile;           // [2][kLoop][d]
  T* sV = sK + 2 * C::kLoopTile;       // [2][kLoop][d]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp_row = 16 * (tid >> 5);
  // The span and its q block; causal: the last q blocks have the most kv blocks, start them
  // first. Rows and keys below are span-local.
  const prim::SpanTile sp =
      prim::load_span_tile<kSpans>(p.spans, p.shape, C::kOwn, /*q_side=*/true, /*last_first=*/true);
  if (!sp.valid) return;
  const int m_block = sp.block;
  const int hq = blockIdx.y;
  const int b = blockIdx.z;
  const int s_q = sp.q_len;
  const int s_k = sp.k_len;
  const int grp = static_cast<int>(p.shape.nheads / p.shape.nheads_kv);
  const int kvh = hq / grp;
  const float c = p.consts.sm_scale_log2;  // softmax scale (softcap when capping) * log2(e)

  // Same range as the forward: kv blocks [n_begin, n_end) hold a key some row of the tile sees.
  const km::Range<int> kv = km::band_kv_blocks(m_block, C::kOwn, C::kLoop, s_q, s_k, sp.lo, sp.hi);
  const int n_begin = kv.begin;
  const int n_end = kv.end;
  const int q_row0 = m_block * C::kOwn;

  float acc[C::kDTiles][4];
#pragma unroll
  for (int j = 0; j < C::kDTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }
  if (n_end <= n_begin && p.accumulate) return;

  if (n_end > n_begin) {
    const T* kg = static_cast<const T*>(p.k) + b * p.k_strides.batch + kvh * p.k_strides.head +
                  sp.k_start * p.k_strides.row;
    const T* vg = static_cast<const T*>(p.v) + b * p.v_strides.batch + kvh * p.v_strides.head +
                  sp.k_start * p.v_strides.row;
    auto issue_stream = [&](int n, int st) {
      const int row0 = n * C::kLoop;
      prim::copy_tile_g2s_async<C::kLoop, C::kHeadDim, C::kThreads>(
          sK + st * C::kLoopTile, kg + row0 * p.k_strides.row, p.k_strides.row, s_k - row0, tid);
      prim::copy_tile_g2s_async<C::kLoop, C::kHeadDim, C::kThreads>(
          sV + st * C::kLoopTile, vg + row0 * p.v_strides.row, p.v_strides.row, s_k - row0, tid);
    };
    prim::copy_tile_g2s_async<C::kOwn, C::kHeadDim, C::kThreads>(
        sQ, static_cast<const T*>(p.q) + b * p.q_strides.batch + hq * p.q_strides.head +
                (sp.q_start + q_row0) * p.q_strides.row,
        p.q_strides.row, s_q - q_row0, tid);
    prim::copy_tile_g2s_async<C::kOwn, C::kHeadDim, C::kThreads>(
        sdO, static_cast<const T*>(p.dout) + b * p.dout_strides.batch + hq * p.dout_strides.head +
                 (sp.q_start + q_row0) * p.dout_strides.row,
        p.dout_strides.row, s_q - q_row0, tid);
    issue_stream(n_begin, 0);
    prim::cp_async_commit();

    // This lane's two rows (c0/c1 and c2/c3): their lse and delta stay in registers.
    const int row_lane0 = q_row0 + warp_row + km::lane_group(lane);
    float l2[2], dl[2];
    {
      const float* lse = static_cast<const float*>(p.lse) + b * p.lse_strides.batch +
                         hq * p.lse_strides.head + sp.q_start;
      const float* delta = static_cast<const float*>(p.delta) + b * p.delta_strides.batch +
                           hq * p.delta_strides.head + sp.q_start;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row_lane0 + 8 * half;
        const bool valid = row < s_q;
        l2[half] = lse_log2(valid ? lse[row] : 0.f, valid);
        dl[half] = valid ? delta[row] : 0.f;
      }
    }

    const uint32_t q_base = prim::smem_addr(sQ);
    const uint32_t do_base = prim::smem_addr(sdO);
    const int col_lane = 2 * km::lane_in_group(lane);
    const int off_a = ldsm_off_a<C::kHeadDim>(lane);
    const int off_b = ldsm_off_b<C::kHeadDim>(lane);

    for (int n = n_begin; n < n_end; ++n) {
      const int st = (n - n_begin) & 1;
      if (n + 1 < n_end) issue_stream(n + 1, st ^ 1);
      prim::cp_async_commit();
      prim::cp_async_wait<1>();
      __syncthreads();

      const uint32_t k_base = prim::smem_addr(sK + st * C::kLoopTile);
      const uint32_t v_base = prim::smem_addr(sV + st * C::kLoopTile);
      const int key0 = n * C::kLoop;

      float pr[C::kLTiles][4];
      gemm_rows_x_tileT<C, T>(pr, q_base, warp_row, k_base, off_a, off_b);  // S = Q K^T
      const bool need_mask = km::band_block_needs_mask(m_block, n, C::kOwn, C::kLoop, s_q, s_k, sp.lo, sp.hi);
      // P, or with the soft-cap P * dt (the dQ kernel needs P only inside dS).
#pragma unroll
      for (int j = 0; j < C::kLTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float s = pr[j][e];
          float dt = 1.f;
          if constexpr (kSoftcap) {
            s = prim::fast_tanh(s * p.consts.cap_pre);  // before the mask: tanh(-inf) would be finite
            dt = (1.f - s) * (1.f + s);
          }
          if (need_mask && !km::band_visible(row_lane0 + 8 * (e >> 1), key0 + 8 * j + col_lane + (e & 1),
                                             s_k, sp.lo, sp.hi)) {
            s = -INFINITY;
          }
          const float pv = prim::fast_exp2(fmaf(s, c, -l2[e >> 1]));
          pr[j][e] = kSoftcap ? pv * dt : pv;
        }
      }
      float ds[C::kLTiles][4];
      gemm_rows_x_tileT<C, T>(ds, do_base, warp_row, v_base, off_a, off_b);  // dP = dO V^T
#pragma unroll
      for (int j = 0; j < C::kLTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[j][e] = pr[j][e] * (ds[j][e] - dl[e >> 1]);
      }
      uint32_t a[C::kLSteps][4];
      prim::c_to_a<T>(a, ds);
      gemm_frag_x_tile<C, T>(acc, a, k_base, off_a);  // dQ += dS K
      __syncthreads();
    }
  }

  store_rows<C, T>(acc, p.consts.softmax_scale, p.dq, p.dq_strides, b, hq,
                   sp.q_start, q_row0 + warp_row, s_q, p.accumulate, lane);
}

template <int kHeadDim, int kNWarps, typename T, bool kSpans, bool kSoftcap>
void launch_bwd(const BwdParams& p_in, cudaStream_t stream) {
  BwdParams p = p_in;
  p.consts = cuda_consts(p.shape);
  using C = Cfg<kHeadDim, kNWarps>;
  // Grids over (tiles of the longest span x spans, heads, batch); flash_api.cu checked limits.
  const bool spans = p.spans.count > 0;
  const int max_q = static_cast<int>(spans ? p.spans.max_q_len : p.shape.seqlen_q);
  const int max_k = static_cast<int>(spans ? p.spans.max_k_len : p.shape.seqlen_k);
  const unsigned n_spans = spans ? static_cast<unsigned>(p.spans.count) : 1u;
  const int batch = static_cast<int>(p.shape.batch);

  auto dkdv = flash_bwd_dkdv_kernel<C, T, kSpans, kSoftcap>;
  check_cuda(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemDkdv),
             "flash bwd dK/dV: cudaFuncSetAttribute(max dynamic shared memory)");
  const dim3 grid_kv(km::ceil_div(max_k, C::kOwn) * n_spans, static_cast<unsigned>(p.shape.nheads_kv), batch);
  if (grid_kv.x > 0) {
    dkdv<<<grid_kv, C::kThreads, C::kSmemDkdv, stream>>>(p);
    check_cuda(cudaGetLastError(), "flash bwd dK/dV kernel launch");
  }

  auto dq = flash_bwd_dq_kernel<C, T, kSpans, kSoftcap>;
  check_cuda(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemDq),
             "flash bwd dQ: cudaFuncSetAttribute(max dynamic shared memory)");
  const dim3 grid_q(km::ceil_div(max_q, C::kOwn) * n_spans, static_cast<unsigned>(p.shape.nheads), batch);
  if (grid_q.x > 0) {
    dq<<<grid_q, C::kThreads, C::kSmemDq, stream>>>(p);
    check_cuda(cudaGetLastError(), "flash bwd dQ kernel launch");
  }
}

}  // namespace bwd

// Explicitly instantiated once per (head dim, element type) in flash_bwd_hdim*_*.cu.
template <int kHeadDim, typename Element>
void run_flash_bwd(const BwdParams& params, cudaStream_t stream) {
  // Config 0 needs up to ~129 KB of shared memory per CTA: more than sm_86/sm_89 can opt in
  // to (~99 KB). There the conservative tiles run instead of a failed launch.
  using Fast = bwd::Cfg<kHeadDim, 8>;
  int device = 0, smem_optin = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "cudaDeviceGetAttribute(max shared memory per block, opt-in)");
  const bool fast_fits = smem_optin >= Fast::kSmemDkdv && smem_optin >= Fast::kSmemDq;
  // Three variants per config, as the forward (<kSpans, kSoftcap>): the dense path, spans,
  // spans and/or soft-cap.
  const bool small = params.config == 1 || !fast_fits;
  if (params.shape.softcap > 0.0) {
    if (small) bwd::launch_bwd<kHeadDim, 4, Element, true, true>(params, stream);
    else bwd::launch_bwd<kHeadDim, 8, Element, true, true>(params, stream);
  } else if (params.spans.count > 0) {
    if (small) bwd::launch_bwd<kHeadDim, 4, Element, true, false>(params, stream);
    else bwd::launch_bwd<kHeadDim, 8, Element, true, false>(params, stream);
  } else {
    if (small) bwd::launch_bwd<kHeadDim, 4, Element, false, false>(params, stream);
    else bwd::launch_bwd<kHeadDim, 8, Element, false, false>(params, stream);
  }
}

}  // namespace ringseq
