// Torch-side support check for the CUDA kernels (declared in cuda/flash_api.h). Compiled in
// every build (setup.py globs csrc/*.cpp) but empty unless the CUDA kernels are built.
#ifdef RINGSEQ_WITH_CUDA

#include <c10/core/ScalarType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "cuda/flash_api.h"

namespace ringseq {

// Compute capability through the runtime API rather than at::cuda::getDeviceProperties: its
// header (ATen/cuda/CUDAContext.h) needs cuBLAS/cuSPARSE headers that minimal toolkits lack.
void check_cuda_support(int device_index, c10::ScalarType dtype, int64_t headdim) {
  TORCH_CHECK_VALUE(dtype == c10::ScalarType::BFloat16 || dtype == c10::ScalarType::Half,
                    "the ringseq CUDA kernel supports bfloat16 and float16 inputs, got ", dtype,
                    "; cast q/k/v to torch.bfloat16 or torch.float16, or pass backend=\"sdpa\"");
  TORCH_CHECK_VALUE(headdim == 64 || headdim == 128,
                    "the ringseq CUDA kernel supports head dims 64 and 128, got headdim=", headdim,
                    "; pass backend=\"sdpa\" for other head dims");
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index));
  TORCH_CHECK_VALUE(major >= 8,
                    "the ringseq CUDA kernel needs compute capability >= 8.0 (sm_80, sm_90), but "
                    "cuda:", device_index, " is sm_", major, minor, "; pass backend=\"sdpa\"");
}

}  // namespace ringseq

#endif  // RINGSEQ_WITH_CUDA
