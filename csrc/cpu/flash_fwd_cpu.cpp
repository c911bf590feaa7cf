// CPU forward: tiled online softmax. One work item is (batch, head, tile of kBlockM query rows);
// it streams the visible key tiles and keeps the running max, sum and output of its rows in
// per-thread scratch, so extra memory is O(threads x tile).
#include "flash_cpu.h"

#include "cpu_common.h"
#include "cpu_math.h"

namespace ringseq {

namespace {

using namespace cpu;

template <typename in_t>
void fwd_impl(const FwdParams& p) {
  using T = typename AccType<in_t>::type;
  using V = vec_t<T>;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = p.shape;
  const int64_t d = sh.headdim;
  const int64_t bm = kBlockM, bm_pad = round_up(bm, VW), bn = block_n(d);
  const int64_t group = sh.nheads / sh.nheads_kv;
  const int64_t offset = sh.seqlen_k - sh.seqlen_q;  // causal: key j visible iff j <= i + offset
  const int64_t ntiles = (sh.seqlen_q + bm - 1) / bm;
  const int64_t nbh = sh.batch * sh.nheads;
  const T scale = static_cast<T>(sh.softmax_scale);

  const in_t* q = static_cast<const in_t*>(p.q);
  const in_t* k = static_cast<const in_t*>(p.k);
  const in_t* v = static_cast<const in_t*>(p.v);
  // Accumulate mode: out/lse hold a running (out, lse) pair in T, read and then rewritten.
  const bool merge = p.accumulate;
  in_t* out = merge ? nullptr : static_cast<in_t*>(p.out);
  T* out_acc = merge ? static_cast<T*>(p.out) : nullptr;
  T* lse = static_cast<T*>(p.lse);

  // Tiles are kept transposed (one column per query): Sᵀ = K·Qᵀ and Oᵀ += Vᵀ·Pᵀ take the
  // key/value tile as the strided A operand in place, and Qᵀ is built once per query tile,
  // so the inner loop packs nothing; the softmax reductions over keys become element-wise
  // vector operations down the rows of Sᵀ.
  struct State {
    Scratch<T> qt, kbuf, vbuf, st, ot, m_run, m_use, alpha, l, lsum;
  };
  auto make_state = [&] {
    return State{Scratch<T>(d * bm_pad), Scratch<T>(bn * d),      Scratch<T>(bn * d),
                 Scratch<T>(bn * bm_pad), Scratch<T>(d * bm_pad), Scratch<T>(bm_pad),
                 Scratch<T>(bm_pad),      Scratch<T>(bm_pad),     Scratch<T>(bm_pad),
                 Scratch<T>(bm_pad)};
  };

  auto work = [&](State& st, int64_t item) {
    // Causal cost grows with the tile index: hand out the last tiles first.
    const int64_t tile = ntiles - 1 - item / nbh;
    const int64_t bh = item % nbh;
    const int64_t b = bh / sh.nheads, h = bh % sh.nheads, hk = h / group;
    const int64_t r0 = tile * bm, rows = std::min(bm, sh.seqlen_q - r0);
    const int64_t mpad = round_up(rows, VW);
    const int64_t kv_end =
        sh.causal ? std::clamp<int64_t>(r0 + rows + offset, 0, sh.seqlen_k) : sh.seqlen_k;

    T *qt = st.qt.get(), *s = st.st.get(), *ot = st.ot.get();
    T *m_run = st.m_run.get(), *m_use = st.m_use.get(), *alpha = st.alpha.get();
    T *l = st.l.get(), *lsum = st.lsum.get();

    load_transposed(row_ptr(q, p.q_strides, b, r0, h), p.q_strides.row, rows, d, scale, qt,
                    bm_pad, mpad);
    T* lse_rows = lse + b * p.lse_strides.batch + h * p.lse_strides.head + r0;
    if (merge) {
      // Resuming the online softmax from a running (out, lse) is the exact merge: with
      // m = lse_old the old rows carry weight exp(lse_old - m) = 1, so l = 1 and O = out_old.
      load_transposed(row_ptr(out_acc, p.out_strides, b, r0, h), p.out_strides.row, rows, d,
                      T(1), ot, bm_pad, mpad);
      for (int64_t i = 0; i < mpad; ++i) {
        // NaN counts as seen: a NaN running state must stay NaN, as in plain attention.
        const bool seen = i < rows && !(lse_rows[i] == kNegInf<T>);
        m_run[i] = seen ? lse_rows[i] : kNegInf<T>;
        l[i] = seen ? T(1) : T(0);
        // A row without mass so far contributes nothing, whatever its out holds.
        if (!seen)
          for (int64_t c = 0; c < d; ++c) ot[c * bm_pad + i] = T(0);
      }
    } else {
      std::fill(m_run, m_run + mpad, kNegInf<T>);
      std::fill(l, l + mpad, T(0));
      for (int64_t c = 0; c < d; ++c) std::fill(ot + c * bm_pad, ot + c * bm_pad + mpad, T(0));
    }

    for (int64_t c0 = 0; c0 < kv_end; c0 += bn) {
      const int64_t n = std::min(bn, kv_end - c0);
      int64_t ldk, ldv;
      const T* kt = rows_as(row_ptr(k, p.k_strides, b, c0, hk), p.k_strides.row, n, d,
                            st.kbuf.get(), ldk);
      const T* vt = rows_as(row_ptr(v, p.v_strides, b, c0, hk), p.v_strides.row, n, d,
                            st.vbuf.get(), ldv);
      gemm(n, mpad, d, kt, ldk, 1, qt, bm_pad, s, bm_pad, /*accumulate=*/false);  // Sᵀ
      if (sh.causal && c0 + n - 1 > r0 + offset) {
        // Key c0 + j is hidden from queries r0 + i with i < c0 + j - offset - r0.
        for (int64_t j = 0; j < n; ++j) {
          const int64_t lo = std::clamp<int64_t>(c0 + j - offset - r0, 0, mpad);
          std::fill(s + j * bm_pad, s + j * bm_pad + lo, kNegInf<T>);
        }
      }
      for (int64_t i = 0; i < mpad; i += VW) {
        V mx = vload(m_run + i);
        for (int64_t j = 0; j < n; ++j) mx = vmax<T>(mx, vload(s + j * bm_pad + i));
        const V old = vload(m_run + i);
        // A query that has seen no key yet keeps m = -inf; subtracting 0 instead keeps
        // exp(-inf - m) = 0 and avoids (-inf) - (-inf).
        const V mu = mx == kNegInf<T> ? V{} : mx;
        vstore(m_run + i, mx);
        vstore(m_use + i, mu);
        vstore(alpha + i, exp_vec(old - mu));
        vstore(lsum + i, V{});
      }
      for (int64_t j = 0; j < n; ++j) {
        T* row = s + j * bm_pad;
        for (int64_t i = 0; i < mpad; i += VW) {
          const V e = exp_vec(vload(row + i) - vload(m_use + i));
          vstore(row + i, e);
          vstore(lsum + i, vload(lsum + i) + e);
        }
      }
      for (int64_t i = 0; i < mpad; i += VW)
        vstore(l + i, vload(l + i) * vload(alpha + i) + vload(lsum + i));
      for (int64_t c = 0; c < d; ++c)
        for (int64_t i = 0; i < mpad; i += VW)
          vstore(ot + c * bm_pad + i, vload(ot + c * bm_pad + i) * vload(alpha + i));
      gemm(d, mpad, n, vt, 1, ldv, s, bm_pad, ot, bm_pad, /*accumulate=*/true);  // Oᵀ += Vᵀ Pᵀ
    }

    for (int64_t i = 0; i < mpad; ++i) {
      // A row that saw no key (or only zero weights) gives out = 0 and lse = -inf; a NaN sum
      // (a NaN or inf among its inputs) is not empty and propagates, as plain attention does.
      const bool empty = l[i] == T(0);
      if (i < rows) lse_rows[i] = empty ? kNegInf<T> : m_run[i] + std::log(l[i]);
      alpha[i] = empty ? T(0) : T(1) / l[i];
    }
    for (int64_t c = 0; c < d; ++c)
      for (int64_t i = 0; i < mpad; i += VW)
        vstore(ot + c * bm_pad + i, vload(ot + c * bm_pad + i) * vload(alpha + i));
    if (merge)
      store_transposed(ot, bm_pad, rows, d, T(1), row_ptr(out_acc, p.out_strides, b, r0, h),
                       p.out_strides.row, /*accumulate=*/false);
    else
      store_transposed(ot, bm_pad, rows, d, T(1), row_ptr(out, p.out_strides, b, r0, h),
                       p.out_strides.row, /*accumulate=*/false);
  };

  run_items(ntiles * nbh, make_state, work);
}

}  // namespace

void flash_fwd_cpu(const FwdParams& params) {
  cpu::dispatch_dtype(params.dtype, [&](auto tag) { fwd_impl<decltype(tag)>(params); });
}

}  // namespace ringseq
