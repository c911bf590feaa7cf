// Backward launcher for head dim 128, bf16; one file per instantiation so ninja builds them in parallel.
#include "flash_bwd_kernel.cuh"

namespace ringseq {
template void run_flash_bwd<128, __nv_bfloat16>(const BwdParams& params, cudaStream_t stream);
}  // namespace ringseq
