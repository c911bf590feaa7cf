// Launchers of the CUDA kernels, one explicit instantiation per (head dim, element type) in
// its own .cu file so ninja compiles them in parallel:
//   flash_fwd_hdim{64,128}_{bf16,fp16}.cu define run_flash_fwd,
//   flash_bwd_hdim{64,128}_{bf16,fp16}.cu define run_flash_bwd.
// Element is __nv_bfloat16 or __half. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../attn_params.h"

namespace ringseq {

template <int kHeadDim, typename Element>
void run_flash_fwd(const FwdParams& params, cudaStream_t stream);

template <int kHeadDim, typename Element>
void run_flash_bwd(const BwdParams& params, cudaStream_t stream);

// Throws std::runtime_error naming `what` when a CUDA runtime call or launch failed.
void check_cuda(cudaError_t err, const char* what);

}  // namespace ringseq
