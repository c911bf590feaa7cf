// Shared pieces of the CPU forward and backward (one copy per ISA level, see vec.h): dtype
// dispatch, strided tile packing, per-thread scratch and the work scheduler.
#pragma once

#include <cstdlib>
#include <type_traits>  // traits only: no code

#include "../attn_params.h"
#include "../kernel_math.h"
#include "isa.h"
#include "vec.h"

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kFloat64: f(double{}); break;
    case DType::kBFloat16: f(bf16_t{}); break;
    case DType::kFloat16: f(f16_t{}); break;
    default: hook_fail("ringseq CPU kernel: unsupported dtype", 0);
  }
}

// Element (b, s, h, 0) of a (b, s, h, d) tensor.
template <typename P>
RS_INLINE P* row_ptr(P* base, const RowStrides& st, int64_t b, int64_t s, int64_t h) {
  return base + b * st.batch + s * st.row + h * st.head;
}

// dst (rows x dpad, row stride ldd) = src (rows x d, row stride ld) converted to T; columns
// [d, dpad) are zero.
template <typename T, typename in_t>
inline void pack_rows(const in_t* src, int64_t ld, int64_t rows, int64_t d, T* dst, int64_t ldd,
                      int64_t dpad) {
  for (int64_t r = 0; r < rows; ++r) {
    const in_t* s = src + r * ld;
    T* o = dst + r * ldd;
    for (int64_t c = 0; c < d; ++c) o[c] = to_acc<T>(s[c]);
    for (int64_t c = d; c < dpad; ++c) o[c] = T(0);
  }
}

// Row stride of a packed copy whose rows the micro-kernel reads down a column (a B operand:
// each K step loads the same columns of the next row; or an A operand read through its
// columns, sa_k = the stride: the forward's Sᵀ, the backward's P and dS). At a stride of an
// even number of 64-byte lines the rows of one panel fall in a fraction of the L1's 64 sets
// (512-byte rows, d = 128 fp32: 8 sets, 12 of a 96-row panel in each of 8 ways) and evict each
// other on every pass; one more line makes the stride odd and spreads them over all sets.
template <typename T>
constexpr int64_t packed_ld(int64_t dpad) {
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(T));
  return dpad % (2 * line) == 0 ? dpad + line : dpad;
}

// A tile of `rows` x `d` as a GEMM operand in T with row stride `buf_ld` (>= dpad): the input
// itself when it already is T and its rows are whole vectors at that stride (rows_in_place;
// any stride for a single row), else a converted, zero-padded copy in `buf`. Returns the
// pointer and sets `ld` to its row stride. Strided tiles are always copied: rows of a
// (b, s, h, d) tensor lie h·d elements apart, often a multiple of 4 KiB, and reading many of
// them in place makes every row of a tile compete for the same L1 sets (a copy costs
// ~1/(2·tile) of the GEMM work on it and measured up to 1.4x faster); for the same reason rows
// at dpad's stride are copied where the operand wants packed_ld's. Rows read again and again
// (by several items, or an item's key tiles) are packed once per thread instead (HeadRows,
// below).
template <typename T, typename in_t>
RS_INLINE bool rows_in_place(int64_t d, int64_t dpad, int64_t src_ld, int64_t buf_ld) {
  return kSame<T, in_t> && d == dpad && src_ld == buf_ld;
}
template <typename T, typename in_t>
inline const T* rows_as(const in_t* src, int64_t src_ld, int64_t rows, int64_t d, int64_t dpad,
                        T* buf, int64_t buf_ld, int64_t& ld) {
  if constexpr (kSame<T, in_t>) {
    if (rows_in_place<T, in_t>(d, dpad, src_ld, buf_ld) || (d == dpad && rows == 1)) {
      ld = src_ld;
      return src;
    }
  }
  pack_rows(src, src_ld, rows, d, buf, buf_ld, dpad);
  ld = buf_ld;
  return buf;
}

// dst[0, n) = scale · src[0, n): each element rounded as pack_transposed's scaled copy rounds
// it (one multiply), so a product over either copy sums the same terms.
template <typename T>
RS_INLINE void scale_row(const T* src, int64_t n, T scale, T* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = src[c] * scale;
}

// dst (d x cols_pad, row stride ldd) = scale · srcᵀ for a `rows` x `d` source; columns
// [rows, cols_pad) are zero.
template <typename T, typename in_t>
inline void pack_transposed(const in_t* src, int64_t ld, int64_t rows, int64_t d, T scale, T* dst,
                            int64_t ldd, int64_t cols_pad) {
  constexpr int64_t kR = 8;  // rows per pass: 8 contiguous stores per column
  int64_t r0 = 0;
  for (; r0 + kR <= rows; r0 += kR) {
    const in_t* s = src + r0 * ld;
    for (int64_t c = 0; c < d; ++c) {
      T* o = dst + c * ldd + r0;
#pragma GCC unroll 8
      for (int64_t r = 0; r < kR; ++r) o[r] = to_acc<T>(s[r * ld + c]) * scale;
    }
  }
  for (; r0 < rows; ++r0) {
    const in_t* s = src + r0 * ld;
    for (int64_t c = 0; c < d; ++c) dst[c * ldd + r0] = to_acc<T>(s[c]) * scale;
  }
  for (int64_t c = 0; c < d; ++c) fill(dst + c * ldd + rows, cols_pad - rows, T(0));
}

// dst (rows x kd pairs, row stride kd) = the rows of a `rows` x `d` bf16 source (row stride ld)
// as pairs: a contiguous copy of a strided tile (see rows_as for why tiles are copied).
inline void pack_pair_rows(const bf16_t* src, int64_t ld, int64_t rows, int64_t d, uint32_t* dst) {
  const int64_t kd = (d + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const bf16_t* s = src + r * ld;
    uint32_t* o = dst + r * kd;
    if (d % 2 == 0) {
      std::memcpy(o, s, static_cast<size_t>(d) * sizeof(bf16_t));
    } else {
      for (int64_t k = 0; k < kd; ++k) o[k] = bf16_pair(s, k, d);
    }
  }
}

// x as bf16 where in_t is bf16, else null: for the pair packing in runtime branches of a kernel
// instantiated for every dtype (taken for bf16 inputs only).
template <typename in_t>
RS_INLINE const bf16_t* bf16_input(const in_t* x) {
  if constexpr (kSame<in_t, bf16_t>) {
    return x;
  } else {
    return nullptr;
  }
}

// dst (kd x cols_pad pairs, row stride ldd): pair k of source row r at dst[k][r], the transposed
// pair layout of a B operand; columns [rows, cols_pad) are zero.
inline void pack_pairs_transposed(const bf16_t* src, int64_t ld, int64_t rows, int64_t d,
                                  uint32_t* dst, int64_t ldd, int64_t cols_pad) {
  const int64_t kd = (d + 1) / 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < kd; ++k) dst[k * ldd + r] = bf16_pair(src + r * ld, k, d);
  for (int64_t k = 0; k < kd; ++k) fill(dst + k * ldd + rows, cols_pad - rows, 0u);
}

// Writes (or, with accumulate, adds) `rows` x `d` of src (row stride lds) times one scale per
// row (nullptr: 1) to a strided destination.
template <typename out_t, typename T>
inline void store_rows(const T* src, int64_t lds, int64_t rows, int64_t d, const T* row_scale,
                       out_t* dst, int64_t ld, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * lds;
    out_t* o = dst + r * ld;
    const T sc = row_scale ? row_scale[r] : T(1);
    if constexpr (kSame<out_t, T>) {
      if (accumulate) {
        for (int64_t c = 0; c < d; ++c) o[c] += s[c] * sc;
        continue;
      }
    }
    for (int64_t c = 0; c < d; ++c) o[c] = from_acc<out_t>(s[c] * sc);
  }
}

// 64-byte aligned scratch owned by one worker thread (or one call).
template <typename T>
struct Scratch {
  T* ptr = nullptr;
  explicit Scratch(int64_t n) {
    const int64_t bytes = round_up(imax(n, 1) * static_cast<int64_t>(sizeof(T)), 64);
    ptr = static_cast<T*>(std::aligned_alloc(64, static_cast<size_t>(bytes)));
    if (ptr == nullptr) hook_fail("ringseq CPU kernel: out of memory for scratch", bytes);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch(Scratch&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
  ~Scratch() { std::free(ptr); }
  T* get() const { return ptr; }
};

// Rows [r0, r1) of one head of a (b, s, h, d) input, packed contiguously (ld elements per row)
// into a worker thread's scratch once and reused by the thread's next items of the same head.
// Why: the rows of one head lie h·d elements apart, usually one 4 KiB page per row, so every
// per-tile copy of them walked the TLB once per row; items of one head read the same rows again
// (the forward's q tiles all read the head's K/V, the backward's key tiles its Q/dO), and
// copying them once per thread made the AVX2 forward 2-6 % and the backward 2-8 % faster at
// s = 4096 on a Zen 4 (the same inputs in 2 MiB pages: 4-7 % and 6-8 %). `slots` heads are held
// at once (a GQA group's query heads take turns in the backward), each up to cap_rows rows.
// A thread's caches together hold at most hook_head_rows_bytes() (9 MiB by default); callers
// use them only where rows are read again (rows() returns nullptr past cap_rows: the caller
// copies per tile as before).
template <typename E>
struct HeadRows {
  static constexpr int kMaxSlots = 16;
  Scratch<E> buf;
  int64_t cap_rows, ld, slots;
  int64_t key[kMaxSlots], begin[kMaxSlots], end[kMaxSlots];
  HeadRows(int64_t cap_rows_, int64_t ld_, int64_t slots_)
      : buf(cap_rows_ * ld_ * slots_), cap_rows(cap_rows_), ld(ld_), slots(slots_) {
    for (int i = 0; i < kMaxSlots; ++i) key[i] = -1;
  }
  // Row r0 of the packed rows [r0, r1) of head `head` (any id unique within the call; row r at
  // result + (r - r0) * ld), packed by pack(dst, r0, r1) unless a slot holds them already;
  // nullptr when they exceed cap_rows (the caller copies per tile).
  template <typename Pack>
  const E* rows(int64_t head, int64_t r0, int64_t r1, Pack&& pack) {
    const int64_t s = head % slots;
    E* slot = buf.get() + s * cap_rows * ld;
    if (key[s] == head && begin[s] <= r0 && r1 <= end[s]) return slot + (r0 - begin[s]) * ld;
    if (r1 - r0 > cap_rows) return nullptr;
    pack(slot, r0, r1);
    key[s] = head;
    begin[s] = r0;
    end[s] = r1;
    return slot;
  }
};

// Rows to prefetch: the first row's address, the step between rows and the bytes of a row.
struct RowsAt {
  const char* at;
  int64_t step, bytes;
};
template <typename E>
RS_INLINE RowsAt rows_at(const E* first, int64_t ld, int64_t cols) {
  return RowsAt{reinterpret_cast<const char*>(first), ld * static_cast<int64_t>(sizeof(E)),
                cols * static_cast<int64_t>(sizeof(E))};
}

// Runs work(state, item) for item in [0, n) on torch's intra-op threads. Items are claimed from
// a shared counter in order, so callers list expensive items first and the tail stays short;
// each item writes disjoint outputs, so results do not depend on which thread ran it.
// make_state() builds per-thread scratch once per thread, not once per item.
template <typename MakeState, typename Work>
void run_items(int64_t n, MakeState&& make_state, Work&& work) {
  if (n <= 0) return;
  using M = std::remove_cv_t<std::remove_reference_t<MakeState>>;
  using W = std::remove_cv_t<std::remove_reference_t<Work>>;
  struct Ctx {
    int64_t n;
    int64_t next;
    M* make_state;
    W* work;
  } ctx{n, 0, &make_state, &work};
  auto body = [](void* p) {
    Ctx& c = *static_cast<Ctx*>(p);
    auto state = (*c.make_state)();
    for (int64_t i = __atomic_fetch_add(&c.next, 1, __ATOMIC_RELAXED); i < c.n;
         i = __atomic_fetch_add(&c.next, 1, __ATOMIC_RELAXED)) {
      (*c.work)(state, i);
    }
  };
  const int64_t nthreads = imin(hook_num_threads(), n);
  if (nthreads <= 1) {
    body(&ctx);
  } else {
    hook_parallel(nthreads, body, &ctx);
  }
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
