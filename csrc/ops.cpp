// The binding: operator schemas, tensor checks and dispatch to the CPU/CUDA kernels.
//
// This is the only file that sees torch tensors. It validates inputs (errors name the
// argument, what was given and what is expected), allocates outputs, fills the params
// structs of attn_params.h and calls the kernel for the tensors' device.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include "attn_params.h"
#include "cpu/flash_cpu.h"

#ifdef RINGSEQ_WITH_CUDA
// c10/cuda only: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE headers, which minimal CUDA
// toolkits (and this project's CI) lack.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include "cuda/flash_api.h"
#endif

namespace ringseq {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void check_4d(const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be a 4-dim tensor ", layout, ", got ", t.dim(),
                    " dims with shape ", shape_str(t));
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name,
                    " must be contiguous in its last (head) dimension, got strides ", t.strides(),
                    "; call .contiguous() on it, only the last dimension needs to be contiguous");
}

DType to_dtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", st);
  }
}

// float64 inputs accumulate (and keep lse/delta) in float64, all others in float32.
at::ScalarType accum_type(at::ScalarType st) { return st == at::kDouble ? at::kDouble : at::kFloat; }

RowStrides row_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }
StatStrides stat_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1)}; }

// Checks q, k, v against each other and against what the device's kernel supports.
AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    double softmax_scale, bool causal) {
  check_4d(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_4d(k, "k", "(batch, seqlen_k, nheads_kv, headdim)");
  check_4d(v, "v", "(batch, seqlen_k, nheads_kv, headdim)");
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                    "q, k and v must be on the same device, got q on ", q.device(), ", k on ",
                    k.device(), ", v on ", v.device());
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "q, k and v must have the same dtype, got q ", q.scalar_type(), ", k ",
                    k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0),
                    "q, k and v must have the same batch size, got q ", shape_str(q), ", k ",
                    shape_str(k), ", v ", shape_str(v));
  TORCH_CHECK_VALUE(k.size(3) == q.size(3) && v.size(3) == q.size(3),
                    "q, k and v must have the same head dim (last dimension), got q ",
                    shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got k ",
                    shape_str(k), " and v ", shape_str(v));
  TORCH_CHECK_VALUE(k.size(2) > 0 && q.size(2) % k.size(2) == 0,
                    "nheads of q must be divisible by nheads_kv of k and v, got nheads=",
                    q.size(2), " and nheads_kv=", k.size(2));
  TORCH_CHECK_VALUE(q.size(3) > 0, "headdim must be positive, got q ", shape_str(q));
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "softmax_scale must be finite, got ",
                    softmax_scale);
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");

  const auto st = q.scalar_type();
  if (q.device().is_cpu()) {
    TORCH_CHECK_VALUE(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
                      "the CPU kernel supports float32, float64, bfloat16 and float16, got ", st);
  } else if (q.device().is_cuda()) {
#ifdef RINGSEQ_WITH_CUDA
    check_cuda_support(q.get_device(), st, q.size(3));
#else
    TORCH_CHECK_VALUE(false, "ringseq was built without CUDA kernels, but q is on ", q.device(),
                      "; reinstall with a CUDA toolkit (see README) or pass backend=\"sdpa\"");
#endif
  } else {
    TORCH_CHECK_VALUE(false, "ringseq kernels run on CPU and CUDA tensors, got q on ", q.device());
  }

  AttnShape shape;
  shape.batch = q.size(0);
  shape.seqlen_q = q.size(1);
  shape.seqlen_k = k.size(1);
  shape.nheads = q.size(2);
  shape.nheads_kv = k.size(2);
  shape.headdim = q.size(3);
  shape.softmax_scale = softmax_scale;
  shape.causal = causal;
  return shape;
}

// Checks a (b, h, s_q) statistics tensor (lse or delta).
void check_stat(const at::Tensor& t, const char* name, const at::Tensor& q) {
  const auto acc = accum_type(q.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(2) &&
                        t.size(2) == q.size(1),
                    name, " must have shape (batch, nheads, seqlen_q) = (", q.size(0), ", ",
                    q.size(2), ", ", q.size(1), "), got ", shape_str(t));
  TORCH_CHECK_VALUE(t.scalar_type() == acc, name, " must be ", acc, " for ", q.scalar_type(),
                    " inputs, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), name, " must be on ", q.device(), ", got ",
                    t.device());
  TORCH_CHECK_VALUE(t.size(2) <= 1 || t.stride(2) == 1, name,
                    " must be contiguous in its last (seqlen) dimension, got strides ", t.strides());
}

// Checks a tensor that must match `like` in shape, dtype and device (dout, out, accumulators).
void check_like(const at::Tensor& t, const char* name, const at::Tensor& like, const char* like_name,
                at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", like_name, " ",
                    shape_str(like), ", got ", shape_str(t));
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " must be on ", like.device(), ", got ",
                    t.device());
  check_last_dim_contiguous(t, name);
}

// Fills the forward params and runs the kernel of q's device. accumulate: out/lse hold a
// running (out, lse) pair in the accumulation dtype that the kernel merges this block into.
void run_fwd(const AttnShape& shape, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool accumulate,
             int64_t tile_config) {
  FwdParams p;
  p.shape = shape;
  p.dtype = to_dtype(q.scalar_type());
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  p.q_strides = row_strides(q);
  p.k_strides = row_strides(k);
  p.v_strides = row_strides(v);
  p.out_strides = row_strides(out);
  p.lse_strides = stat_strides(lse);
  p.accumulate = accumulate;
  p.config = static_cast<int>(tile_config);
  if (q.is_cpu()) {
    flash_fwd_cpu(p);
  } else {
#ifdef RINGSEQ_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    flash_fwd_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
#endif
  }
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double softmax_scale, bool causal,
                                       int64_t tile_config) {
  const AttnShape shape = check_qkv(q, k, v, softmax_scale, causal);
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);  // (b, s_q, h, d)
  auto lse = at::empty({shape.batch, shape.nheads, shape.seqlen_q},
                       q.options().dtype(accum_type(q.scalar_type())));  // (b, h, s_q)
  if (out.numel() == 0) return {out, lse};
  if (shape.seqlen_k == 0) {  // no key at all: every row sees nothing
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  run_fwd(shape, q, k, v, out, lse, /*accumulate=*/false, tile_config);
  return {out, lse};
}

void fwd_accum(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               double softmax_scale, bool causal, const at::Tensor& out_acc,
               const at::Tensor& lse_acc, int64_t tile_config) {
  const AttnShape shape = check_qkv(q, k, v, softmax_scale, causal);
  check_like(out_acc, "out_acc", q, "q", accum_type(q.scalar_type()));
  check_stat(lse_acc, "lse_acc", q);
  if (q.numel() == 0 || shape.seqlen_k == 0) return;  // no key: nothing to merge
  TORCH_CHECK_NOT_IMPLEMENTED(q.is_cpu(), "ringseq::fwd_accum runs on CPU tensors; on ", q.device(),
                              " call ringseq::fwd and merge (ringseq's backends do this)");
  run_fwd(shape, q, k, v, out_acc, lse_acc, /*accumulate=*/true, tile_config);
}

// Shared by bwd (fresh gradients in the input dtype) and bwd_accum (added into accumulators).
void bwd_into(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
              double softmax_scale, bool causal, const std::optional<at::Tensor>& delta_opt,
              const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, bool accumulate,
              int64_t tile_config) {
  const AttnShape shape = check_qkv(q, k, v, softmax_scale, causal);
  const auto st = q.scalar_type();
  const auto acc = accum_type(st);
  check_like(dout, "dout", q, "q", st);
  check_like(out, "out", q, "q", st);
  check_stat(lse, "lse", q);
  const auto grad_type = accumulate ? acc : st;
  check_like(dq, accumulate ? "dq_accum" : "dq", q, "q", grad_type);
  check_like(dk, accumulate ? "dk_accum" : "dk", k, "k", grad_type);
  check_like(dv, accumulate ? "dv_accum" : "dv", v, "v", grad_type);
  if (q.numel() == 0 || k.numel() == 0) {
    if (!accumulate) {
      dq.zero_();
      dk.zero_();
      dv.zero_();
    }
    return;
  }
  at::Tensor delta;
  if (delta_opt.has_value()) {
    delta = *delta_opt;
    check_stat(delta, "delta", q);
  } else {
    // delta = rowsum(dout * out) in the accumulation type, (b, h, s_q)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous();
  }
  BwdParams p;
  p.shape = shape;
  p.dtype = to_dtype(st);
  p.dout = dout.data_ptr();
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  p.delta = delta.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.accumulate = accumulate;
  p.dout_strides = row_strides(dout);
  p.q_strides = row_strides(q);
  p.k_strides = row_strides(k);
  p.v_strides = row_strides(v);
  p.out_strides = row_strides(out);
  p.dq_strides = row_strides(dq);
  p.dk_strides = row_strides(dk);
  p.dv_strides = row_strides(dv);
  p.lse_strides = stat_strides(lse);
  p.delta_strides = stat_strides(delta);
  p.config = static_cast<int>(tile_config);
  if (q.is_cpu()) {
    flash_bwd_cpu(p);
  } else {
#ifdef RINGSEQ_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    flash_bwd_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
#endif
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal,
    const std::optional<at::Tensor>& delta, int64_t tile_config) {
  check_4d(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_4d(k, "k", "(batch, seqlen_k, nheads_kv, headdim)");
  check_4d(v, "v", "(batch, seqlen_k, nheads_kv, headdim)");
  auto dq = at::empty_like(q, at::MemoryFormat::Contiguous);  // (b, s_q, h, d)
  auto dk = at::empty_like(k, at::MemoryFormat::Contiguous);  // (b, s_k, h_kv, d)
  auto dv = at::empty_like(v, at::MemoryFormat::Contiguous);  // (b, s_k, h_kv, d)
  bwd_into(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq, dk, dv,
           /*accumulate=*/false, tile_config);
  return {dq, dk, dv};
}

void bwd_accum(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
               double softmax_scale, bool causal, const std::optional<at::Tensor>& delta,
               const at::Tensor& dq_accum, const at::Tensor& dk_accum, const at::Tensor& dv_accum,
               int64_t tile_config) {
  bwd_into(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum, dk_accum, dv_accum,
           /*accumulate=*/true, tile_config);
}

}  // namespace

TORCH_LIBRARY(ringseq, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int tile_config=0)"
      " -> (Tensor out, Tensor lse)");
  // Merges this block into a running (out_acc, lse_acc) pair in place (accumulation dtype):
  // lse' = log(exp(lse_acc) + exp(lse_b)), out' = weighted sum; rows with lse_acc = -inf hold
  // nothing yet. The ring's forward step without a block-sized temporary.
  m.def(
      "fwd_accum(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal,"
      " Tensor(a!) out_acc, Tensor(b!) lse_acc, int tile_config=0) -> ()");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale,"
      " bool causal, Tensor? delta=None, int tile_config=0) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "bwd_accum(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
      " float softmax_scale, bool causal, Tensor? delta, Tensor(a!) dq_accum,"
      " Tensor(b!) dk_accum, Tensor(c!) dv_accum, int tile_config=0) -> ()");
}

TORCH_LIBRARY_IMPL(ringseq, CPU, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_accum", &fwd_accum);
  m.impl("bwd", &bwd);
  m.impl("bwd_accum", &bwd_accum);
}

#ifdef RINGSEQ_WITH_CUDA
TORCH_LIBRARY_IMPL(ringseq, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("fwd_accum", &fwd_accum);
  m.impl("bwd", &bwd);
  m.impl("bwd_accum", &bwd_accum);
}
#endif

}  // namespace ringseq
