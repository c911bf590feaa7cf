// Forward kernels for head dim 128, bf16: both tile configurations (see km::fwd_block_m/n).
#include "flash_fwd_kernel.cuh"

namespace ringseq {
template void run_flash_fwd<128, __nv_bfloat16>(const FwdParams&, cudaStream_t);
}  // namespace ringseq
