// Backward launcher for head dim 64, fp16; one file per instantiation so ninja builds them in parallel.
#include "flash_bwd_kernel.cuh"

namespace ringseq {
template void run_flash_bwd<64, __half>(const BwdParams& params, cudaStream_t stream);
}  // namespace ringseq
