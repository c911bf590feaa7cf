// The binding: operator schemas, tensor checks and dispatch to the CPU/CUDA kernels.
//
// This is the only file that sees torch tensors. It validates inputs (errors name the
// argument, what was given and what is expected), allocates outputs, fills the params
// structs of attn_params.h and calls the kernel for the tensors' device.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "attn_params.h"
#include "cpu/flash_cpu.h"
#include "kernel_math.h"

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
  // (an empty tensor has no element to read: torch.compile hands an empty gradient strides 0)
  TORCH_CHECK_VALUE(t.numel() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, name,
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

void check_kernel_support(const at::Tensor& q);

// The kernels scale and cap in float32 for every input dtype but float64: a scale beyond
// float32's range became inf there (NaN outputs), a cap inf (NaN) or 0 (no capping at all);
// the Python layer's rule (ringseq/kernels/spans.py, ringseq/_args.py) for direct calls too.
void check_float32_range(at::ScalarType st, double softmax_scale, double softcap) {
  if (st == at::kDouble) return;
  constexpr double kMax = std::numeric_limits<float>::max();
  constexpr double kTiny = std::numeric_limits<float>::min();  // smallest normal
  TORCH_CHECK_VALUE(std::abs(softmax_scale) <= kMax, "softmax_scale must be within float32's "
                    "range (|scale| <= ", kMax, ") for ", st, " inputs, got ", softmax_scale);
  TORCH_CHECK_VALUE(softcap == 0.0 || (softcap >= kTiny && softcap <= kMax), "softcap must be "
                    "0.0 (off) or within float32's range [", kTiny, ", ", kMax, "] for ", st,
                    " inputs, got ", softcap);
}

// tile_config selects the CUDA forward's tiles (km::kNumFwdConfigs of them); the CPU kernels
// take their tiles from the ISA level, but refuse what CUDA refuses, before narrowing to int.
void check_tile_config(int64_t tile_config) {
  TORCH_CHECK_VALUE(tile_config >= 0 && tile_config < km::kNumFwdConfigs,
                    "tile_config must be 0 (fast), 1 (conservative) or 2 (128x64 tiles), got ",
                    tile_config);
}

// Checks q, k, v against each other and against what the device's kernel supports.
AttnShape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    double softmax_scale, bool causal, double softcap) {
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
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0,
                    "softcap must be a finite float >= 0 (0.0: off), got ", softcap);
  check_float32_range(q.scalar_type(), softmax_scale, softcap);
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
  check_kernel_support(q);

  AttnShape shape;
  shape.batch = q.size(0);
  shape.seqlen_q = q.size(1);
  shape.seqlen_k = k.size(1);
  shape.nheads = q.size(2);
  shape.nheads_kv = k.size(2);
  shape.headdim = q.size(3);
  shape.softmax_scale = softmax_scale;
  shape.causal = causal;
  shape.softcap = softcap;
  return shape;
}

// Whether the kernel of q's device runs q's dtype and head dim (ValueError naming them if not).
void check_kernel_support(const at::Tensor& q) {
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
}

// ---------------------------------------------------------------------------------------
// Spans (docs/kernels.md, "Spans, bands and softcap").
// ---------------------------------------------------------------------------------------
constexpr int kSpanCols = 6;  // q_start, q_len, k_start, k_len, band_lo, band_hi

// The spans of one call, checked and ready for the kernels.
struct Spans {
  bool given = false;      // false: the default span (today's dense/causal call)
  at::Tensor host;         // (n, 6) int64, contiguous, bands clamped (km::band_clamp)
  at::Tensor device;       // the same on q's device for CUDA (kept alive for the launch)
  SpanList list;           // what the kernels read (count 0 = default span)
  bool covers_q = true;    // every q row is in some span
  bool covers_k = true;    // every kv row is in some span
  bool empty() const { return given && list.count == 0; }
};

// Checks that the ranges [start, start + len) of the spans are pairwise disjoint (`what` is
// "q" or "kv"); zero-length ranges overlap nothing.
void check_disjoint(const std::vector<std::array<int64_t, kSpanCols>>& rows, int start_col,
                    const char* what) {
  std::vector<size_t> idx;
  for (size_t t = 0; t < rows.size(); ++t) {
    if (rows[t][start_col + 1] > 0) idx.push_back(t);
  }
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return rows[a][start_col] < rows[b][start_col];
  });
  for (size_t u = 1; u < idx.size(); ++u) {
    const auto& a = rows[idx[u - 1]];
    const auto& b = rows[idx[u]];
    TORCH_CHECK_VALUE(a[start_col] + a[start_col + 1] <= b[start_col], "spans must have pairwise "
                      "disjoint ", what, " row ranges, but span ", idx[u - 1], " covers ", what,
                      " rows [", a[start_col], ", ", a[start_col] + a[start_col + 1], ") and span ",
                      idx[u], " covers [", b[start_col], ", ", b[start_col] + b[start_col + 1], ")");
  }
}

// Validates the `spans` argument against the shape and prepares it for q's device. Errors
// name the argument, the offending span and what was expected.
Spans prepare_spans(const std::optional<at::Tensor>& spans_opt, const AttnShape& shape,
                    const at::Tensor& q) {
  Spans out;
  if (!spans_opt.has_value()) return out;
  const at::Tensor& s = *spans_opt;
  out.given = true;
  TORCH_CHECK_VALUE(!shape.causal, "spans and causal=True cannot be combined: with spans, causal "
                    "must be False and each span's band says what it sees (causal is band_hi = "
                    "k_len - q_len)");
  TORCH_CHECK_VALUE(s.dim() == 2 && s.size(1) == kSpanCols, "spans must be a 2-dim tensor (n, 6) of "
                    "(q_start, q_len, k_start, k_len, band_lo, band_hi) rows, got shape ",
                    shape_str(s));
  TORCH_CHECK_VALUE(s.scalar_type() == at::kLong, "spans must be an int64 tensor, got ",
                    s.scalar_type());
  TORCH_CHECK_VALUE(s.device().is_cpu(), "spans must be a CPU tensor (the binding copies it to the "
                    "device), got a tensor on ", s.device());
  const at::Tensor host = s.contiguous();
  const int64_t n = host.size(0);
  const int64_t* raw = host.data_ptr<int64_t>();
  std::vector<std::array<int64_t, kSpanCols>> rows(static_cast<size_t>(n));
  int64_t covered_q = 0, covered_k = 0;
  for (int64_t t = 0; t < n; ++t) {
    auto& r = rows[static_cast<size_t>(t)];
    std::copy(raw + t * kSpanCols, raw + (t + 1) * kSpanCols, r.begin());
    const int64_t qs = r[0], ql = r[1], ks = r[2], kl = r[3], lo = r[4], hi = r[5];
    TORCH_CHECK_VALUE(qs >= 0 && ql >= 0 && qs <= shape.seqlen_q && ql <= shape.seqlen_q - qs,
                      "spans[", t, "]: q rows [q_start, q_start + q_len) = [", qs, ", ", qs, " + ",
                      ql, ") must lie inside [0, seqlen_q = ", shape.seqlen_q, ")");
    TORCH_CHECK_VALUE(ks >= 0 && kl >= 0 && ks <= shape.seqlen_k && kl <= shape.seqlen_k - ks,
                      "spans[", t, "]: kv rows [k_start, k_start + k_len) = [", ks, ", ", ks, " + ",
                      kl, ") must lie inside [0, seqlen_k = ", shape.seqlen_k, ")");
    TORCH_CHECK_VALUE(lo <= hi, "spans[", t, "]: band_lo must be <= band_hi, got band_lo = ", lo,
                      ", band_hi = ", hi, " (use -2**62 / 2**62 for unbounded)");
    covered_q += ql;
    covered_k += kl;
  }
  check_disjoint(rows, 0, "q");
  check_disjoint(rows, 2, "kv");

  at::Tensor norm = at::empty({n, kSpanCols}, host.options());
  auto* dst = reinterpret_cast<AttnSpan*>(norm.data_ptr<int64_t>());
  static_assert(sizeof(AttnSpan) == kSpanCols * sizeof(int64_t), "AttnSpan is a row of spans");
  for (int64_t t = 0; t < n; ++t) {
    const auto& r = rows[static_cast<size_t>(t)];
    AttnSpan& d = dst[t];
    d.q_start = r[0];
    d.q_len = r[1];
    d.k_start = r[2];
    d.k_len = r[3];
    d.band_lo = km::band_clamp<int64_t>(r[4], r[1], r[3]);
    d.band_hi = km::band_clamp<int64_t>(r[5], r[1], r[3]);
    out.list.max_q_len = std::max(out.list.max_q_len, r[1]);
    out.list.max_k_len = std::max(out.list.max_k_len, r[3]);
  }
  out.host = norm;
  out.list.count = n;
  out.covers_q = covered_q == shape.seqlen_q;  // disjoint ranges inside the tensor
  out.covers_k = covered_k == shape.seqlen_k;
  if (q.is_cuda() && n > 0) {
    // Pinned staging and an asynchronous copy on the current stream: a pageable copy would
    // block the host until the stream drains, which would serialise a ring's overlap.
    at::Tensor pinned = at::empty({n, kSpanCols}, host.options().pinned_memory(true));
    pinned.copy_(norm);
    out.device = pinned.to(q.device(), /*non_blocking=*/true);
    out.list.data = reinterpret_cast<const AttnSpan*>(out.device.data_ptr<int64_t>());
  } else {
    out.list.data = reinterpret_cast<const AttnSpan*>(norm.data_ptr<int64_t>());
  }
  return out;
}

// Blocks the CPU kernels computed, for tests (ringseq::_tiles_visited): (q tile, kv tile)
// pairs of the forward and of the backward, summed over batch and heads.
std::array<int64_t, 2> g_tiles_visited{};

std::vector<int64_t> tiles_visited(bool reset) {
  std::vector<int64_t> out(g_tiles_visited.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = reset ? __atomic_exchange_n(&g_tiles_visited[i], int64_t(0), __ATOMIC_RELAXED)
                   : __atomic_load_n(&g_tiles_visited[i], __ATOMIC_RELAXED);
  }
  return out;
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
  // (an empty one has no element to read: torch_delta's transposed empty result keeps its
  // strides through .contiguous())
  TORCH_CHECK_VALUE(t.numel() == 0 || t.size(2) <= 1 || t.stride(2) == 1, name,
                    " must be contiguous in its last (seqlen) dimension, got strides ", t.strides());
}

// delta = rowsum(dout * out) by torch, (b, h, s_q) contiguous in the accumulation dtype (the
// CUDA kernel's; the CPU kernel sums its own: delta_op).
at::Tensor torch_delta(const at::Tensor& dout, const at::Tensor& out) {
  const auto acc = accum_type(out.scalar_type());
  return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous();
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

// Checks a tensor the kernel writes into (the accumulators, and dq/dk/dv): no two of its
// elements at one address (an expanded or self-overlapping view, where several work items
// would read-modify-write the same memory), and no memory shared with a tensor the call reads.
void check_written(const at::Tensor& t, const char* name,
                   std::initializer_list<std::pair<const at::Tensor*, const char*>> reads) {
  TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, name,
                    " has elements that share memory (an expanded or overlapping view, strides ",
                    t.strides(), "): the kernel writes into it; pass a tensor whose elements are "
                    "distinct (e.g. its .contiguous() copy)");
  for (const auto& [other, other_name] : reads) {
    const at::MemOverlapStatus st = at::get_overlap_status(t, *other);
    TORCH_CHECK_VALUE(st != at::MemOverlapStatus::Full && st != at::MemOverlapStatus::Partial, name,
                      " shares memory with ", other_name, ", which the call reads: pass "
                      "separate tensors");
  }
}

// Fills the forward params and runs the kernel of q's device. accumulate: out/lse hold a
// running (out, lse) pair in the accumulation dtype that the kernel merges this block into.
// The forward params every call fills alike: shape, dtype, pointers and strides.
FwdParams fwd_params(const AttnShape& shape, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse) {
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
  return p;
}

void run_fwd(const AttnShape& shape, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool accumulate,
             int64_t tile_config, const Spans& spans) {
  FwdParams p = fwd_params(shape, q, k, v, out, lse);
  p.accumulate = accumulate;
  p.config = static_cast<int>(tile_config);
  p.spans = spans.list;
  if (q.is_cpu()) {
    p.tiles_visited = &g_tiles_visited[0];
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
                                       int64_t tile_config, const std::optional<at::Tensor>& spans_opt,
                                       double softcap) {
  const AttnShape shape = check_qkv(q, k, v, softmax_scale, causal, softcap);
  check_tile_config(tile_config);
  const Spans spans = prepare_spans(spans_opt, shape, q);
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);  // (b, s_q, h, d)
  auto lse = at::empty({shape.batch, shape.nheads, shape.seqlen_q},
                       q.options().dtype(accum_type(q.scalar_type())));  // (b, h, s_q)
  if (out.numel() == 0) return {out, lse};
  if (shape.seqlen_k == 0 || spans.empty() || !spans.covers_q) {
    // Rows no span computes see nothing: out = 0, lse = -inf (the kernel writes the others).
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    if (shape.seqlen_k == 0 || spans.empty()) return {out, lse};
  }
  run_fwd(shape, q, k, v, out, lse, /*accumulate=*/false, tile_config, spans);
  return {out, lse};
}

void fwd_accum(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               double softmax_scale, bool causal, const at::Tensor& out_acc,
               const at::Tensor& lse_acc, int64_t tile_config,
               const std::optional<at::Tensor>& spans_opt, double softcap) {
  const AttnShape shape = check_qkv(q, k, v, softmax_scale, causal, softcap);
  check_tile_config(tile_config);
  const Spans spans = prepare_spans(spans_opt, shape, q);
  check_like(out_acc, "out_acc", q, "q", accum_type(q.scalar_type()));
  check_stat(lse_acc, "lse_acc", q);
  check_written(out_acc, "out_acc", {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&lse_acc, "lse_acc"}});
  check_written(lse_acc, "lse_acc", {{&q, "q"}, {&k, "k"}, {&v, "v"}});
  // no key or no span: nothing to merge (rows outside every span stay untouched)
  if (q.numel() == 0 || shape.seqlen_k == 0 || spans.empty()) return;
  TORCH_CHECK_NOT_IMPLEMENTED(q.is_cpu(), "ringseq::fwd_accum runs on CPU tensors; on ", q.device(),
                              " call ringseq::fwd and merge (ringseq's backends do this)");
  run_fwd(shape, q, k, v, out_acc, lse_acc, /*accumulate=*/true, tile_config, spans);
}

// Shared by bwd (fresh gradients in the input dtype) and bwd_accum (added into accumulators).
void bwd_into(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
              double softmax_scale, bool causal, const std::optional<at::Tensor>& delta_opt,
              const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, bool accumulate,
              int64_t tile_config, const std::optional<at::Tensor>& spans_opt, double softcap) {
  const AttnShape shape = check_qkv(q, k, v, softmax_scale, causal, softcap);
  const Spans spans = prepare_spans(spans_opt, shape, q);
  const auto st = q.scalar_type();
  const auto acc = accum_type(st);
  check_like(dout, "dout", q, "q", st);
  check_like(out, "out", q, "q", st);
  check_stat(lse, "lse", q);
  const auto grad_type = accumulate ? acc : st;
  const char* dq_name = accumulate ? "dq_accum" : "dq";
  const char* dk_name = accumulate ? "dk_accum" : "dk";
  const char* dv_name = accumulate ? "dv_accum" : "dv";
  check_like(dq, dq_name, q, "q", grad_type);
  check_like(dk, dk_name, k, "k", grad_type);
  check_like(dv, dv_name, v, "v", grad_type);
  check_written(dq, dq_name, {{&dout, "dout"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"},
                              {&lse, "lse"}, {&dk, dk_name}, {&dv, dv_name}});
  check_written(dk, dk_name, {{&dout, "dout"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"},
                              {&lse, "lse"}, {&dv, dv_name}});
  check_written(dv, dv_name, {{&dout, "dout"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"},
                              {&lse, "lse"}});
  check_tile_config(tile_config);
  if (delta_opt.has_value()) {  // checked before the empty-input return, like every input
    check_stat(*delta_opt, "delta", q);
    check_written(dq, dq_name, {{&*delta_opt, "delta"}});
    check_written(dk, dk_name, {{&*delta_opt, "delta"}});
    check_written(dv, dv_name, {{&*delta_opt, "delta"}});
  }
  if (q.numel() == 0 || k.numel() == 0 || spans.empty()) {
    if (!accumulate) {
      dq.zero_();
      dk.zero_();
      dv.zero_();
    }
    return;
  }
  if (!accumulate) {
    // Rows no span computes get zero gradients (the kernels write the others).
    if (!spans.covers_q) dq.zero_();
    if (!spans.covers_k) {
      dk.zero_();
      dv.zero_();
    }
  }
  at::Tensor delta;
  if (delta_opt.has_value()) {
    delta = *delta_opt;
  } else if (!q.is_cpu()) {
    delta = torch_delta(dout, out);  // the CPU kernel sums its own, in its dP GEMM's order
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
  p.delta = delta.defined() ? delta.data_ptr() : nullptr;
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
  if (delta.defined()) p.delta_strides = stat_strides(delta);
  p.config = static_cast<int>(tile_config);
  p.spans = spans.list;
  if (q.is_cpu()) {
    p.tiles_visited = &g_tiles_visited[1];
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
    const std::optional<at::Tensor>& delta, int64_t tile_config,
    const std::optional<at::Tensor>& spans, double softcap) {
  check_4d(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_4d(k, "k", "(batch, seqlen_k, nheads_kv, headdim)");
  check_4d(v, "v", "(batch, seqlen_k, nheads_kv, headdim)");
  auto dq = at::empty_like(q, at::MemoryFormat::Contiguous);  // (b, s_q, h, d)
  auto dk = at::empty_like(k, at::MemoryFormat::Contiguous);  // (b, s_k, h_kv, d)
  auto dv = at::empty_like(v, at::MemoryFormat::Contiguous);  // (b, s_k, h_kv, d)
  bwd_into(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq, dk, dv,
           /*accumulate=*/false, tile_config, spans, softcap);
  return {dq, dk, dv};
}

void bwd_accum(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
               double softmax_scale, bool causal, const std::optional<at::Tensor>& delta,
               const at::Tensor& dq_accum, const at::Tensor& dk_accum, const at::Tensor& dv_accum,
               int64_t tile_config, const std::optional<at::Tensor>& spans, double softcap) {
  bwd_into(dout, q, k, v, out, lse, softmax_scale, causal, delta, dq_accum, dk_accum, dv_accum,
           /*accumulate=*/true, tile_config, spans, softcap);
}

// ---------------------------------------------------------------------------------------
// KV-cache decoding (docs/kernels.md, "KV-cache decoding"; flash_attn_with_kvcache in
// ringseq/kvcache.py appends new keys and applies rotary before calling this).
// ---------------------------------------------------------------------------------------

// A (batch,) int32 tensor of per-row cache indices or lengths on q's device; returns its data.
const int32_t* check_rows_i32(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == q.size(0), name, " must be a 1-dim tensor of ",
                    q.size(0), " entries (one per batch row of q), got shape ", shape_str(t));
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == q.device(), name, " must be on q's device ", q.device(),
                    ", got ", t.device());
  TORCH_CHECK_VALUE(t.numel() <= 1 || t.stride(0) == 1, name, " must be contiguous, got strides ",
                    t.strides());
  return t.data_ptr<int32_t>();
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& seqlens_k, const std::optional<at::Tensor>& leftpad_k,
    const std::optional<at::Tensor>& batch_idx, double softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, int64_t num_splits, bool out_acc) {
  check_4d(q, "q", "(batch, seqlen_q, nheads, headdim)");
  check_4d(k_cache, "k_cache", "(batch_cache, seqlen_cache, nheads_kv, headdim)");
  check_4d(v_cache, "v_cache", "(batch_cache, seqlen_cache, nheads_kv, headdim)");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have the same "
                    "shape, got ", shape_str(k_cache), " and ", shape_str(v_cache));
  // The cache rows q reads must exist: without batch_idx they are rows [0, batch).
  TORCH_CHECK_VALUE(batch_idx.has_value() || k_cache.size(0) >= q.size(0), "k_cache and v_cache "
                    "need a row per batch row of q when cache_batch_idx is not given: batch_cache "
                    "must be >= ", q.size(0), ", got ", shape_str(k_cache));
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "window_size entries must be >= 0 or "
                    "-1 (unbounded), got (", window_left, ", ", window_right, ")");
  TORCH_CHECK_VALUE(num_splits >= 0, "num_splits must be >= 0 (0: chosen from the shape), got ",
                    num_splits);
  TORCH_CHECK_VALUE(!out_acc || q.is_cpu(), "out_acc=True (out in the accumulation dtype) runs on "
                    "CPU only, got q on ", q.device());
  // Shapes, dtypes, devices and head counts as any call, on the first batch rows of the cache
  // (a view: check_qkv compares batch sizes, which cache_batch_idx decouples).
  const int64_t rows = std::min(q.size(0), k_cache.size(0));
  AttnShape shape = check_qkv(q.narrow(0, 0, rows), k_cache.narrow(0, 0, rows),
                              v_cache.narrow(0, 0, rows), softmax_scale, causal, softcap);
  shape.batch = q.size(0);
  const int32_t* seqlens = check_rows_i32(seqlens_k, "cache_seqlens", q);
  const int32_t* leftpad = leftpad_k.has_value() ? check_rows_i32(*leftpad_k, "cache_leftpad", q) : nullptr;
  const int32_t* bidx = batch_idx.has_value() ? check_rows_i32(*batch_idx, "cache_batch_idx", q) : nullptr;
  if (q.is_cpu()) {
    // Host values: checked here. On CUDA they stay on the device (no synchronization); a row
    // with values out of range gets NaN there instead of reading outside the cache.
    for (int64_t b = 0; b < shape.batch; ++b) {
      TORCH_CHECK_VALUE(seqlens[b] >= 0 && seqlens[b] <= shape.seqlen_k, "cache_seqlens[", b,
                        "] = ", seqlens[b], " must lie in [0, seqlen_cache = ",
                        shape.seqlen_k, "]");
      TORCH_CHECK_VALUE(leftpad == nullptr || (leftpad[b] >= 0 && leftpad[b] <= seqlens[b]),
                        "cache_leftpad[", b, "] = ", leftpad ? leftpad[b] : 0, " must lie in [0, ",
                        seqlens[b], "] (the row's cache length)");
      TORCH_CHECK_VALUE(bidx == nullptr || (bidx[b] >= 0 && bidx[b] < k_cache.size(0)),
                        "cache_batch_idx[", b, "] = ", bidx ? bidx[b] : 0, " must lie in [0, ",
                        k_cache.size(0), ")");
    }
  }
  // (b, s_q, h, d), in the accumulation dtype with out_acc (a partial result merged later)
  auto out = at::empty_like(q, out_acc ? q.options().dtype(accum_type(q.scalar_type())) : q.options(),
                            at::MemoryFormat::Contiguous);
  auto lse = at::empty({shape.batch, shape.nheads, shape.seqlen_q},
                       q.options().dtype(accum_type(q.scalar_type())));  // (b, h, s_q)
  if (out.numel() == 0) return {out, lse};
  FwdParams p = fwd_params(shape, q, k_cache, v_cache, out, lse);
  p.out_acc = out_acc;
  p.kv.seqlens = seqlens;
  p.kv.leftpad = leftpad;
  p.kv.batch_idx = bidx;
  p.kv.batch_cache = k_cache.size(0);
  // A window wider than the cache is no window (as flash-attn treats it); this keeps the
  // kernels' 32-bit index sums in range. With the left side bounded, an unbounded right side
  // is the cache's width, its capacity (flash-attn's set_params_fprop): the first
  // s_q - k_len - s_c rows, where that is positive, see no key.
  p.kv.window_left = window_left >= shape.seqlen_k ? -1 : window_left;
  p.kv.window_right = window_right >= shape.seqlen_k ? -1 : window_right;
  if (p.kv.window_left >= 0 && p.kv.window_right < 0) p.kv.window_right = shape.seqlen_k;
  p.num_splits = static_cast<int>(std::min<int64_t>(num_splits, km::kMaxSplits));
  if (q.is_cpu()) {
    p.tiles_visited = &g_tiles_visited[0];
    flash_fwd_cpu(p);
  } else {
#ifdef RINGSEQ_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    at::Tensor scratch;  // the splits' partial results, from torch's caching allocator
    const int64_t floats = flash_fwd_cuda_split_floats(p);
    if (floats > 0) {
      scratch = at::empty({floats}, q.options().dtype(at::kFloat));
      p.split_scratch = scratch.data_ptr<float>();
      p.split_scratch_floats = floats;
    }
    flash_fwd_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
#endif
  }
  return {out, lse};
}

// delta = rowsum(dout * out), (b, h, s_q) contiguous in the accumulation dtype: what bwd takes
// as `delta`. On CPU summed by the kernel in its dP GEMM's order (so dP - delta is exactly 0
// where out is a single value row, as in plain attention); elsewhere by torch.
at::Tensor delta_op(const at::Tensor& dout, const at::Tensor& out) {
  check_4d(out, "out", "(batch, seqlen_q, nheads, headdim)");
  const auto st = out.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
                    "out must be float32, float64, bfloat16 or float16, got ", st);
  const DType dtype = to_dtype(st);
  check_like(dout, "dout", out, "out", st);
  check_last_dim_contiguous(out, "out");
  if (!out.is_cpu() || out.numel() == 0) return torch_delta(dout, out);
  at::Tensor result = at::empty({out.size(0), out.size(2), out.size(1)},
                                out.options().dtype(accum_type(st)));  // (b, h, s_q)
  BwdParams p;
  p.shape.batch = out.size(0);
  p.shape.seqlen_q = out.size(1);
  p.shape.nheads = out.size(2);
  p.shape.headdim = out.size(3);
  p.dtype = dtype;
  p.dout = dout.data_ptr();
  p.out = out.data_ptr();
  p.dout_strides = row_strides(dout);
  p.out_strides = row_strides(out);
  flash_delta_cpu(p, result.data_ptr());
  return result;
}

// exp(x) through the active CPU level's softmax exp (vec.h: exp_vecs), for tests: x a float32
// tensor of any shape (registered for CPU only: the dispatcher refuses other devices); a float32
// tensor of x's shape. Raises ValueError for another dtype.
at::Tensor softmax_exp_op(const at::Tensor& x, bool non_positive) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat,
                    "ringseq::_softmax_exp(x): x must be a float32 CPU tensor, got ", x.scalar_type());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  if (xc.numel() > 0) softmax_exp_cpu(xc.data_ptr<float>(), y.data_ptr<float>(), xc.numel(), non_positive);
  return y;
}

}  // namespace

// spans / softcap trail every schema so that existing positional calls keep working;
// docs/kernels.md, "Spans, bands and softcap", is their contract.
TORCH_LIBRARY(ringseq, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, int tile_config=0,"
      " Tensor? spans=None, float softcap=0.0) -> (Tensor out, Tensor lse)");
  // Merges this block into a running (out_acc, lse_acc) pair in place (accumulation dtype):
  // lse' = log(exp(lse_acc) + exp(lse_b)), out' = weighted sum; rows with lse_acc = -inf hold
  // nothing yet. The ring's forward step without a block-sized temporary.
  m.def(
      "fwd_accum(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal,"
      " Tensor(a!) out_acc, Tensor(b!) lse_acc, int tile_config=0, Tensor? spans=None,"
      " float softcap=0.0) -> ()");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale,"
      " bool causal, Tensor? delta=None, int tile_config=0, Tensor? spans=None,"
      " float softcap=0.0) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "bwd_accum(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
      " float softmax_scale, bool causal, Tensor? delta, Tensor(a!) dq_accum,"
      " Tensor(b!) dk_accum, Tensor(c!) dv_accum, int tile_config=0, Tensor? spans=None,"
      " float softcap=0.0) -> ()");
  // Test statistic of the CPU kernels: (q tile, kv tile) pairs computed so far by [fwd, bwd],
  // summed over batch and heads; reset=True returns and zeroes them.
  m.def("_tiles_visited(bool reset=False) -> int[]", &tiles_visited);
  // delta = rowsum(dout * out), (b, h, s_q) in the accumulation dtype, summed as bwd sums dP.
  m.def("delta(Tensor dout, Tensor out) -> Tensor");
  // exp(x) through the CPU kernel's softmax exp at the active ISA level (float32), for tests.
  m.def("_softmax_exp(Tensor x, bool non_positive=False) -> Tensor");
  // KV-cache decoding: q (b, s_q, h, d) against the valid keys [cache_leftpad[b],
  // cache_seqlens[b]) of cache row cache_batch_idx[b] of k_cache / v_cache (batch_cache,
  // seqlen_cache, h_kv, d); causal and the window (-1: unbounded) bottom-right aligned to
  // them. int32 (b,) index tensors on q's device. num_splits: key splits, 0 = from the shape.
  // out_acc (CPU only): out in the accumulation dtype, for partial results merged afterwards.
  m.def(
      "fwd_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens,"
      " Tensor? cache_leftpad, Tensor? cache_batch_idx, float softmax_scale, bool causal,"
      " int window_left=-1, int window_right=-1, float softcap=0.0, int num_splits=0,"
      " bool out_acc=False) -> (Tensor out, Tensor lse)");
}

// Every operator's ValueErrors name it ("ringseq::bwd: lse must be ..."): the checks above
// speak of their arguments only, and a direct call reaches them without a Python layer.
template <auto Fn, const char* Op>
struct Named;

template <class R, class... Args, R (*Fn)(Args...), const char* Op>
struct Named<Fn, Op> {
  static R call(Args... args) {
    try {
      return Fn(args...);
    } catch (const c10::ValueError& e) {
      throw c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            std::string(Op) + ": " + e.msg());
    }
  }
};

constexpr char kFwd[] = "ringseq::fwd";
constexpr char kFwdAccum[] = "ringseq::fwd_accum";
constexpr char kBwd[] = "ringseq::bwd";
constexpr char kBwdAccum[] = "ringseq::bwd_accum";
constexpr char kDelta[] = "ringseq::delta";
constexpr char kFwdKvcache[] = "ringseq::fwd_kvcache";

// The operators both devices run (one list: a device cannot miss one).
void register_ops(torch::Library& m) {
  m.impl("fwd", &Named<&fwd, kFwd>::call);
  m.impl("fwd_accum", &Named<&fwd_accum, kFwdAccum>::call);
  m.impl("bwd", &Named<&bwd, kBwd>::call);
  m.impl("bwd_accum", &Named<&bwd_accum, kBwdAccum>::call);
  m.impl("delta", &Named<&delta_op, kDelta>::call);
  m.impl("fwd_kvcache", &Named<&fwd_kvcache, kFwdKvcache>::call);
}

TORCH_LIBRARY_IMPL(ringseq, CPU, m) {
  register_ops(m);
  m.impl("_softmax_exp", &softmax_exp_op);  // (names itself)
}

#ifdef RINGSEQ_WITH_CUDA
TORCH_LIBRARY_IMPL(ringseq, CUDA, m) {
  register_ops(m);
}
#endif

}  // namespace ringseq
