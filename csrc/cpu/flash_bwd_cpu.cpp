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
  int64_t d, dpad, group, offset;
  T scale;
  const in_t *q, *k, *v, *dout;
  const T *lse, *delta;

  explicit BwdCtx(const BwdParams& params)
      : p(params),
        sh(params.shape),
        d(sh.headdim),
        dpad(round_up(sh.headdim, kVW<T>)),
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

  // Writes or adds scale·acc into a gradient (input dtype, or T accumulators).
  template <typename out_grad_t>
  void store_grad(const T* acc, int64_t rows, T s, void* base, const RowStrides& strides,
                  int64_t b, int64_t row0, int64_t head) const {
    out_grad_t* dst = row_ptr(static_cast<out_grad_t*>(base), strides, b, row0, head);
    store_rows(acc, dpad, rows, d, s, dst, strides.row, p.accumulate);
  }
  void store(const T* acc, int64_t rows, T s, void* base, const RowStrides& strides, int64_t b,
             int64_t row0, int64_t head) const {
    if (p.accumulate) {
      store_grad<T>(acc, rows, s, base, strides, b, row0, head);
    } else {
      store_grad<in_t>(acc, rows, s, base, strides, b, row0, head);
    }
  }
};

// Pass 1: dK and dV of one key tile.
template <typename in_t>
void bwd_dkdv(const BwdCtx<in_t>& c) {
  using T = typename BwdCtx<in_t>::T;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = c.sh;
  const int64_t d = c.d, dpad = c.dpad;
  const int64_t bm = kBlockM, bm_pad = round_up(bm, VW);
  const int64_t bn = getenv("RS_BN1") ? atoi(getenv("RS_BN1")) : block_n(d);
  const int64_t ntiles = (sh.seqlen_k + bn - 1) / bn;
  const int64_t nbh = sh.batch * sh.nheads_kv;

  struct State {
    Scratch<T> ks, vs, qt, dot, qp, dop, st, dpt, dk, dv, lse_c, delta_c;
  };
  auto make_state = [&] {
    return State{Scratch<T>(bn * d),      Scratch<T>(bn * d),      Scratch<T>(d * bm_pad),
                 Scratch<T>(d * bm_pad),  Scratch<T>(bm * dpad),   Scratch<T>(bm * dpad),
                 Scratch<T>(bn * bm_pad), Scratch<T>(bn * bm_pad), Scratch<T>(bn * dpad),
                 Scratch<T>(bn * dpad),   Scratch<T>(bm_pad),      Scratch<T>(bm_pad)};
  };

  auto work = [&](State& s, int64_t item) {
    // Causal: the first key tiles are seen by the most queries; hand them out first.
    const int64_t tile = item / nbh, bh = item % nbh;
    const int64_t b = bh / sh.nheads_kv, hk = bh % sh.nheads_kv;
    const int64_t c0 = tile * bn, n = std::min(bn, sh.seqlen_k - c0);
    T *ks = s.ks.get(), *vs = s.vs.get(), *qt = s.qt.get(), *dot = s.dot.get();
    T *qp = s.qp.get(), *dop = s.dop.get(), *st = s.st.get(), *dpt = s.dpt.get();
    T *dk = s.dk.get(), *dv = s.dv.get(), *lse_c = s.lse_c.get(), *delta_c = s.delta_c.get();

    load_rows(row_ptr(c.k, c.p.k_strides, b, c0, hk), c.p.k_strides.row, n, d, T(1), ks, d);
    load_rows(row_ptr(c.v, c.p.v_strides, b, c0, hk), c.p.v_strides.row, n, d, T(1), vs, d);
    std::fill(dk, dk + n * dpad, T(0));
    std::fill(dv, dv + n * dpad, T(0));

    // First query row that sees key c0.
    const int64_t q_start = sh.causal ? std::max<int64_t>(0, c0 - c.offset) : 0;
    for (int64_t h = hk * c.group; h < (hk + 1) * c.group; ++h) {
      const T* lse_h = c.lse_row(b, h);
      const T* delta_h = c.delta_row(b, h);
      for (int64_t r0 = q_start; r0 < sh.seqlen_q; r0 += bm) {
        const int64_t m = std::min(bm, sh.seqlen_q - r0), mpad = round_up(m, VW);
        const in_t* qrows = row_ptr(c.q, c.p.q_strides, b, r0, h);
        const in_t* dorows = row_ptr(c.dout, c.p.dout_strides, b, r0, h);
        pack_b_transposed(qrows, c.p.q_strides.row, m, d, c.scale, qt);
        pack_b_transposed(dorows, c.p.dout_strides.row, m, d, T(1), dot);
        for (int64_t i = 0; i < m; ++i) {
          lse_c[i] = guard_lse(lse_h[r0 + i]);
          delta_c[i] = delta_h[r0 + i];
        }
        gemm_packed(n, mpad, d, ks, d, qt, st, bm_pad, /*accumulate=*/false);   // Sᵀ
        gemm_packed(n, mpad, d, vs, d, dot, dpt, bm_pad, /*accumulate=*/false); // dPᵀ
        for (int64_t j = 0; j < n; ++j) {
          // Key c0 + j is visible to query r0 + i iff i >= c0 + j - offset - r0.
          const int64_t lo =
              sh.causal ? std::clamp<int64_t>(c0 + j - c.offset - r0, 0, m) : 0;
          T* prow = st + j * bm_pad;
          T* dsrow = dpt + j * bm_pad;
          std::fill(prow, prow + lo, T(0));
          std::fill(dsrow, dsrow + lo, T(0));
          exp_sub_vec(prow + lo, lse_c + lo, m - lo);
          for (int64_t i = lo; i < m; ++i) dsrow[i] = prow[i] * (dsrow[i] - delta_c[i]);
        }
        pack_b_rows(qrows, c.p.q_strides.row, m, d, T(1), qp);
        pack_b_rows(dorows, c.p.dout_strides.row, m, d, T(1), dop);
        gemm_packed(n, dpad, m, st, bm_pad, dop, dv, dpad, /*accumulate=*/true);  // dV += Pᵀ dO
        gemm_packed(n, dpad, m, dpt, bm_pad, qp, dk, dpad, /*accumulate=*/true);  // dK += dSᵀ Q
      }
    }
    c.store(dk, n, c.scale, c.p.dk, c.p.dk_strides, b, c0, hk);
    c.store(dv, n, T(1), c.p.dv, c.p.dv_strides, b, c0, hk);
  };

  run_items(ntiles * nbh, make_state, work);
}

// Pass 2: dQ of one query tile.
template <typename in_t>
void bwd_dq(const BwdCtx<in_t>& c) {
  using T = typename BwdCtx<in_t>::T;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = c.sh;
  const int64_t d = c.d, dpad = c.dpad;
  const int64_t bm = kBlockM, bn = block_n(d), bn_pad = round_up(bn, VW);
  const int64_t ntiles = (sh.seqlen_q + bm - 1) / bm;
  const int64_t nbh = sh.batch * sh.nheads;

  struct State {
    Scratch<T> qs, dos, kt, vt, kp, s, dp, dq, lse_r;
  };
  auto make_state = [&] {
    return State{Scratch<T>(bm * d),      Scratch<T>(bm * d),      Scratch<T>(d * bn_pad),
                 Scratch<T>(d * bn_pad),  Scratch<T>(bn * dpad),   Scratch<T>(bm * bn_pad),
                 Scratch<T>(bm * bn_pad), Scratch<T>(bm * dpad),   Scratch<T>(bm)};
  };

  auto work = [&](State& s, int64_t item) {
    const int64_t tile = ntiles - 1 - item / nbh;
    const int64_t bh = item % nbh;
    const int64_t b = bh / sh.nheads, h = bh % sh.nheads, hk = h / c.group;
    const int64_t r0 = tile * bm, rows = std::min(bm, sh.seqlen_q - r0);
    const int64_t kv_end =
        sh.causal ? std::clamp<int64_t>(r0 + rows + c.offset, 0, sh.seqlen_k) : sh.seqlen_k;
    T *qs = s.qs.get(), *dos = s.dos.get(), *kt = s.kt.get(), *vt = s.vt.get();
    T *kp = s.kp.get(), *sb = s.s.get(), *dp = s.dp.get(), *dq = s.dq.get();
    T* lse_r = s.lse_r.get();

    load_rows(row_ptr(c.q, c.p.q_strides, b, r0, h), c.p.q_strides.row, rows, d, c.scale, qs, d);
    load_rows(row_ptr(c.dout, c.p.dout_strides, b, r0, h), c.p.dout_strides.row, rows, d, T(1),
              dos, d);
    const T* lse_h = c.lse_row(b, h) + r0;
    const T* delta_h = c.delta_row(b, h) + r0;
    for (int64_t r = 0; r < rows; ++r) lse_r[r] = guard_lse(lse_h[r]);
    std::fill(dq, dq + rows * dpad, T(0));

    for (int64_t c0 = 0; c0 < kv_end; c0 += bn) {
      const int64_t n = std::min(bn, kv_end - c0), npad = round_up(n, VW);
      const in_t* krows = row_ptr(c.k, c.p.k_strides, b, c0, hk);
      const in_t* vrows = row_ptr(c.v, c.p.v_strides, b, c0, hk);
      pack_b_transposed(krows, c.p.k_strides.row, n, d, T(1), kt);
      pack_b_transposed(vrows, c.p.v_strides.row, n, d, T(1), vt);
      pack_b_rows(krows, c.p.k_strides.row, n, d, T(1), kp);
      gemm_packed(rows, npad, d, qs, d, kt, sb, bn_pad, /*accumulate=*/false);   // S
      gemm_packed(rows, npad, d, dos, d, vt, dp, bn_pad, /*accumulate=*/false);  // dP
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t nv =
            sh.causal ? std::clamp<int64_t>(r0 + r + c.offset - c0 + 1, 0, n) : n;
        T* srow = sb + r * bn_pad;
        const T* dprow = dp + r * bn_pad;
        exp_sub_sum(srow, nv, lse_r[r]);
        const T dl = delta_h[r];
        for (int64_t j = 0; j < nv; ++j) srow[j] = srow[j] * (dprow[j] - dl);
        std::fill(srow + nv, srow + n, T(0));
      }
      gemm_packed(rows, dpad, n, sb, bn_pad, kp, dq, dpad, /*accumulate=*/true);  // dQ += dS K
    }
    c.store(dq, rows, c.scale, c.p.dq, c.p.dq_strides, b, r0, h);
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
