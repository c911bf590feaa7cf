// Device building blocks of the flash-attention kernels: inline PTX for tensor-core MMA,
// ldmatrix and cp.async, quad reductions, fast exp2 and 16-bit packing, and the swizzled
// global -> shared tile copy. Torch-free; index math lives in ../kernel_math.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../attn_params.h"
#include "../kernel_math.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "ringseq kernels need sm_80 or newer (bf16 mma.sync, cp.async)"
#endif

namespace ringseq {
namespace prim {

#ifndef RS_DEV
#define RS_DEV __device__ __forceinline__
#endif

RS_DEV uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ----------------------------------------------------------------------------------------
// Tensor cores: D = A * B + D, m16n8k16, float32 accumulators, A row-major, B "col".
// ----------------------------------------------------------------------------------------
template <typename Element>
RS_DEV void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same<Element, __nv_bfloat16>::value || std::is_same<Element, __half>::value,
                "mma_16816 supports __nv_bfloat16 and __half");
  if constexpr (std::is_same<Element, __nv_bfloat16>::value) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// B operand given as two registers picked out of an x4 ldmatrix result.
template <typename Element>
RS_DEV void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  mma_16816<Element>(d, a, b);
}

// ----------------------------------------------------------------------------------------
// ldmatrix: `addr` is this lane's row address (shared state space, 16-byte aligned), see
// km::ldsm_a_row / km::ldsm_b_row for which row each lane points at.
// ----------------------------------------------------------------------------------------
RS_DEV void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
RS_DEV void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// x2: lanes 0..15 supply addresses (matrix j = lane >> 3); the other lanes' addresses are
// ignored but must still be valid shared addresses.
RS_DEV void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
RS_DEV void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

// ----------------------------------------------------------------------------------------
// cp.async: 16-byte global -> shared copy bypassing L1. With valid == false the source size
// is 0, so nothing is read and the 16 destination bytes are zero-filled: ragged tails never
// touch memory past the end of a tensor. `gmem` must still be a valid address then (callers
// pass the tensor base).
// ----------------------------------------------------------------------------------------
RS_DEV void cp_async_16(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(src_bytes)
               : "memory");
}
RS_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight. Other
// threads' copies become visible only after a following __syncthreads().
template <int N>
RS_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ----------------------------------------------------------------------------------------
// Row statistics: the 4 lanes of a group (lane >> 2) hold one row of a C fragment.
// ----------------------------------------------------------------------------------------
RS_DEV float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
RS_DEV float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// 2^x with one MUFU instruction; exp2(-inf) = +0, which the online softmax relies on.
RS_DEV float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh(x) = 1 - 2 / (2^(2 x log2(e)) + 1): one MUFU exp2, one fast division. The error is
// absolute (~1e-7; no relative accuracy near 0), which is what the soft-cap needs: its capped
// score softcap * tanh(x / softcap) is then off by ~softcap * 1e-7. Saturates to exactly +-1
// for large |x| (the exp2 gives inf or 0), never NaN for finite x.
RS_DEV float fast_tanh(float x) { return 1.f - 2.f / (fast_exp2(x * 2.8853900817779268f) + 1.f); }

// Two floats -> one .b32 of 16-bit elements, `lo` in the low half (the lower column of a
// fragment pair), round to nearest even.
template <typename Element>
RS_DEV uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<Element, __nv_bfloat16>::value) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <typename Element>
RS_DEV float2 unpack2(uint32_t v) {
  if constexpr (std::is_same<Element, __nv_bfloat16>::value) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
  }
}

// C fragments of 2 * kSteps adjacent n8 tiles (float) -> A fragments of the kSteps k16 steps
// of the next GEMM (16-bit pairs), in registers: P for P V, dS for dS K, P^T / dS^T in the
// backward. Only through km::c_to_a_tile / km::c_to_a_reg, which the CPU tests check against
// the PTX fragment layouts.
template <typename Element, int kSteps>
RS_DEV void c_to_a(uint32_t (&a)[kSteps][4], const float (&c)[2 * kSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tile = 2 * kk + km::c_to_a_tile(2 * r);
      a[kk][r] = pack2<Element>(c[tile][km::c_to_a_reg(2 * r)], c[tile][km::c_to_a_reg(2 * r + 1)]);
    }
  }
}

// ----------------------------------------------------------------------------------------
// Tiles. A (kRows x kCols) tile of 16-bit elements whose rows are `row_stride` elements apart
// in global memory (last dim contiguous), rows >= rows_valid zero-filled.
// ----------------------------------------------------------------------------------------

// Asynchronous swizzled copy global -> shared by kThreads threads; consecutive threads take
// consecutive 16-byte chunks of a row, so global reads coalesce and the swizzled smem
// writes of 8 consecutive threads hit 8 distinct bank groups. The caller commits.
template <int kRows, int kCols, int kThreads, typename Element>
RS_DEV void copy_tile_g2s_async(Element* smem, const Element* gmem, int64_t row_stride,
                                int rows_valid, int tid) {
  constexpr int kChunksPerRow = kCols / km::kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kCols % 64 == 0, "swizzled rows must be a multiple of 64 elements");
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly over the threads");
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  const int chunk = tid % kChunksPerRow;
  const int row0 = tid / kChunksPerRow;
  // Walk the source with one running pointer: precomputed per-row 64-bit offsets would be
  // hoisted out of the kv loop and occupy registers the accumulators need.
  const uint32_t s_base = smem_addr(smem) + 2u * km::swz_offset(row0, chunk * km::kChunkElems, kCols);
  const Element* src = gmem + row0 * row_stride + chunk * km::kChunkElems;
  const int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const bool valid = row0 + it * kRowsPerPass < rows_valid;
    static_assert(kRowsPerPass % 8 == 0, "row steps must keep row & 7 (the swizzle phase)");
    cp_async_16(s_base + 2u * (it * kRowsPerPass * kCols), valid ? src : gmem, valid);
    src += pass_stride;
  }
}

// Synchronous swizzled copy shared -> global with 16-byte stores, rows >= rows_valid skipped.
// The caller synchronizes before (so the tile is complete) and after (before reusing smem).
template <int kRows, int kCols, int kThreads, typename Element>
RS_DEV void copy_tile_s2g(Element* gmem, const Element* smem, int64_t row_stride, int rows_valid,
                          int tid) {
  constexpr int kChunksPerRow = kCols / km::kChunkElems;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kThreads == 0, "tile chunks must divide evenly over the threads");
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  const int chunk = tid % kChunksPerRow;
  const int row0 = tid / kChunksPerRow;
#pragma unroll
  for (int it = 0; it < kChunks / kThreads; ++it) {
    const int row = row0 + it * kRowsPerPass;
    if (row < rows_valid) {
      const uint4 v = *reinterpret_cast<const uint4*>(
          smem + km::swz_offset(row, chunk * km::kChunkElems, kCols));
      *reinterpret_cast<uint4*>(gmem + row * row_stride + chunk * km::kChunkElems) = v;
    }
  }
}

// Writes one C fragment pair (two floats of one row, columns col and col+1) into a
// swizzled 16-bit smem tile; col is even, so the pair never straddles a chunk.
template <int kCols, typename Element>
RS_DEV void store_pair_s(Element* smem, int row, int col, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(smem + km::swz_offset(row, col, kCols)) = pack2<Element>(lo, hi);
}

// ----------------------------------------------------------------------------------------
// Spans: which span and which of its tiles a CTA computes (docs/kernels.md, "Spans, bands and
// softcap"). Grids are (tiles of the longest span x spans, ...): blockIdx.x = rank * n_spans +
// span, so every span's first-ranked tiles are in the first wave; CTAs whose rank is past
// their span's tiles return at once. last_first: rank 0 is the span's last tile (the
// forward's and dQ kernel's heaviest under a causal band), else its first (the dK/dV
// kernel's heaviest).
//
// kSpans = false: the call has no spans, and the one span comes from the shape in the
// parameter bank. Why the kernels are compiled both ways: values loaded from the spans array
// live in vector registers, and so does every address and range derived from them, where the
// parameter-bank and blockIdx values of the dense path are uniform and cost none; the dense
// path keeps the registers it had before spans existed (the 128 x 64 d=128 forward tile has
// none to spare, see run_flash_fwd).
// ----------------------------------------------------------------------------------------
struct SpanTile {
  int q_start, k_start;  // the span's first rows (< 2^30, flash_api.cu)
  int q_len, k_len, lo, hi;  // lengths and the clamped band (|lo|, |hi| <= 2^30)
  int block;                 // the CTA's tile within the span
  bool valid;                // false: blockIdx.x is past its span's tiles
};

template <bool kSpans>
RS_DEV SpanTile load_span_tile(const SpanList& spans, const AttnShape& shape, int tile, bool q_side,
                               bool last_first) {
  AttnSpan s;
  int rank = static_cast<int>(blockIdx.x);
  if (kSpans && spans.count > 0) {
    const int n_spans = static_cast<int>(spans.count);
    s = spans.data[rank % n_spans];
    rank /= n_spans;
  } else {
    s = default_span(shape);
  }
  SpanTile out;
  out.q_start = static_cast<int>(s.q_start);
  out.k_start = static_cast<int>(s.k_start);
  out.q_len = static_cast<int>(s.q_len);
  out.k_len = static_cast<int>(s.k_len);
  out.lo = static_cast<int>(s.band_lo);
  out.hi = static_cast<int>(s.band_hi);
  const int tiles = km::ceil_div(q_side ? out.q_len : out.k_len, tile);
  out.valid = rank < tiles;
  out.block = last_first ? tiles - 1 - rank : rank;
  return out;
}

// The split-KV kernel's tile (flash_fwd_split_kernel): the span of batch row blockIdx.z of a
// KV-cache call -- its valid keys and band from km::kvcache_span, read from the per-row
// arrays in device memory -- or the call's default span. `batch_kv` is the cache row to read;
// `bad` marks a row whose device-side values are out of range (seqlens past the cache,
// leftpad past seqlens, batch_idx outside the cache), which the binding cannot check without
// a synchronization: its outputs become NaN instead of reads outside the cache.
struct KvTile {
  SpanTile t;
  int batch_kv;
  bool bad;
};

RS_DEV KvTile load_kvcache_tile(const FwdParams& p, int tile, int rank) {
  KvTile out;
  const int b = static_cast<int>(blockIdx.z);
  AttnSpan s = default_span(p.shape);
  out.batch_kv = b;
  out.bad = false;
  if (p.kv.seqlens != nullptr) {
    const int seqlen = p.kv.seqlens[b];
    const int leftpad = p.kv.leftpad != nullptr ? p.kv.leftpad[b] : 0;
    out.batch_kv = p.kv.batch_idx != nullptr ? p.kv.batch_idx[b] : b;
    out.bad = seqlen < 0 || seqlen > p.shape.seqlen_k || leftpad < 0 || leftpad > seqlen ||
              out.batch_kv < 0 || out.batch_kv >= p.kv.batch_cache;
    const km::KvSpan<int> ks = km::kvcache_span<int>(
        static_cast<int>(p.shape.seqlen_q), leftpad, out.bad ? 0 : seqlen, p.shape.causal,
        static_cast<int>(p.kv.window_left), static_cast<int>(p.kv.window_right), p.kv.heads_as_rows);
    s.k_start = out.bad ? 0 : ks.k_start;
    s.k_len = out.bad ? 0 : ks.k_len;
    s.band_lo = ks.lo;
    s.band_hi = ks.hi;
    if (out.bad) out.batch_kv = 0;
  }
  out.t.q_start = 0;
  out.t.k_start = static_cast<int>(s.k_start);
  out.t.q_len = static_cast<int>(s.q_len);
  out.t.k_len = static_cast<int>(s.k_len);
  out.t.lo = static_cast<int>(s.band_lo);
  out.t.hi = static_cast<int>(s.band_hi);
  const int tiles = km::ceil_div(out.t.q_len, tile);
  out.t.valid = rank < tiles;
  out.t.block = tiles - 1 - rank;
  return out;
}

}  // namespace prim
}  // namespace ringseq
