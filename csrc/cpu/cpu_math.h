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

// x[i] = exp(x[i] - sub) for i < n, returns the sum. `sub` is finite.
inline float exp_sub_sum(float* x, int64_t n, float sub) {
  using V = vec_t<float>;
  constexpr int64_t VW = kVW<float>;
  V acc = V{};
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    const V e = exp_vec(vload(x + i) - sub);
    vstore(x + i, e);
    acc += e;
  }
  float s = 0.f;
  for (int64_t l = 0; l < VW; ++l) s += acc[l];
  if (i < n) {
    alignas(64) float tail[VW];
    for (int64_t l = 0; l < VW; ++l) tail[l] = i + l < n ? x[i + l] - sub : kNegInf<float>;
    const V e = exp_vec(vload(tail));
    for (int64_t l = 0; i + l < n; ++l) {
      x[i + l] = e[l];
      s += e[l];
    }
  }
  return s;
}

// float64 inputs are for accuracy, not speed: libm exp.
inline double exp_sub_sum(double* x, int64_t n, double sub) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - sub);
    s += x[i];
  }
  return s;
}

// Element-wise exp(x[i] - sub[i]) in place (sub[i] may be +inf, giving 0).
inline void exp_sub_vec(float* x, const float* sub, int64_t n) {
  constexpr int64_t VW = kVW<float>;
  int64_t i = 0;
  for (; i + VW <= n; i += VW) vstore(x + i, exp_vec(vload(x + i) - vload(sub + i)));
  for (; i < n; ++i) x[i] = std::exp(x[i] - sub[i]);
}
inline void exp_sub_vec(double* x, const double* sub, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - sub[i]);
}

template <typename T>
inline T row_max(const T* x, int64_t n) {
  using V = vec_t<T>;
  constexpr int64_t VW = kVW<T>;
  int64_t i = 0;
  T m = kNegInf<T>;
  if (n >= VW) {
    V acc = vload(x);
    for (i = VW; i + VW <= n; i += VW) {
      const V v = vload(x + i);
      acc = v > acc ? v : acc;
    }
    for (int64_t l = 0; l < VW; ++l) m = acc[l] > m ? acc[l] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

template <typename T>
inline void scale_row(T* x, int64_t n, T s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace cpu
}  // namespace ringseq
