// Dispatch of the CUDA kernels on (dtype, head dim) and the checks only the kernel side can
// make (16-byte alignment for cp.async / vector stores, launch limits). Torch-free.
#include "flash_api.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../kernel_math.h"
#include "launch.h"

namespace ringseq {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("ringseq CUDA error in ") + what + ": " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

bool cuda_supports(DType dtype, int64_t headdim) {
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) && (headdim == 64 || headdim == 128);
}

namespace {

[[noreturn]] void invalid(const std::string& msg) {
  throw std::invalid_argument("ringseq CUDA kernel: " + msg);
}

// Tiles move through 16-byte cp.async copies and vector stores: every row a kernel touches
// must start on a 16-byte boundary (km::rows_aligned, tested on CPU). `rows` and `heads` are
// the view's seqlen and head count.
void check_rows_aligned(const void* ptr, const RowStrides& s, int64_t batch, int64_t rows,
                        int64_t heads, const char* name) {
  if (ptr == nullptr) invalid(std::string(name) + " is a null pointer");
  if (!km::rows_aligned(reinterpret_cast<uintptr_t>(ptr), s.batch, s.row, s.head, batch, rows, heads)) {
    invalid(std::string(name) + " must be 16-byte aligned with batch/seq/head strides that are "
            "multiples of 8 elements (dimensions of size 1 excepted), got strides (" +
            std::to_string(s.batch) + ", " + std::to_string(s.row) + ", " + std::to_string(s.head) +
            ", 1) for shape (" + std::to_string(batch) + ", " + std::to_string(rows) + ", " +
            std::to_string(heads) + ", d); pass a .contiguous() copy or use backend=\"sdpa\"");
  }
}

// Views shaped like q (b, s_q, h, d) and like k (b, s_k, h_kv, d).
void check_q_rows(const AttnShape& sh, const void* ptr, const RowStrides& s, const char* name) {
  check_rows_aligned(ptr, s, sh.batch, sh.seqlen_q, sh.nheads, name);
}
void check_kv_rows(const AttnShape& sh, const void* ptr, const RowStrides& s, const char* name) {
  check_rows_aligned(ptr, s, sh.batch, sh.seqlen_k, sh.nheads_kv, name);
}

void check_shape(const AttnShape& sh, DType dtype, int config) {
  if (!cuda_supports(dtype, sh.headdim)) {
    invalid("supports bfloat16/float16 inputs with head dim 64 or 128, got head dim " +
            std::to_string(sh.headdim) + "; use backend=\"sdpa\" for other inputs");
  }
  if (config < 0 || config >= km::kNumFwdConfigs) {
    invalid("tile_config must be 0 (fast), 1 (conservative) or 2 (128x64 tiles; the backward "
            "runs config 0's), got " + std::to_string(config));
  }
  if (!(sh.softmax_scale > 0.0)) {
    // The online softmax takes row maxima of unscaled scores, which needs a positive scale.
    invalid("softmax_scale must be positive on CUDA, got " + std::to_string(sh.softmax_scale));
  }
  constexpr int64_t kMaxSeq = std::numeric_limits<int32_t>::max() / 2;
  if (sh.seqlen_q > kMaxSeq || sh.seqlen_k > kMaxSeq) {
    invalid("sequence lengths must be below 2^30, got seqlen_q=" + std::to_string(sh.seqlen_q) +
            ", seqlen_k=" + std::to_string(sh.seqlen_k));
  }
  if (sh.nheads > 65535 || sh.batch > 65535) {
    invalid("batch and nheads must be at most 65535 (grid limits), got batch=" +
            std::to_string(sh.batch) + ", nheads=" + std::to_string(sh.nheads));
  }
  if (sh.nheads_kv <= 0 || sh.nheads % sh.nheads_kv != 0) {
    invalid("nheads must be a multiple of nheads_kv");
  }
  if (!(sh.softcap >= 0.0) || sh.softcap > 3.0e38) {
    invalid("softcap must be a finite number >= 0, got " + std::to_string(sh.softcap));
  }
}

// Spans (the binding validated their ranges and clamped their bands): the grids are
// (tiles of the longest span x spans, ...), whose x dimension must fit 2^31 - 1. The smallest
// tile of any kernel is 64 rows.
void check_spans(const SpanList& s) {
  if (s.count == 0) return;
  if (s.data == nullptr) invalid("spans is a null pointer");
  constexpr int64_t kMinTile = 64;
  const int64_t tiles = (std::max(s.max_q_len, s.max_k_len) + kMinTile - 1) / kMinTile;
  if (s.count > std::numeric_limits<int32_t>::max() ||
      tiles * s.count > std::numeric_limits<int32_t>::max()) {
    invalid("too many spans for one launch: " + std::to_string(s.count) + " spans of up to " +
            std::to_string(std::max(s.max_q_len, s.max_k_len)) + " rows need more than 2^31 - 1 "
            "CTAs; split the call");
  }
}

template <typename Fn>
void dispatch(DType dtype, int64_t headdim, Fn&& fn) {
  if (dtype == DType::kBFloat16) {
    if (headdim == 64) return fn(std::integral_constant<int, 64>{}, __nv_bfloat16{});
    return fn(std::integral_constant<int, 128>{}, __nv_bfloat16{});
  }
  if (headdim == 64) return fn(std::integral_constant<int, 64>{}, __half{});
  return fn(std::integral_constant<int, 128>{}, __half{});
}

// The key splits of a call (km::kv_splits; 1: the dense and spans kernels run it), from the
// shape of the view it runs as. A KV-cache call sizes them by the cache's capacity: its
// lengths live on the device.
int fwd_splits(const FwdParams& p) {
  if (p.accumulate || p.spans.count > 0) return 1;
  const int d = static_cast<int>(p.shape.headdim);
  const int64_t bm = km::fwd_block_m(d, km::kSplitConfig), bn = km::fwd_block_n(d, km::kSplitConfig);
  const int64_t q_tiles = (p.shape.seqlen_q + bm - 1) / bm;
  const int64_t items = q_tiles * p.shape.nheads * p.shape.batch;
  const int64_t key_tiles = (p.shape.seqlen_k + bn - 1) / bn;
  return static_cast<int>(km::kv_splits<int64_t>(p.num_splits, q_tiles, items, key_tiles,
                                                 km::kCudaSplitTarget, km::kCudaSplitMinTiles,
                                                 km::kMaxSplits));
}

// What a forward call runs as: the GQA rows view of a single-token call (attn_params.h) and
// its resolved split count.
FwdParams resolve_fwd(const FwdParams& p) {
  FwdParams r = gqa_rows_possible(p) ? gqa_rows_view(p) : p;
  r.num_splits = fwd_splits(r);
  return r;
}

int64_t split_floats(const FwdParams& r) {
  return r.num_splits > 1 ? km::split_scratch_floats(r.num_splits, r.shape.batch, r.shape.nheads,
                                                     r.shape.seqlen_q, r.shape.headdim)
                          : 0;
}

// Split scratch for a torch-free caller that passed none (the binding passes torch memory):
// stream-ordered device memory, or host memory where this file is compiled as host code (the
// lane-level emulator of docs/kernels.md runs the kernels on the CPU).
class OwnScratch {
 public:
  OwnScratch(int64_t floats, cudaStream_t stream) : stream_(stream) {
#if defined(__CUDACC__)
    check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&ptr_), size_t(floats) * sizeof(float), stream),
               "flash fwd: cudaMallocAsync(split scratch)");
#else
    host_.resize(size_t(floats));
    ptr_ = host_.data();
#endif
  }
  ~OwnScratch() {
#if defined(__CUDACC__)
    cudaFreeAsync(ptr_, stream_);  // after the kernels that use it, in stream order
#endif
  }
  OwnScratch(const OwnScratch&) = delete;
  OwnScratch& operator=(const OwnScratch&) = delete;
  float* get() const { return ptr_; }

 private:
  float* ptr_ = nullptr;
  cudaStream_t stream_;
  std::vector<float> host_;
};

}  // namespace

int64_t flash_fwd_cuda_split_floats(const FwdParams& p) { return split_floats(resolve_fwd(p)); }

// An error left pending by an earlier asynchronous launch would otherwise be reported as a
// failure of ours by the cudaGetLastError after our launch.
static void check_no_pending_error() {
  check_cuda(cudaPeekAtLastError(), "an earlier CUDA call (pending before ringseq's kernels ran)");
}

void flash_fwd_cuda(const FwdParams& params, cudaStream_t stream) {
  check_no_pending_error();
  check_shape(params.shape, params.dtype, params.config);
  if (params.accumulate) invalid("the forward kernel has no accumulate (merge) mode yet");
  if (params.out_acc) invalid("the forward kernel writes out in the inputs' dtype only (out_acc: CPU)");
  check_spans(params.spans);
  if (params.kv.seqlens != nullptr && params.spans.count > 0) invalid("a KV-cache call takes no spans");
  if (params.shape.batch == 0 || params.shape.seqlen_q == 0 || params.shape.nheads == 0) return;
  FwdParams p = resolve_fwd(params);
  check_q_rows(p.shape, p.q, p.q_strides, "q");
  check_kv_rows(p.shape, p.k, p.k_strides, "k");
  check_kv_rows(p.shape, p.v, p.v_strides, "v");
  check_q_rows(p.shape, p.out, p.out_strides, "out");
  if (p.lse == nullptr) invalid("lse is a null pointer");
  const int64_t floats = split_floats(p);
  std::unique_ptr<OwnScratch> own;
  if (floats > 0 && (p.split_scratch == nullptr || p.split_scratch_floats < floats)) {
    if (p.split_scratch != nullptr) invalid("split_scratch holds fewer floats than the call needs");
    own.reset(new OwnScratch(floats, stream));
    p.split_scratch = own->get();
    p.split_scratch_floats = floats;
  }
  dispatch(p.dtype, p.shape.headdim, [&](auto hd, auto elem) {
    run_flash_fwd<decltype(hd)::value, decltype(elem)>(p, stream);
  });
}

void flash_bwd_cuda(const BwdParams& p, cudaStream_t stream) {
  check_no_pending_error();
  check_shape(p.shape, p.dtype, p.config);
  check_spans(p.spans);
  if (p.shape.batch == 0 || p.shape.seqlen_q == 0 || p.shape.seqlen_k == 0 || p.shape.nheads == 0) {
    return;
  }
  check_q_rows(p.shape, p.dout, p.dout_strides, "dout");
  check_q_rows(p.shape, p.q, p.q_strides, "q");
  check_kv_rows(p.shape, p.k, p.k_strides, "k");
  check_kv_rows(p.shape, p.v, p.v_strides, "v");
  // `out` is not read here: the binding has turned it into delta already.
  check_q_rows(p.shape, p.dq, p.dq_strides, p.accumulate ? "dq_accum" : "dq");
  check_kv_rows(p.shape, p.dk, p.dk_strides, p.accumulate ? "dk_accum" : "dk");
  check_kv_rows(p.shape, p.dv, p.dv_strides, p.accumulate ? "dv_accum" : "dv");
  if (p.lse == nullptr || p.delta == nullptr) invalid("lse and delta must be given");
  dispatch(p.dtype, p.shape.headdim, [&](auto hd, auto elem) {
    run_flash_bwd<decltype(hd)::value, decltype(elem)>(p, stream);
  });
}

}  // namespace ringseq
