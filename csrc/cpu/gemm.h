// Register-blocked micro-GEMM for the CPU attention tiles (one copy per ISA level, see vec.h).
//
// Why our own: the BLAS that torch links is not reachable from an extension in a portable way
// (the cpublas overloads that call it are hidden symbols), and attention tiles are small
// (K = headdim or one tile), where a micro-kernel that keeps the whole C block in registers is
// as fast as a library call and needs no per-call dispatch or threading logic.
//
// Layout: C (M x N, row-major) = / += A (M x K, any strides) * B (K x N, row-major). A is read
// by scalar broadcasts at any strides (element (m, k) at A[m * sa_m + k * sa_k]), so a
// transposed or in-place A costs nothing; B is read by full vectors. N is cut into panels of
// kNR vectors (the last may be narrower) and callers pad N to whole vectors, so the kernel never
// needs a column tail: padding columns of C get whatever the padding columns of B give and are
// never read back as results. The attention kernels pick GEMM orientations in which B is
// either a tile packed once per outer iteration or an input row block read in place.
//
// The micro-kernels are out of line (RS_NOINLINE): one register block per call, and a symbol
// per (type, rows, vectors, epilogue) whose inner loop tests/test_cpu_codegen.py disassembles.
#pragma once

#include "../kernel_math.h"
#include "vec.h"

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

// What the micro-kernel does with its block of A·B:
//   kStore     C = A·B
//   kAdd       C += A·B   (the block's partial sum is formed from zero and added at the end:
//                          a long reduction over many tiles becomes a sum of per-tile partial
//                          sums, whose rounding error grows with the tile, not the sequence)
//   kScaleAdd  C = s[m]·C + A·B with one scale per row of C (the online-softmax rescale of O)
//   kStoreMax  C = A·B and cmax[n] = max(cmax[n], max over the block's rows of C[m][n])
enum class Epi : int { kStore = 0, kAdd = 1, kScaleAdd = 2, kStoreMax = 3 };

// Reduction steps summed in registers before they are added to C, for the GEMMs whose K is a
// whole key tile of unnormalized probabilities (the forward's P·V): the K terms become a sum of
// partial sums of kChunk terms, so the rounding error grows with kChunk + K / kChunk rather
// than with K (on torch.rand inputs a 256-term chain left out 2.3x and dq 3.6x the error of
// plain fp32 attention; with partial sums 1.0x and 1.6x). It costs one load, add and store of
// C per kChunk FMAs per accumulator. The backward's per-tile products (K = one tile of rows)
// already add per-tile partials and do without (chunk = 0: one chain over all of K).
// 72 at every level: on AVX2 the forward's whole 72-key tile (vec.h, fwd_block_n; 36 keys at
// d = 256) in one chain, the length the backward's per-tile products already have (96 rows);
// on AVX-512 and the baseline (tiles of 48 to 256 keys by head dim, vec.h) one to four chunks,
// about half as many as 36 gave. Every case of tests/test_cpu_accuracy.py stays within
// flash-attn's rule at every level. Each chunk boundary costs a load, add and store of the
// register block: against chunks of 36, 72 measured 3 % faster on a real Zen 3 (AVX2; forward,
// 1 thread, s = 4096, d 64 and 128) and 2-4 % on a Zen 4 (fp32 forward at avx512: d 64 full,
// d 128 full and causal; bf16 d 128 full at avx512bf16; same shape).
constexpr int64_t kChunk = 72;

// The same for the GEMMs whose K is the head dim (S = Q·Kᵀ and dP = dO·Vᵀ, forward and
// backward): a d-term chain per score. With one chain, float32 on torch.randn inputs reached
// 3.4x plain fp32 attention's error on dq at d = 256 and 4.3x at d = 192 (causal, s = 1024),
// and 3.8x on dk at d = 128 with softcap 30; with partial sums of 64 terms every case of
// flash-attn's grid (d 64..256, softcap 0 and 30) stays below 2.1x (tests/test_cpu_accuracy.py).
// d <= 64 is one chunk (unchanged); at d = 128 the cost was within noise (< 1 %), and chunks
// of 32 cost 1-5 % for no case that needed them.
constexpr int64_t kHeadChunk = 64;

// What one K step of a GEMM multiplies and adds: the operands' element type and the vector
// operations of the micro-kernel's step (B vectors, A broadcast, multiply-add into float lanes).
// FmaStep: A and B hold T, one step is one term per lane (vfma).
template <typename T>
struct FmaStep {
  using elem = T;
  static constexpr bool kScaled = false;  // C = A·B
  RS_INLINE static vec_t<T> load(const T* b) { return vload(b); }
  RS_INLINE static vec_t<T> splat(T a) { return vsplat(a); }
  RS_INLINE static vec_t<T> madd(vec_t<T> a, vec_t<T> b, vec_t<T> c) { return vfma(a, b, c); }
};

// Not on the amx level, which is built with AVX512_BF16 too (for amx.h's conversions): it runs
// its bf16 products on tiles (amx.h) and the rest as avx512 does, since the CPUs that have AMX
// (Intel) issue vdpbf16ps at half the rate of float FMAs (dispatch.cpp: kAutoExceptions).
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
// Bf16PairStep (the avx512bf16 level): A and B hold bfloat16 pairs, K elements 2k and 2k+1 in
// one uint32 (the even one in the low half, as they lie in a row of the tensor), and one step
// is vdpbf16ps: c + a[2k+1]·b[2k+1] + a[2k]·b[2k] per float lane, products exact in float32
// and each addition rounded, i.e. two FMAs on the converted inputs as FmaStep runs them, the odd
// term first (inputs and results below 2^-126 are flushed to zero), at twice FmaStep's terms
// per instruction. C is scale·A·B: the scale is applied to the finished sums (a bf16 operand
// cannot carry it exactly).
struct Bf16PairStep {
  using elem = uint32_t;
  static constexpr bool kScaled = true;
  RS_INLINE static __m512i load(const uint32_t* b) { return _mm512_loadu_si512(b); }
  RS_INLINE static __m512i splat(uint32_t a) { return _mm512_set1_epi32(static_cast<int>(a)); }
  RS_INLINE static vec_t<float> madd(__m512i a, __m512i b, vec_t<float> c) {
    return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
  }
};
constexpr bool kBf16Pairs = true;
#else
struct Bf16PairStep;  // declared only: the callers' pair branches are discarded (kBf16Pairs)
constexpr bool kBf16Pairs = false;
#endif

template <typename T, int MR, int NR, Epi E, typename Step>
RS_NOINLINE void micro_kernel(int64_t K, int64_t chunk, const typename Step::elem* __restrict__ A,
                              int64_t sa_m, int64_t sa_k, const typename Step::elem* __restrict__ B,
                              int64_t ldb, T* __restrict__ C, int64_t ldc, T* __restrict__ aux,
                              T scale) {
  constexpr int64_t VW = kVW<T>;
  using V = vec_t<T>;
  static_assert(!Step::kScaled || E == Epi::kStore || E == Epi::kStoreMax, "scale: kStore(Max) only");
  V acc[MR][NR];
  const typename Step::elem* a = A;
  const typename Step::elem* b = B;
  const int64_t step = chunk > 0 ? chunk : K;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    const int64_t k1 = imin(K, k0 + step);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[m][n] = vzero<T>();
    for (int64_t k = k0; k < k1; ++k) {
      decltype(Step::load(b)) bv[NR];
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) bv[n] = Step::load(b + n * VW);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const auto am = Step::splat(a[m * sa_m]);
#pragma GCC unroll 4
        for (int n = 0; n < NR; ++n) acc[m][n] = Step::madd(am, bv[n], acc[m][n]);
      }
      a += sa_k;
      b += ldb;
    }
    if (k0 > 0 || E == Epi::kAdd) {
      // C holds the sum of the earlier chunks (or, for kAdd, the value to add to).
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int n = 0; n < NR; ++n) acc[m][n] += vload(C + m * ldc + n * VW);
    }
    if constexpr (Step::kScaled) {
      if (k1 == K) {
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
          for (int n = 0; n < NR; ++n) acc[m][n] *= vsplat(scale);
      }
    }
    if constexpr (E == Epi::kScaleAdd) {
      if (k0 == 0) {
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const V s = vsplat(aux[m]);
#pragma GCC unroll 4
          for (int n = 0; n < NR; ++n) acc[m][n] = vfma(s, vload(C + m * ldc + n * VW), acc[m][n]);
        }
      }
    }
    if constexpr (E == Epi::kStoreMax) {
      if (k1 == K) {
#pragma GCC unroll 4
        for (int n = 0; n < NR; ++n) {
          V mx = vload(aux + n * VW);
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) mx = vmax(acc[m][n], mx);
          vstore(aux + n * VW, mx);
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) vstore(C + m * ldc + n * VW, acc[m][n]);
  }
}

// a·b over n terms (converted to T), summed in the order gemm<T, Epi::kStore> sums one element
// of C with this `chunk`: an FMA chain from zero per chunk, each chunk's chain added to the
// earlier chunks' total. Bit-identical to that element (FMA where the level's vfma fuses,
// a multiply and an add where it does not), so a difference of the two is exactly 0 where the
// operands are equal.
template <typename T, typename in_t>
inline T gemm_order_dot(const in_t* a, const in_t* b, int64_t n, int64_t chunk) {
  const int64_t step = chunk > 0 ? chunk : n;
  T total = T(0);
  for (int64_t k0 = 0; k0 < n; k0 += step) {
    const int64_t k1 = imin(n, k0 + step);
    T acc = T(0);
    for (int64_t k = k0; k < k1; ++k) acc = sfma(to_acc<T>(a[k]), to_acc<T>(b[k]), acc);
    total = k0 > 0 ? acc + total : acc;
  }
  return total;
}

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
// a·b over d bf16 terms summed as gemm<float, Epi::kStore, Bf16PairStep> sums one element with
// `chunk` pairs per partial sum and scale 1, through the same instruction (one lane of it), so
// bit-identical to that element on any CPU of the level (whatever order the instruction adds
// its two products in).
inline float pair_order_dot(const bf16_t* a, const bf16_t* b, int64_t d, int64_t chunk) {
  const int64_t kd = (d + 1) / 2;
  float total = 0.0f;
  for (int64_t k0 = 0; k0 < kd; k0 += chunk) {
    const int64_t k1 = imin(kd, k0 + chunk);
    __m128 acc = _mm_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m128i pa = _mm_cvtsi32_si128(static_cast<int>(bf16_pair(a, k, d)));
      const __m128i pb = _mm_cvtsi32_si128(static_cast<int>(bf16_pair(b, k, d)));
      acc = _mm_dpbf16_ps(acc, (__m128bh)pa, (__m128bh)pb);
    }
    const float c = _mm_cvtss_f32(acc);
    total = k0 > 0 ? c + total : c;
  }
  return total;
}
#else
float pair_order_dot(const bf16_t* a, const bf16_t* b, int64_t d, int64_t chunk);  // never called
#endif

// rows < kMR: the tail of M, with a smaller register block.
template <typename T, int NR, Epi E, typename Step, int MR = kMR>
RS_INLINE void micro_rows(int64_t rows, int64_t K, int64_t chunk, const typename Step::elem* A,
                          int64_t sa_m, int64_t sa_k, const typename Step::elem* B, int64_t ldb,
                          T* C, int64_t ldc, T* aux, T scale) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      micro_kernel<T, MR, NR, E, Step>(K, chunk, A, sa_m, sa_k, B, ldb, C, ldc, aux, scale);
    } else {
      micro_rows<T, NR, E, Step, MR - 1>(rows, K, chunk, A, sa_m, sa_k, B, ldb, C, ldc, aux, scale);
    }
  }
}

// C (rows x width at C, row stride ldc) as gemm leaves it when A·B is zero there: kStore and
// kStoreMax write zeros (kStoreMax also raises its `width` column maxima in aux to at least 0),
// kAdd keeps C, kScaleAdd scales row m by aux[m].
template <typename T, Epi E>
inline void zero_product(int64_t rows, int64_t width, T* C, int64_t ldc, T* aux) {
  for (int64_t m = 0; m < rows; ++m) {
    T* c = C + m * ldc;
    if constexpr (E == Epi::kStore || E == Epi::kStoreMax) {
      fill(c, width, T(0));
    } else if constexpr (E == Epi::kScaleAdd) {
      for (int64_t n = 0; n < width; ++n) c[n] *= aux[m];
    }
  }
  if constexpr (E == Epi::kStoreMax) {
    if (rows > 0)
      for (int64_t n = 0; n < width; ++n) aux[n] = aux[n] > T(0) ? aux[n] : T(0);
  }
}

// The part of a masked block that a GEMM computes (the attention kernels' band edges; masks.h:
// block_band): with `on_k`, A (m, k) is exactly zero unless lo <= k - m <= hi, and each
// register block of rows runs only the K steps some of its rows need (a leading cut rounded
// down to a whole chunk, so every sum keeps its chunks); otherwise C (m, n) is not wanted
// unless lo <= n - m <= hi, and with kStore (the caller overwrites those entries) register
// blocks with no wanted entry are not computed: their C keeps whatever it held (the other
// epilogues compute all of C). The default band cuts nothing. Skipped terms are exact zeros,
// so a sum differs from the full product's only in its sign of zero, an inf or NaN of B where
// A is zero (no longer 0·inf = NaN), and with kScaleAdd where whole leading chunks are
// skipped: s·C + (A·B) is then rounded once instead of twice.
struct Band {
  int64_t lo = INT64_MIN / 4, hi = INT64_MAX / 4;
  bool on_k = false;
  bool cuts() const { return lo != INT64_MIN / 4 || hi != INT64_MAX / 4; }
  // The columns (K steps) row m needs of [0, limit): [first, last), and the vectors of T that
  // cover them, [v_begin, v_end) (what a kStore with this band computed of the row; empty
  // when the row needs none).
  struct Cols {
    int64_t first, last, v_begin, v_end;
  };
  template <typename T>
  Cols cols(int64_t m, int64_t limit) const {
    const int64_t first = iclamp(m + lo, 0, limit), last = iclamp(m + hi + 1, first, limit);
    const int64_t v_begin = first - first % kVW<T>;
    return Cols{first, last, v_begin, first < last ? round_up(last, kVW<T>) : v_begin};
  }
};

// C (M x npad) op= A (M x K, strides sa_m, sa_k) * B (K x npad, row stride ldb), npad a multiple
// of one vector. aux: kScaleAdd: M row scales; kStoreMax: npad column maxima (read and updated).
// chunk: K steps per partial sum (0: all of K in one chain; see kChunk). Step: what a K step
// is (FmaStep; Bf16PairStep, whose A and B are bf16 pairs, K counts pairs and C = scale·A·B).
// band: the masked block's band (Band), the whole product by default.
template <typename T, Epi E, typename Step = FmaStep<T>>
inline void gemm(int64_t M, int64_t npad, int64_t K, const typename Step::elem* A, int64_t sa_m,
                 int64_t sa_k, const typename Step::elem* B, int64_t ldb, T* C, int64_t ldc,
                 T* aux = nullptr, int64_t chunk = 0, T scale = T(1), Band band = Band{}) {
  constexpr int64_t VW = kVW<T>;
  constexpr int64_t PW = kNR * VW;  // columns per panel
  static_assert(kNR == 2, "the panel tail below assumes panels of two vectors");
  if (K == 0) {
    zero_product<T, E>(M, npad, C, ldc, aux);
    return;
  }
  const bool cut = band.cuts();
  for (int64_t c0 = 0; c0 < npad; c0 += PW) {
    const int64_t width = imin(PW, npad - c0);
    T* col_aux = E == Epi::kStoreMax ? aux + c0 : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t rows = imin(kMR, M - m0);
      T* c = C + m0 * ldc + c0;
      T* x = E == Epi::kScaleAdd ? aux + m0 : col_aux;
      int64_t k_begin = 0, k_end = K;
      if (cut) {
        // The columns (K steps) some row of [m0, m0 + rows) needs.
        const km::Range<int64_t> need =
            km::band_key_range<int64_t>(m0, m0 + rows, band.on_k ? K : npad, band.lo, band.hi);
        if (band.on_k) {
          k_begin = chunk > 0 ? need.begin - need.begin % chunk : need.begin;
          k_end = need.end;
          if (need.empty()) {
            zero_product<T, E>(rows, width, c, ldc, x);
            continue;
          }
        } else if (E == Epi::kStore && (need.end <= c0 || need.begin >= c0 + width)) {
          continue;
        }
      }
      const typename Step::elem* a = A + m0 * sa_m + k_begin * sa_k;
      const typename Step::elem* b = B + c0 + k_begin * ldb;
      if (width == PW) {
        micro_rows<T, kNR, E, Step>(rows, k_end - k_begin, chunk, a, sa_m, sa_k, b, ldb, c, ldc, x, scale);
      } else {
        micro_rows<T, 1, E, Step>(rows, k_end - k_begin, chunk, a, sa_m, sa_k, b, ldb, c, ldc, x, scale);
      }
    }
  }
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
