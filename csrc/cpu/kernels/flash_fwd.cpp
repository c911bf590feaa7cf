// CPU forward (one copy per ISA level): tiled online softmax. One work item is (batch, head,
// tile of query rows); it streams the visible key tiles and keeps the running max, sum and
// output of its rows in per-thread scratch, so extra memory is O(threads x tile), plus the
// packed K/V rows of one kv head per thread (common.h: HeadRows, at most 9 MiB by default).
//
// Per key tile: Sᵀ = K·Qᵀ (K as the broadcast operand, Qᵀ packed once per item; the column
// maxima come out of the GEMM's epilogue), P = exp(S - m) through the rows of Sᵀ, and
// O = alpha·O + P·V (Pᵀ as the broadcast operand, the rescale in the GEMM's epilogue). K and V
// rows are read as float rows (V, Qᵀ and Sᵀ at a stride of an odd number of cache lines:
// common.h: packed_ld): packed once per thread and kv head where other items reuse them
// (HeadRows), else copied per tile (common.h: rows_as). O stays row-major, so the
// epilogue writes output rows without a transpose.
//
// Spans and bands (masks.h): one work item is a q tile of one span; it visits only the keys
// its band reaches (element-exact, km::band_key_range) and masks only key tiles that straddle
// a band edge (km::band_block_full). With a soft-cap, S = softcap * tanh(S / softcap) before
// the mask and the softmax.
//
// KV-cache decoding (FwdParams::kv): one span per batch row (km::kvcache_span: the valid keys
// of its cache row, bottom-right aligned), so the work items are the q tiles of every batch
// row's span; K/V rows come from cache row batch_idx[b]. Key splits (FwdParams::num_splits,
// km::kv_splits): when a call has too few items to keep the threads busy (decoding a token
// for a small batch), each q tile's keys are cut into ranges computed as separate items, each
// writing a normalized partial (out, lse) to scratch; a second pass merges them exactly,
// out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s).
#include "../amx.h"
#include "../common.h"
#include "../gemm.h"
#include "../masks.h"

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

namespace {

// The spans of a KV-cache call, one per batch row (km::kvcache_span), in `out` (batch entries).
inline void kvcache_spans(const FwdParams& p, AttnSpan* out) {
  const AttnShape& sh = p.shape;
  for (int64_t b = 0; b < sh.batch; ++b) {
    const km::KvSpan<int64_t> ks = km::kvcache_span<int64_t>(
        sh.seqlen_q, p.kv.leftpad != nullptr ? p.kv.leftpad[b] : 0, p.kv.seqlens[b], sh.causal,
        p.kv.window_left, p.kv.window_right, p.kv.heads_as_rows);
    out[b] = AttnSpan{0, sh.seqlen_q, ks.k_start, ks.k_len, ks.lo, ks.hi};
  }
}

// Work items a call is split into when it has fewer than this (km::kv_splits): enough for
// the cores of a large server, from the shape alone (results must not depend on the thread
// count). Each split keeps at least kSplitMinTiles key tiles: merging costs one pass over its
// rows, against a GEMM over two tiles of keys.
constexpr int64_t kSplitTarget = 64;
constexpr int64_t kSplitMinTiles = 2;

// P = exp(Sᵀ - m) for NV vectors of one row of Sᵀ in place (their NV exps side by side:
// exp_vecs), m_use their columns' maxima, each added to its column's partial sum in lpart.
template <typename T, int NV>
RS_INLINE void exp_add(T* row, const T* m_use, T* lpart) {
  constexpr int64_t VW = kVW<T>;
  vec_t<T> e[NV];  // x - m <= 0
  for (int v = 0; v < NV; ++v) e[v] = vload(row + v * VW) - vload(m_use + v * VW);
  exp_vecs<NV, /*kNonPositive=*/true>(e);
  for (int v = 0; v < NV; ++v) {
    vstore(row + v * VW, e[v]);
    vstore(lpart + v * VW, vload(lpart + v * VW) + e[v]);
  }
}

template <typename in_t>
void fwd_impl(const FwdParams& p) {
  using T = typename AccType<in_t>::type;
  using V = vec_t<T>;
  constexpr int64_t VW = kVW<T>;
  const AttnShape& sh = p.shape;
  const int64_t d = sh.headdim, dpad = round_up(d, VW);
  // Row stride of the copied V rows, the B operand of O = P·V (common.h: packed_ld).
  const int64_t ldp = packed_ld<T>(dpad);
  // bfloat16 inputs on the avx512bf16 level: S = scale·K·Qᵀ from bf16 pairs (Bf16PairStep),
  // Qᵀ and the K tile kept as kd pairs per row instead of d floats; P·V stays in float32 (P is
  // not rounded to bf16). On the amx level, with the head dim a multiple of 32 (amx.h): the
  // same pairs as tiles of Sᵀ = K·Qᵀ, and Oᵀ = Vᵀ·Pᵀ with P rounded to bf16 pairs (pt) and Vᵀ
  // per kv head (HeadColumns); O is kept transposed (ot, d x mpad) until the item ends.
  constexpr bool kPairs = kBf16Pairs && kSame<in_t, bf16_t>;
  constexpr bool kAmxType = kAmx && kSame<in_t, bf16_t>;
  const bool amx = kAmxType && d % 32 == 0;
  const bool pairs = kPairs || amx;
  const int64_t kd = (d + 1) / 2;
  // Query rows per item and keys per tile (vec.h; amx.h for the tiles' own).
  const int64_t bm = amx ? kAmxBlockM : fwd_block_m<T>(d), bn = amx ? kAmxBlockN : fwd_block_n<T>(d);
  // Row stride of Qᵀ (B of Sᵀ = K·Qᵀ) and of Sᵀ/P (read down its columns by O = P·V): bm
  // columns, padded where that is an even number of lines (packed_ld).
  const int64_t ldqt = packed_ld<T>(bm);
  const int64_t group = sh.nheads / sh.nheads_kv;
  const T scale = static_cast<T>(sh.softmax_scale);
  const T cap = static_cast<T>(sh.softcap);  // 0: no soft-cap
  // The q tiles of every span with the keys each one's band reaches, heaviest first. A
  // KV-cache call has one span per batch row (SpanTile::span is the batch row), any other
  // call one list of spans shared by every batch row.
  const bool per_batch = p.kv.seqlens != nullptr;
  Scratch<AttnSpan> batch_spans(per_batch ? sh.batch : 0);
  if (per_batch) kvcache_spans(p, batch_spans.get());
  const SpanList list{batch_spans.get(), sh.batch, 0, 0};
  const Spans spans(sh, per_batch ? list : p.spans);
  const int64_t ntiles = span_tile_count(spans, bm, /*q_side=*/true);
  Scratch<SpanTile> tile_list(ntiles);
  span_tiles(spans, bm, /*q_side=*/true, tile_list.get());
  const int64_t nbh = per_batch ? sh.nheads : sh.batch * sh.nheads;  // items per tile
  const int64_t items = ntiles * nbh;
  const int64_t q_tiles = per_batch ? ntiles / sh.batch : ntiles;
  const int64_t key_tiles = ntiles > 0 ? (tile_list.get()[0].other.size() + bn - 1) / bn : 0;
  const int64_t n_splits =
      p.accumulate ? 1 : km::kv_splits<int64_t>(p.num_splits, q_tiles, items, key_tiles, kSplitTarget,
                                                kSplitMinTiles, km::kMaxSplits);
  // Partial results of the splits: [split][batch][head][q row][d] and [split][batch][head][q row].
  const int64_t part_rows = sh.batch * sh.nheads * sh.seqlen_q;
  Scratch<T> part_o(n_splits > 1 ? n_splits * part_rows * d : 0);
  Scratch<T> part_lse(n_splits > 1 ? n_splits * part_rows : 0);

  const in_t* q = static_cast<const in_t*>(p.q);
  const in_t* k = static_cast<const in_t*>(p.k);
  const in_t* v = static_cast<const in_t*>(p.v);
  // Accumulate mode: out/lse hold a running (out, lse) pair in T, read and then rewritten.
  const bool merge = p.accumulate;
  // out in T: a running pair (merge), or a partial result the caller merges (out_acc).
  const bool out_in_acc = merge || p.out_acc;
  // `rows` rows of out at (b, r0, h) from src (row stride dpad), each times its row_scale
  // (nullptr: 1), in T or rounded to the input type.
  auto store_out = [&](const T* src, int64_t rows, const T* row_scale, int64_t b, int64_t r0,
                       int64_t h) {
    if (out_in_acc) {
      store_rows(src, dpad, rows, d, row_scale, row_ptr(static_cast<T*>(p.out), p.out_strides, b, r0, h),
                 p.out_strides.row, /*accumulate=*/false);
    } else {
      store_rows(src, dpad, rows, d, row_scale,
                 row_ptr(static_cast<in_t*>(p.out), p.out_strides, b, r0, h), p.out_strides.row,
                 /*accumulate=*/false);
    }
  };
  T* lse = static_cast<T*>(p.lse);

  // K and V rows of an item's keys, packed once per thread and kv head (HeadRows) where other
  // items may read them again (several q tiles, of any span, or query heads per kv head; no key
  // splits: a split item's range is its own) and they fit, else copied per tile; read in place
  // where they already are rows of T at the stride the GEMM reads them at (K: dpad; V: ldp).
  const int64_t k_row_elems = pairs ? kd : dpad;
  const bool k_in_place = !pairs && rows_in_place<T, in_t>(d, dpad, p.k_strides.row, dpad);
  const bool v_in_place = rows_in_place<T, in_t>(d, dpad, p.v_strides.row, ldp);
  int64_t max_keys = 0;
  for (int64_t t = 0; t < ntiles; ++t) max_keys = imax(max_keys, tile_list.get()[t].other.size());
  const bool reused = n_splits == 1 && q_tiles * group > 1;
  const int64_t kv_row_bytes = static_cast<int64_t>(sizeof(T)) * (k_row_elems + ldp);
  const int64_t cache_rows = reused ? imin(max_keys, hook_head_rows_bytes() / kv_row_bytes) : 0;
  struct State {
    Scratch<T> qt, kbuf, vbuf, st, o, m_run, m_use, alpha, l, lsum, lpart, cmax, ot, smax;
    Scratch<uint32_t> qpairs, kpairs, pt;
    HeadRows<T> krows, vrows;
    HeadRows<uint32_t> kprows;
    HeadColumns vcols;
    Scratch<bf16_t> vtail;  // amx: the last partial 32-key step of Vᵀ (amx_pv)
  };
  auto make_state = [&] {
    return State{Scratch<T>(pairs ? 0 : d * ldqt),
                 Scratch<T>(pairs ? 0 : bn * dpad),
                 Scratch<T>(amx ? 0 : bn * ldp),
                 Scratch<T>(bn * ldqt),
                 Scratch<T>(bm * dpad),
                 Scratch<T>(bm),
                 Scratch<T>(bm),
                 Scratch<T>(bm),
                 Scratch<T>(bm),
                 Scratch<T>(bm),
                 Scratch<T>(bm),
                 Scratch<T>(bm),
                 Scratch<T>(amx ? dpad * ldqt : 0),
                 Scratch<T>(amx ? bm : 0),
                 Scratch<uint32_t>(pairs ? kd * ldqt : 0),
                 // the K tile, or with amx its last 16-row tile (zero past the keys)
                 Scratch<uint32_t>(pairs ? imax(bn, 16) * kd : 0),
                 Scratch<uint32_t>(amx ? bn / 2 * ldqt : 0),
                 HeadRows<T>(pairs || k_in_place ? 0 : cache_rows, dpad, 1),
                 HeadRows<T>(amx || v_in_place ? 0 : cache_rows, ldp, 1),
                 HeadRows<uint32_t>(pairs ? cache_rows : 0, kd, 1),
                 HeadColumns(amx ? imax(bn, cache_rows) : 0, amx ? d : 0),
                 Scratch<bf16_t>(amx ? d * 32 : 0)};
  };

  auto work = [&](State& st, int64_t item) {
    // Items run head by head, each head's tiles heaviest first (span_tiles), a tile's splits
    // next to each other: a thread's next item reads the same K/V rows, still in L2/L3, where
    // tile by tile over all heads swept every head's K/V between two reads (at s = 4096,
    // d = 128: 32 MiB, more than the L3 of a CCX), measured 5 % slower. Rows r0.. and keys
    // c0.. are span-local; the span's first q and kv rows are added where the tensors are
    // indexed.
    const int64_t split = item % n_splits, base = item / n_splits;
    const SpanTile& tile = tile_list.get()[base % ntiles];
    const AttnSpan& sp = spans[tile.span];
    const int64_t bh = base / ntiles;
    const int64_t b = per_batch ? tile.span : bh / sh.nheads, h = bh % sh.nheads, hk = h / group;
    const int64_t b_kv = p.kv.batch_idx != nullptr ? p.kv.batch_idx[b] : b;  // the cache row
    const int64_t r0 = tile.r0, rows = tile.rows, qr0 = sp.q_start + r0, k0 = sp.k_start;
    // The keys the band reaches, or this split's key tiles of them.
    const km::Range<int64_t> part = km::split_blocks<int64_t>(
        {0, (tile.other.size() + bn - 1) / bn}, split, n_splits);
    const int64_t kv_begin = tile.other.begin + part.begin * bn;
    const int64_t kv_end = imin(tile.other.end, tile.other.begin + part.end * bn);
    // The statistic counts (q tile, kv tile) pairs per query head: a tile of heads-as-rows
    // stands for one such pair of each of its heads.
    count_tiles(p.tiles_visited, part.size() * (p.kv.heads_as_rows ? rows : 1));
    if (merge && tile.other.empty()) return;  // nothing to merge: the running rows stay as they are
    // Query columns computed: the tile's rows rounded up to a vector (a short last tile, or
    // a decoding step's few queries, does not pay for a whole tile).
    const int64_t mpad = imin(bm, round_up(rows, VW));

    T *qt = st.qt.get(), *s = st.st.get(), *o = st.o.get(), *cmax = st.cmax.get();
    T *m_run = st.m_run.get(), *m_use = st.m_use.get(), *alpha = st.alpha.get();
    T *l = st.l.get(), *lsum = st.lsum.get(), *lpart = st.lpart.get();

    // Qᵀ (d x mpad, row stride ldqt), scaled; padding columns (queries past the tile) are zero.
    // With pairs: Qᵀ as kd x mpad pairs (row stride ldqt), unscaled.
    uint32_t* qp = st.qpairs.get();
    if (amx) {
      // (Qᵀ's pairs are the 32-bit transpose of Q's rows: d is even.)
      if constexpr (kAmxType) transpose(bf16_input(row_ptr(q, p.q_strides, b, qr0, h)), p.q_strides.row, rows, kd, qp, ldqt);
    } else if (pairs) {
      pack_pairs_transposed(bf16_input(row_ptr(q, p.q_strides, b, qr0, h)), p.q_strides.row, rows, d, qp, ldqt, mpad);
    } else {
      pack_transposed(row_ptr(q, p.q_strides, b, qr0, h), p.q_strides.row, rows, d, scale, qt, ldqt, mpad);
    }
    T* lse_rows = lse + b * p.lse_strides.batch + h * p.lse_strides.head + qr0;
    // Where this item's lse and out rows go: the outputs, or this split's partial rows (the
    // splits of a tile run concurrently, so they never write the outputs themselves).
    const int64_t part_at = (split * sh.batch + b) * sh.nheads * sh.seqlen_q + h * sh.seqlen_q + qr0;
    T* lse_dst = n_splits > 1 ? part_lse.get() + part_at : lse_rows;
    bool fresh = true;  // O holds nothing yet: the first P·V stores instead of rescaling
    if (merge) {
      // Resuming the online softmax from a running (out, lse) is the exact merge: with
      // m = lse_old the old rows carry weight exp(lse_old - m) = 1, so l = 1 and O = out_old.
      const T* acc_rows = row_ptr(static_cast<const T*>(p.out), p.out_strides, b, qr0, h);
      for (int64_t i = 0; i < mpad; ++i) {
        // NaN counts as seen: a NaN running state must stay NaN, as in plain attention.
        const bool seen = i < rows && !(lse_rows[i] == kNegInf<T>);
        m_run[i] = seen ? lse_rows[i] : kNegInf<T>;
        l[i] = seen ? T(1) : T(0);
        T* orow = o + i * dpad;
        // A row without mass so far contributes nothing, whatever its out holds.
        if (seen) {
          for (int64_t c = 0; c < d; ++c) orow[c] = acc_rows[i * p.out_strides.row + c];
          fill(orow + d, dpad - d, T(0));
        } else {
          fill(orow, dpad, T(0));
        }
      }
      fresh = false;
    } else {
      fill(m_run, mpad, kNegInf<T>);
      fill(l, mpad, T(0));
    }

    // The item's K and V rows [g0, g1) of kv head (b_kv, hk), packed (null: copied per tile or
    // read in place).
    const int64_t g0 = k0 + kv_begin, g1 = k0 + kv_end, head = b_kv * sh.nheads_kv + hk;
    const T* k_item = nullptr;
    const uint32_t* kp_item = nullptr;
    if (pairs) {
      kp_item = st.kprows.rows(head, g0, g1, [&](uint32_t* dst, int64_t r0, int64_t r1) {
        pack_pair_rows(bf16_input(row_ptr(k, p.k_strides, b_kv, r0, hk)), p.k_strides.row, r1 - r0, d, dst);
      });
    } else if (!k_in_place) {
      k_item = st.krows.rows(head, g0, g1, [&](T* dst, int64_t r0, int64_t r1) {
        pack_rows(row_ptr(k, p.k_strides, b_kv, r0, hk), p.k_strides.row, r1 - r0, d, dst, dpad, dpad);
      });
    }
    const T* v_item = amx || v_in_place ? nullptr : st.vrows.rows(head, g0, g1, [&](T* dst, int64_t r0, int64_t r1) {
      pack_rows(row_ptr(v, p.v_strides, b_kv, r0, hk), p.v_strides.row, r1 - r0, d, dst, ldp, dpad);
    });
    // Where the prefetches read: row kv_begin of the packed rows or of the tensor, row step
    // and bytes per row.
    const RowsAt k_ahead = kp_item != nullptr ? rows_at(kp_item, kd, kd)
                           : k_item != nullptr ? rows_at(k_item, dpad, dpad)
                                               : rows_at(row_ptr(k, p.k_strides, b_kv, g0, hk), p.k_strides.row, d);
    const RowsAt v_ahead = v_item != nullptr ? rows_at(v_item, ldp, dpad)
                                             : rows_at(row_ptr(v, p.v_strides, b_kv, g0, hk), p.v_strides.row, d);
    // amx: Vᵀ of the item's keys when it fits the thread's HeadColumns (else packed per tile),
    // O transposed (a running out read in merge mode above), and this thread's tile state.
    const bf16_t* v_cols = nullptr;
    T* ot = st.ot.get();
    if constexpr (kAmxType) {
      if (amx) {
        // (a key split past the band's end has no keys: g1 < g0)
        if (g0 < g1 && g1 - g0 <= st.vcols.cap)
          v_cols = st.vcols.columns(head, g0, g1, row_ptr(v, p.v_strides, b_kv, g0, hk), p.v_strides.row);
        if (!fresh) transpose(o, dpad, mpad, d, ot, ldqt);
        amx_configure();
      }
    }
    for (int64_t c0 = kv_begin; c0 < kv_end; c0 += bn) {
      const int64_t n = imin(bn, kv_end - c0);
      int64_t ldk = dpad, ldv = ldp;
      const T* kt = nullptr;
      const uint32_t* kp = st.kpairs.get();
      if (pairs) {
        if (kp_item != nullptr) {
          kp = kp_item + (c0 - kv_begin) * kd;
        } else {
          pack_pair_rows(bf16_input(row_ptr(k, p.k_strides, b_kv, k0 + c0, hk)), p.k_strides.row, n, d, st.kpairs.get());
        }
      } else if (k_item != nullptr) {
        kt = k_item + (c0 - kv_begin) * dpad;
      } else {
        kt = rows_as(row_ptr(k, p.k_strides, b_kv, k0 + c0, hk), p.k_strides.row, n, d, dpad, st.kbuf.get(), dpad, ldk);
      }
      const T* vt = amx ? nullptr
                    : v_item != nullptr ? v_item + (c0 - kv_begin) * ldp
                                      : rows_as(row_ptr(v, p.v_strides, b_kv, k0 + c0, hk), p.v_strides.row, n, d,
                                                dpad, st.vbuf.get(), ldp, ldv);
      for (int64_t i = 0; i < mpad; i += VW) vstore(cmax + i, vload(m_run + i));
      const bool masked = !km::band_block_full(r0, r0 + rows, c0, c0 + n, sp.k_len, sp.band_lo, sp.band_hi);
      // In a masked block, Sᵀ is computed only in register blocks with a visible entry (the
      // rest is masked below) and P·V runs only the keys some row of a register block sees
      // (P is exactly 0 elsewhere; gemm.h: Band): a causal tile on the diagonal costs about
      // its visible half instead of all of it.
      const Band s_band = masked ? block_band(sp, r0, c0, /*keys_as_rows=*/true, /*on_k=*/false) : Band{};
      const Band pv_band = masked ? block_band(sp, r0, c0, /*keys_as_rows=*/false, /*on_k=*/true) : Band{};
      // amx: whether Sᵀ is scaled before the softmax (masked tiles and the soft-cap need the
      // scaled scores; a scale <= 0 would turn the maxima into minima), else the exp scales it.
      const bool s_scaled = masked || cap > T(0) || !(scale > T(0));
      // Sᵀ = K·Qᵀ (n x mpad), and with kStoreMax its column maxima into cmax.
      auto scores = [&](auto epi) {
        constexpr Epi E = decltype(epi)::value;
        T* mx = E == Epi::kStoreMax ? cmax : nullptr;
        if constexpr (kPairs) {
          gemm<T, E, Bf16PairStep>(n, mpad, kd, kp, kd, 1, qp, ldqt, s, ldqt, mx, kHeadChunk / 2, scale, s_band);
        } else if constexpr (kAmxType) {
          if (amx) {
            // (Sᵀ has bn rows, a multiple of 16: room for the last K tile's padding rows.)
            if (!s_scaled) {
              // Sᵀ stays unscaled (the exp pass applies the scale) and its column maxima come
              // out of the tile product; scaled after: with scale > 0 and rounding monotone,
              // max fl(scale·x) = fl(scale·max x).
              T* smax = st.smax.get();
              fill(smax, mpad, kNegInf<T>);
              amx_pair_rows_gemm(n, mpad, d, kp, qp, ldqt, s, ldqt, st.kpairs.get(), smax);
              for (int64_t i = 0; i < mpad; i += VW)
                vstore(cmax + i, vmax(vload(smax + i) * vsplat(scale), vload(cmax + i)));
            } else {
              // (A masked tile's blocks no key of which a query sees are left out: masked below.)
              amx_pair_rows_gemm(n, mpad, d, kp, qp, ldqt, s, ldqt, st.kpairs.get(), nullptr, s_band);
              scale_rows(s, ldqt, n, mpad, scale, mx);
            }
          } else {
            gemm<T, E>(n, mpad, d, kt, ldk, 1, qt, ldqt, s, ldqt, mx, kHeadChunk, T(1), s_band);
          }
        } else {
          gemm<T, E>(n, mpad, d, kt, ldk, 1, qt, ldqt, s, ldqt, mx, kHeadChunk, T(1), s_band);
        }
      };
      if (masked || cap > T(0)) {
        scores(std::integral_constant<Epi, Epi::kStore>{});
        for (int64_t j = 0; j < n; ++j) {
          T* row = s + j * ldqt;
          // The queries that see key c0 + j, [first, last), and the scores computed of the row.
          const Band::Cols cl = s_band.cols<T>(j, mpad);
          // Before the mask: tanh(-inf) is finite.
          if (cap > T(0)) softcap_row(row + cl.v_begin, cl.v_end - cl.v_begin, cap);
          fill(row, cl.first, kNegInf<T>);
          fill(row + cl.last, mpad - cl.last, kNegInf<T>);
          for (int64_t i = cl.v_begin; i < cl.v_end; i += VW) vstore(cmax + i, vmax(vload(row + i), vload(cmax + i)));
        }
      } else {
        scores(std::integral_constant<Epi, Epi::kStoreMax>{});
      }
      bool moved = false;  // some alpha is not 1 (amx: Oᵀ needs its rescale)
      for (int64_t i = 0; i < mpad; i += VW) {
        const V mx = vload(cmax + i);
        // A query that has seen no key yet keeps m = -inf; subtracting 0 instead keeps
        // exp(-inf - m) = 0 and avoids (-inf) - (-inf).
        const V mu = mx == vsplat(kNegInf<T>) ? vzero<T>() : mx;
        vstore(alpha + i, exp_vec(vload(m_run + i) - mu));
        vstore(m_run + i, mx);
        vstore(m_use + i, mu);
      }
      if (amx)
        for (int64_t i = 0; i < mpad; ++i) moved |= alpha[i] != T(1);
      // The next kv tile's rows, fetched into L2 while this one computes: the packed rows, or
      // the strided rows of the K/V tensors, which the hardware prefetchers do not follow far
      // enough ahead (packed rows come from L3 or memory too when an item starts over).
      const int64_t n_next = imin(bn, kv_end - c0 - n);
      const int64_t next = n_next > 0 ? c0 + n - kv_begin : 0;
      const char* k_next = k_ahead.at + next * k_ahead.step;
      const char* v_next = v_ahead.at + next * v_ahead.step;
      // P = exp(Sᵀ - m) in place, row by row (sequential through the tile), column sums in
      // lsum; the next tile's K/V rows are prefetched one per row. The sums are taken over
      // kChunk rows at a time in lpart (as the GEMMs do, gemm.h), so their rounding error does
      // not grow with the tile.
      fill(lsum, mpad, T(0));
      fill(lpart, mpad, T(0));
      if (amx) {
        if constexpr (kAmxType) {
          // Two rows at a time into Pᵀ's bf16 pairs (amx.h: exp_pair_rows): masked scores are
          // -inf here and give P = 0; rows past n (to a whole 32-key step) are zero.
          // The sums are flushed where the row-by-row loop (the other branch) flushes them
          // (kChunk is even).
          uint32_t* pt = st.pt.get();
          for (int64_t j = 0; j < round_up(n, 32); j += 2) {
            uint32_t* dst = pt + j / 2 * ldqt;
            if (j >= n) {
              fill(dst, mpad, 0u);
              continue;
            }
            // The next tile's K rows (its V is read from Vᵀ, packed once per item, or per tile
            // from the tensor's rows when the item's keys exceed HeadColumns: then those too).
            for (int64_t r = j; r < imin(j + 2, n_next); ++r) {
              prefetch_lines(k_next + r * k_ahead.step, k_ahead.bytes);
              if (v_cols == nullptr) prefetch_lines(v_next + r * v_ahead.step, v_ahead.bytes);
            }
            // A masked tile's pair of rows: the exp over the vectors either row sees, P = 0
            // elsewhere (consecutive rows' bands touch, so that is one range).
            int64_t cb = 0, ce = mpad;
            if (masked) {
              const Band::Cols a = s_band.cols<T>(j, mpad);
              const Band::Cols c = j + 1 < n ? s_band.cols<T>(j + 1, mpad) : Band::Cols{0, 0, 0, 0};
              const bool a_any = a.v_begin < a.v_end, c_any = c.v_begin < c.v_end;
              cb = a_any && c_any ? imin(a.v_begin, c.v_begin) : a_any ? a.v_begin : c.v_begin;
              ce = a_any && c_any ? imax(a.v_end, c.v_end) : a_any ? a.v_end : c.v_end;
            }
            fill(dst, cb, 0u);
            fill(dst + ce, mpad - ce, 0u);
            if (cb < ce)
              exp_pair_rows(s + j * ldqt + cb, j + 1 < n ? s + (j + 1) * ldqt + cb : nullptr, ce - cb,
                            s_scaled ? T(1) : scale, m_use + cb, lpart + cb, dst + cb);
            if ((j + 2) % kChunk == 0 || j + 2 >= n) {
              for (int64_t i = 0; i < mpad; i += VW) {
                vstore(lsum + i, vload(lsum + i) + vload(lpart + i));
                vstore(lpart + i, vzero<T>());
              }
            }
          }
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          if (j < n_next) {
            prefetch_lines(k_next + j * k_ahead.step, k_ahead.bytes);
            prefetch_lines(v_next + j * v_ahead.step, v_ahead.bytes);
          }
          T* row = s + j * ldqt;
          // Masked scores are -inf: their P is 0, written without an exp.
          const Band::Cols cl = s_band.cols<T>(j, mpad);
          fill(row, cl.v_begin, T(0));
          fill(row + cl.v_end, mpad - cl.v_end, T(0));
          int64_t i = cl.v_begin;
          for (; i + 4 * VW <= cl.v_end; i += 4 * VW) exp_add<T, 4>(row + i, m_use + i, lpart + i);
          for (; i < cl.v_end; i += VW) exp_add<T, 1>(row + i, m_use + i, lpart + i);
          if ((j + 1) % kChunk == 0 || j + 1 == n) {
            for (int64_t i = 0; i < mpad; i += VW) {
              vstore(lsum + i, vload(lsum + i) + vload(lpart + i));
              vstore(lpart + i, vzero<T>());
            }
          }
        }
      }
      for (int64_t i = 0; i < mpad; i += VW)
        vstore(l + i, vfma(vload(l + i), vload(alpha + i), vload(lsum + i)));
      // Rows past the tile's (padding columns of Sᵀ) are never stored: O keeps only `rows`.
      if (amx) {
        if constexpr (kAmxType) {
          // Oᵀ = a·Oᵀ + Vᵀ·Pᵀ over whole 32-key steps (Pᵀ's pairs past n are zero).
          const uint32_t* pt = st.pt.get();
          const bf16_t* vc = v_cols != nullptr
                                 ? v_cols + (c0 - kv_begin)
                                 : st.vcols.columns(head, k0 + c0, k0 + c0 + n,
                                                    row_ptr(v, p.v_strides, b_kv, k0 + c0, hk), p.v_strides.row);
          // (The rescale a·Oᵀ inside the product, per block; the steps of keys a masked tile's
          // queries do not see are skipped: their P is 0.)
          amx_pv(d, mpad, n, vc, st.vcols.ld, pt, ldqt, ot, ldqt, st.vtail.get(), /*accumulate=*/!fresh,
                 moved ? alpha : nullptr, pv_band);
          fresh = false;
        }
      } else if (fresh) {
        gemm<T, Epi::kStore>(rows, dpad, n, s, 1, ldqt, vt, ldv, o, dpad, nullptr, kChunk, T(1), pv_band);  // O = P·V
        fresh = false;
      } else {
        gemm<T, Epi::kScaleAdd>(rows, dpad, n, s, 1, ldqt, vt, ldv, o, dpad, alpha, kChunk, T(1),
                                pv_band);  // O = a·O + P·V
      }
    }
    if constexpr (kAmxType) {
      if (amx) {
        amx_release();
        if (!fresh) transpose(ot, ldqt, d, mpad, o, dpad);
      }
    }
    if (fresh) fill(o, mpad * dpad, T(0));  // no visible key at all

    for (int64_t i = 0; i < rows; ++i) {
      // A row that saw no key (or only zero weights) gives out = 0 and lse = -inf; a NaN sum
      // (a NaN or inf among its inputs) is not empty and propagates, as plain attention does.
      const bool empty = l[i] == T(0);
      lse_dst[i] = empty ? kNegInf<T> : m_run[i] + std::log(l[i]);
      alpha[i] = empty ? T(0) : T(1) / l[i];
    }
    if (n_splits > 1) {
      store_rows(o, dpad, rows, d, alpha, part_o.get() + part_at * d, d, /*accumulate=*/false);
    } else {
      store_out(o, rows, alpha, b, qr0, h);
    }
  };

  run_items(items * n_splits, make_state, work);
  if (n_splits == 1) return;

  // The exact merge of the splits, one item per (tile, head): with m = max_s lse_s,
  // w_s = exp(lse_s - m), out = sum_s w_s out_s / sum_s w_s and lse = m + log sum_s w_s. A row
  // no split saw a key for keeps out = 0, lse = -inf; a NaN anywhere stays NaN.
  auto merge_item = [&](Scratch<T>& acc, int64_t base) {
    const SpanTile& tile = tile_list.get()[base % ntiles];
    const AttnSpan& sp = spans[tile.span];
    const int64_t bh = base / ntiles;
    const int64_t b = per_batch ? tile.span : bh / sh.nheads, h = bh % sh.nheads;
    const int64_t qr0 = sp.q_start + tile.r0;
    const int64_t split_stride = part_rows;
    T* lse_rows = lse + b * p.lse_strides.batch + h * p.lse_strides.head + qr0;
    T* o = acc.get();
    for (int64_t i = 0; i < tile.rows; ++i) {
      const int64_t at = (b * sh.nheads + h) * sh.seqlen_q + qr0 + i;
      T m = kNegInf<T>;
      bool nan = false;
      for (int64_t sp_i = 0; sp_i < n_splits; ++sp_i) {
        const T x = part_lse.get()[sp_i * split_stride + at];
        nan |= x != x;
        m = x > m ? x : m;
      }
      fill(o, dpad, T(0));
      if (nan || m == kNegInf<T>) {
        lse_rows[i] = nan ? std::numeric_limits<T>::quiet_NaN() : kNegInf<T>;
        if (nan) fill(o, d, std::numeric_limits<T>::quiet_NaN());
      } else {
        T l = T(0);
        for (int64_t sp_i = 0; sp_i < n_splits; ++sp_i) {
          const T w = std::exp(part_lse.get()[sp_i * split_stride + at] - m);
          const T* src = part_o.get() + (sp_i * split_stride + at) * d;
          for (int64_t c = 0; c < d; ++c) o[c] += w * src[c];
          l += w;
        }
        lse_rows[i] = m + std::log(l);
        const T inv = T(1) / l;
        for (int64_t c = 0; c < d; ++c) o[c] *= inv;
      }
      store_out(o, 1, nullptr, b, qr0 + i, h);
    }
  };
  run_items(items, [&] { return Scratch<T>(dpad); }, merge_item);
}

}  // namespace

void flash_fwd(const FwdParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { fwd_impl<decltype(tag)>(params); });
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
