// Parameters of one block-attention call, shared by the CPU and CUDA kernels.
//
// Kernels see only raw pointers, element strides and sizes: no torch types. The binding
// (csrc/ops.cpp) checks tensors, allocates outputs and fills these structs.
//
// Conventions (docs/design.md): q (b, s_q, h, d); k, v (b, s_k, h_kv, d); out like q;
// lse and delta (b, h, s_q) in the accumulation type; h % h_kv == 0 and query head `hi`
// reads kv head `hi / (h / h_kv)`. All strides are in elements; the last dimension of every
// tensor is contiguous (stride 1). Causal masking is bottom-right aligned:
// key j is visible to query i iff j <= i + s_k - s_q.
//
// Spans (docs/kernels.md, "Spans, bands and softcap"): a call may compute several spans, each
// q rows [q_start, q_start + q_len) against kv rows [k_start, k_start + k_len) with key j
// (span-local) visible to query i iff band_lo <= j - i <= band_hi. Without spans a call is
// the one span over everything with the causal (or no) band, see default_span.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RS_PARAMS_HD __host__ __device__
#else
#define RS_PARAMS_HD
#endif

namespace ringseq {

// Element type of q/k/v/out/dout (and of dq/dk/dv when not accumulating).
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2, kFloat16 = 3 };

struct AttnShape {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t nheads = 0;
  int64_t nheads_kv = 0;
  int64_t headdim = 0;
  double softmax_scale = 0.0;  // double so that float64 inputs keep float64 accuracy
  bool causal = false;
  // Logit soft-capping (Gemma 2, flash-attn's softcap): > 0 replaces the scaled score
  // x = softmax_scale * q.k by softcap * tanh(x / softcap) before the softmax (lse is of the
  // capped scores); 0 = off.
  double softcap = 0.0;
};

// One span, as the binding hands it to the kernels: ranges inside the tensors, pairwise
// disjoint q ranges and pairwise disjoint kv ranges (checked in csrc/ops.cpp), and the band
// clamped into [-q_len, k_len] (km::band_clamp), which leaves the visible set unchanged.
struct AttnSpan {
  int64_t q_start = 0;
  int64_t q_len = 0;
  int64_t k_start = 0;
  int64_t k_len = 0;
  int64_t band_lo = 0;
  int64_t band_hi = 0;
};

// The spans of a call: `count` entries at `data` (host memory for the CPU kernel, device
// memory for CUDA), or count == 0 for the default span. max_q_len / max_k_len size the CUDA
// grids.
struct SpanList {
  const AttnSpan* data = nullptr;
  int64_t count = 0;
  int64_t max_q_len = 0;
  int64_t max_k_len = 0;
};

// Float constants of the CUDA kernels, derived from the shape by their launchers (double
// arithmetic once on the host): the kernels read them from the parameter bank, where an
// operand costs no register. Unused on CPU.
struct CudaConsts {
  float softmax_scale = 0.f;  // the scale of dQ / dK
  float sm_scale = 0.f;       // the softmax's scale: softcap when soft-capping, else softmax_scale
  float sm_scale_log2 = 0.f;  // sm_scale * log2(e)
  float cap_pre = 0.f;        // softmax_scale / softcap (0 without soft-cap)
  float inv_sm_scale_log2 = 0.f;  // 1 / sm_scale_log2
};

RS_PARAMS_HD inline CudaConsts cuda_consts(const AttnShape& sh) {
  CudaConsts c;
  const bool cap = sh.softcap > 0.0;
  c.softmax_scale = static_cast<float>(sh.softmax_scale);
  c.sm_scale = static_cast<float>(cap ? sh.softcap : sh.softmax_scale);
  c.sm_scale_log2 = static_cast<float>((cap ? sh.softcap : sh.softmax_scale) * 1.4426950408889634);
  c.cap_pre = cap ? static_cast<float>(sh.softmax_scale / sh.softcap) : 0.f;
  c.inv_sm_scale_log2 = static_cast<float>(1.0 / ((cap ? sh.softcap : sh.softmax_scale) * 1.4426950408889634));
  return c;
}

// The span of a call without spans: everything, causal band or none (already clamped).
RS_PARAMS_HD inline AttnSpan default_span(const AttnShape& sh) {
  AttnSpan s;
  s.q_len = sh.seqlen_q;
  s.k_len = sh.seqlen_k;
  s.band_lo = -sh.seqlen_q;
  s.band_hi = sh.causal ? sh.seqlen_k - sh.seqlen_q : sh.seqlen_k;
  return s;
}

// Strides of a (b, s, h, d) tensor; the d stride is 1.
struct RowStrides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// Strides of a (b, h, s) tensor (lse, delta); the s stride is 1.
struct StatStrides {
  int64_t batch = 0;
  int64_t head = 0;
};

// KV-cache decoding (flash-attn's flash_attn_with_kvcache; docs/kernels.md, "KV-cache
// decoding"). The k/v tensors of the call are the caches (batch_cache, seqlen_cache, h_kv, d)
// and AttnShape::seqlen_k is seqlen_cache. Batch row b of q reads cache row batch_idx[b] (b when
// batch_idx is null), whose valid keys are [leftpad[b], seqlens[b]) (leftpad null: from 0);
// causal masking and the window (left, right; -1 = unbounded) are bottom-right aligned to the
// valid keys, as flash-attn aligns them (km::kvcache_span). The int32 arrays live in host
// memory for the CPU kernel and in device memory for CUDA; the binding checks their values
// where they are on the host. seqlens == nullptr: not a KV-cache call (one span for all rows).
//
// heads_as_rows: single-token decoding with GQA, seen as h_kv heads of `group` rows (the query
// heads that share a kv head): the device entry points (flash_fwd_cpu, flash_fwd_cuda)
// re-stride q, out and lse of every call that allows it (gqa_rows_view), so that a tile reads
// each key once for all heads of its group. Its rows all stand at the last position: the
// window becomes a key range, not a band.
struct KvCache {
  const int32_t* seqlens = nullptr;
  const int32_t* leftpad = nullptr;
  const int32_t* batch_idx = nullptr;
  int64_t batch_cache = 0;  // rows of the caches (batch_idx must index below it)
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool heads_as_rows = false;
};

struct FwdParams {
  AttnShape shape;
  DType dtype = DType::kFloat32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  // (b, s_q, h, d), element type `dtype` (the accumulation type with accumulate or out_acc)
  void* out = nullptr;
  void* lse = nullptr;   // (b, h, s_q), float64 for kFloat64 inputs, float32 otherwise
  // accumulate == true: out/lse already hold a running (out, lse) pair (rows with lse = -inf
  // hold nothing) and the kernel merges this block into them exactly, in place. This is the
  // ring's merge without a block-sized temporary.
  bool accumulate = false;
  // out_acc == true (CPU kernel only): out is written in the accumulation type instead of
  // being rounded to `dtype`. A partial result merged with others afterwards (the ring's
  // KV-cache decoding) is then rounded once, after its merge.
  bool out_acc = false;
  RowStrides q_strides, k_strides, v_strides, out_strides;
  StatStrides lse_strides;
  SpanList spans;
  CudaConsts consts;     // filled by the CUDA launcher
  int config = 0;        // CUDA tile configuration (0 = default); ignored on CPU
  KvCache kv;            // KV-cache call when kv.seqlens is set (with spans.count == 0)
  // Key splits (split-KV): each q tile's keys are cut into this many ranges computed in
  // parallel, whose partial (out, lse) are merged exactly afterwards. 0: the kernel decides
  // from the shape (km::kv_splits), 1: none. Not with accumulate.
  int num_splits = 0;
  // CUDA only: float32 scratch for the partial results of the splits, at least
  // km::split_scratch_floats(...) elements; null: the launcher allocates it.
  float* split_scratch = nullptr;
  int64_t split_scratch_floats = 0;
  // CPU only, a statistic for tests (may be null): the kernel adds the number of
  // (q tile, kv tile) pairs it computed, so a test can see that invisible tiles are skipped.
  int64_t* tiles_visited = nullptr;
};

// The GQA rows view of a single-token call (KvCache::heads_as_rows): q (b, 1, h, d) and out
// become (b, group, h_kv, d) views (row stride = the head stride, head stride = group head
// strides) and lse (b, h, 1) becomes (b, h_kv, group), which needs lse's head stride to be 1
// (a contiguous (b, h, 1) tensor has it). No data moves.
RS_PARAMS_HD inline bool gqa_rows_possible(const FwdParams& p) {
  const int64_t group = p.shape.nheads_kv > 0 ? p.shape.nheads / p.shape.nheads_kv : 0;
  return p.shape.seqlen_q == 1 && group > 1 && p.spans.count == 0 && !p.accumulate &&
         p.lse_strides.head == 1;
}
RS_PARAMS_HD inline FwdParams gqa_rows_view(const FwdParams& p) {
  FwdParams g = p;
  const int64_t group = p.shape.nheads / p.shape.nheads_kv;
  g.shape.seqlen_q = group;
  g.shape.nheads = p.shape.nheads_kv;
  g.q_strides = {p.q_strides.batch, p.q_strides.head, p.q_strides.head * group};
  g.out_strides = {p.out_strides.batch, p.out_strides.head, p.out_strides.head * group};
  g.lse_strides = {p.lse_strides.batch, group};
  g.shape.causal = false;  // one query at the last position sees every key: no causal edge
  g.kv.heads_as_rows = true;
  return g;
}

struct BwdParams {
  AttnShape shape;
  DType dtype = DType::kFloat32;
  const void* dout = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;    // may be the global (merged) output of a ring
  const void* lse = nullptr;    // may be the global (merged) lse of a ring
  // delta = rowsum(dout * out), (b, h, s_q) in the accumulation type: the caller's, else
  // computed by the binding (CUDA) or null (CPU: the kernel computes it from dout/out).
  const void* delta = nullptr;
  // Gradients. accumulate == false: element type `dtype`, overwritten.
  // accumulate == true: accumulation type (float32, float64 for kFloat64), added into.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  bool accumulate = false;
  RowStrides dout_strides, q_strides, k_strides, v_strides, out_strides;
  RowStrides dq_strides, dk_strides, dv_strides;
  StatStrides lse_strides, delta_strides;
  SpanList spans;
  CudaConsts consts;  // filled by the CUDA launcher
  int config = 0;
  // CPU only, a statistic for tests (may be null): the kernel adds the number of
  // (q tile, kv tile) pairs it computed.
  int64_t* tiles_visited = nullptr;
};

}  // namespace ringseq
