// Entry points of the CUDA kernels for the binding (csrc/ops.cpp). Torch-free: the binding
// has validated shapes, dtypes and devices and filled the params structs; these dispatch on
// (dtype, head dim) to the per-instantiation launchers of launch.h. Errors that only the
// kernel side can see (misaligned pointers or strides, launch failures) are thrown as
// std::invalid_argument / std::runtime_error, which torch reports as Python exceptions.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../attn_params.h"

// Declared without pulling in torch: c10::ScalarType is `enum class ScalarType : int8_t`.
namespace c10 {
enum class ScalarType : int8_t;
}

namespace ringseq {

void flash_fwd_cuda(const FwdParams& params, cudaStream_t stream);
// Floats of split scratch flash_fwd_cuda needs for `params` (0: the call does not split); a
// caller that passes FwdParams::split_scratch of that size keeps the allocation its own.
int64_t flash_fwd_cuda_split_floats(const FwdParams& params);
void flash_bwd_cuda(const BwdParams& params, cudaStream_t stream);

// Whether the CUDA kernels support `headdim` (64 or 128) and `dtype` (bf16/fp16) inputs.
bool cuda_supports(DType dtype, int64_t headdim);

// Raises a ValueError (TORCH_CHECK_VALUE) unless the device at `device_index` has compute
// capability >= 8.0 and the dtype/head dim are supported; the message names what is
// supported and backend="sdpa" as the fallback. Implemented torch-side (csrc/cuda_checks.cpp).
void check_cuda_support(int device_index, c10::ScalarType dtype, int64_t headdim);

}  // namespace ringseq
