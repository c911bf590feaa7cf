// This level's entry points (one copy per ISA level; see csrc/cpu/isa.h).
#include "../isa.h"
#include "../vec.h"

#define RS_STR2(x) #x
#define RS_STR(x) RS_STR2(x)

namespace ringseq {
namespace cpu {
namespace RINGSEQ_CPU_ISA_NS {

void flash_fwd(const FwdParams& params);  // flash_fwd.cpp
void flash_bwd(const BwdParams& params);  // flash_bwd.cpp
void flash_delta(const BwdParams& params, void* delta);  // flash_bwd.cpp

// KernelTable::exp: whole groups of four vectors through exp_vecs, the last one zero-padded.
void exp_floats(const float* x, float* y, int64_t n, bool non_positive) {
  constexpr int64_t kGroup = 4 * kVW<float>;
  for (int64_t i = 0; i < n; i += kGroup) {
    const int64_t m = n - i < kGroup ? n - i : kGroup;
    alignas(64) float buf[kGroup] = {};
    std::memcpy(buf, x + i, static_cast<size_t>(m) * sizeof(float));
    vec_t<float> v[4];
    for (int j = 0; j < 4; ++j) v[j] = vload(buf + j * kVW<float>);
    if (non_positive) {
      exp_vecs<4, /*kNonPositive=*/true>(v);
    } else {
      exp_vecs<4>(v);
    }
    for (int j = 0; j < 4; ++j) vstore(buf + j * kVW<float>, v[j]);
    std::memcpy(y + i, buf, static_cast<size_t>(m) * sizeof(float));
  }
}

const KernelTable* kernel_table() {
  static const KernelTable table{RS_STR(RINGSEQ_CPU_ISA_NS), &flash_fwd, &flash_bwd, &flash_delta,
                                 &exp_floats};
  return &table;
}

}  // namespace RINGSEQ_CPU_ISA_NS
}  // namespace cpu
}  // namespace ringseq
