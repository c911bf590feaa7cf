// The seam between the CPU kernel's per-ISA translation units and the rest of the extension.
//
// csrc/cpu/kernels/*.cpp are compiled once per ISA level (setup.py: baseline x86-64 or the
// generic build elsewhere, AVX2+FMA, AVX-512, AVX-512 with the bf16 dot product, AVX-512 with AMX
// tiles), each into namespace ringseq::cpu::<level>, and
// each level exports one KernelTable. csrc/cpu/dispatch.cpp (compiled for the baseline only)
// picks a table at first use from cpuid, or from RINGSEQ_CPU_ISA, the way ATen's
// CPU_CAPABILITY does. The per-level units include no torch header: they reach torch's thread
// pool and error type only through the hooks below, which dispatch.cpp implements.
#pragma once

#include <cstdint>

#include "../attn_params.h"

namespace ringseq {
namespace cpu {

struct KernelTable {
  const char* name;  // "baseline", "avx2", "avx512", "avx512bf16", "amx"
  void (*fwd)(const FwdParams&);
  void (*bwd)(const BwdParams&);
  // delta = rowsum(dout * out) into a contiguous (b, h, s_q) buffer of the accumulation type,
  // in the order bwd's dP sums (reads shape, dtype, dout/out and their strides only).
  void (*delta)(const BwdParams&, void* delta);
  // y = exp(x) for n floats through the softmax's exp (vec.h: exp_vecs, four vectors at a time
  // as the kernels call it; non_positive: its variant for x <= 0 or NaN). For tests.
  void (*exp)(const float* x, float* y, int64_t n, bool non_positive);
};

// Hooks into torch (dispatch.cpp).
int hook_num_threads();
// Runs body(ctx) once on each of `nthreads` threads of torch's intra-op pool and waits;
// an exception thrown by a body is rethrown here.
void hook_parallel(int64_t nthreads, void (*body)(void*), void* ctx);
// Throws the error torch reports for a failed kernel (c10::Error, a RuntimeError in Python).
[[noreturn]] void hook_fail(const char* what, int64_t bytes);
// Bytes of input rows a worker thread may keep packed in one call (common.h: HeadRows).
int64_t hook_head_rows_bytes();

namespace baseline {
const KernelTable* kernel_table();
}
namespace avx2 {
const KernelTable* kernel_table();
}
namespace avx512 {
const KernelTable* kernel_table();
}
namespace avx512bf16 {
const KernelTable* kernel_table();
}
namespace amx {
const KernelTable* kernel_table();
}

}  // namespace cpu
}  // namespace ringseq
