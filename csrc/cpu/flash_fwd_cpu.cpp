// CPU forward: tiled online softmax. One work item is (batch, head, tile of kBlockM query rows);
// it streams the visible key tiles through packed K/V buffers and keeps the running max, sum
// and output of its rows in per-thread scratch, so extra memory is O(threads x tile).
#include "flash_cpu.h"

#include "cpu_common.h"
#include "cpu_math.h"

namespace ringseq {

namespace {

using namespace cpu;

template <typename in_t>
void fwd_impl(const FwdParams& p) {
  using T = typename AccType<in_t>::type;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = p.shape;
  const int64_t d = sh.headdim, dpad = round_up(d, VW);
  const int64_t bm = kBlockM, bn = block_n(d), bn_pad = round_up(bn, VW);
  const int64_t group = sh.nheads / sh.nheads_kv;
  const int64_t offset = sh.seqlen_k - sh.seqlen_q;  // causal: key j visible iff j <= i + offset
  const int64_t ntiles = (sh.seqlen_q + bm - 1) / bm;
  const int64_t nbh = sh.batch * sh.nheads;
  const T scale = static_cast<T>(sh.softmax_scale);

  const in_t* q = static_cast<const in_t*>(p.q);
  const in_t* k = static_cast<const in_t*>(p.k);
  const in_t* v = static_cast<const in_t*>(p.v);
  in_t* out = static_cast<in_t*>(p.out);
  T* lse = static_cast<T*>(p.lse);

  struct State {
    Scratch<T> qs, kt, vp, s, o, m, l;
  };
  auto make_state = [&] {
    return State{Scratch<T>(bm * d),      Scratch<T>(d * bn_pad), Scratch<T>(bn * dpad),
                 Scratch<T>(bm * bn_pad), Scratch<T>(bm * dpad), Scratch<T>(bm),
                 Scratch<T>(bm)};
  };

  auto work = [&](State& st, int64_t item) {
    // Causal cost grows with the tile index: hand out the last tiles first.
    const int64_t tile = ntiles - 1 - item / nbh;
    const int64_t bh = item % nbh;
    const int64_t b = bh / sh.nheads, h = bh % sh.nheads, hk = h / group;
    const int64_t r0 = tile * bm, rows = std::min(bm, sh.seqlen_q - r0);
    const int64_t kv_end =
        sh.causal ? std::clamp<int64_t>(r0 + rows + offset, 0, sh.seqlen_k) : sh.seqlen_k;

    T* qs = st.qs.get();
    T* kt = st.kt.get();
    T* vp = st.vp.get();
    T* s = st.s.get();
    T* o = st.o.get();
    T* m = st.m.get();
    T* l = st.l.get();

    load_rows(row_ptr(q, p.q_strides, b, r0, h), p.q_strides.row, rows, d, scale, qs, d);
    std::fill(m, m + rows, kNegInf<T>);
    std::fill(l, l + rows, T(0));
    std::fill(o, o + rows * dpad, T(0));

    for (int64_t c0 = 0; c0 < kv_end; c0 += bn) {
      const int64_t n = std::min(bn, kv_end - c0), npad = round_up(n, VW);
      pack_b_transposed(row_ptr(k, p.k_strides, b, c0, hk), p.k_strides.row, n, d, T(1), kt);
      gemm_packed(rows, npad, d, qs, d, kt, s, bn_pad, /*accumulate=*/false);
      pack_b_rows(row_ptr(v, p.v_strides, b, c0, hk), p.v_strides.row, n, d, T(1), vp);
      for (int64_t r = 0; r < rows; ++r) {
        T* srow = s + r * bn_pad;
        const int64_t nv =
            sh.causal ? std::clamp<int64_t>(r0 + r + offset - c0 + 1, 0, n) : n;
        if (nv > 0) {
          const T m_new = std::max(m[r], row_max(srow, nv));
          // m[r] == -inf means nothing was accumulated yet (o and l are 0).
          const T alpha = m[r] == kNegInf<T> ? T(0) : std::exp(m[r] - m_new);
          const T sum = exp_sub_sum(srow, nv, m_new);
          if (alpha != T(1)) {
            l[r] *= alpha;
            scale_row(o + r * dpad, dpad, alpha);
          }
          l[r] += sum;
          m[r] = m_new;
        }
        std::fill(srow + nv, srow + n, T(0));
      }
      gemm_packed(rows, dpad, n, s, bn_pad, vp, o, dpad, /*accumulate=*/true);
    }

    in_t* out_rows = row_ptr(out, p.out_strides, b, r0, h);
    T* lse_rows = lse + b * p.lse_strides.batch + h * p.lse_strides.head + r0;
    for (int64_t r = 0; r < rows; ++r) {
      // A row that saw no key (or only zero weights) gives out = 0 and lse = -inf.
      const bool empty = !(l[r] > T(0));
      const T inv = empty ? T(0) : T(1) / l[r];
      store_rows(o + r * dpad, dpad, 1, d, inv, out_rows + r * p.out_strides.row,
                 p.out_strides.row, /*accumulate=*/false);
      lse_rows[r] = empty ? kNegInf<T> : m[r] + std::log(l[r]);
    }
  };

  run_items(ntiles * nbh, make_state, work);
}

}  // namespace

void flash_fwd_cpu(const FwdParams& params) {
  cpu::dispatch_dtype(params.dtype, [&](auto tag) { fwd_impl<decltype(tag)>(params); });
}

}  // namespace ringseq
