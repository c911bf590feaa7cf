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

struct FwdParams {
  AttnShape shape;
  DType dtype = DType::kFloat32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;   // (b, s_q, h, d), element type `dtype` (accumulation type if accumulate)
  void* lse = nullptr;   // (b, h, s_q), float64 for kFloat64 inputs, float32 otherwise
  // accumulate == true: out/lse already hold a running (out, lse) pair (rows with lse = -inf
  // hold nothing) and the kernel merges this block into them exactly, in place. This is the
  // ring's merge without a block-sized temporary.
  bool accumulate = false;
  RowStrides q_strides, k_strides, v_strides, out_strides;
  StatStrides lse_strides;
  SpanList spans;
  CudaConsts consts;     // filled by the CUDA launcher
  int config = 0;        // CUDA tile configuration (0 = default); ignored on CPU
  // CPU only, a statistic for tests (may be null): the kernel adds the number of
  // (q tile, kv tile) pairs it computed, so a test can see that invisible tiles are skipped.
  int64_t* tiles_visited = nullptr;
};

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
