// AMX tile products for the bfloat16 GEMMs of the amx level (one copy per ISA level, see
// vec.h; declarations only below it): both of the forward's, and the backward's S and dP.
//
// Why: on the CPUs that have AMX (Intel Sapphire Rapids and later) one tdpbf16ps multiplies a
// 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 float sums, 1.6-2.1 TFLOP/s per core
// measured against ~0.14 for 512-bit float FMAs, and torch's bf16 SDPA already uses it there
// (benchmarks/RESULTS.md). The forward (kernels/flash_fwd.cpp) runs both of its products on
// tiles when the inputs are bf16 and the head dim is a multiple of 32 (one A tile row):
//   Sᵀ = K·Qᵀ: A = the K rows as they lie (32 bf16 = 64 bytes per tile row), B = the Qᵀ pairs
//              the avx512bf16 level packs already (pair k of query i at [k][i]: AMX's B layout);
//   Oᵀ = Vᵀ·Pᵀ: A = Vᵀ (d rows of keys, HeadColumns below), B = Pᵀ as bf16 pairs of key rows,
//              written by the softmax's exp pass (exp_pair_rows) instead of P itself.
//              Oᵀ keeps the queries along its rows, the way Sᵀ, cmax, alpha and l already
//              have them, so the online-softmax rescale is one vector multiply
//              per row of Oᵀ (skipped for tiles that move no maximum) and nothing is transposed
//              per key tile; O is transposed once per work item.
// P is rounded to bf16 before P·V, as flash-attn's kernels and torch's bf16 SDPA do (l sums P in
// float32). Inputs and results below 2^-126 are flushed to zero, as vdpbf16ps does.
//
// Tile state is per thread: each work item loads the configuration (amx_configure) and
// releases it at the end, so no state leaks into torch's other code on the pool's threads.
// The OS must grant the process the tile data state first (Linux: arch_prctl
// ARCH_REQ_XCOMP_PERM), which dispatch.cpp requests before it offers this level.
#pragma once

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

// dst (cols x rows, row stride ldd) = srcᵀ for a rows x cols src (row stride lds).
template <typename T>
inline void transpose(const T* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

RS_INLINE const bf16_t* as_bf16(const uint32_t* pairs) { return reinterpret_cast<const bf16_t*>(pairs); }

// Rows [0, n) of C (cols floats each, a multiple of a vector, row stride ldc) times scale, and
// with cmax (not null) cmax[i] = max(cmax[i], C[j][i]) over those rows, as gemm's kStoreMax.
template <typename T>
inline void scale_rows(T* C, int64_t ldc, int64_t n, int64_t cols, T scale, T* cmax) {
  constexpr int64_t VW = kVW<T>;
  for (int64_t j = 0; j < n; ++j) {
    T* row = C + j * ldc;
    for (int64_t i = 0; i < cols; i += VW) {
      const vec_t<T> x = vload(row + i) * vsplat(scale);
      vstore(row + i, x);
      if (cmax != nullptr) vstore(cmax + i, vmax(x, vload(cmax + i)));
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
constexpr bool kAmx = true;

// Query rows per work item and keys per key tile of the forward on tiles (multiples of 32: a
// 2 x 2 block of C tiles, and whole 32-key steps of Pᵀ). Larger than the float tiles (vec.h):
// each key tile's Oᵀ is loaded and stored once per 32-key step of the product, and the
// softmax passes over Sᵀ cost the same per score, so bigger tiles spread those over more
// tile products. Measured on a Sapphire Rapids-class Xeon (1 thread, s = 4096, h = 8, full,
// bf16): d = 128, 206 -> 167 ms against 128 x 128 (384 x 256, 256 x 384, 256 x 512: within 3 %
// of 256 x 256); d = 64, 256 x 256 as fast as 128 x 256 (the float tiles) and 8 % faster than
// 256 x 128.
constexpr int64_t kAmxBlockM = 256, kAmxBlockN = 256;

// Every tile is 16 rows x 64 bytes: tiles 0-3 the 2 x 2 block of C (16 x 16 floats each), 4-5
// two A tiles (16 rows x 32 bf16), 6-7 two B tiles (16 rows of 16 bf16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_configure() {
  TileConfig c{};
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

inline void amx_release() { _tile_release(); }

// One MB x NB block of 16 x 16 C tiles: C (row stride ldc floats) = / += A·B over kb steps of
// 32 terms, A (16·MB rows x 32·kb bf16, row stride lda elements), B (16·kb pair rows x 16·NB
// pairs, row stride ldb).
template <int MB, int NB, bool kAccumulate>
RS_INLINE void amx_block(int64_t kb, const bf16_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                         float* C, int64_t ldc) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // bytes
  float* c10 = C + 16 * ldc;
  if constexpr (kAccumulate) {
    _tile_loadd(0, C, sc);
    if constexpr (NB > 1) _tile_loadd(1, C + 16, sc);
    if constexpr (MB > 1) _tile_loadd(2, c10, sc);
    if constexpr (MB > 1 && NB > 1) _tile_loadd(3, c10 + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (MB > 1) _tile_zero(2);
    if constexpr (MB > 1 && NB > 1) _tile_zero(3);
  }
  for (int64_t k = 0; k < kb; ++k) {
    _tile_loadd(4, A + k * 32, sa);
    if constexpr (MB > 1) _tile_loadd(5, A + 16 * lda + k * 32, sa);
    _tile_loadd(6, B + k * 16 * ldb, sb);
    if constexpr (NB > 1) _tile_loadd(7, B + k * 16 * ldb + 16, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MB > 1 && NB > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, sc);
  if constexpr (NB > 1) _tile_stored(1, C + 16, sc);
  if constexpr (MB > 1) _tile_stored(2, c10, sc);
  if constexpr (MB > 1 && NB > 1) _tile_stored(3, c10 + 16, sc);
}

// C (M x N floats, row stride ldc) = A·B, or C += A·B with kAccumulate: A (M x 32·kb bf16, row
// stride lda), B (16·kb pair rows x N, row stride ldb uint32; pair k of column n holds terms 2k
// and 2k+1). M and N are multiples of 16.
template <bool kAccumulate>
inline void amx_gemm(int64_t M, int64_t N, int64_t kb, const bf16_t* A, int64_t lda, const uint32_t* B,
                     int64_t ldb, float* C, int64_t ldc) {
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const bool two_m = m0 + 32 <= M;
    const bf16_t* a = A + m0 * lda;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      const bool two_n = n0 + 32 <= N;
      float* c = C + m0 * ldc + n0;
      const uint32_t* b = B + n0;
      if (two_m && two_n) {
        amx_block<2, 2, kAccumulate>(kb, a, lda, b, ldb, c, ldc);
      } else if (two_m) {
        amx_block<2, 1, kAccumulate>(kb, a, lda, b, ldb, c, ldc);
      } else if (two_n) {
        amx_block<1, 2, kAccumulate>(kb, a, lda, b, ldb, c, ldc);
      } else {
        amx_block<1, 1, kAccumulate>(kb, a, lda, b, ldb, c, ldc);
      }
    }
  }
}

// C (round_up(M, 16) x N floats, row stride ldc) = A·B for A = M contiguous rows of d bf16 (kd
// = d / 2 pairs each; d a multiple of 32) and B the 16·(d / 32) x N pairs: whole 16-row tiles
// of A in place, the last partial one from a zero-padded copy in `tail` (16 x kd pairs, which
// may be A's own buffer: the copy runs after the rows it overwrites were read). C's rows past M
// take the padding's zeros.
inline void amx_pair_rows_gemm(int64_t M, int64_t N, int64_t d, const uint32_t* A, const uint32_t* B,
                               int64_t ldb, float* C, int64_t ldc, uint32_t* tail) {
  const int64_t kd = d / 2, m16 = M - M % 16;
  if (m16 > 0) amx_gemm<false>(m16, N, d / 32, as_bf16(A), d, B, ldb, C, ldc);
  if (m16 < M) {
    std::memmove(tail, A + m16 * kd, static_cast<size_t>((M - m16) * kd) * sizeof(uint32_t));
    fill(tail + (M - m16) * kd, (16 - (M - m16)) * kd, 0u);
    amx_gemm<false>(16, N, d / 32, as_bf16(tail), d, B, ldb, C + m16 * ldc, ldc);
  }
}

// C (d x N floats, row stride ldc) = / += (accumulate) Vᵀ·Pᵀ over n keys: vt (d rows of keys,
// row stride ldv), pt (round_up(n, 32) / 2 pair rows, zero past n). Whole 32-key steps read
// vt in place; a last partial step reads its n % 32 keys from a zero-padded copy in tail (d x
// 32), not the keys held past n (HeadColumns keeps other items' keys there: an inf or NaN among
// them would make 0·inf = NaN in rows that cannot see them). C is stored and reloaded between
// the two products exactly, so the sums are the same as one product over all steps.
inline void amx_pv(int64_t d, int64_t N, int64_t n, const bf16_t* vt, int64_t ldv, const uint32_t* pt,
                   int64_t ldp, float* C, int64_t ldc, bf16_t* tail, bool accumulate) {
  const int64_t n32 = n - n % 32;
  if (n32 > 0) {
    if (accumulate) {
      amx_gemm<true>(d, N, n32 / 32, vt, ldv, pt, ldp, C, ldc);
    } else {
      amx_gemm<false>(d, N, n32 / 32, vt, ldv, pt, ldp, C, ldc);
    }
  }
  if (n32 == n) return;
  for (int64_t c = 0; c < d; ++c) {
    bf16_t* o = tail + c * 32;
    std::memcpy(o, vt + c * ldv + n32, static_cast<size_t>(n - n32) * sizeof(bf16_t));
    fill(o + (n - n32), 32 - (n - n32), bf16_t{0});
  }
  if (accumulate || n32 > 0) {
    amx_gemm<true>(d, N, 1, tail, 32, pt + n32 / 2 * ldp, ldp, C, ldc);
  } else {
    amx_gemm<false>(d, N, 1, tail, 32, pt + n32 / 2 * ldp, ldp, C, ldc);
  }
}

// dst[r] = a_r·b_r for `rows` pairs of bf16 rows (row strides lda, ldb; d a multiple of 32),
// each summed as amx_gemm sums one element of A·Bᵀ (the diagonal of 16 x 16 tile products, 16
// rows at a time): delta for a dP computed on tiles, so that dP - delta is exactly 0 where a
// row of out is a row of V.
inline void amx_diagonal_dots(const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, int64_t rows,
                              int64_t d, float* dst) {
  const int64_t kd = d / 2;
  Scratch<uint32_t> ap(16 * kd), bp(kd * 16);
  alignas(64) float c[16 * 16];
  amx_configure();
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = imin(16, rows - r0);
    pack_pair_rows(a + r0 * lda, lda, nr, d, ap.get());
    fill(ap.get() + nr * kd, (16 - nr) * kd, 0u);
    pack_pairs_transposed(b + r0 * ldb, ldb, nr, d, bp.get(), 16, 16);
    amx_gemm<false>(16, 16, d / 32, as_bf16(ap.get()), d, bp.get(), 16, c, 16);
    for (int64_t i = 0; i < nr; ++i) dst[r0 + i] = c[i * 16 + i];
  }
  amx_release();
}

// The 16-bit lanes of cvtne2ps_pbh(odd, even) (even row's 16 values low, odd row's high) in
// pair order: even[i] and odd[i] side by side.
alignas(64) constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                  21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

RS_INLINE __m512i bf16_pairs(__m512 even, __m512 odd, __m512i interleave) {
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// P = exp(x - m_use) of two rows of Sᵀ (odd null: past the tile's keys, P = 0), each added to
// its column's partial sum in lpart (the even row first, as the row-by-row loop adds them),
// and stored as bf16 pairs in dst (a row of Pᵀ's pairs) instead of back to Sᵀ. cols is a
// multiple of 16.
inline void exp_pair_rows(const float* even, const float* odd, int64_t cols, const float* m_use,
                          float* lpart, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  int64_t i = 0;
  if (odd != nullptr) {
    for (; i + 32 <= cols; i += 32) {
      const __m512 m0 = _mm512_loadu_ps(m_use + i), m1 = _mm512_loadu_ps(m_use + i + 16);
      vec_t<float> e[4] = {_mm512_loadu_ps(even + i) - m0, _mm512_loadu_ps(odd + i) - m0,
                           _mm512_loadu_ps(even + i + 16) - m1, _mm512_loadu_ps(odd + i + 16) - m1};
      exp_vecs<4, /*kNonPositive=*/true>(e);
      _mm512_storeu_ps(lpart + i, (_mm512_loadu_ps(lpart + i) + e[0]) + e[1]);
      _mm512_storeu_ps(lpart + i + 16, (_mm512_loadu_ps(lpart + i + 16) + e[2]) + e[3]);
      _mm512_storeu_si512(dst + i, bf16_pairs(e[0], e[1], idx));
      _mm512_storeu_si512(dst + i + 16, bf16_pairs(e[2], e[3], idx));
    }
  }
  for (; i < cols; i += 16) {
    const __m512 m = _mm512_loadu_ps(m_use + i);
    vec_t<float> e[2] = {_mm512_loadu_ps(even + i) - m, odd != nullptr ? _mm512_loadu_ps(odd + i) - m : _mm512_setzero_ps()};
    exp_vecs<2, /*kNonPositive=*/true>(e);
    __m512 sum = _mm512_loadu_ps(lpart + i) + e[0];
    if (odd != nullptr) sum += e[1];
    _mm512_storeu_ps(lpart + i, sum);
    _mm512_storeu_si512(dst + i, bf16_pairs(e[0], odd != nullptr ? e[1] : _mm512_setzero_ps(), idx));
  }
}

#else
// Declared only: the callers' amx branches are discarded (kAmx).
constexpr bool kAmx = false;
constexpr int64_t kAmxBlockM = 0, kAmxBlockN = 0;
void amx_configure();
void amx_release();
template <bool kAccumulate>
void amx_gemm(int64_t M, int64_t N, int64_t kb, const bf16_t* A, int64_t lda, const uint32_t* B,
              int64_t ldb, float* C, int64_t ldc);
void exp_pair_rows(const float* even, const float* odd, int64_t cols, const float* m_use, float* lpart,
                   uint32_t* dst);
void amx_pair_rows_gemm(int64_t M, int64_t N, int64_t d, const uint32_t* A, const uint32_t* B, int64_t ldb,
                        float* C, int64_t ldc, uint32_t* tail);
void amx_diagonal_dots(const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, int64_t rows, int64_t d,
                       float* dst);
void amx_pv(int64_t d, int64_t N, int64_t n, const bf16_t* vt, int64_t ldv, const uint32_t* pt, int64_t ldp,
            float* C, int64_t ldc, bf16_t* tail, bool accumulate);
#endif

// Vᵀ of one kv head's rows [begin, end) (d rows of bf16 keys at row stride ld, zero past the
// keys), packed once per thread and read again by the thread's next items whose rows lie inside
// (the forward's q tiles of one head all read its V). An item whose rows are not inside packs
// its own range, or, past cap keys, each key tile's. ld keeps 32 zero keys past the range
// (a tile of Pᵀ pairs reads whole 32-key steps from any offset) and is an odd number of cache
// lines (packed_ld's reason: tile loads go down the rows).
struct HeadColumns {
  Scratch<bf16_t> buf;
  int64_t cap, d, head = -1, begin = 0, end = 0, ld = 0;
  HeadColumns(int64_t cap_keys, int64_t d_) : buf(d_ * stride(cap_keys)), cap(cap_keys), d(d_) {}
  static int64_t stride(int64_t keys) {
    const int64_t ld = round_up(keys, 32) + 32;  // 64-byte lines of bf16
    return (ld / 32) % 2 == 0 ? ld + 32 : ld;
  }
  // Key r0 of Vᵀ for keys [r0, r1) of `head` (column r at result + (r - r0), row stride ld):
  // the held columns, or rows v (row stride ldv, row r0 first) packed now. 0 < r1 - r0 <= cap.
  const bf16_t* columns(int64_t head_, int64_t r0, int64_t r1, const bf16_t* v, int64_t ldv) {
    if (head == head_ && begin <= r0 && r1 <= end) return buf.get() + (r0 - begin);
    ld = stride(r1 - r0);
    bf16_t* dst = buf.get();
    const int64_t keys = r1 - r0;
    // 16 keys at a time: each source row is read once, 16 destination rows written together.
    for (int64_t j0 = 0; j0 < keys; j0 += 16) {
      const int64_t nj = imin(16, keys - j0);
      for (int64_t c = 0; c < d; ++c) {
        bf16_t* o = dst + c * ld + j0;
        for (int64_t j = 0; j < nj; ++j) o[j] = v[(j0 + j) * ldv + c];
      }
    }
    for (int64_t c = 0; c < d; ++c) fill(dst + c * ld + keys, ld - keys, bf16_t{0});
    head = head_;
    begin = r0;
    end = r1;
    return dst;
  }
};

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
