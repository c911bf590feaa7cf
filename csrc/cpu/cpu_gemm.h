// Register-blocked micro-GEMM for the CPU attention tiles.
//
// Why our own: the BLAS that torch links is not reachable from an extension in a portable way
// (the cpublas overloads that call it are hidden symbols), and attention tiles are small
// (K = headdim or one key tile), where a micro-kernel that keeps the whole C block in
// registers is as fast as a library call and needs no per-call dispatch or threading logic.
//
// Layout: C (M x N, row-major) (+)= A (M x K, any strides) * B (K x N, row-major). N is cut
// into panels of 2 vectors (the last may be one) and padded to whole vectors by the callers,
// so the kernel never needs a column tail. The attention kernels arrange their tiles so that
// the operand that changes in the inner loop is A (read in place, strided) and B is a tile
// transposed once per outer iteration: nothing is packed in the inner loops.
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

// C[MR x NR vectors] (+)= A[MR x K] * B[K x NR vectors]. A is read by scalar broadcasts at any
// strides (element (m, k) at A[m * sa_m + k * sa_k]), so a transposed A costs nothing; B is
// row-major with row stride ldb.
template <typename T, int MR, int NR>
inline void micro_kernel(int64_t K, const T* __restrict__ A, int64_t sa_m, int64_t sa_k,
                         const T* __restrict__ B, int64_t ldb, T* __restrict__ C, int64_t ldc,
                         bool accumulate) {
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
    for (int n = 0; n < NR; ++n) b[n] = vload(B + k * ldb + n * VW);
    const T* a = A + k * sa_k;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const T am = a[m * sa_m];
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[m][n] += b[n] * am;
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
inline void micro_rows(int64_t rows, int64_t K, const T* A, int64_t sa_m, int64_t sa_k,
                       const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      micro_kernel<T, MR, NR>(K, A, sa_m, sa_k, B, ldb, C, ldc, accumulate);
    } else {
      micro_rows<T, NR, MR - 1>(rows, K, A, sa_m, sa_k, B, ldb, C, ldc, accumulate);
    }
  }
}

// C (M x npad) (+)= A (M x K, strides sa_m, sa_k) * B (K x npad, row stride ldb). npad is a
// multiple of one vector: callers keep B and C padded to whole vectors (padding columns of C
// get whatever the padding columns of B give and are never read back as results).
template <typename T>
inline void gemm(int64_t M, int64_t npad, int64_t K, const T* A, int64_t sa_m, int64_t sa_k,
                 const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  constexpr int64_t VW = kVW<T>;
  if (K == 0) {
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(C + m * ldc, C + m * ldc + npad, T(0));
    return;
  }
  for (int64_t c0 = 0; c0 < npad; c0 += 2 * VW) {
    const bool wide = npad - c0 >= 2 * VW;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t rows = std::min<int64_t>(kMR, M - m0);
      const T* a = A + m0 * sa_m;
      T* c = C + m0 * ldc + c0;
      if (wide) {
        micro_rows<T, 2>(rows, K, a, sa_m, sa_k, B + c0, ldb, c, ldc, accumulate);
      } else {
        micro_rows<T, 1>(rows, K, a, sa_m, sa_k, B + c0, ldb, c, ldc, accumulate);
      }
    }
  }
}

}  // namespace cpu
}  // namespace ringseq
