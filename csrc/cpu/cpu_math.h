// Vectorized exp and the per-row softmax pieces of the CPU attention kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_gemm.h"

namespace ringseq {
namespace cpu {

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// exp(x) for float lanes: 2^t with t = x·log2(e), split as 2^n · 2^f, |f| <= 1/2, and 2^f from
// a degree-7 Taylor polynomial (truncation error < 1e-8 relative, so the result is within a
// couple of ulp of std::exp). Results below 2^-126 flush to 0, which also maps -inf to 0.
// Rounding to nearest uses the 1.5·2^23 trick, so this file must not be built with
// -ffast-math (which would fold (t + c) - c away).
inline vec_t<float> exp_vec(vec_t<float> x) {
  using V = vec_t<float>;
  using VI = Vec<float>::itype;
  const V t_raw = x * 1.4426950408889634f;
  const V lo = V{} - 126.0f, hi = V{} + 127.0f;
  V t = t_raw < lo ? lo : t_raw;
  t = t > hi ? hi : t;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23
  const V r = t + magic;
  const VI n = (VI)r - (VI)magic;
  const V f = t - (r - magic);
  // Taylor coefficients of 2^f = e^(f ln 2): (ln 2)^k / k!
  V p = V{} + 1.5252733804059841e-05f;
  p = p * f + 1.5403530393381608e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const V two_n = (V)((n + 127) << 23);
  const V res = p * two_n;
  return t_raw < lo ? V{} : res;
}

// float64 inputs are for accuracy, not speed: libm exp per lane.
inline vec_t<double> exp_vec(vec_t<double> x) {
  vec_t<double> r;
  for (int64_t l = 0; l < kVW<double>; ++l) r[l] = std::exp(x[l]);
  return r;
}

template <typename T>
inline vec_t<T> vmax(vec_t<T> a, vec_t<T> b) {
  return a > b ? a : b;
}

// Element-wise over whole vectors (n is a multiple of kVW<T>):
// x = exp(x - sub), where sub is one value per column (+inf gives 0).
template <typename T>
inline void exp_sub_cols(T* x, const T* sub, int64_t n) {
  for (int64_t i = 0; i < n; i += kVW<T>) vstore(x + i, exp_vec(vload(x + i) - vload(sub + i)));
}

// x = exp(x - sub) for one scalar sub (+inf gives 0).
template <typename T>
inline void exp_sub_scalar(T* x, T sub, int64_t n) {
  for (int64_t i = 0; i < n; i += kVW<T>) vstore(x + i, exp_vec(vload(x + i) - sub));
}

}  // namespace cpu
}  // namespace ringseq
