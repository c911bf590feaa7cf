// Spans, bands and soft-capping in the CPU kernels (docs/kernels.md, "Spans, bands and
// softcap"); compiled into each ISA level with the kernels. The index math itself is
// kernel_math.h's (km::band_*, shared with the CUDA kernels and tested against brute force):
// here it is laid out as the work lists of the CPU kernels, element-exact (tiles start at the
// first row or key a band reaches, not at a block multiple).
#pragma once

#include <cstdint>

#include "../attn_params.h"
#include "../kernel_math.h"
#include "common.h"
#include "gemm.h"
#include "vec.h"

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

// The spans of a call: the list the binding checked, or the call's one default span.
struct Spans {
  const AttnSpan* data;
  int64_t count;
  AttnSpan one;
  explicit Spans(const AttnShape& sh, const SpanList& list)
      : data(list.count > 0 ? list.data : &one), count(list.count > 0 ? list.count : 1),
        one(default_span(sh)) {}
  const AttnSpan& operator[](int64_t t) const { return data[t]; }
};

// A tile of one span: `rows` rows from r0 of its own side (span-local) and the range of the
// other side its band reaches (element-exact; empty when begin >= end).
struct SpanTile {
  int64_t span, r0, rows;
  km::Range<int64_t> other;
};

// Number of tiles of `tile` rows over every span's q side (q_side) or kv side.
inline int64_t span_tile_count(const Spans& spans, int64_t tile, bool q_side) {
  int64_t n = 0;
  for (int64_t t = 0; t < spans.count; ++t) n += ((q_side ? spans[t].q_len : spans[t].k_len) + tile - 1) / tile;
  return n;
}

// Those tiles into `a` (span_tile_count entries), each with the keys (queries) its band
// reaches, sorted by descending work (the other side's length) so that run_items hands out
// the heaviest first: a causal band's last q tiles, a long document's tiles. The order only
// balances threads: every tile's outputs have one owner.
inline void span_tiles(const Spans& spans, int64_t tile, bool q_side, SpanTile* a) {
  int64_t m = 0;
  for (int64_t t = 0; t < spans.count; ++t) {
    const AttnSpan& s = spans[t];
    const int64_t len = q_side ? s.q_len : s.k_len;
    for (int64_t r0 = 0; r0 < len; r0 += tile) {
      const int64_t r1 = imin(r0 + tile, len);
      a[m++] = SpanTile{t, r0, r1 - r0,
                        q_side ? km::band_key_range(r0, r1, s.k_len, s.band_lo, s.band_hi)
                               : km::band_row_range(r0, r1, s.q_len, s.k_len, s.band_lo, s.band_hi)};
    }
  }
  // Heap sort by (work descending, index ascending): no std:: code in the per-ISA units.
  auto before = [&](int64_t i, int64_t j) {  // i sorts before j
    const int64_t wi = a[i].other.size(), wj = a[j].other.size();
    return wi != wj ? wi > wj : (a[i].span != a[j].span ? a[i].span < a[j].span : a[i].r0 < a[j].r0);
  };
  auto sift = [&](int64_t root, int64_t end) {
    for (int64_t child; (child = 2 * root + 1) < end; root = child) {
      if (child + 1 < end && before(child, child + 1)) ++child;  // max-heap on "sorts later"
      if (!before(root, child)) return;
      const SpanTile x = a[root];
      a[root] = a[child];
      a[child] = x;
    }
  };
  for (int64_t i = m / 2 - 1; i >= 0; --i) sift(i, m);
  for (int64_t end = m - 1; end > 0; --end) {
    const SpanTile x = a[0];
    a[0] = a[end];
    a[end] = x;
    sift(0, end);
  }
}

// The band of the block of span sp whose query rows start at r0 and keys at c0 (span-local), as
// gemm's Band (gemm.h) for a product whose rows are the block's queries or (keys_as_rows) its
// keys, cutting its columns or (on_k) its K steps: query r0 + i sees key c0 + j iff
// band_lo <= (c0 + j) - (r0 + i) <= band_hi.
inline Band block_band(const AttnSpan& sp, int64_t r0, int64_t c0, bool keys_as_rows, bool on_k) {
  const int64_t lo = r0 - c0 + sp.band_lo, hi = r0 - c0 + sp.band_hi;  // bounds of j - i
  return keys_as_rows ? Band{-hi, -lo, on_k} : Band{lo, hi, on_k};
}

// tanh(x) within ~2 ulp relative error. For |x| >= atanh(1/2), sign(x) (1 - 2 / (exp(2|x|) + 1))
// with the kernels' vector exp (saturating to exactly +-1: exp_vec saturates at exp(88)).
// Below that the formula cancels: its absolute error stays ~1 ulp of 1, so a soft-cap of C
// left C·eps in every small score (cap 30: ~30x plain attention's error on scores of size 1,
// and 3-6x on out and dq). There an odd polynomial x + x³·q(x²) fitted for relative
// error on [0, atanh(1/2)] (1.1e-9 in exact arithmetic, ~1 ulp evaluated in float) is used.
// The formula (an exp and a division) is only evaluated for vectors with a lane past the
// polynomial's range: soft-caps sit well above typical scores (Gemma 2: 50 on scores of a few
// units), so most vectors take the 6-operation polynomial alone. NaN propagates through both.
RS_INLINE vec_t<float> tanh_vec(vec_t<float> x) {
  using V = vec_t<float>;
  const V u = x * x;
  V q = vsplat(-0.006269610021263361f);
  q = vfma(q, u, vsplat(0.02106764167547226f));
  q = vfma(q, u, vsplat(-0.05385109782218933f));
  q = vfma(q, u, vsplat(0.1333257108926773f));
  q = vfma(q, u, vsplat(-0.33333316445350647f));
  const V small = vfma(x * u, q, x);
  const V ax = vmax(x, -x), edge = vsplat(0.5493061443340549f);
  if (!vany_le(edge, ax)) return small;
  // on |x|, the sign put back: for x < 0 the formula itself lands near -1 as 1 minus a
  // quotient just below 2, whose rounding (of exp + 1 and of the division) cost ~3 ulp there
  using VI = Vec<float>::itype;
  const V mag = vsplat(1.0f) - vsplat(2.0f) / (exp_vec(ax + ax) + vsplat(1.0f));  // >= 0
  const V big = (V)((VI)mag | ((VI)x & (VI)vsplat(-0.0f)));  // x's sign bit on mag
  return ax < edge ? small : big;
}
// float64 inputs are for accuracy, not speed: libm tanh per lane.
RS_INLINE vec_t<double> tanh_vec(vec_t<double> x) {
  vec_t<double> r{};
  for (int64_t l = 0; l < kVW<double>; ++l) r[l] = std::tanh(x[l]);
  return r;
}

// Soft-cap of n scores (n a multiple of the vector width): x -> cap * tanh(x / cap); with
// `t` non-null the tanh values are written there too (the backward's 1 - t^2).
template <typename T>
RS_INLINE void softcap_row(T* x, int64_t n, T cap, T* t = nullptr) {
  const vec_t<T> inv = vsplat(T(1) / cap), c = vsplat(cap);
  for (int64_t j = 0; j < n; j += kVW<T>) {
    const vec_t<T> th = tanh_vec(vload(x + j) * inv);
    vstore(x + j, th * c);
    if (t != nullptr) vstore(t + j, th);
  }
}

// Adds the tiles a kernel computed to the call's test statistic (BwdParams::tiles_visited).
RS_INLINE void count_tiles(int64_t* counter, int64_t n) {
  if (counter != nullptr && n > 0) __atomic_fetch_add(counter, n, __ATOMIC_RELAXED);
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
