// Forward kernels for head dim 64, fp16: both tile configurations (see km::fwd_block_m/n).
#include "flash_fwd_kernel.cuh"

namespace ringseq {
template void run_flash_fwd<64, __half>(const FwdParams&, cudaStream_t);
}  // namespace ringseq
