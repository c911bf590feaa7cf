// CPU backward in two deterministic passes, neither with atomics nor an (s_q x s_k) buffer:
//   pass 1, one item per (batch, kv head, key tile): loops over the query heads of the GQA
//     group and their query tiles, recomputes Pᵀ and dSᵀ for the tile and accumulates dK, dV;
//   pass 2, one item per (batch, head, query tile): recomputes P and dS and accumulates dQ.
// Every output element is owned by exactly one item, so GQA heads never race and the result
// does not depend on the thread count. The price is recomputing S and dP once more in pass 2.
//
// P = exp(scale·QKᵀ - lse) uses the lse it is given (possibly the global one of a ring), and a
// row with lse = -inf (it saw no key) is treated as lse = +inf, so its P is 0 and not NaN.
#include "flash_cpu.h"

#include "cpu_common.h"
#include "cpu_math.h"

namespace ringseq {

namespace {

using namespace cpu;

template <typename T>
inline T guard_lse(T x) {
  return x == kNegInf<T> ? std::numeric_limits<T>::infinity() : x;
}

template <typename in_t>
struct BwdCtx {
  using T = typename AccType<in_t>::type;
  const BwdParams& p;
  const AttnShape& sh;
  int64_t d, group, offset;
  T scale;
  const in_t *q, *k, *v, *dout;
  const T *lse, *delta;

  explicit BwdCtx(const BwdParams& params)
      : p(params),
        sh(params.shape),
        d(sh.headdim),
        group(sh.nheads / sh.nheads_kv),
        offset(sh.seqlen_k - sh.seqlen_q),
        scale(static_cast<T>(sh.softmax_scale)),
        q(static_cast<const in_t*>(params.q)),
        k(static_cast<const in_t*>(params.k)),
        v(static_cast<const in_t*>(params.v)),
        dout(static_cast<const in_t*>(params.dout)),
        lse(static_cast<const T*>(params.lse)),
        delta(static_cast<const T*>(params.delta)) {}

  const T* lse_row(int64_t b, int64_t h) const {
    return lse + b * p.lse_strides.batch + h * p.lse_strides.head;
  }
  const T* delta_row(int64_t b, int64_t h) const {
    return delta + b * p.delta_strides.batch + h * p.delta_strides.head;
  }

  // Writes or adds scale·accᵀ into a gradient (input dtype, or T accumulators); acc is
  // d x rows with row stride lda.
  void store_t(const T* acc, int64_t lda, int64_t rows, T s, void* base,
               const RowStrides& strides, int64_t b, int64_t row0, int64_t head) const {
    if (p.accumulate) {
      T* dst = row_ptr(static_cast<T*>(base), strides, b, row0, head);
      store_transposed(acc, lda, rows, d, s, dst, strides.row, true);
    } else {
      in_t* dst = row_ptr(static_cast<in_t*>(base), strides, b, row0, head);
      store_transposed(acc, lda, rows, d, s, dst, strides.row, false);
    }
  }
};

// Pass 1: dK and dV of one key tile. Kᵀ and Vᵀ are built once per item; for each query tile
// S = Q·Kᵀ and dP = dO·Vᵀ take Q and dO as the strided A operand in place, and dKᵀ += Qᵀ·dS,
// dVᵀ += dOᵀ·P read Q and dO transposed through A's strides: nothing is packed per query
// tile. (scale·Q) serves both S and dK, so dK needs no final scaling.
template <typename in_t>
void bwd_dkdv(const BwdCtx<in_t>& c) {
  using T = typename BwdCtx<in_t>::T;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = c.sh;
  const int64_t d = c.d;
  const int64_t bm = kBlockM, bn = block_n(d), bn_pad = round_up(bn, VW);
  const int64_t ntiles = (sh.seqlen_k + bn - 1) / bn;
  const int64_t nbh = sh.batch * sh.nheads_kv;

  struct State {
    Scratch<T> kt, vt, qbuf, dobuf, s, dp, dkt, dvt;
  };
  auto make_state = [&] {
    return State{Scratch<T>(d * bn_pad),  Scratch<T>(d * bn_pad),  Scratch<T>(bm * d),
                 Scratch<T>(bm * d),      Scratch<T>(bm * bn_pad), Scratch<T>(bm * bn_pad),
                 Scratch<T>(d * bn_pad),  Scratch<T>(d * bn_pad)};
  };

  auto work = [&](State& st, int64_t item) {
    // Causal: the first key tiles are seen by the most queries; hand them out first.
    const int64_t tile = item / nbh, bh = item % nbh;
    const int64_t b = bh / sh.nheads_kv, hk = bh % sh.nheads_kv;
    const int64_t c0 = tile * bn, n = std::min(bn, sh.seqlen_k - c0), npad = round_up(n, VW);
    T *kt = st.kt.get(), *vt = st.vt.get(), *qbuf = st.qbuf.get();
    T *s = st.s.get(), *dp = st.dp.get(), *dkt = st.dkt.get(), *dvt = st.dvt.get();

    load_transposed(row_ptr(c.k, c.p.k_strides, b, c0, hk), c.p.k_strides.row, n, d, T(1), kt,
                    bn_pad, npad);
    load_transposed(row_ptr(c.v, c.p.v_strides, b, c0, hk), c.p.v_strides.row, n, d, T(1), vt,
                    bn_pad, npad);
    for (int64_t x = 0; x < d; ++x) {
      std::fill(dkt + x * bn_pad, dkt + x * bn_pad + npad, T(0));
      std::fill(dvt + x * bn_pad, dvt + x * bn_pad + npad, T(0));
    }

    // First query row that sees key c0.
    const int64_t q_start = sh.causal ? std::max<int64_t>(0, c0 - c.offset) : 0;
    for (int64_t h = hk * c.group; h < (hk + 1) * c.group; ++h) {
      const T* lse_h = c.lse_row(b, h);
      const T* delta_h = c.delta_row(b, h);
      for (int64_t r0 = q_start; r0 < sh.seqlen_q; r0 += bm) {
        const int64_t m = std::min(bm, sh.seqlen_q - r0);
        load_rows(row_ptr(c.q, c.p.q_strides, b, r0, h), c.p.q_strides.row, m, d, c.scale,
                  qbuf, d);
        int64_t ldo;
        const T* dos = rows_as(row_ptr(c.dout, c.p.dout_strides, b, r0, h),
                               c.p.dout_strides.row, m, d, st.dobuf.get(), ldo);
        gemm(m, npad, d, qbuf, d, 1, kt, bn_pad, s, bn_pad, /*accumulate=*/false);  // S
        gemm(m, npad, d, dos, ldo, 1, vt, bn_pad, dp, bn_pad, /*accumulate=*/false);  // dP
        for (int64_t i = 0; i < m; ++i) {
          // Query r0 + i sees keys c0 .. c0 + nv - 1 of this tile.
          const int64_t nv =
              sh.causal ? std::clamp<int64_t>(r0 + i + c.offset - c0 + 1, 0, n) : n;
          T* prow = s + i * bn_pad;
          T* dsrow = dp + i * bn_pad;
          exp_sub_scalar(prow, guard_lse(lse_h[r0 + i]), npad);
          std::fill(prow + nv, prow + npad, T(0));
          const T dl = delta_h[r0 + i];
          for (int64_t j = 0; j < npad; j += VW)
            vstore(dsrow + j, vload(prow + j) * (vload(dsrow + j) - dl));
        }
        gemm(d, npad, m, dos, 1, ldo, s, bn_pad, dvt, bn_pad, /*accumulate=*/true);  // dVᵀ
        gemm(d, npad, m, qbuf, 1, d, dp, bn_pad, dkt, bn_pad, /*accumulate=*/true);  // dKᵀ
      }
    }
    c.store_t(dkt, bn_pad, n, T(1), c.p.dk, c.p.dk_strides, b, c0, hk);
    c.store_t(dvt, bn_pad, n, T(1), c.p.dv, c.p.dv_strides, b, c0, hk);
  };

  run_items(ntiles * nbh, make_state, work);
}

// Pass 2: dQ of one query tile, transposed like the forward: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ and
// dQᵀ += Kᵀ·dSᵀ take the key/value tile as the in-place A operand; Qᵀ and dOᵀ are built once.
template <typename in_t>
void bwd_dq(const BwdCtx<in_t>& c) {
  using T = typename BwdCtx<in_t>::T;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = c.sh;
  const int64_t d = c.d;
  const int64_t bm = kBlockM, bm_pad = round_up(bm, VW), bn = block_n(d);
  const int64_t ntiles = (sh.seqlen_q + bm - 1) / bm;
  const int64_t nbh = sh.batch * sh.nheads;

  struct State {
    Scratch<T> qt, dot, kbuf, vbuf, s, dp, dqt, lse_c, delta_c;
  };
  auto make_state = [&] {
    return State{Scratch<T>(d * bm_pad),  Scratch<T>(d * bm_pad),  Scratch<T>(bn * d),
                 Scratch<T>(bn * d),      Scratch<T>(bn * bm_pad), Scratch<T>(bn * bm_pad),
                 Scratch<T>(d * bm_pad),  Scratch<T>(bm_pad),      Scratch<T>(bm_pad)};
  };

  auto work = [&](State& st, int64_t item) {
    const int64_t tile = ntiles - 1 - item / nbh;
    const int64_t bh = item % nbh;
    const int64_t b = bh / sh.nheads, h = bh % sh.nheads, hk = h / c.group;
    const int64_t r0 = tile * bm, rows = std::min(bm, sh.seqlen_q - r0);
    const int64_t mpad = round_up(rows, VW);
    const int64_t kv_end =
        sh.causal ? std::clamp<int64_t>(r0 + rows + c.offset, 0, sh.seqlen_k) : sh.seqlen_k;
    T *qt = st.qt.get(), *dot = st.dot.get(), *s = st.s.get(), *dp = st.dp.get();
    T *dqt = st.dqt.get(), *lse_c = st.lse_c.get(), *delta_c = st.delta_c.get();

    load_transposed(row_ptr(c.q, c.p.q_strides, b, r0, h), c.p.q_strides.row, rows, d, c.scale,
                    qt, bm_pad, mpad);
    load_transposed(row_ptr(c.dout, c.p.dout_strides, b, r0, h), c.p.dout_strides.row, rows, d,
                    T(1), dot, bm_pad, mpad);
    const T* lse_h = c.lse_row(b, h) + r0;
    const T* delta_h = c.delta_row(b, h) + r0;
    for (int64_t i = 0; i < mpad; ++i) {
      // Padding columns get P = 0 through lse = +inf.
      lse_c[i] = i < rows ? guard_lse(lse_h[i]) : std::numeric_limits<T>::infinity();
      delta_c[i] = i < rows ? delta_h[i] : T(0);
    }
    for (int64_t x = 0; x < d; ++x) std::fill(dqt + x * bm_pad, dqt + x * bm_pad + mpad, T(0));

    for (int64_t c0 = 0; c0 < kv_end; c0 += bn) {
      const int64_t n = std::min(bn, kv_end - c0);
      int64_t ldk, ldv;
      const T* kr = rows_as(row_ptr(c.k, c.p.k_strides, b, c0, hk), c.p.k_strides.row, n, d,
                            st.kbuf.get(), ldk);
      const T* vr = rows_as(row_ptr(c.v, c.p.v_strides, b, c0, hk), c.p.v_strides.row, n, d,
                            st.vbuf.get(), ldv);
      gemm(n, mpad, d, kr, ldk, 1, qt, bm_pad, s, bm_pad, /*accumulate=*/false);    // Sᵀ
      gemm(n, mpad, d, vr, ldv, 1, dot, bm_pad, dp, bm_pad, /*accumulate=*/false);  // dPᵀ
      for (int64_t j = 0; j < n; ++j) {
        T* prow = s + j * bm_pad;
        T* dsrow = dp + j * bm_pad;
        exp_sub_cols(prow, lse_c, mpad);
        if (sh.causal) {
          // Key c0 + j is hidden from queries r0 + i with i < c0 + j - offset - r0.
          const int64_t lo = std::clamp<int64_t>(c0 + j - c.offset - r0, 0, mpad);
          std::fill(prow, prow + lo, T(0));
        }
        for (int64_t i = 0; i < mpad; i += VW)
          vstore(prow + i, vload(prow + i) * (vload(dsrow + i) - vload(delta_c + i)));
      }
      gemm(d, mpad, n, kr, 1, ldk, s, bm_pad, dqt, bm_pad, /*accumulate=*/true);  // dQᵀ += Kᵀ dSᵀ
    }
    c.store_t(dqt, bm_pad, rows, c.scale, c.p.dq, c.p.dq_strides, b, r0, h);
  };

  run_items(ntiles * nbh, make_state, work);
}

template <typename in_t>
void bwd_impl(const BwdParams& p) {
  const BwdCtx<in_t> ctx(p);
  bwd_dkdv(ctx);
  bwd_dq(ctx);
}

}  // namespace

void flash_bwd_cpu(const BwdParams& params) {
  cpu::dispatch_dtype(params.dtype, [&](auto tag) { bwd_impl<decltype(tag)>(params); });
}

}  // namespace ringseq
