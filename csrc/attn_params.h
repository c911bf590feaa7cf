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
#pragma once

#include <cstdint>

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
};

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
  int config = 0;        // CUDA tile configuration (0 = default); ignored on CPU
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
  // delta = rowsum(dout * out), (b, h, s_q) in the accumulation type. The binding always
  // supplies it: computed from dout/out when the caller did not pass one.
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
  int config = 0;
};

}  // namespace ringseq
