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
constexpr int64_t kChunk = 32;

// The same for the GEMMs whose K is the head dim (S = Q·Kᵀ and dP = dO·Vᵀ, forward and
// backward): a d-term chain per score. With one chain, float32 on torch.randn inputs reached
// 3.4x plain fp32 attention's error on dq at d = 256 and 4.3x at d = 192 (causal, s = 1024),
// and 3.8x on dk at d = 128 with softcap 30; with partial sums of 64 terms every case of
// flash-attn's grid (d 64..256, softcap 0 and 30) stays below 2.1x (tests/test_cpu_accuracy.py).
// d <= 64 is one chunk (unchanged); at d = 128 the cost was within noise (< 1 %), and chunks
// of 32 cost 1-5 % for no case that needed them.
constexpr int64_t kHeadChunk = 64;

template <typename T, int MR, int NR, Epi E>
RS_NOINLINE void micro_kernel(int64_t K, int64_t chunk, const T* __restrict__ A, int64_t sa_m,
                              int64_t sa_k, const T* __restrict__ B, int64_t ldb,
                              T* __restrict__ C, int64_t ldc, T* __restrict__ aux) {
  constexpr int64_t VW = kVW<T>;
  using V = vec_t<T>;
  V acc[MR][NR];
  const T* a = A;
  const T* b = B;
  const int64_t step = chunk > 0 ? chunk : K;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    const int64_t k1 = imin(K, k0 + step);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[m][n] = vzero<T>();
    for (int64_t k = k0; k < k1; ++k) {
      V bv[NR];
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) bv[n] = vload(b + n * VW);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V am = vsplat(a[m * sa_m]);
#pragma GCC unroll 4
        for (int n = 0; n < NR; ++n) acc[m][n] = vfma(am, bv[n], acc[m][n]);
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
    } else if constexpr (E == Epi::kScaleAdd) {
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const V s = vsplat(aux[m]);
#pragma GCC unroll 4
        for (int n = 0; n < NR; ++n) acc[m][n] = vfma(s, vload(C + m * ldc + n * VW), acc[m][n]);
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

// rows < kMR: the tail of M, with a smaller register block.
template <typename T, int NR, Epi E, int MR = kMR>
RS_INLINE void micro_rows(int64_t rows, int64_t K, int64_t chunk, const T* A, int64_t sa_m,
                          int64_t sa_k, const T* B, int64_t ldb, T* C, int64_t ldc, T* aux) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      micro_kernel<T, MR, NR, E>(K, chunk, A, sa_m, sa_k, B, ldb, C, ldc, aux);
    } else {
      micro_rows<T, NR, E, MR - 1>(rows, K, chunk, A, sa_m, sa_k, B, ldb, C, ldc, aux);
    }
  }
}

// C (M x npad) op= A (M x K, strides sa_m, sa_k) * B (K x npad, row stride ldb), npad a multiple
// of one vector. aux: kScaleAdd: M row scales; kStoreMax: npad column maxima (read and updated).
// chunk: K steps per partial sum (0: all of K in one chain; see kChunk).
template <typename T, Epi E>
inline void gemm(int64_t M, int64_t npad, int64_t K, const T* A, int64_t sa_m, int64_t sa_k,
                 const T* B, int64_t ldb, T* C, int64_t ldc, T* aux = nullptr, int64_t chunk = 0) {
  constexpr int64_t VW = kVW<T>;
  constexpr int64_t PW = kNR * VW;  // columns per panel
  static_assert(kNR == 2, "the panel tail below assumes panels of two vectors");
  if (K == 0) {
    // A·B = 0: kStore and kStoreMax write zeros, kAdd keeps C, kScaleAdd scales it.
    for (int64_t m = 0; m < M; ++m) {
      T* c = C + m * ldc;
      if constexpr (E == Epi::kStore || E == Epi::kStoreMax) {
        fill(c, npad, T(0));
      } else if constexpr (E == Epi::kScaleAdd) {
        for (int64_t n = 0; n < npad; ++n) c[n] *= aux[m];
      }
    }
    if constexpr (E == Epi::kStoreMax) {
      if (M > 0)
        for (int64_t n = 0; n < npad; ++n) aux[n] = aux[n] > T(0) ? aux[n] : T(0);
    }
    return;
  }
  for (int64_t c0 = 0; c0 < npad; c0 += PW) {
    const bool wide = npad - c0 >= PW;
    T* col_aux = E == Epi::kStoreMax ? aux + c0 : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t rows = imin(kMR, M - m0);
      const T* a = A + m0 * sa_m;
      T* c = C + m0 * ldc + c0;
      T* x = E == Epi::kScaleAdd ? aux + m0 : col_aux;
      if (wide) {
        micro_rows<T, kNR, E>(rows, K, chunk, a, sa_m, sa_k, B + c0, ldb, c, ldc, x);
      } else {
        micro_rows<T, 1, E>(rows, K, chunk, a, sa_m, sa_k, B + c0, ldb, c, ldc, x);
      }
    }
  }
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
