// CPU flash attention: tiled online softmax forward, one-pass backward (csrc/cpu/kernels/),
// compiled per ISA level and dispatched at first use (csrc/cpu/dispatch.cpp).
#pragma once

#include <string>

#include "../attn_params.h"

namespace ringseq {

// Forward: writes out (dtype) and lse (accumulation type). Requires batch, seqlen_q,
// seqlen_k, nheads > 0 (the binding handles empty inputs).
void flash_fwd_cpu(const FwdParams& params);

// Backward with the caller's delta, or (null) one the kernel sums from dout and out;
// overwrites or accumulates dq/dk/dv (see BwdParams).
void flash_bwd_cpu(const BwdParams& params);

// delta = rowsum(dout * out), (b, h, s_q) contiguous in the accumulation type, summed in the
// order flash_bwd_cpu's dP sums (so dP - delta is exactly 0 where out is one value row).
void flash_delta_cpu(const BwdParams& params, void* delta);

// y = exp(x) for n floats (n > 0) through the active level's softmax exp (vec.h: exp_vecs;
// non_positive: the variant for x <= 0 or NaN). For tests.
void softmax_exp_cpu(const float* x, float* y, int64_t n, bool non_positive);

namespace cpu {

// The ISA level the CPU kernel uses ("baseline", "avx2", "avx512", "avx512bf16", "amx"), resolved
// at first use from cpuid or RINGSEQ_CPU_ISA; false with `error` set when RINGSEQ_CPU_ISA asks for a level this
// CPU or this build lacks (every kernel call then fails with that message).
bool isa_active(std::string* name, std::string* error);
// Comma-separated levels built into this extension / also runnable on this CPU (low to high).
std::string isa_built();
std::string isa_supported();
// The level `auto` picks: on this CPU (both null), or for a CPU of `vendor` (cpuid's string)
// whose highest level is `supported`. "" with `error` set for an unknown level name or a
// bad RINGSEQ_CPU_ISA_CEILING.
std::string isa_auto(const std::string* vendor, const std::string* supported, std::string* error);
// Forces a level for this process ("" resets: the next call resolves RINGSEQ_CPU_ISA again).
// For tests and benchmarks; thread-safe, but kernels already running keep their level.
bool isa_force(const std::string& request, std::string* error);
// Bytes of input rows a worker thread may keep packed per call (common.h: HeadRows; default
// 9 MiB); value >= 0 sets it for later calls, -1 only reads it. Returns the previous value.
// Results do not depend on it (the same data in the same order); for tests and benchmarks.
int64_t head_rows_bytes(int64_t value);

}  // namespace cpu
}  // namespace ringseq
