// This level's entry points (one copy per ISA level; see csrc/cpu/isa.h).
#include "../isa.h"

#define RS_STR2(x) #x
#define RS_STR(x) RS_STR2(x)

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

void flash_fwd(const FwdParams& params);  // flash_fwd.cpp
void flash_bwd(const BwdParams& params);  // flash_bwd.cpp
void flash_delta(const BwdParams& params, void* delta);  // flash_bwd.cpp

const KernelTable* kernel_table() {
  static const KernelTable table{RS_STR(RINGSEQ_CPU_ISA_NS), &flash_fwd, &flash_bwd, &flash_delta};
  return &table;
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
