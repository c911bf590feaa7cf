// CPU backward (one copy per ISA level) in one pass over the visible (query, key) blocks:
// five GEMMs per block, the minimum (S, dP, dV, dK, dQ), deterministic and without atomics.
//
// One work item is (batch, kv head, chunk of key tiles). For each of its key tiles it packs
// scale·Kᵀ and Vᵀ once, then walks the query heads of the GQA group and their visible query
// tiles: S = Q·(scale·Kᵀ), dP = dO·Vᵀ (Q and dO as the broadcast operand), P = exp(S - lse),
// dS = scale·P∘(dP - D), then dV += Pᵀ·dO and dK += dSᵀ·Q (P and dS read transposed through the
// broadcast operand's strides) into the tile's accumulators, and dQ += dS·K into the query rows.
// Q, dO and K rows are read as float rows (at a stride of an odd number of cache lines, as are
// Kᵀ, Vᵀ, P and dS: common.h: packed_ld): Q/dO packed once per thread and query
// head where an item's key tiles reuse them (common.h: HeadRows), else copied per block
// (rows_as). dK/dV of a key tile are owned by one item. dQ rows are shared by the chunks of a head: with one chunk
// (enough heads to keep the threads busy) the item adds straight into dq; otherwise every chunk
// owns a float32 partial dQ and the partials are summed in chunk order at the end. The chunk
// count depends on the shape and the machine only (bwd_chunks), so results do not depend on
// the thread count.
//
// P = exp(scale·QKᵀ - lse) uses the lse it is given (possibly the global one of a ring), and a
// row with lse = -inf (it saw no key) is treated as lse = +inf, so its P is 0 and not NaN.
//
// On the amx level (bf16, head dim a multiple of 32) all five products run on AMX tiles, P and
// dS rounded to bf16 for dV, dK and dQ (see the amx notes in bwd_impl).
//
// Spans and bands (masks.h): the key tiles are those of every span (heaviest first); each
// visits only the query rows its band reaches (element-exact, km::band_row_range) and masks
// only blocks that straddle a band edge (km::band_block_full). With a soft-cap, S becomes
// softcap·tanh(S / softcap) and dS takes the factor 1 - tanh².
#include <unistd.h>

#include "../amx.h"
#include "../common.h"
#include "../gemm.h"
#include "../masks.h"

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

namespace {

// Chunks of key tiles per (batch, kv head): enough work items (b · h_kv · chunks) for twice the
// machine's processors (at least 16), while all the float32 partial dQ buffers stay under
// 256 MiB. Depends on the shape and the machine only, never on torch's thread setting, so
// results do not change with the thread count. At least 1, also without key tiles (spans whose
// k_len is 0): the dQ rows of the spans are then cleared (or kept, accumulating) through the
// same path as rows that see no key, not summed from partials nobody wrote.
int64_t bwd_chunks(int64_t nbh, int64_t nkt, int64_t dq_part_bytes) {
  static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  const int64_t target = imax(16, 2 * static_cast<int64_t>(cpus > 0 ? cpus : 1));
  int64_t chunks = iclamp((target + nbh - 1) / nbh, 1, imax(nkt, 1));
  const int64_t budget = int64_t(256) << 20;
  if (chunks > 1 && dq_part_bytes > 0) chunks = imin(chunks, imax(1, budget / dq_part_bytes));
  return chunks;
}

template <typename T>
RS_INLINE T guard_lse(T x) {
  return x == kNegInf<T> ? kPosInf<T> : x;
}

// delta = rowsum(dO∘O) of every query row, (b, h, s_q) contiguous in the accumulation type,
// summed in the order the dP GEMM sums dO_i·v_j (gemm_order_dot). A row that sees a single key
// has O_i = v_j exactly, and then dP_ij - delta_i is exactly 0, as in plain attention (whose
// softmax backward cancels exactly there); a delta summed in another order (torch's) left dS a
// few ulps of dP instead: up to 5x plain fp32 attention's dq error on that row (d = 64,
// causal), alone and in a ring (which computes delta once, through this, for all its steps).
template <typename in_t>
void delta_rows(const BwdParams& p, typename AccType<in_t>::type* dst) {
  using T = typename AccType<in_t>::type;
  const AttnShape& sh = p.shape;
  const in_t* dout = static_cast<const in_t*>(p.dout);
  const in_t* out = static_cast<const in_t*>(p.out);
  run_items(sh.batch * sh.nheads, [] { return 0; }, [&](int&, int64_t bh) {
    const int64_t b = bh / sh.nheads, h = bh % sh.nheads;
    if constexpr (kAmx && kSame<in_t, bf16_t>) {
      if (sh.headdim % 32 == 0) {  // dP on tiles (bwd_impl): the same tile products' order
        amx_diagonal_dots(row_ptr(dout, p.dout_strides, b, 0, h), p.dout_strides.row,
                          row_ptr(out, p.out_strides, b, 0, h), p.out_strides.row, sh.seqlen_q, sh.headdim,
                          dst + bh * sh.seqlen_q);
        return;
      }
    }
    for (int64_t r = 0; r < sh.seqlen_q; ++r) {
      const in_t* dout_row = row_ptr(dout, p.dout_strides, b, r, h);
      const in_t* out_row = row_ptr(out, p.out_strides, b, r, h);
      if constexpr (kBf16Pairs && kSame<in_t, bf16_t>) {  // dP from bf16 pairs (bwd_impl)
        dst[bh * sh.seqlen_q + r] = pair_order_dot(dout_row, out_row, sh.headdim, kHeadChunk / 2);
      } else {
        dst[bh * sh.seqlen_q + r] = gemm_order_dot<T>(dout_row, out_row, sh.headdim, kHeadChunk);
      }
    }
  });
}

// P = exp(s_mul·S - lse) and dS = P∘(dP - D)·scale for NV vectors of one row (their NV exps
// side by side: exp_vecs), in place: S -> P in prow, dP -> dS in dsrow. s_mul: the softmax
// scale where S comes unscaled from the tiles (amx), else 1 (exact).
template <typename T, int NV>
RS_INLINE void p_ds(T* prow, T* dsrow, vec_t<T> s_mul, vec_t<T> lse_i, vec_t<T> d_i, vec_t<T> sc) {
  constexpr int64_t VW = kVW<T>;
  vec_t<T> e[NV];
  for (int v = 0; v < NV; ++v) e[v] = vload(prow + v * VW) * s_mul - lse_i;
  exp_vecs<NV>(e);  // lse comes from the caller (a merged ring lse, any tensor): x may pass 0
  for (int v = 0; v < NV; ++v) {
    vstore(prow + v * VW, e[v]);
    vstore(dsrow + v * VW, e[v] * (vload(dsrow + v * VW) - d_i) * sc);
  }
}

template <typename in_t>
void bwd_impl(const BwdParams& p) {
  using T = typename AccType<in_t>::type;
  using V = vec_t<T>;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = p.shape;
  const int64_t d = sh.headdim, dpad = round_up(d, VW);
  // Row stride of the copied K, Q and dO rows: the B operands of dQ += dS·K, dK += dSᵀ·Q and
  // dV += Pᵀ·dO (common.h: packed_ld).
  const int64_t ldp = packed_ld<T>(dpad);
  const int64_t bm = bwd_block_m<T>(), bn = bwd_block_n<T>(d), bn_pad = round_up(bn, VW);
  // Row stride of Kᵀ, Vᵀ (B of S and dP), P and dS (read down their columns by dV += Pᵀ·dO and
  // dK += dSᵀ·Q): bn_pad columns, padded where that is an even number of lines (packed_ld).
  const int64_t ldt = packed_ld<T>(bn_pad);
  const int64_t group = sh.nheads / sh.nheads_kv;
  const int64_t s_q = sh.seqlen_q;
  const T cap = static_cast<T>(sh.softcap);  // 0: no soft-cap
  // The key tiles of every span with the query rows each one's band reaches, heaviest first.
  const Spans spans(sh, p.spans);
  const int64_t nkt = span_tile_count(spans, bn, /*q_side=*/false);
  Scratch<SpanTile> ktiles(nkt);
  span_tiles(spans, bn, /*q_side=*/false, ktiles.get());
  const int64_t nbh = sh.batch * sh.nheads_kv;
  const int64_t part_elems = sh.batch * sh.nheads * s_q * dpad;
  const int64_t chunks = bwd_chunks(nbh, nkt, part_elems * static_cast<int64_t>(sizeof(T)));
  const T scale = static_cast<T>(sh.softmax_scale);

  const in_t* q = static_cast<const in_t*>(p.q);
  const in_t* k = static_cast<const in_t*>(p.k);
  const in_t* v = static_cast<const in_t*>(p.v);
  const in_t* dout = static_cast<const in_t*>(p.dout);
  const T* lse = static_cast<const T*>(p.lse);
  // delta = rowsum(dO∘O): the caller's, or summed here (delta_rows).
  Scratch<T> own_delta(p.delta ? 0 : sh.batch * sh.nheads * s_q);
  StatStrides delta_strides = p.delta_strides;
  const T* delta = static_cast<const T*>(p.delta);
  if (delta == nullptr) {
    delta_rows<in_t>(p, own_delta.get());
    delta_strides.batch = sh.nheads * s_q;
    delta_strides.head = s_q;
    delta = own_delta.get();
  }

  // Where dQ accumulates: straight into dq (float rows of whole vectors, one chunk), or into
  // per-chunk float partials (b, h, s_q, dpad) summed at the end.
  const bool dq_float = p.accumulate || kSame<in_t, T>;
  const bool direct = chunks == 1 && dq_float && d == dpad;
  Scratch<T> parts(direct ? 0 : chunks * part_elems);
  T* dq_float_base = static_cast<T*>(p.dq);
  // Only the q rows of the call's spans (pairwise disjoint) receive dQ: the rest of dq is the
  // binding's (zeroed, or left as it is when accumulating), and the partials of those rows are
  // neither cleared nor summed. A ring step's spans often cover a small part of the shard:
  // clearing and summing every row cost a pass over chunks x s_q x d floats per call.
  if (direct && !p.accumulate) {
    run_items(sh.batch * sh.nheads, [] { return 0; }, [&](int&, int64_t bh) {
      const int64_t b = bh / sh.nheads, h = bh % sh.nheads;
      for (int64_t t = 0; t < spans.count; ++t)
        for (int64_t r = spans[t].q_start; r < spans[t].q_start + spans[t].q_len; ++r)
          fill(row_ptr(dq_float_base, p.dq_strides, b, r, h), d, T(0));
    });
  } else if (!direct) {
    T* base = parts.get();
    run_items(chunks * sh.batch * sh.nheads, [] { return 0; }, [&](int&, int64_t i) {
      for (int64_t t = 0; t < spans.count; ++t)
        fill(base + i * s_q * dpad + spans[t].q_start * dpad, spans[t].q_len * dpad, T(0));
    });
  }

  // bfloat16 inputs on the avx512bf16 level: S = scale·Q·Kᵀ (as the forward computes it, so
  // both sum the same terms in the same order) and dP = dO·Vᵀ (as delta_rows sums delta) from
  // bf16 pairs (Bf16PairStep): Q and dO rows, Kᵀ and Vᵀ as kd pairs per row. On the amx level
  // (head dim a multiple of 32) the same two products from the same pairs on tiles (amx.h),
  // again as the forward and delta_rows sum them, and the other three on tiles too, with P and
  // dS rounded to bf16 (as flash-attn's kernels round them): dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS
  // (Qᵀ, dOᵀ per block, P and dS as pairs of query rows; dVᵀ, dKᵀ transposed once per key
  // tile) and dQ += dS·K (dS as bf16 rows, K as pairs of key rows once per key tile).
  constexpr bool kPairs = kBf16Pairs && kSame<in_t, bf16_t>;
  constexpr bool kAmxType = kAmx && kSame<in_t, bf16_t>;
  const bool amx = kAmxType && d % 32 == 0;
  const bool pairs = kPairs || amx;
  const int64_t kd = (d + 1) / 2;
  // Q and dO rows of a key tile's query rows, packed once per thread and query head (HeadRows:
  // an item's key tiles all read them) where an item has several key tiles and every query
  // head of a GQA group gets a slot (they take turns per key tile; with fewer slots each turn
  // would pack again), else copied per block; read in place where they already are rows of T
  // at stride ldp.
  const bool q_in_place = rows_in_place<T, in_t>(d, dpad, p.q_strides.row, ldp);
  const bool do_in_place = rows_in_place<T, in_t>(d, dpad, p.dout_strides.row, ldp);
  int64_t max_rows = 0;
  for (int64_t t = 0; t < nkt; ++t) max_rows = imax(max_rows, ktiles.get()[t].other.size());
  // (amx packs the pairs only: its five products read no float Q or dO rows.)
  const int64_t q_row_bytes = (amx ? 0 : static_cast<int64_t>(sizeof(T)) * 2 * ldp) + (pairs ? 8 * kd : 0);
  const int64_t slots = imin(group, HeadRows<T>::kMaxSlots);
  const int64_t group_rows = hook_head_rows_bytes() / (q_row_bytes * slots);
  const bool cached = nkt > chunks && group <= HeadRows<T>::kMaxSlots && group_rows >= max_rows;
  const int64_t cache_rows = cached ? max_rows : 0;
  // amx: row strides of Qᵀ/dOᵀ (bm queries), of dS's bf16 rows (bn keys): an odd number of
  // lines (HeadColumns::stride); queries and keys rounded to whole 32-term steps.
  const int64_t bm32 = round_up(bm, 32), bn32 = round_up(bn, 32);
  const int64_t ldcq = amx ? HeadColumns::stride(bm) : 0, ldsr = amx ? HeadColumns::stride(bn) : 0;
  struct State {
    Scratch<T> kt, vt, kbuf, qbuf, dobuf, s, dp, dk, dv;
    Scratch<uint32_t> qpairs, kpairs, dopairs, vpairs;
    HeadRows<T> qrows, dorows;
    HeadRows<uint32_t> qprows, doprows;
    // amx: Qᵀ, dOᵀ; P and dS as pairs of query rows; dS as bf16 rows; K as pairs of key rows;
    // dVᵀ, dKᵀ (d x ldt); one block's dQ
    Scratch<bf16_t> qcols, docols, dsrows;
    Scratch<uint32_t> ppairs, dspairs, kvnni;
    Scratch<T> dvt, dkt, dqb;
    // float path: one block's scale·Q rows for S (kt holds Kᵀ unscaled)
    Scratch<T> qsbuf;
    // a key tile's dK and dV (amx: dKᵀ and dVᵀ) summed over the partial sums of its heads
    // (one or a few heads each, kTileRows rows or more; see work)
    Scratch<T> dksum, dvsum;
  };
  auto make_state = [&] {
    return State{Scratch<T>(pairs ? 0 : d * ldt),
                 Scratch<T>(pairs ? 0 : d * ldt),
                 Scratch<T>(bn * ldp),
                 Scratch<T>(bm * ldp),
                 Scratch<T>(bm * ldp),
                 Scratch<T>(bm * ldt),
                 Scratch<T>(bm * ldt),
                 Scratch<T>(bn_pad * dpad),
                 Scratch<T>(bn_pad * dpad),
                 Scratch<uint32_t>(pairs ? bm * kd : 0),
                 Scratch<uint32_t>(pairs ? kd * ldt : 0),
                 Scratch<uint32_t>(pairs ? bm * kd : 0),
                 Scratch<uint32_t>(pairs ? kd * ldt : 0),
                 HeadRows<T>(q_in_place || amx ? 0 : cache_rows, ldp, slots),
                 HeadRows<T>(do_in_place || amx ? 0 : cache_rows, ldp, slots),
                 HeadRows<uint32_t>(pairs ? cache_rows : 0, kd, slots),
                 HeadRows<uint32_t>(pairs ? cache_rows : 0, kd, slots),
                 Scratch<bf16_t>(amx ? d * ldcq : 0),
                 Scratch<bf16_t>(amx ? d * ldcq : 0),
                 Scratch<bf16_t>(amx ? round_up(bm, 16) * ldsr : 0),
                 Scratch<uint32_t>(amx ? bm32 / 2 * ldt : 0),
                 Scratch<uint32_t>(amx ? bm32 / 2 * ldt : 0),
                 Scratch<uint32_t>(amx ? bn32 / 2 * d : 0),
                 Scratch<T>(amx ? d * ldt : 0),
                 Scratch<T>(amx ? d * ldt : 0),
                 Scratch<T>(amx ? round_up(bm, 16) * dpad : 0),
                 Scratch<T>(pairs ? 0 : bm * ldp),
                 Scratch<T>(amx ? d * ldt : bn_pad * dpad),
                 Scratch<T>(amx ? d * ldt : bn_pad * dpad)};
  };

  auto work = [&](State& st, int64_t item) {
    // Head by head (the forward's order, for the same reason): the chunks of one head run
    // next to each other and share its Q/dO rows in L2/L3.
    const int64_t chunk = item % chunks, bh = item / chunks;
    const int64_t b = bh / sh.nheads_kv, hk = bh % sh.nheads_kv;
    T *kt = st.kt.get(), *vt = st.vt.get(), *s = st.s.get(), *dp = st.dp.get();
    T *dk = st.dk.get(), *dv = st.dv.get();
    // Key tiles chunk, chunk + chunks, ... of the list (heaviest first): interleaved so that
    // the chunks cost about the same. Keys c0.. and rows r0.. are span-local; the span's first
    // kv and q rows (k0, q0) are added where the tensors are indexed.
    for (int64_t kt_i = chunk; kt_i < nkt; kt_i += chunks) {
      const SpanTile& tile = ktiles.get()[kt_i];
      const AttnSpan& sp = spans[tile.span];
      const int64_t c0 = tile.r0, n = tile.rows, npad = round_up(n, VW);
      const int64_t k0 = sp.k_start, q0 = sp.q_start;
      const int64_t q_begin = tile.other.begin, q_end = tile.other.end;  // rows the band reaches
      if (p.accumulate && tile.other.empty()) continue;  // nothing to add
      uint32_t *qp = st.qpairs.get(), *kp = st.kpairs.get();
      uint32_t *dop = st.dopairs.get(), *vp = st.vpairs.get();
      if (pairs) {
        pack_pairs_transposed(bf16_input(row_ptr(k, p.k_strides, b, k0 + c0, hk)), p.k_strides.row, n, d, kp, ldt,
                              npad);
        pack_pairs_transposed(bf16_input(row_ptr(v, p.v_strides, b, k0 + c0, hk)), p.v_strides.row, n, d, vp, ldt,
                              npad);
      } else {
        // (unscaled: the scale goes on Q's side of S, as in the forward; below)
        pack_transposed(row_ptr(k, p.k_strides, b, k0 + c0, hk), p.k_strides.row, n, d, T(1), kt, ldt,
                        npad);
        pack_transposed(row_ptr(v, p.v_strides, b, k0 + c0, hk), p.v_strides.row, n, d, T(1), vt, ldt,
                        npad);
      }
      int64_t ldk = ldp;
      const T* kr = nullptr;
      if (amx) {
        if constexpr (kAmxType) {
          row_pairs(bf16_input(row_ptr(k, p.k_strides, b, k0 + c0, hk)), p.k_strides.row, n, d, st.kvnni.get(), d);
          fill(st.dvt.get(), d * ldt, T(0));
          fill(st.dkt.get(), d * ldt, T(0));
        }
      } else {
        kr = rows_as(row_ptr(k, p.k_strides, b, k0 + c0, hk), p.k_strides.row, n, d, dpad, st.kbuf.get(), ldp, ldk);
        fill(dk, n * dpad, T(0));
        fill(dv, n * dpad, T(0));
      }
      // dK and dV of this key tile sum the products of every query row of every head of the
      // GQA group: one chain of that many terms per element, where plain attention sums each
      // head's alone and the heads pairwise (with one query row per head and 300 heads, dV
      // reached 5.3x plain float32's error). The products go into partial sums (dk / dv, amx:
      // dkt / dvt), added into dksum / dvsum (amx: transposed as dkt / dvt are) at the end
      // of a head once they hold kTileRows rows or more: a head's rows stay one chain (as
      // they were, within the rule), the heads' partial sums another. A tile of fewer rows
      // keeps its one partial sum (no pass at all); otherwise one add per head or group of
      // heads, not per block of rows (a long sequence's blocks pay nothing).
      constexpr int64_t kTileRows = 16;
      const int64_t sum_elems = amx ? d * ldt : n * dpad;
      T* part_k = amx ? st.dkt.get() : dk;
      T* part_v = amx ? st.dvt.get() : dv;
      int64_t pending = 0;  // query rows in the partial sums
      bool summed = false;  // dksum / dvsum hold the earlier partial sums
      auto add_partials = [&] {
        T *sk = st.dksum.get(), *sv = st.dvsum.get();
        for (int64_t e = 0; e < sum_elems; ++e) {
          sk[e] = summed ? sk[e] + part_k[e] : part_k[e];
          sv[e] = summed ? sv[e] + part_v[e] : part_v[e];
        }
        fill(part_k, sum_elems, T(0));
        fill(part_v, sum_elems, T(0));
        summed = true;
        pending = 0;
      };
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const T* lse_h = lse + b * p.lse_strides.batch + h * p.lse_strides.head;
        const T* delta_h = delta + b * delta_strides.batch + h * delta_strides.head;
        T* dq_rows;
        int64_t ldq;
        if (direct) {
          dq_rows = row_ptr(dq_float_base, p.dq_strides, b, 0, h);
          ldq = p.dq_strides.row;
        } else {
          dq_rows = parts.get() + chunk * part_elems + (b * sh.nheads + h) * s_q * dpad;
          ldq = dpad;
        }
        count_tiles(p.tiles_visited, (tile.other.size() + bm - 1) / bm);
        // The tile's Q and dO rows [g0, g1) of query head (b, h), packed (null: copied per
        // block or read in place).
        const int64_t g0 = q0 + q_begin, g1 = q0 + q_end, head = b * sh.nheads + h;
        auto packed = [&](auto& cache, const in_t* src, const RowStrides& strides, auto pack) {
          return cache.rows(head, g0, g1, [&](auto* dst, int64_t r0, int64_t r1) {
            pack(row_ptr(src, strides, b, r0, h), strides.row, r1 - r0, dst);
          });
        };
        auto float_rows = [&](const in_t* src, int64_t ld, int64_t rows, T* dst) {
          pack_rows(src, ld, rows, d, dst, ldp, dpad);
        };
        auto pair_rows = [&](const in_t* src, int64_t ld, int64_t rows, uint32_t* dst) {
          pack_pair_rows(bf16_input(src), ld, rows, d, dst);
        };
        // (amx reads Q and dO as bf16 pairs only.)
        const T* q_item = q_in_place || amx ? nullptr : packed(st.qrows, q, p.q_strides, float_rows);
        const T* do_item = do_in_place || amx ? nullptr : packed(st.dorows, dout, p.dout_strides, float_rows);
        const uint32_t* qp_item = pairs ? packed(st.qprows, q, p.q_strides, pair_rows) : nullptr;
        const uint32_t* dop_item = pairs ? packed(st.doprows, dout, p.dout_strides, pair_rows) : nullptr;
        // Where the prefetches of the next block read (row q_begin of the packed rows or of the
        // tensor).
        const RowsAt q_ahead = q_item != nullptr ? rows_at(q_item, ldp, dpad)
                                                 : rows_at(row_ptr(q, p.q_strides, b, g0, h), p.q_strides.row, d);
        const RowsAt do_ahead = do_item != nullptr
                                    ? rows_at(do_item, ldp, dpad)
                                    : rows_at(row_ptr(dout, p.dout_strides, b, g0, h), p.dout_strides.row, d);
        for (int64_t r0 = q_begin; r0 < q_end; r0 += bm) {
          const int64_t m = imin(bm, q_end - r0);
          // Query r0 + i sees key c0 + j iff lo <= (c0 + j) - (r0 + i) <= hi. In a masked block,
          // S and dP are computed only where some of a register block's entries are visible (the
          // rest is zeroed below), and dV, dK and dQ run only the rows or keys each register
          // block needs (P and dS are exactly 0 elsewhere; gemm.h: Band).
          const bool full = km::band_block_full(r0, r0 + m, c0, c0 + n, sp.k_len, sp.band_lo, sp.band_hi);
          const Band s_band = full ? Band{} : block_band(sp, r0, c0, false, false);   // S, dP: (i, j)
          int64_t ldqi = ldp, ldo = ldp;
          const T* qi = amx ? nullptr
                        : q_item != nullptr ? q_item + (r0 - q_begin) * ldp
                                          : rows_as(row_ptr(q, p.q_strides, b, q0 + r0, h), p.q_strides.row, m, d,
                                                    dpad, st.qbuf.get(), ldp, ldqi);
          const T* doi = amx ? nullptr
                         : do_item != nullptr ? do_item + (r0 - q_begin) * ldp
                                            : rows_as(row_ptr(dout, p.dout_strides, b, q0 + r0, h),
                                                      p.dout_strides.row, m, d, dpad, st.dobuf.get(), ldp, ldo);
          if (pairs) {
            const uint32_t* qpi = qp;
            const uint32_t* dopi = dop;
            if (qp_item != nullptr) {
              qpi = qp_item + (r0 - q_begin) * kd;
              dopi = dop_item + (r0 - q_begin) * kd;
            } else {
              pack_pair_rows(bf16_input(row_ptr(q, p.q_strides, b, q0 + r0, h)), p.q_strides.row, m, d, qp);
              pack_pair_rows(bf16_input(row_ptr(dout, p.dout_strides, b, q0 + r0, h)), p.dout_strides.row, m, d, dop);
            }
            if constexpr (kPairs) {
              gemm<T, Epi::kStore, Bf16PairStep>(m, npad, kd, qpi, kd, 1, kp, ldt, s, ldt, nullptr,
                                                 kHeadChunk / 2, scale, s_band);  // S
              gemm<T, Epi::kStore, Bf16PairStep>(m, npad, kd, dopi, kd, 1, vp, ldt, dp, ldt, nullptr,
                                                 kHeadChunk / 2, T(1), s_band);  // dP
            } else if constexpr (kAmxType) {
              // All of S and dP (bm rows, a multiple of 16, hold the last tile's padding rows);
              // the scale is applied to the finished sums, as the forward does, in the exp
              // loop below (s_mul), on the vectors a query sees.
              // Qᵀ and dOᵀ of the block for dK and dV below, before qp and dop (which may be
              // qpi and dopi) take the padding copies of the last 16 rows.
              columns_of(as_bf16(qpi), d, m, d, st.qcols.get(), ldcq);
              columns_of(as_bf16(dopi), d, m, d, st.docols.get(), ldcq);
              // (The tile state stays loaded for dV, dK and dQ below.)
              amx_configure();
              // (A masked block's 32 x 32 blocks no query of which sees a key are left out:
              // P and dS are zeroed there below.)
              amx_pair_rows_gemm(m, npad, d, qpi, kp, ldt, s, ldt, qp, nullptr, s_band);     // S
              amx_pair_rows_gemm(m, npad, d, dopi, vp, ldt, dp, ldt, dop, nullptr, s_band);  // dP
            }
          } else {
            // S = (scale·Q)·Kᵀ: the forward's terms fl(scale·q)·k summed in its order (the same
            // GEMM, kHeadChunk), so that P = exp(S - lse) meets the forward's S bit for bit (a
            // row with one visible key gets P = 1 exactly; with Q·(scale·Kᵀ) the products
            // rounded otherwise wherever the scale is not a power of two, and P missed by
            // ~|S|·2^-24, 6-7x plain float32's dV error at large scores).
            T* qs = st.qsbuf.get();
            for (int64_t i = 0; i < m; ++i) scale_row(qi + i * ldqi, d, scale, qs + i * ldp);
            gemm<T, Epi::kStore>(m, npad, d, qs, ldp, 1, kt, ldt, s, ldt, nullptr, kHeadChunk, T(1), s_band);  // S
            gemm<T, Epi::kStore>(m, npad, d, doi, ldo, 1, vt, ldt, dp, ldt, nullptr, kHeadChunk, T(1), s_band);  // dP
          }
          // amx: P and dS as pairs of query rows (zero past m, to a whole 32-query step), dS as
          // bf16 rows (zero past n, to a whole 32-key step; rows past m, to 16, zero).
          const int64_t m32 = round_up(m, 32), m16 = round_up(m, 16), n32 = round_up(n, 32);
          uint32_t *pp = st.ppairs.get(), *dsp = st.dspairs.get();
          bf16_t* dsr = st.dsrows.get();
          for (int64_t i = 0; i < m; ++i) {
            // Query r0 + i sees keys [jb, je) of this tile: all of them in a full block, else
            // those within its band (keys past n are the tile's padding); S and dP were
            // computed on the vectors [j_begin, j_end) that cover them.
            const Band::Cols jc = s_band.cols<T>(i, n);
            const int64_t jb = jc.first, je = jc.last, j_begin = jc.v_begin, j_end = jc.v_end;
            T* prow = s + i * ldt;
            T* dsrow = dp + i * ldt;
            if (r0 + bm + i < q_end) {
              // The next block's Q/dO rows (strided rows the hardware prefetchers miss, or the
              // packed ones), one per row of this one: 1-6 % faster at AVX2 and AVX-512 (Zen 4).
              const int64_t next = r0 + bm + i - q_begin;
              prefetch_lines(q_ahead.at + next * q_ahead.step, q_ahead.bytes);
              prefetch_lines(do_ahead.at + next * do_ahead.step, do_ahead.bytes);
            }
            const V lse_i = vsplat(guard_lse(lse_h[q0 + r0 + i]));
            const V d_i = vsplat(delta_h[q0 + r0 + i]);
            const V sc = vsplat(scale);
            const V s_mul = vsplat(amx ? scale : T(1));  // S from the tiles is unscaled (above)
            if (cap > T(0)) {
              // P = exp(cap·t - lse) with t = tanh(S / cap); dS takes d(cap·t)/dS = 1 - t².
              const V inv = vsplat(T(1) / cap), cv = vsplat(cap), one = vsplat(T(1));
              for (int64_t j = j_begin; j < j_end; j += VW) {
                const V th = tanh_vec(vload(prow + j) * s_mul * inv);
                const V pj = exp_vec(th * cv - lse_i);
                vstore(prow + j, pj);
                vstore(dsrow + j, pj * (vload(dsrow + j) - d_i) * sc * (one - th * th));
              }
            } else {
              int64_t j = j_begin;
              for (; j + 4 * VW <= j_end; j += 4 * VW) p_ds<T, 4>(prow + j, dsrow + j, s_mul, lse_i, d_i, sc);
              for (; j < j_end; j += VW) p_ds<T, 1>(prow + j, dsrow + j, s_mul, lse_i, d_i, sc);
            }
            if (jb > 0) {
              fill(prow, jb, T(0));
              fill(dsrow, jb, T(0));
            }
            if (je < npad) {
              fill(prow + je, npad - je, T(0));
              fill(dsrow + je, npad - je, T(0));
            }
            if (amx && (i % 2 == 1 || i + 1 == m)) {
              if constexpr (kAmxType) {
                // P and dS of rows e and (odd) e + 1 as pairs of query rows, and dS as bf16
                // rows, while those rows are in L1 (a pass after the loop read the block's P
                // and dS back from L2: 64 rows of 128 keys each at d = 128, 64 KiB together).
                const int64_t e = i - i % 2;
                const bool odd = e + 1 < m;
                float_row_pairs(s + e * ldt, odd ? s + (e + 1) * ldt : nullptr, npad, pp + e / 2 * ldt);
                float_row_pairs(dp + e * ldt, odd ? dp + (e + 1) * ldt : nullptr, npad, dsp + e / 2 * ldt);
                for (int64_t r = e; r <= i; ++r) bf16_row(dp + r * ldt, npad, n32, dsr + r * ldsr);
              }
            }
          }
          if (amx) {
            if constexpr (kAmxType) {
              // (Rows [0, m) were written in the loop above.)
              const int64_t m2 = round_up(m, 2);
              fill(pp + m2 / 2 * ldt, (m32 - m2) / 2 * ldt, 0u);
              fill(dsp + m2 / 2 * ldt, (m32 - m2) / 2 * ldt, 0u);
              fill(dsr + m * ldsr, (m16 - m) * ldsr, bf16_t{0});
              // 32-query steps none of whose queries a key of the column block sees are skipped
              // (P and dS are exactly 0 there).
              AmxExtras ex;
              ex.cols_see = full ? Band{} : block_band(sp, r0, c0, true, false);  // query - key
              ex.steps_total = m32 / 32;
              amx_gemm(true, d, npad, m32 / 32, st.docols.get(), ldcq, pp, ldt, st.dvt.get(), ldt, ex);  // dVᵀ += dOᵀ·P
              amx_gemm(true, d, npad, m32 / 32, st.qcols.get(), ldcq, dsp, ldt, st.dkt.get(), ldt, ex);  // dKᵀ += Qᵀ·dS
              T* dqb = st.dqb.get();
              amx_gemm(false, m16, d, n32 / 32, dsr, ldsr, st.kvnni.get(), d, dqb, dpad);           // dS·K
              amx_release();
              for (int64_t i = 0; i < m; ++i) {
                T* dst = dq_rows + (q0 + r0 + i) * ldq;
                for (int64_t c = 0; c < d; c += VW) vstore(dst + c, vload(dst + c) + vload(dqb + i * dpad + c));
              }
            }
          } else {
            const Band kq_band = full ? Band{} : block_band(sp, r0, c0, true, true);   // dV, dK: (j, i)
            const Band qk_band = full ? Band{} : block_band(sp, r0, c0, false, true);  // dQ: (i, j)
            gemm<T, Epi::kAdd>(n, dpad, m, s, 1, ldt, doi, ldo, dv, dpad, nullptr, 0, T(1), kq_band);   // dV += Pᵀ·dO
            gemm<T, Epi::kAdd>(n, dpad, m, dp, 1, ldt, qi, ldqi, dk, dpad, nullptr, 0, T(1), kq_band);  // dK += dSᵀ·Q
            gemm<T, Epi::kAdd>(m, dpad, n, dp, ldt, 1, kr, ldk, dq_rows + (q0 + r0) * ldq, ldq, nullptr, 0, T(1),
                               qk_band);  // dQ += dS·K
          }
          pending += m;
        }
        // (at a head's end: a head's own rows stay one chain, as they always were)
        if (pending >= kTileRows) add_partials();
      }
      if (summed && pending > 0) add_partials();
      // the tile's dK and dV: the sums, or the one partial sum of a tile of few rows
      const T* tile_k = summed ? st.dksum.get() : part_k;
      const T* tile_v = summed ? st.dvsum.get() : part_v;
      if (amx) {
        if constexpr (kAmxType) {
          // dV, dK rows from dVᵀ, dKᵀ (npad rows: the scratch holds bn_pad).
          transpose(tile_v, ldt, d, npad, dv, dpad);
          transpose(tile_k, ldt, d, npad, dk, dpad);
        }
      }
      // (rows of dpad: amx's transposed into dk / dv above, the float path's where they are)
      const T* out_k = amx ? dk : tile_k;
      const T* out_v = amx ? dv : tile_v;
      const bool acc = p.accumulate;
      if (acc) {
        store_rows(out_k, dpad, n, d, static_cast<const T*>(nullptr),
                   row_ptr(static_cast<T*>(p.dk), p.dk_strides, b, k0 + c0, hk), p.dk_strides.row, true);
        store_rows(out_v, dpad, n, d, static_cast<const T*>(nullptr),
                   row_ptr(static_cast<T*>(p.dv), p.dv_strides, b, k0 + c0, hk), p.dv_strides.row, true);
      } else {
        store_rows(out_k, dpad, n, d, static_cast<const T*>(nullptr),
                   row_ptr(static_cast<in_t*>(p.dk), p.dk_strides, b, k0 + c0, hk), p.dk_strides.row, false);
        store_rows(out_v, dpad, n, d, static_cast<const T*>(nullptr),
                   row_ptr(static_cast<in_t*>(p.dv), p.dv_strides, b, k0 + c0, hk), p.dv_strides.row, false);
      }
    }
  };

  run_items(chunks * nbh, make_state, work);

  if (!direct) {
    // dq (+)= the chunks' partials, in chunk order.
    const T* base = parts.get();
    run_items(sh.batch * sh.nheads, [] { return 0; }, [&](int&, int64_t bh) {
      const int64_t b = bh / sh.nheads, h = bh % sh.nheads;
      for (int64_t t = 0; t < spans.count; ++t) {
        for (int64_t r = spans[t].q_start; r < spans[t].q_start + spans[t].q_len; ++r) {
          const T* src = base + (bh * s_q + r) * dpad;
          if (p.accumulate) {
            T* dst = row_ptr(static_cast<T*>(p.dq), p.dq_strides, b, r, h);
            for (int64_t c = 0; c < d; ++c) {
              T sum = src[c];
              for (int64_t ch = 1; ch < chunks; ++ch) sum += src[ch * part_elems + c];
              dst[c] += sum;
            }
          } else {
            in_t* dst = row_ptr(static_cast<in_t*>(p.dq), p.dq_strides, b, r, h);
            for (int64_t c = 0; c < d; ++c) {
              T sum = src[c];
              for (int64_t ch = 1; ch < chunks; ++ch) sum += src[ch * part_elems + c];
              dst[c] = from_acc<in_t>(sum);
            }
          }
        }
      }
    });
  }
}

}  // namespace

void flash_bwd(const BwdParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { bwd_impl<decltype(tag)>(params); });
}

void flash_delta(const BwdParams& params, void* delta) {
  dispatch_dtype(params.dtype, [&](auto tag) {
    using in_t = decltype(tag);
    delta_rows<in_t>(params, static_cast<typename AccType<in_t>::type*>(delta));
  });
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
