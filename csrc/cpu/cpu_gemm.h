// Register-blocked micro-GEMM for the CPU attention tiles.
//
// Why our own: the BLAS that torch links is not reachable from an extension in a portable way
// (the cpublas overloads that call it are hidden symbols), and attention tiles are small
// (K = headdim or one key tile), where a packed micro-kernel that keeps the whole C block in
// registers is as fast as a library call and needs no per-call dispatch or threading logic.
//
// Layout: C (M x N, row-major, ldc) (+)= A (M x K, row-major, lda) * B, where B is "packed":
// N is cut into panels of kPanel = 2 vectors (the last panel may be one vector), and each
// panel is stored as K rows of its width, contiguous. Packing pads N up to a multiple of one
// vector with zeros, so the kernel never needs a column tail.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ringseq {
namespace cpu {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif

// GCC/Clang vector extensions: the compiler maps them onto the widest ISA enabled at build
// time (setup.py passes -march=native by default) and falls back to narrower code elsewhere.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float type __attribute__((vector_size(kVecBytes), aligned(4)));
  typedef int32_t itype __attribute__((vector_size(kVecBytes), aligned(4)));
};
template <>
struct Vec<double> {
  typedef double type __attribute__((vector_size(kVecBytes), aligned(8)));
  typedef int64_t itype __attribute__((vector_size(kVecBytes), aligned(8)));
};

template <typename T>
using vec_t = typename Vec<T>::type;

template <typename T>
constexpr int64_t kVW = kVecBytes / static_cast<int>(sizeof(T));  // lanes per vector

// Rows per micro-kernel call. With 32 vector registers (AVX-512) an 8 x 2 block of
// accumulators plus operands fits; with 16 registers (AVX2/SSE) 6 x 2 does.
#if defined(__AVX512F__)
constexpr int kMR = 8;
#else
constexpr int kMR = 6;
#endif

template <typename T>
inline vec_t<T> vload(const T* p) {
  vec_t<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline void vstore(T* p, vec_t<T> v) {
  std::memcpy(p, &v, sizeof(v));
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Width (in elements) of panel `p` of a packed operand with padded width `npad`.
template <typename T>
inline int64_t panel_width(int64_t npad, int64_t col0) {
  return std::min<int64_t>(2 * kVW<T>, npad - col0);
}

// C[MR x NR vectors] (+)= A[MR x K] * Bpanel[K x NR vectors].
template <typename T, int MR, int NR>
inline void micro_kernel(int64_t K, const T* __restrict__ A, int64_t lda, const T* __restrict__ B,
                         T* __restrict__ C, int64_t ldc, bool accumulate) {
  constexpr int64_t VW = kVW<T>;
  using V = vec_t<T>;
  // Accumulation starts from zero and C is added at the end: a long reduction that spans many
  // tiles (dK/dV over all query tiles, O and dQ over all key tiles) becomes a sum of per-tile
  // partial sums, whose float32 rounding error grows with the tile length, not the sequence.
  V acc[MR][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[m][n] = V{};
  for (int64_t k = 0; k < K; ++k) {
    V b[NR];
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) b[n] = vload(B + k * NR * VW + n * VW);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const T a = A[m * lda + k];
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[m][n] += b[n] * a;
    }
  }
  if (accumulate) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[m][n] += vload(C + m * ldc + n * VW);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) vstore(C + m * ldc + n * VW, acc[m][n]);
}

template <typename T, int NR, int MR = kMR>
inline void micro_rows(int64_t rows, int64_t K, const T* A, int64_t lda, const T* B, T* C,
                       int64_t ldc, bool accumulate) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      micro_kernel<T, MR, NR>(K, A, lda, B, C, ldc, accumulate);
    } else {
      micro_rows<T, NR, MR - 1>(rows, K, A, lda, B, C, ldc, accumulate);
    }
  }
}

// C (M x npad) (+)= A (M x K) * Bpacked (K x npad); npad is a multiple of one vector and
// C's row stride ldc >= npad.
template <typename T>
inline void gemm_packed(int64_t M, int64_t npad, int64_t K, const T* A, int64_t lda,
                        const T* Bp, T* C, int64_t ldc, bool accumulate) {
  constexpr int64_t VW = kVW<T>;
  if (K == 0) {
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(C + m * ldc, C + m * ldc + npad, T(0));
    return;
  }
  for (int64_t c0 = 0; c0 < npad; c0 += 2 * VW) {
    const int64_t w = panel_width<T>(npad, c0);
    const T* B = Bp + c0 * K;  // earlier panels are all full width
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t rows = std::min<int64_t>(kMR, M - m0);
      if (w == 2 * VW) {
        micro_rows<T, 2>(rows, K, A + m0 * lda, lda, B, C + m0 * ldc + c0, ldc, accumulate);
      } else {
        micro_rows<T, 1>(rows, K, A + m0 * lda, lda, B, C + m0 * ldc + c0, ldc, accumulate);
      }
    }
  }
}

// Packs `rows` x `cols` of src (row-major, element (r, c) at src[r * ld + c]) as B with
// K = rows and N = cols: dst receives K x npad in panels. Converts to T and multiplies by
// `scale`. Columns past `cols` are zero.
template <typename T, typename in_t>
inline void pack_b_rows(const in_t* src, int64_t ld, int64_t rows, int64_t cols, T scale,
                        T* dst) {
  constexpr int64_t VW = kVW<T>;
  const int64_t npad = round_up(cols, VW);
  for (int64_t c0 = 0; c0 < npad; c0 += 2 * VW) {
    const int64_t w = panel_width<T>(npad, c0);
    const int64_t valid = std::min<int64_t>(w, cols - c0);
    T* panel = dst + c0 * rows;
    for (int64_t r = 0; r < rows; ++r) {
      const in_t* s = src + r * ld + c0;
      T* o = panel + r * w;
      for (int64_t c = 0; c < valid; ++c) o[c] = static_cast<T>(s[c]) * scale;
      for (int64_t c = valid; c < w; ++c) o[c] = T(0);
    }
  }
}

// Packs the transpose: B = srcᵀ, where src is `n` rows (the future N) of `k` contiguous
// elements (the future K), row stride ld. dst receives K x npad (npad = n rounded up).
template <typename T, typename in_t>
inline void pack_b_transposed(const in_t* src, int64_t ld, int64_t n, int64_t k, T scale,
                              T* dst) {
  constexpr int64_t VW = kVW<T>;
  const int64_t npad = round_up(n, VW);
  for (int64_t c0 = 0; c0 < npad; c0 += 2 * VW) {
    const int64_t w = panel_width<T>(npad, c0);
    const int64_t valid = std::min<int64_t>(w, n - c0);
    T* panel = dst + c0 * k;
    for (int64_t c = 0; c < valid; ++c) {
      const in_t* s = src + (c0 + c) * ld;
      for (int64_t kk = 0; kk < k; ++kk) panel[kk * w + c] = static_cast<T>(s[kk]) * scale;
    }
    for (int64_t c = valid; c < w; ++c)
      for (int64_t kk = 0; kk < k; ++kk) panel[kk * w + c] = T(0);
  }
}

}  // namespace cpu
}  // namespace ringseq
