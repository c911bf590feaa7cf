// Shared pieces of the CPU forward and backward: dtype dispatch, strided tile loads and
// stores, tile sizes, per-thread scratch and the work scheduler.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>

#include "../attn_params.h"
#include "cpu_gemm.h"

namespace ringseq {
namespace cpu {

template <typename in_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat64: f(double{}); break;
    case DType::kBFloat16: f(c10::BFloat16{}); break;
    case DType::kFloat16: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "ringseq CPU kernel: unsupported dtype");
  }
}

// Element (b, s, h, 0) of a (b, s, h, d) tensor.
template <typename P>
inline P* row_ptr(P* base, const RowStrides& st, int64_t b, int64_t s, int64_t h) {
  return base + b * st.batch + s * st.row + h * st.head;
}

// Copies `rows` rows of `d` elements (row stride `ld`) into dst (row stride `ldd`), converted
// to T and multiplied by `scale`.
template <typename T, typename in_t>
inline void load_rows(const in_t* src, int64_t ld, int64_t rows, int64_t d, T scale, T* dst,
                      int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const in_t* s = src + r * ld;
    T* o = dst + r * ldd;
    for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(s[c]) * scale;
  }
}

// A tile of `rows` x `d` as a GEMM A operand in T: the input itself when it already is T
// (read in place through its row stride; a compacting copy measured no faster), else a
// converted copy in `buf`. Returns the pointer and sets `ld` to its row stride.
template <typename T, typename in_t>
inline const T* rows_as(const in_t* src, int64_t src_ld, int64_t rows, int64_t d, T* buf,
                        int64_t& ld) {
  if constexpr (std::is_same_v<T, in_t>) {
    ld = src_ld;
    return src;
  } else {
    load_rows(src, src_ld, rows, d, T(1), buf, d);
    ld = d;
    return buf;
  }
}

// dst (d x cols_pad, row stride ldd) = scale · srcᵀ for a `rows` x `d` source; columns
// [rows, cols_pad) are zero.
template <typename T, typename in_t>
inline void load_transposed(const in_t* src, int64_t ld, int64_t rows, int64_t d, T scale,
                            T* dst, int64_t ldd, int64_t cols_pad) {
  for (int64_t r = 0; r < rows; ++r) {
    const in_t* s = src + r * ld;
    for (int64_t c = 0; c < d; ++c) dst[c * ldd + r] = static_cast<T>(s[c]) * scale;
  }
  for (int64_t c = 0; c < d; ++c) std::fill(dst + c * ldd + rows, dst + c * ldd + cols_pad, T(0));
}

// Writes (or, with accumulate, adds) scale · srcᵀ to `rows` rows of a strided destination,
// where src is d x rows (row stride lds).
template <typename out_t, typename T>
inline void store_transposed(const T* src, int64_t lds, int64_t rows, int64_t d, T scale,
                             out_t* dst, int64_t ld, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    out_t* o = dst + r * ld;
    if (accumulate) {
      for (int64_t c = 0; c < d; ++c)
        o[c] = static_cast<out_t>(static_cast<T>(o[c]) + src[c * lds + r] * scale);
    } else {
      for (int64_t c = 0; c < d; ++c) o[c] = static_cast<out_t>(src[c * lds + r] * scale);
    }
  }
}

// 64-byte aligned scratch owned by one worker thread.
template <typename T>
struct Scratch {
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> buf;
  explicit Scratch(int64_t n) {
    const size_t bytes = round_up(std::max<int64_t>(n, 1) * static_cast<int64_t>(sizeof(T)), 64);
    buf.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buf != nullptr, "ringseq CPU kernel: out of memory for ", bytes,
                " bytes of scratch");
  }
  T* get() const { return buf.get(); }
};

// Tile sizes: query rows per tile and keys per tile. Keys per tile shrink with the head dim so
// that a K or V tile stays around 128 KiB and a work item's tiles fit in L2. Measured on
// Zen 5 (AVX-512), d = 64 and 128: 64..256 x 64..512 all lie within ~10% of each other; the
// micro-kernel alone reaches ~250 GFLOP/s per core at these shapes.
constexpr int64_t kBlockM = 128;
inline int64_t block_n(int64_t d) {
  int64_t bn = 256;
  while (bn > 32 && bn * d > 32768) bn /= 2;
  return bn;
}

// Runs work(item) for item in [0, n) on torch's intra-op threads. Items are claimed from a
// shared counter in order, so callers list expensive items first and the tail stays short;
// each item writes disjoint outputs, so results do not depend on which thread ran it.
// make_state() builds per-thread scratch once per thread, not once per item.
template <typename MakeState, typename Work>
void run_items(int64_t n, MakeState&& make_state, Work&& work) {
  if (n <= 0) return;
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      work(state, i);
    }
  });
}

}  // namespace cpu
}  // namespace ringseq
