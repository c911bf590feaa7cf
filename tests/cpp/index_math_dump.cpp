// Dumps the index math of csrc/kernel_math.h (the functions the CUDA kernels call) as JSON
// for tests/test_index_math.py, which checks it against the PTX ISA layouts and a reference
// causal mask written independently in Python.
//
//   index_math_dump static          -> swizzle, fragment, ldmatrix and tile tables
//   index_math_dump cases < lines   -> per line "s_q s_k block_m block_n causal": block ranges
//   index_math_dump mask s_q s_k causal pad -> key_visible for i < s_q + pad, j < s_k + pad
//   index_math_dump aligned < lines -> per line "addr stride_b stride_s stride_h size_b size_s
//                                      size_h": rows_aligned (the CUDA binding's stride check)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernel_math.h"

namespace km = ringseq::km;

namespace {

void list(const char* key, int n, int (*fn)(int), bool last = false) {
  std::printf("\"%s\": [", key);
  for (int i = 0; i < n; ++i) std::printf("%s%d", i ? ", " : "", fn(i));
  std::printf("]%s\n", last ? "" : ",");
}

// table[lane][i] of a (lane, i) -> int map
void table(const char* key, int n_i, int (*fn)(int, int), bool last = false) {
  std::printf("\"%s\": [", key);
  for (int lane = 0; lane < 32; ++lane) {
    std::printf("%s[", lane ? ", " : "");
    for (int i = 0; i < n_i; ++i) std::printf("%s%d", i ? ", " : "", fn(lane, i));
    std::printf("]");
  }
  std::printf("]%s\n", last ? "" : ",");
}

void dump_static() {
  std::printf("{\n");
  // swizzle: offsets of every (row, col) for rows 0..31 of d=64 and d=128 tiles
  for (int d : {64, 128}) {
    std::printf("\"swz_offset_%d\": [", d);
    for (int r = 0; r < 32; ++r) {
      std::printf("%s[", r ? ", " : "");
      for (int c = 0; c < d; ++c) std::printf("%s%d", c ? ", " : "", km::swz_offset(r, c, d));
      std::printf("]");
    }
    std::printf("],\n");
    // The kernels' ldmatrix addresses: per-lane base (A or B order) advanced by 16-row and
    // 16-column steps, exactly as flash_fwd_kernel.cuh computes them.
    for (int order = 0; order < 2; ++order) {
      std::printf("\"ldsm_offsets_%s_%d\": [", order == 0 ? "a" : "b", d);
      for (int lane = 0; lane < 32; ++lane) {
        const int base = order == 0 ? km::swz_offset(km::ldsm_a_row(lane), km::ldsm_a_col(lane), d)
                                    : km::swz_offset(km::ldsm_b_row(lane), km::ldsm_b_col(lane), d);
        std::printf("%s[", lane ? ", " : "");
        for (int rs = 0; rs < 8; ++rs) {
          std::printf("%s[", rs ? ", " : "");
          for (int cs = 0; cs < d / 16; ++cs) {
            std::printf("%s%d", cs ? ", " : "", km::swz_advance(base, 16 * rs, 16 * cs, d));
          }
          std::printf("]");
        }
        std::printf("]");
      }
      std::printf("],\n");
    }
  }
  table("a_row", 8, km::mma_a_row);
  table("a_col", 8, km::mma_a_col);
  table("b_k", 4, km::mma_b_k);
  table("b_n", 4, km::mma_b_n);
  table("c_row", 4, km::mma_c_row);
  table("c_col", 4, km::mma_c_col);
  list("c_to_a_tile", 8, km::c_to_a_tile);
  list("c_to_a_reg", 8, km::c_to_a_reg);
  list("ldsm_src_matrix", 32, km::ldsm_src_matrix);
  list("ldsm_src_row", 32, km::ldsm_src_row);
  table("ldsm_dst_row", 2, km::ldsm_dst_row);
  table("ldsm_dst_col", 2, km::ldsm_dst_col);
  table("ldsm_trans_dst_row", 2, km::ldsm_trans_dst_row);
  table("ldsm_trans_dst_col", 2, km::ldsm_trans_dst_col);
  list("ldsm_a_row", 32, km::ldsm_a_row);
  list("ldsm_a_col", 32, km::ldsm_a_col);
  list("ldsm_b_row", 32, km::ldsm_b_row);
  list("ldsm_b_col", 32, km::ldsm_b_col);
  std::printf("\"fwd_tiles\": [");
  bool first = true;
  for (int d : {64, 128}) {
    for (int cfg = 0; cfg < km::kNumFwdConfigs; ++cfg) {
      std::printf("%s{\"headdim\": %d, \"config\": %d, \"block_m\": %d, \"block_n\": %d, \"smem\": %d, "
                  "\"dynamic\": %s}",
                  first ? "" : ", ", d, cfg, km::fwd_block_m(d, cfg), km::fwd_block_n(d, cfg),
                  km::fwd_smem_bytes(d, cfg), km::fwd_smem_dynamic(d, cfg) ? "true" : "false");
      first = false;
    }
  }
  std::printf("],\n\"fwd_threads\": %d,\n\"max_static_smem\": %d\n}\n", km::kFwdThreads,
              km::kMaxStaticSmemBytes);
}

void dump_cases() {
  int sq, sk, bm, bn, causal_i;
  std::printf("[");
  bool first = true;
  while (std::scanf("%d %d %d %d %d", &sq, &sk, &bm, &bn, &causal_i) == 5) {
    const bool causal = causal_i != 0;
    const int m_blocks = km::ceil_div(sq, bm);
    const int n_blocks = km::ceil_div(sk, bn);
    std::printf("%s{\"s_q\": %d, \"s_k\": %d, \"block_m\": %d, \"block_n\": %d, \"causal\": %s,\n",
                first ? "" : ",\n", sq, sk, bm, bn, causal ? "true" : "false");
    first = false;
    std::printf(" \"num_kv\": [");
    for (int m = 0; m < m_blocks; ++m)
      std::printf("%s%d", m ? ", " : "", km::fwd_num_kv_blocks(m, bm, bn, sq, sk, causal));
    std::printf("],\n \"unmasked\": [");
    for (int m = 0; m < m_blocks; ++m)
      std::printf("%s%d", m ? ", " : "", km::fwd_num_unmasked_kv_blocks(m, bm, bn, sq, sk, causal));
    std::printf("],\n \"needs_mask\": [");
    for (int m = 0; m < m_blocks; ++m) {
      std::printf("%s\"", m ? ", " : "");
      for (int n = 0; n < n_blocks; ++n)
        std::printf("%c", km::block_needs_mask(m, n, bm, bn, sq, sk, causal) ? '1' : '0');
      std::printf("\"");
    }
    std::printf("],\n \"first_q\": [");
    for (int n = 0; n < n_blocks; ++n)
      std::printf("%s%d", n ? ", " : "", km::bwd_first_q_block(n, bm, bn, sq, sk, causal));
    std::printf("]}");
  }
  std::printf("]\n");
}

void dump_mask(int sq, int sk, bool causal, int pad) {
  std::printf("{\"key_visible\": [");
  for (int i = 0; i < sq + pad; ++i) {
    std::printf("%s\"", i ? ", " : "");
    for (int j = 0; j < sk + pad; ++j) std::printf("%c", km::key_visible(i, j, sq, sk, causal) ? '1' : '0');
    std::printf("\"");
  }
  std::printf("],\n\"element_visible\": [");
  for (int i = 0; i < sq + pad; ++i) {
    std::printf("%s\"", i ? ", " : "");
    for (int j = 0; j < sk + pad; ++j) std::printf("%c", km::element_visible(i, j, sq, sk, causal) ? '1' : '0');
    std::printf("\"");
  }
  std::printf("]}\n");
}

void dump_aligned() {
  unsigned long long addr;
  long long sb, ss, sh, nb, ns, nh;
  std::printf("[");
  bool first = true;
  while (std::scanf("%llu %lld %lld %lld %lld %lld %lld", &addr, &sb, &ss, &sh, &nb, &ns, &nh) == 7) {
    std::printf("%s%d", first ? "" : ", ", km::rows_aligned(addr, sb, ss, sh, nb, ns, nh) ? 1 : 0);
    first = false;
  }
  std::printf("]\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "static") == 0) {
    dump_static();
  } else if (argc >= 2 && std::strcmp(argv[1], "cases") == 0) {
    dump_cases();
  } else if (argc >= 2 && std::strcmp(argv[1], "aligned") == 0) {
    dump_aligned();
  } else if (argc == 6 && std::strcmp(argv[1], "mask") == 0) {
    dump_mask(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]) != 0, std::atoi(argv[5]));
  } else {
    std::fprintf(stderr, "usage: %s static | cases | aligned | mask s_q s_k causal pad\n", argv[0]);
    return 2;
  }
  return 0;
}
