// AMX tile products for the bfloat16 GEMMs of the amx level (one copy per ISA level, see
// vec.h; declarations only below it): the forward's two and the backward's five.
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
#include "gemm.h"  // Band
#include <cstdlib>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

RS_INLINE const bf16_t* as_bf16(const uint32_t* pairs) { return reinterpret_cast<const bf16_t*>(pairs); }

// Rows [0, n) of C (cols floats each, a multiple of a vector, row stride ldc) times scale, and
// with cmax (not null) cmax[i] = max(cmax[i], C[j][i]) over those rows, as gemm's kStoreMax.
// (The forward's unmasked tiles skip this pass: amx_gemm takes their maxima as it stores C.)
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

// What amx_gemm does besides C = / += A·B, each while a 32 x 32 block of C is in L1 (a pass
// over the whole of C before or after it would read C from L2). Row, column and step indexes
// below are the product's own plus row_off / step_off (a call over part of a larger product).
struct AmxExtras {
  // C = A·B: cmax[j] = max(cmax[j], C[i][j]) over rows i < max_rows (N floats).
  float* cmax = nullptr;
  int64_t max_rows = 0;
  // C += A·B: C's column j scaled by alpha[j] first (the online softmax's rescale of Oᵀ).
  const float* alpha = nullptr;
  // Blocks where no row i sees a column j (j - i outside [lo, hi]) are not computed (Sᵀ of a
  // masked key tile; the caller masks those scores).
  Band rows_see = {};
  int64_t row_off = 0;
  // 32-term steps holding no term k that a column j of the block sees (k - j outside [lo, hi],
  // k < 32·steps_total) are skipped (Oᵀ = Vᵀ·Pᵀ, dVᵀ = dOᵀ·P, dKᵀ = Qᵀ·dS: P and dS are
  // exactly 0 there).
  Band cols_see = {};
  int64_t step_off = 0, steps_total = 0;
};  // (plain data, declared on every level: the callers' discarded amx branches name it)

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

// The permutes of transpose16: stage s, row i with bit s clear takes lo[s] (its own columns with
// bit s clear, row i+b's in the others: 16 + index), row i+b takes hi[s].
struct Transpose16Index {
  int32_t lo[4][16], hi[4][16];
  constexpr Transpose16Index() : lo{}, hi{} {
    for (int s = 0; s < 4; ++s)
      for (int c = 0; c < 16; ++c) {
        const int b = 1 << s;
        lo[s][c] = (c & b) ? 16 + c - b : c;
        hi[s][c] = (c & b) ? 16 + c : c + b;
      }
  }
};
alignas(64) constexpr Transpose16Index kTranspose16{};

// The 16 x 16 transpose of 32-bit elements in r (row i in r[i]), in place: four stages, stage s
// swapping bit s of the row and column index (the off-diagonal b x b blocks of each 2b x 2b
// block, b = 2^s), each one two-source permute per row.
RS_INLINE void transpose16(__m512i (&r)[16]) {
#pragma GCC unroll 4
  for (int s = 0; s < 4; ++s) {
    const int b = 1 << s;
    const __m512i il = _mm512_load_si512(kTranspose16.lo[s]), ih = _mm512_load_si512(kTranspose16.hi[s]);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (i & b) continue;
      const __m512i a = r[i], c = r[i + b];
      r[i] = _mm512_permutex2var_epi32(a, il, c);
      r[i + b] = _mm512_permutex2var_epi32(a, ih, c);
    }
  }
}

// dst (cols x round_up(rows, 16) 32-bit elements, row stride ldd) = srcᵀ for a rows x cols
// src of 32-bit elements (floats, or S = bf16_t: pairs of bf16, row stride lds in S elements),
// zero in the columns past rows; cols is a multiple of 16. 16 x 16 blocks through registers: a
// scalar transpose reads or writes one element per cache line (~3 % of the forward each for
// Oᵀ's and Qᵀ's pairs).
template <typename S, typename D>
inline void transpose(const S* src, int64_t lds, int64_t rows, int64_t cols, D* dst, int64_t ldd) {
  static_assert(sizeof(D) == 4, "transpose: 32-bit elements");
  constexpr int64_t kPer = 4 / sizeof(S);  // S elements per 32-bit element
  __m512i r[16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      for (int64_t i = 0; i < 16; ++i)
        r[i] = r0 + i < rows ? _mm512_loadu_si512(src + (r0 + i) * lds + c0 * kPer) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (c0 + i) * ldd + r0, r[i]);
    }
}

// The bf16 pairs of 16-bit lanes: the low ([0]) or high ([1]) 16 lanes of a and b side by side,
// a[i] then b[i] (permutex2var_epi16 indices: 32 + i picks b[i]).
struct PairLanes {
  uint16_t idx[2][32];
  constexpr PairLanes() : idx{} {
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) {
        idx[h][2 * i] = static_cast<uint16_t>(16 * h + i);
        idx[h][2 * i + 1] = static_cast<uint16_t>(32 + 16 * h + i);
      }
  }
};
alignas(64) constexpr PairLanes kPairLanes{};

// dst (32 rows x 32 bf16, row stride ldd) = srcᵀ for src = `rows` <= 32 rows of 32 bf16 (row
// stride lds), zero for the rows past them: rows 2p and 2p+1 side by side as 32-bit pairs per
// column, then two 16 x 16 transposes of those pairs (columns 0-15, 16-31), whose row c is
// column c of src in row order.
inline void transpose_bf16_block(const bf16_t* src, int64_t lds, int64_t rows, bf16_t* dst, int64_t ldd) {
  auto row = [&](int64_t j) { return j < rows ? _mm512_loadu_si512(src + j * lds) : _mm512_setzero_si512(); };
  __m512i r[16];
  for (int h = 0; h < 2; ++h) {
    const __m512i idx = _mm512_load_si512(kPairLanes.idx[h]);
    for (int p = 0; p < 16; ++p) r[p] = _mm512_permutex2var_epi16(row(2 * p), idx, row(2 * p + 1));
    transpose16(r);
    for (int c = 0; c < 16; ++c) _mm512_storeu_si512(dst + (16 * h + c) * ldd, r[c]);
  }
}

// Every tile is 16 rows x 64 bytes: tiles 0-3 the 2 x 2 block of C (16 x 16 floats each), 4-5
// two A tiles (16 rows x 32 bf16), 6-7 two B tiles (16 rows of 16 bf16 pairs).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
  constexpr TileConfig() : palette(1), start_row(0), reserved{}, colsb{}, rows{} {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = 16;
    }
  }
};
// A constant, not built on the stack at each call: built there, with amx_configure inlined into
// the backward's loop, GCC 12.2 -O3 left the column widths unwritten when ldtilecfg read them
// (rows 16, widths 0: an invalid configuration, the instruction faults; seen as a SIGSEGV in
// tests/test_kernel_cpu.py).
alignas(64) constexpr TileConfig kTileConfig{};

inline void amx_configure() { _tile_loadconfig(&kTileConfig); }

inline void amx_release() { _tile_release(); }

// One MB x NB block of 16 x 16 C tiles: C (row stride ldc floats) = / += A·B over kb steps of
// 32 terms, A (16·MB rows x 32·kb bf16, row stride lda elements), B (16·kb pair rows x 16·NB
// pairs, row stride ldb). cmax, max_rows and alpha (null: none): AmxExtras's, for this block
// (cmax and alpha at its first column, max_rows of its rows).
template <int MB, int NB, bool kAccumulate>
RS_INLINE void amx_block(int64_t kb, const bf16_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                         float* C, int64_t ldc, float* cmax, int64_t max_rows, const float* alpha) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // bytes
  float* c10 = C + 16 * ldc;
  if constexpr (kAccumulate) {
    if (alpha != nullptr) {
      for (int nb = 0; nb < NB; ++nb) {
        const __m512 a = _mm512_loadu_ps(alpha + 16 * nb);
        for (int64_t j = 0; j < 16 * MB; ++j) {
          float* c = C + j * ldc + 16 * nb;
          _mm512_storeu_ps(c, _mm512_loadu_ps(c) * a);
        }
      }
    }
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
  if (cmax != nullptr) {
    for (int nb = 0; nb < NB; ++nb) {
      __m512 m = _mm512_loadu_ps(cmax + 16 * nb);
      for (int64_t j = 0; j < max_rows; ++j) m = vmax(_mm512_loadu_ps(C + j * ldc + 16 * nb), m);
      _mm512_storeu_ps(cmax + 16 * nb, m);
    }
  }
}

// C (M x N floats, row stride ldc) = A·B, or C += A·B with accumulate: A (M x 32·kb bf16, row
// stride lda), B (16·kb pair rows x N, row stride ldb uint32; pair k of column n holds terms 2k
// and 2k+1). M and N are multiples of 16. ex: AmxExtras. Out of line: one symbol, whose
// 2 x 2 block tests/test_cpu_codegen.py disassembles.
inline RS_NOINLINE void amx_gemm(bool accumulate, int64_t M, int64_t N, int64_t kb, const bf16_t* A,
                                 int64_t lda, const uint32_t* B, int64_t ldb, float* C, int64_t ldc,
                                 const AmxExtras& ex = {}) {
  const bool skip_blocks = ex.rows_see.cuts(), skip_steps = ex.cols_see.cuts();
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const bool two_m = m0 + 32 <= M;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      const bool two_n = n0 + 32 <= N;
      if (skip_blocks) {
        const int64_t r = ex.row_off + m0;
        const km::Range<int64_t> seen =
            km::band_key_range<int64_t>(r, r + (two_m ? 32 : 16), N, ex.rows_see.lo, ex.rows_see.hi);
        if (seen.end <= n0 || seen.begin >= n0 + (two_n ? 32 : 16)) continue;
      }
      int64_t k0 = 0, k1 = kb;  // the steps computed
      if (skip_steps) {
        const km::Range<int64_t> seen = km::band_key_range<int64_t>(n0, n0 + (two_n ? 32 : 16), ex.steps_total * 32,
                                                                    ex.cols_see.lo, ex.cols_see.hi);
        k0 = iclamp(seen.begin / 32 - ex.step_off, int64_t(0), kb);
        k1 = seen.empty() ? k0 : iclamp((seen.end + 31) / 32 - ex.step_off, k0, kb);
      }
      float* c = C + m0 * ldc + n0;
      const bf16_t* a = A + m0 * lda + k0 * 32;
      const uint32_t* b = B + k0 * 16 * ldb + n0;
      float* mx = ex.cmax != nullptr ? ex.cmax + n0 : nullptr;
      const int64_t mr = imax(0, imin(32, ex.max_rows - m0));
      const float* al = ex.alpha != nullptr ? ex.alpha + n0 : nullptr;
      // The block's shape in tiles (2 x 2, or 1 where M or N ends in a half block).
      auto block = [&](auto mb, auto nb) {
        constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
        if (accumulate) {
          amx_block<MB, NB, true>(k1 - k0, a, lda, b, ldb, c, ldc, mx, mr, al);
        } else {
          amx_block<MB, NB, false>(k1 - k0, a, lda, b, ldb, c, ldc, mx, mr, al);
        }
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      if (two_m && two_n) {
        block(Two{}, Two{});
      } else if (two_m) {
        block(Two{}, One{});
      } else if (two_n) {
        block(One{}, Two{});
      } else {
        block(One{}, One{});
      }
    }
  }
}

// C (round_up(M, 16) x N floats, row stride ldc) = A·B for A = M contiguous rows of d bf16 (kd
// = d / 2 pairs each; d a multiple of 32) and B the 16·(d / 32) x N pairs: whole 16-row tiles
// of A in place, the last partial one from a zero-padded copy in `tail` (16 x kd pairs, which
// may be A's own buffer: the copy runs after the rows it overwrites were read). C's rows past M
// take the padding's zeros. cmax and rows_see: AmxExtras's (the maxima over C's M rows, the
// padding rows left out).
inline void amx_pair_rows_gemm(int64_t M, int64_t N, int64_t d, const uint32_t* A, const uint32_t* B,
                               int64_t ldb, float* C, int64_t ldc, uint32_t* tail, float* cmax = nullptr,
                               Band rows_see = {}) {
  const int64_t kd = d / 2, m16 = M - M % 16;
  AmxExtras ex;
  ex.cmax = cmax;
  ex.rows_see = rows_see;
  ex.max_rows = m16;
  if (m16 > 0) amx_gemm(false, m16, N, d / 32, as_bf16(A), d, B, ldb, C, ldc, ex);
  if (m16 < M) {
    std::memmove(tail, A + m16 * kd, static_cast<size_t>((M - m16) * kd) * sizeof(uint32_t));
    fill(tail + (M - m16) * kd, (16 - (M - m16)) * kd, 0u);
    ex.max_rows = M - m16;
    ex.row_off = m16;
    amx_gemm(false, 16, N, d / 32, as_bf16(tail), d, B, ldb, C + m16 * ldc, ldc, ex);
  }
}

// C (d x N floats, row stride ldc) = / += (accumulate) Vᵀ·Pᵀ over n keys: vt (d rows of keys,
// row stride ldv), pt (round_up(n, 32) / 2 pair rows, zero past n). Whole 32-key steps read
// vt in place; a last partial step reads its n % 32 keys from a zero-padded copy in tail (d x
// 32), not the keys held past n (HeadColumns keeps other items' keys there: an inf or NaN among
// them would make 0·inf = NaN in rows that cannot see them). C is stored and reloaded between
// the two products exactly, so the sums are the same as one product over all steps. alpha
// (accumulate, not null) and cols_see: AmxExtras's.
inline void amx_pv(int64_t d, int64_t N, int64_t n, const bf16_t* vt, int64_t ldv, const uint32_t* pt,
                   int64_t ldp, float* C, int64_t ldc, bf16_t* tail, bool accumulate, const float* alpha,
                   Band cols_see) {
  const int64_t n32 = n - n % 32;
  AmxExtras ex;
  ex.alpha = accumulate ? alpha : nullptr;
  ex.cols_see = cols_see;
  ex.steps_total = round_up(n, 32) / 32;
  if (n32 > 0) {
    amx_gemm(accumulate, d, N, n32 / 32, vt, ldv, pt, ldp, C, ldc, ex);
    ex.alpha = nullptr;  // applied
  }
  if (n32 == n) return;
  for (int64_t c = 0; c < d; ++c) {
    bf16_t* o = tail + c * 32;
    std::memcpy(o, vt + c * ldv + n32, static_cast<size_t>(n - n32) * sizeof(bf16_t));
    fill(o + (n - n32), 32 - (n - n32), bf16_t{0});
  }
  ex.step_off = n32 / 32;
  amx_gemm(accumulate || n32 > 0, d, N, 1, tail, 32, pt + n32 / 2 * ldp, ldp, C, ldc, ex);
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
    amx_gemm(false, 16, 16, d / 32, as_bf16(ap.get()), d, bp.get(), 16, c, 16);
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

// P = exp(scale·x - m_use) of two rows of Sᵀ (odd null: past the tile's keys, P = 0; scale·x -
// m_use one fused multiply-add, so Sᵀ need not be scaled first), each added to its column's
// partial sum in lpart (the even row first, as the row-by-row loop adds them), and stored as
// bf16 pairs in dst (a row of Pᵀ's pairs) instead of back to Sᵀ. cols is a multiple of 16.
inline void exp_pair_rows(const float* even, const float* odd, int64_t cols, float scale, const float* m_use,
                          float* lpart, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t i = 0;
  if (odd != nullptr) {
    for (; i + 32 <= cols; i += 32) {
      const __m512 m0 = _mm512_loadu_ps(m_use + i), m1 = _mm512_loadu_ps(m_use + i + 16);
      vec_t<float> e[4] = {_mm512_fmsub_ps(_mm512_loadu_ps(even + i), sc, m0),
                           _mm512_fmsub_ps(_mm512_loadu_ps(odd + i), sc, m0),
                           _mm512_fmsub_ps(_mm512_loadu_ps(even + i + 16), sc, m1),
                           _mm512_fmsub_ps(_mm512_loadu_ps(odd + i + 16), sc, m1)};
      exp_vecs<4, /*kNonPositive=*/true>(e);
      _mm512_storeu_ps(lpart + i, (_mm512_loadu_ps(lpart + i) + e[0]) + e[1]);
      _mm512_storeu_ps(lpart + i + 16, (_mm512_loadu_ps(lpart + i + 16) + e[2]) + e[3]);
      _mm512_storeu_si512(dst + i, bf16_pairs(e[0], e[1], idx));
      _mm512_storeu_si512(dst + i + 16, bf16_pairs(e[2], e[3], idx));
    }
  }
  for (; i < cols; i += 16) {
    const __m512 m = _mm512_loadu_ps(m_use + i);
    vec_t<float> e[2] = {_mm512_fmsub_ps(_mm512_loadu_ps(even + i), sc, m),
                         odd != nullptr ? _mm512_fmsub_ps(_mm512_loadu_ps(odd + i), sc, m) : _mm512_setzero_ps()};
    exp_vecs<2, /*kNonPositive=*/true>(e);
    __m512 sum = _mm512_loadu_ps(lpart + i) + e[0];
    if (odd != nullptr) sum += e[1];
    _mm512_storeu_ps(lpart + i, sum);
    _mm512_storeu_si512(dst + i, bf16_pairs(e[0], odd != nullptr ? e[1] : _mm512_setzero_ps(), idx));
  }
}

// Two float rows as one row of bf16 pairs (even[i], odd[i]) (odd null: zero halves), cols a
// multiple of 16: B of a tile product over the rows' index (the backward's P and dS over
// query pairs).
inline void float_row_pairs(const float* even, const float* odd, int64_t cols, uint32_t* dst) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  for (int64_t i = 0; i < cols; i += 16) {
    const __m512 e = _mm512_loadu_ps(even + i), o = odd != nullptr ? _mm512_loadu_ps(odd + i) : _mm512_setzero_ps();
    _mm512_storeu_si512(dst + i, bf16_pairs(e, o, idx));
  }
}

// A float row as bf16 (round to nearest even), cols a multiple of 16, zero to pad (>= cols).
inline void bf16_row(const float* src, int64_t cols, int64_t pad, bf16_t* dst) {
  for (int64_t i = 0; i < cols; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  fill(dst + cols, pad - cols, bf16_t{0});
}

// Rows 2p and 2p+1 of src (rows bf16 rows of d, row stride lds; d a multiple of 32; a missing
// odd row is zero) as row p of pairs (src[2p][c], src[2p+1][c]), ldd pairs per row, for p <
// round_up(rows, 32) / 2 (pairs past the rows zero): B of a tile product over src's rows (the
// backward's K over key pairs).
inline void row_pairs(const bf16_t* src, int64_t lds, int64_t rows, int64_t d, uint32_t* dst, int64_t ldd) {
  const __m512i lo = _mm512_load_si512(kPairLanes.idx[0]), hi = _mm512_load_si512(kPairLanes.idx[1]);
  for (int64_t p = 0; p < round_up(rows, 32) / 2; ++p) {
    uint32_t* o = dst + p * ldd;
    for (int64_t c = 0; c < d; c += 32) {
      const __m512i a = 2 * p < rows ? _mm512_loadu_si512(src + 2 * p * lds + c) : _mm512_setzero_si512();
      const __m512i b = 2 * p + 1 < rows ? _mm512_loadu_si512(src + (2 * p + 1) * lds + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(o + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// dst (d rows x round_up(rows, 32) bf16, row stride ldd) = srcᵀ for rows bf16 rows of d (row
// stride lds; d a multiple of 32), zero past the rows: A of a tile product over src's rows
// (the backward's Qᵀ and dOᵀ).
inline void columns_of(const bf16_t* src, int64_t lds, int64_t rows, int64_t d, bf16_t* dst, int64_t ldd) {
  for (int64_t j0 = 0; j0 < rows; j0 += 32)
    for (int64_t c0 = 0; c0 < d; c0 += 32)
      transpose_bf16_block(src + j0 * lds + c0, lds, imin(32, rows - j0), dst + c0 * ldd + j0, ldd);
}

#else
// Declared only: the callers' amx branches are discarded (kAmx).
constexpr bool kAmx = false;
constexpr int64_t kAmxBlockM = 0, kAmxBlockN = 0;
void amx_configure();
void amx_release();
void amx_gemm(bool accumulate, int64_t M, int64_t N, int64_t kb, const bf16_t* A, int64_t lda,
              const uint32_t* B, int64_t ldb, float* C, int64_t ldc, const AmxExtras& ex = {});
void exp_pair_rows(const float* even, const float* odd, int64_t cols, float scale, const float* m_use,
                   float* lpart, uint32_t* dst);
void amx_pair_rows_gemm(int64_t M, int64_t N, int64_t d, const uint32_t* A, const uint32_t* B, int64_t ldb,
                        float* C, int64_t ldc, uint32_t* tail, float* cmax = nullptr, Band rows_see = {});
template <typename S, typename D>
void transpose(const S* src, int64_t lds, int64_t rows, int64_t cols, D* dst, int64_t ldd);
void transpose_bf16_block(const bf16_t* src, int64_t lds, int64_t rows, bf16_t* dst, int64_t ldd);
void float_row_pairs(const float* even, const float* odd, int64_t cols, uint32_t* dst);
void bf16_row(const float* src, int64_t cols, int64_t pad, bf16_t* dst);
void row_pairs(const bf16_t* src, int64_t lds, int64_t rows, int64_t d, uint32_t* dst, int64_t ldd);
void columns_of(const bf16_t* src, int64_t lds, int64_t rows, int64_t d, bf16_t* dst, int64_t ldd);
void amx_diagonal_dots(const bf16_t* a, int64_t lda, const bf16_t* b, int64_t ldb, int64_t rows, int64_t d,
                       float* dst);
void amx_pv(int64_t d, int64_t N, int64_t n, const bf16_t* vt, int64_t ldv, const uint32_t* pt, int64_t ldp,
            float* C, int64_t ldc, bf16_t* tail, bool accumulate, const float* alpha, Band cols_see);
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
    const int64_t keys = r1 - r0, k32 = round_up(keys, 32);
    // (d is a multiple of 32 on the amx level; the keys of the last 32 past r1 zero)
    columns_of(v, ldv, keys, d, dst, ld);
    for (int64_t c = 0; c < d; ++c) fill(dst + c * ld + k32, ld - k32, bf16_t{0});
    head = head_;
    begin = r0;
    end = r1;
    return dst;
  }
};

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
