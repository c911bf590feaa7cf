// The CPU kernel's one ISA header: vector types, loads/stores, FMA, broadcast, max, exp, the
// 16-bit float conversions and the per-level tuning constants (register blocking, tiles).
//
// Included only by the per-level kernel translation units (csrc/cpu/kernels/*.cpp), which
// setup.py compiles once per ISA level with that level's flags and with RINGSEQ_CPU_ISA_NS
// set to the level's name (baseline, avx2, avx512, avx512bf16): everything here lives in
// ringseq::cpu::<level>, so no inline function compiled for one level can be picked by the
// linker for another (csrc/cpu/isa.h; tests/test_cpu_codegen.py checks it). For the same reason
// these units include no torch header and call no out-of-line std:: template.
//
// Loads and stores dereference unaligned vector typedefs (`may_alias`, element alignment), never
// memcpy: every tuning of GCC then emits one full-width move per vector, and accumulators stay
// in registers (tests/test_cpu_codegen.py checks the built micro-kernels).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#ifndef RINGSEQ_CPU_ISA_NS
#error "RINGSEQ_CPU_ISA_NS must name the ISA level this unit is compiled for (setup.py sets it)"
#endif

#define RS_NOINLINE __attribute__((noinline))
#define RS_INLINE inline __attribute__((always_inline))

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

// ------------------------------------------------------------------------- level and tuning
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kVecRegs = 32;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kVecBytes = 32;
constexpr int kVecRegs = 16;
#elif defined(__aarch64__)
constexpr int kVecBytes = 16;
constexpr int kVecRegs = 32;
#else
constexpr int kVecBytes = 16;
constexpr int kVecRegs = 16;
#endif

template <typename T>
constexpr int64_t kVW = kVecBytes / static_cast<int>(sizeof(T));  // lanes per vector

// Micro-kernel register block: kMR rows x kNR vectors of accumulators, plus kNR B vectors and
// one broadcast, must fit the register file: 8 x 2 (+3) of 32 registers with AVX-512, 6 x 2 (+3)
// of 16 with AVX2/SSE. Tile sizes below are multiples of kMR and of kNR vectors where they
// are a GEMM's M or N, so the GEMMs of full tiles have no row tail and no column tail.
constexpr int kMR = kVecRegs >= 32 ? 8 : 6;
constexpr int kNR = 2;

// Forward tiles: query rows per work item (a multiple of 2 vectors and of kMR: N of Sᵀ = K·Qᵀ,
// M of O = P·V) and keys per kv tile (M of Sᵀ). Backward tiles: query rows per inner block and
// keys per kv tile (an item's dK/dV rows). Scanned on Zen 5 at s = 4096, d = 64 and 128, fp32,
// 1 thread (forward rows 96..256, keys 96..256; backward rows 24..128, keys 48..256): all
// within ~3-4% of each other per level; these are the best of the scan. K/V tiles stay under
// 64 KiB so that an item's tiles fit in L2.
//
// AVX2 forward (issue 28): the AVX2 CPUs (Zen 2/3, Intel client cores) have 32 KiB L1D and
// 256-512 KiB L2, and every query row an item holds saves a pass over its head's K/V rows,
// which in the (b, s, h, d) layout lie h·d elements apart (one page per row at h·d·4 >= 4 KiB:
// a TLB walk and a cache miss per row and pass). So more query rows and fewer keys per tile:
// 240 rows and 72-key tiles (a multiple of kMR and of 8 lanes); the item's tiles (Qᵀ, O, Sᵀ,
// K, V at a row stride of d + 16 (packed_ld): 4·(2·d·bm + bn·bm + bn·(2·d + 16)) bytes) are
// 228 KiB at d = 64 and 384 KiB at d = 128,
// inside a 512 KiB L2 (Zen 3); past d = 128, 96 rows. Measured on Zen 4 forced to AVX2
// (Zen 3's L1D; 1 thread, s = 4096): 2-5 % faster than 96/144 rows with 192-key tiles (more
// rows were no faster, and 288 at d = 128 would need 504 KiB).
template <typename T>
inline int64_t fwd_block_m(int64_t d) {
  if (kVecBytes == 64) return 128;
  if (kVecBytes == 32) return d <= 128 ? 240 : 96;
  return d <= 64 ? 96 : 144;
}
template <typename T>
inline int64_t fwd_block_n(int64_t d) {
  int64_t bn = kVecBytes == 64 ? 256 : kVecBytes == 32 ? 72 : 192;
  while (bn > 32 && bn * d * static_cast<int64_t>(sizeof(T)) > 65536) bn /= 2;
  return bn;
}
template <typename T>
inline int64_t bwd_block_m() {
  return kVecBytes == 64 ? 64 : 96;
}
template <typename T>
inline int64_t bwd_block_n(int64_t d) {
  int64_t bn = kVecBytes == 64 ? 128 : 96;
  while (bn > 32 && bn * d * static_cast<int64_t>(sizeof(T)) > 65536) bn /= 2;
  return bn;
}

// ------------------------------------------------------------------------- vector types
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float type __attribute__((vector_size(kVecBytes)));
  typedef float mem __attribute__((vector_size(kVecBytes), aligned(4), may_alias));
  typedef int32_t itype __attribute__((vector_size(kVecBytes)));
};
template <>
struct Vec<double> {
  typedef double type __attribute__((vector_size(kVecBytes)));
  typedef double mem __attribute__((vector_size(kVecBytes), aligned(8), may_alias));
  typedef int64_t itype __attribute__((vector_size(kVecBytes)));
};
template <typename T>
using vec_t = typename Vec<T>::type;

template <typename T>
RS_INLINE vec_t<T> vload(const T* p) {
  return *reinterpret_cast<const typename Vec<T>::mem*>(p);
}
template <typename T>
RS_INLINE void vstore(T* p, vec_t<T> v) {
  *reinterpret_cast<typename Vec<T>::mem*>(p) = v;
}
RS_INLINE vec_t<float> vsplat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX__)
  return _mm256_set1_ps(x);
#elif defined(__SSE2__)
  return _mm_set1_ps(x);
#else
  return x - vec_t<float>{};  // x - (+0) is x for every x (signed zeros too): folds to a splat
#endif
}
RS_INLINE vec_t<double> vsplat(double x) {
#if defined(__AVX512F__)
  return _mm512_set1_pd(x);
#elif defined(__AVX__)
  return _mm256_set1_pd(x);
#elif defined(__SSE2__)
  return _mm_set1_pd(x);
#else
  return x - vec_t<double>{};
#endif
}
template <typename T>
RS_INLINE vec_t<T> vzero() {
  return vec_t<T>{};
}

// a * b + c, fused where the level has FMA.
RS_INLINE vec_t<float> vfma(vec_t<float> a, vec_t<float> b, vec_t<float> c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
RS_INLINE vec_t<double> vfma(vec_t<double> a, vec_t<double> b, vec_t<double> c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_pd(a, b, c);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_pd(a, b, c);
#else
  return a * b + c;
#endif
}

// The scalar a * b + c rounded as vfma rounds each lane (fused or not, as the level's vfma).
template <typename T>
RS_INLINE T sfma(T a, T b, T c) {
#if defined(__AVX2__) && defined(__FMA__)
  return std::fma(a, b, c);  // one vfmadd with -mfma
#else
  return a * b + c;
#endif
}

// max(a, b) with x86 semantics: b where either is NaN (the same as a > b ? a : b).
RS_INLINE vec_t<float> vmax(vec_t<float> a, vec_t<float> b) {
#if defined(__AVX512F__)
  return _mm512_max_ps(a, b);
#elif defined(__AVX2__)
  return _mm256_max_ps(a, b);
#elif defined(__SSE2__)
  return _mm_max_ps(a, b);
#else
  return a > b ? a : b;
#endif
}
RS_INLINE vec_t<double> vmax(vec_t<double> a, vec_t<double> b) {
#if defined(__AVX512F__)
  return _mm512_max_pd(a, b);
#elif defined(__AVX2__)
  return _mm256_max_pd(a, b);
#elif defined(__SSE2__)
  return _mm_max_pd(a, b);
#else
  return a > b ? a : b;
#endif
}

// Software prefetch of the 64-byte lines holding [p, p + bytes) into L2 (prefetcht2), for rows
// read one tile later. Not into L1: a tile ahead (up to 2 x 64 KiB of K and V) is larger than
// a 32 KiB L1D and evicted the working tiles the GEMMs were reading; into L2 the forward ran
// 4-11 % faster on Zen 4 (32 KiB L1D) at AVX2 and AVX-512, d = 64 and 128.
RS_INLINE void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// min(a, b): b where either is NaN.
RS_INLINE vec_t<float> vmin(vec_t<float> a, vec_t<float> b) {
#if defined(__AVX512F__)
  return _mm512_min_ps(a, b);
#elif defined(__AVX2__)
  return _mm256_min_ps(a, b);
#elif defined(__SSE2__)
  return _mm_min_ps(a, b);
#else
  return a < b ? a : b;
#endif
}

// Whether a <= b in any lane (ordered: a NaN lane counts as false).
RS_INLINE bool vany_le(vec_t<float> a, vec_t<float> b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_LE_OQ)) != 0;
#elif defined(__SSE2__)
  return _mm_movemask_ps(_mm_cmple_ps(a, b)) != 0;
#else
  for (int64_t l = 0; l < kVW<float>; ++l)
    if (a[l] <= b[l]) return true;
  return false;
#endif
}

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();
template <typename T>
constexpr T kPosInf = std::numeric_limits<T>::infinity();

// ------------------------------------------------------------------------- exp
// exp(x) for float lanes: x = n·ln2 + r with integer n and |r| <= ln2/2, exp(r) from a
// degree-6 polynomial 1 + r + r²·q(r) fitted for relative error on that interval (3.8e-9 in
// exact arithmetic, 6.3e-8 evaluated in float: within ~1 ulp) and 2^n put into the exponent
// bits. ln2 is split in two (Cody-Waite) so that r stays exact for large |x|. x > 88 saturates
// at exp(88) (attention only feeds x <= 0, or barely above 0 with a global lse). Results with
// n < -126 (exp(x) < 2^-126.5) flush to 0: x is clamped at -88 first, where n = -127, so the
// biased exponent n + 127 is 0 there and below (-inf included), and 2^n becomes a zero factor;
// NaN propagates (the clamps return x when it is NaN). n + 127 is the integer difference of nf's
// bits and magic's less 127: one subtraction. Rounding to nearest uses the 1.5·2^23 trick, so
// this code must not be built with -ffast-math (which would fold (t + c) - c away). 14 vector
// operations (15 with the upper clamp); the earlier form, a clamp at -88.5 and a biased exponent
// clamped at 0, gives the same value in every lane in two more.
//
// That is the path without AVX-512. With AVX-512, vscalefps puts 2^n in (p·2^n, rounded once,
// as the multiply by the power of two is) and a compare of n against -126 zeroes the lanes the
// exponent bits flush (NaN compares true and propagates): no lower clamp and no integer n, 12
// operations (13 with the upper clamp), the same value in every lane (tests/test_cpu_exp.py).
// The lanes zeroed may compute inf - inf on the way (an invalid-operation flag, never a trap:
// torch leaves FP exceptions masked). The softmax passes around it run ~20 operations per
// vector, on the two ports the FMAs also use.
//
// exp_vecs: NV vectors in place, each step applied to all of them before the next. One exp
// is a chain of ~15 dependent operations (~50 cycles); with one or two chains per iteration
// the softmax loops waited on it, the CPU's scheduler full of operations waiting on their
// predecessors (llvm-mca -mcpu=znver3 on the AVX2 build, benchmarks/mca_loops.py: forward
// 10.0 and backward 11.5 cycles per vector, against port throughputs of 6 and 7; with four
// chains side by side 8.5 and 9.3). Bit-identical lane by lane to the one-vector code it
// replaced (exp_vec is now exp_vecs<1>). kNonPositive: every x is <= 0 or NaN (a score minus
// its running max), where the upper clamp returns x unchanged, so it is left out.
template <int NV, bool kNonPositive = false>
RS_INLINE void exp_vecs(vec_t<float> (&x)[NV]) {
  using V = vec_t<float>;
  using VI = Vec<float>::itype;
  const V magic = vsplat(12582912.0f);  // 1.5 * 2^23
  V nf[NV], p[NV];
#if defined(__AVX512F__)
  constexpr bool kScalef = true;  // 2^n through vscalefps (below): n stays a float in nf
#else
  constexpr bool kScalef = false;
#endif
  [[maybe_unused]] VI n[NV];  // n + 127 (without AVX-512)
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    if constexpr (!kScalef) x[v] = vmax(vsplat(-88.0f), x[v]);
    if constexpr (!kNonPositive) x[v] = vmin(vsplat(88.0f), x[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) nf[v] = vfma(x[v], vsplat(1.44269504088896341f), magic);
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    if constexpr (!kScalef) n[v] = (VI)nf[v] - ((VI)magic - 127);  // n + 127, >= 0
    nf[v] = nf[v] - magic;
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) x[v] = vfma(nf[v], vsplat(-0.693145751953125f), x[v]);  // r
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) x[v] = vfma(nf[v], vsplat(-1.428606765330187e-06f), x[v]);
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) p[v] = vfma(vsplat(0.0013751407386735082f), x[v], vsplat(0.008368915878236294f));
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) p[v] = vfma(p[v], x[v], vsplat(0.04166953265666962f));
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) p[v] = vfma(p[v], x[v], vsplat(0.166665181517601f));
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) p[v] = vfma(p[v], x[v], vsplat(0.49999988079071045f));
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) p[v] = vfma(p[v], x[v], vsplat(1.0f));
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) p[v] = vfma(p[v], x[v], vsplat(1.0f));
#if defined(__AVX512F__)
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const __mmask16 keep = _mm512_cmp_ps_mask(nf[v], vsplat(-126.0f), _CMP_NLT_UQ);  // n >= -126, or NaN
    x[v] = _mm512_maskz_scalef_ps(keep, p[v], nf[v]);  // p·2^n, or 0 where n < -126
  }
#else
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) x[v] = p[v] * (V)(n[v] << 23);  // p·2^n, or 0 where n + 127 = 0
#endif
}
RS_INLINE vec_t<float> exp_vec(vec_t<float> x) {
  vec_t<float> v[1] = {x};
  exp_vecs<1>(v);
  return v[0];
}

// float64 inputs are for accuracy, not speed: libm exp per lane.
RS_INLINE vec_t<double> exp_vec(vec_t<double> x) {
  vec_t<double> r;
  for (int64_t l = 0; l < kVW<double>; ++l) r[l] = std::exp(x[l]);
  return r;
}
template <int NV, bool kNonPositive = false>
RS_INLINE void exp_vecs(vec_t<double> (&x)[NV]) {
  for (int v = 0; v < NV; ++v) x[v] = exp_vec(x[v]);
}

// ------------------------------------------------------------------------- element types
// Storage of bfloat16 and float16 tensors (bit-compatible with c10::BFloat16 / c10::Half,
// which these units must not include). Conversions round to nearest even like c10's.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

RS_INLINE uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
RS_INLINE float f32_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

RS_INLINE float to_float(bf16_t x) { return f32_from_bits(static_cast<uint32_t>(x.bits) << 16); }

RS_INLINE float to_float(f16_t x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return f32_from_bits(sign | 0x7f800000u | ((em & 0x3ffu) << 13));  // inf, NaN
  if (em >= 0x0400u) return f32_from_bits(sign | ((em << 13) + ((127u - 15u) << 23)));  // normal
  const float mag = static_cast<float>(em) * 5.9604644775390625e-08f;  // subnormal: em * 2^-24
  return sign ? -mag : mag;
}

RS_INLINE bf16_t to_bf16(float x) {
  const uint32_t u = f32_bits(x);
  if (x != x) return bf16_t{0x7fc0};
  return bf16_t{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

RS_INLINE f16_t to_f16(float x) {
  uint32_t f = f32_bits(x);
  const uint32_t sign = (f >> 16) & 0x8000u;
  f &= 0x7fffffffu;
  if (f >= 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | (f > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  if (f >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (f < 0x38800000u) {
    // Below 2^-14 (half subnormals): adding 0.5 (ulp 2^-24) lets the FPU round to nearest even.
    const float v = f32_from_bits(f) + 0.5f;
    return f16_t{static_cast<uint16_t>(sign | (f32_bits(v) - 0x3f000000u))};
  }
  const uint32_t odd = (f >> 13) & 1u;
  f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return f16_t{static_cast<uint16_t>(sign | (f >> 13))};
}

// bfloat16 pairs (Bf16PairStep, gemm.h): elements 2k and 2k+1 of a row as one uint32, the even
// one in the low half; a row of d elements is kd = (d + 1) / 2 pairs, the last one's high half
// zero when d is odd.
RS_INLINE uint32_t bf16_pair(const bf16_t* row, int64_t k, int64_t d) {
  const uint32_t hi = 2 * k + 1 < d ? row[2 * k + 1].bits : 0u;
  return row[2 * k].bits | (hi << 16);
}

// Accumulation type of an element type: float64 for float64, float32 otherwise.
template <typename in_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

template <typename T>
RS_INLINE T to_acc(float x) {
  return x;
}
template <typename T>
RS_INLINE T to_acc(double x) {
  return static_cast<T>(x);
}
template <typename T>
RS_INLINE T to_acc(bf16_t x) {
  return to_float(x);
}
template <typename T>
RS_INLINE T to_acc(f16_t x) {
  return to_float(x);
}

template <typename out_t, typename T>
RS_INLINE out_t from_acc(T x) {
  if constexpr (sizeof(out_t) == 2 && __is_same(out_t, bf16_t)) {
    return to_bf16(static_cast<float>(x));
  } else if constexpr (sizeof(out_t) == 2) {
    return to_f16(static_cast<float>(x));
  } else {
    return static_cast<out_t>(x);
  }
}

template <typename A, typename B>
constexpr bool kSame = __is_same(A, B);

// Integer helpers (no std::min/max templates in these units, see the top of this file).
RS_INLINE int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
RS_INLINE int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
RS_INLINE int64_t iclamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }
RS_INLINE int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename T>
RS_INLINE void fill(T* p, int64_t n, T value) {
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
