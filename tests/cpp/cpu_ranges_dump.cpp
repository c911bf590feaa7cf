// Dumps the CPU kernel section of csrc/kernel_math.h (element-exact causal ranges) as JSON for
// tests/test_cpu_causal_ranges.py, which checks them against a brute-force causal mask.
//
//   cpu_ranges_dump s_q s_k causal -> {"kv_end": [row_end = 0..s_q], "first_row": [key =
//   -2..s_k+1], "masked": [[row0, key_end, 0/1] for row0 in 0..s_q-1, key_end in 1..s_k]}
#include <cstdio>
#include <cstdlib>

#include "kernel_math.h"

namespace km = ringseq::km;

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  const long s_q = std::atol(argv[1]), s_k = std::atol(argv[2]);
  const bool causal = std::atoi(argv[3]) != 0;
  std::printf("{\"kv_end\": [");
  for (long r = 0; r <= s_q; ++r)
    std::printf("%s%ld", r ? ", " : "", static_cast<long>(km::causal_kv_end(r, s_q, s_k, causal)));
  std::printf("], \"first_row\": [");
  for (long j = -2; j <= s_k + 1; ++j)
    std::printf("%s%ld", j > -2 ? ", " : "", static_cast<long>(km::causal_first_row(j, s_q, s_k, causal)));
  std::printf("], \"masked\": [");
  bool first = true;
  for (long r = 0; r < s_q; ++r)
    for (long e = 1; e <= s_k; ++e) {
      std::printf("%s[%ld, %ld, %d]", first ? "" : ", ", r, e,
                  km::causal_block_masked(r, e, s_q, s_k, causal) ? 1 : 0);
      first = false;
    }
  std::printf("]}\n");
  return 0;
}
