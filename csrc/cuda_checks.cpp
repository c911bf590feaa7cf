// Torch-side support check for the CUDA kernels (declared in cuda/flash_api.h). Compiled in
// every build (setup.py globs csrc/*.cpp) but empty unless the CUDA kernels are built.
#ifdef RINGSEQ_WITH_CUDA

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include "cuda/flash_api.h"

namespace ringseq {

void check_cuda_support(int device_index, c10::ScalarType dtype, int64_t headdim) {
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf,
                    "the ringseq CUDA kernel supports bfloat16 and float16 inputs, got ", dtype,
                    "; cast q/k/v to torch.bfloat16 or torch.float16, or pass backend=\"sdpa\"");
  TORCH_CHECK_VALUE(headdim == 64 || headdim == 128,
                    "the ringseq CUDA kernel supports head dims 64 and 128, got headdim=", headdim,
                    "; pass backend=\"sdpa\" for other head dims");
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device_index);
  TORCH_CHECK_VALUE(prop->major >= 8,
                    "the ringseq CUDA kernel needs compute capability >= 8.0 (sm_80, sm_90), but "
                    "cuda:", device_index, " (", prop->name, ") is sm_", prop->major, prop->minor,
                    "; pass backend=\"sdpa\"");
}

}  // namespace ringseq

#endif  // RINGSEQ_WITH_CUDA
