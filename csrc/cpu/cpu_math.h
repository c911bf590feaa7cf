// Vectorized exp and element-wise softmax pieces of the CPU attention kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_gemm.h"

namespace ringseq {
namespace cpu {

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// exp(x) for float lanes: x = n·ln2 + r with integer n and |r| <= ln2/2, exp(r) from its
// degree-7 Taylor polynomial (truncation < 6e-9 relative) and 2^n put into the exponent bits.
// ln2 is split in two (Cody-Waite) so that r stays exact for large |x|; the result is within
// ~2 ulp of the correctly rounded exp. x > 88 saturates at exp(88) (attention only feeds
// x <= 0, or barely above 0 with a global lse). Results below 2^-126 (x < -87.3) flush to 0,
// which also maps -inf to 0; NaN propagates. Rounding to nearest uses the 1.5·2^23 trick, so this
// code must not be built with -ffast-math (which would fold (t + c) - c away).
inline vec_t<float> exp_vec(vec_t<float> x) {
  using V = vec_t<float>;
  using VI = Vec<float>::itype;
  const V lo = V{} - 87.33654475f, hi = V{} + 88.0f;  // 2^-126 and just below 2^127
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23
  const V nr = xc * 1.44269504088896341f + magic;
  const V nf = nr - magic;
  const VI n = (VI)nr - (VI)magic;
  const V r = (xc - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  V p = V{} + 1.9841269841269841e-04f;  // 1/7!
  p = p * r + 1.3888888888888889e-03f;
  p = p * r + 8.3333333333333333e-03f;
  p = p * r + 4.1666666666666667e-02f;
  p = p * r + 1.6666666666666667e-01f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V two_n = (V)((n + 127) << 23);
  const V res = p * two_n;
  return x < lo ? V{} : res;
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
