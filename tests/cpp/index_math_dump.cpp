// The one C++ harness of csrc/kernel_math.h: dumps the helpers' values (as JSON, or lines for
// bwd_blocks) for the tests/test_index_math*.py and tests/test_cpu_causal_ranges.py checks,
// which compare them with the PTX ISA layouts and brute-force masks written independently in
// Python. Compiled once per test session (tests/conftest.py: index_math_harness).
//
//   index_math_dump static          -> swizzle, fragment, ldmatrix and tile tables
//   index_math_dump cases < lines   -> per line "s_q s_k block_m block_n causal": block ranges
//   index_math_dump mask s_q s_k causal pad -> key_visible for i < s_q + pad, j < s_k + pad
//   index_math_dump aligned < lines -> per line "addr stride_b stride_s stride_h size_b size_s
//                                      size_h": rows_aligned (the CUDA binding's stride check)
//   index_math_dump band32|band64 < lines -> per line "q_len k_len block_m block_n lo hi" (raw
//                                      int64 bands): the band helpers instantiated for int (the
//                                      CUDA kernels) or int64_t (the CPU kernels)
//   index_math_dump cpu_ranges s_q s_k causal -> the CPU kernels' element-exact causal ranges:
//                                      {"kv_end": [row_end = 0..s_q], "first_row": [key =
//                                      -2..s_k+1], "masked": [[row0, key_end, 0/1] ...]}
//   index_math_dump bwd_blocks      -> lines "F|N|M|S ..." of the backward's block ranges and
//                                      swizzle steps over a grid of tiles and lengths
//   index_math_dump kvcache32|kvcache64 < lines -> per line "q_len leftpad seqlen causal left
//                                      right heads_as_rows": kvcache_span as "k_start k_len lo hi"
//   index_math_dump splits < lines  -> per line "requested q_tiles items key_tiles target
//                                      min_tiles max": kv_splits, then split_blocks of
//                                      [0, key_tiles) for each split, as "s begin end" pairs
#include <cstdint>
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

// The band helpers for one span, instantiated for index type I. The raw bounds are clamped in
// 64 bits first (band_clamp, as the binding does) and then narrowed, like the CUDA binding.
template <typename I>
void dump_band_case(int64_t q_len64, int64_t k_len64, int64_t bm64, int64_t bn64, int64_t lo_raw,
                    int64_t hi_raw, bool first) {
  const int64_t lo64 = km::band_clamp<int64_t>(lo_raw, q_len64, k_len64);
  const int64_t hi64 = km::band_clamp<int64_t>(hi_raw, q_len64, k_len64);
  const I q_len = I(q_len64), k_len = I(k_len64), bm = I(bm64), bn = I(bn64), lo = I(lo64), hi = I(hi64);
  const I m_blocks = (q_len + bm - 1) / bm, n_blocks = (k_len + bn - 1) / bn;
  std::printf("%s{\"q_len\": %lld, \"k_len\": %lld, \"block_m\": %lld, \"block_n\": %lld, "
              "\"lo_raw\": %lld, \"hi_raw\": %lld, \"lo\": %lld, \"hi\": %lld,\n",
              first ? "" : ",\n", (long long)q_len, (long long)k_len, (long long)bm, (long long)bn,
              (long long)lo_raw, (long long)hi_raw, (long long)lo, (long long)hi);
  // The element mask, for spans small enough to check element by element.
  std::printf(" \"visible\": [");
  for (I i = 0; i < q_len && int64_t(q_len) * (k_len + 3) <= (int64_t(1) << 20); ++i) {
    std::printf("%s\"", i ? ", " : "");
    for (I j = 0; j < k_len + 3; ++j) std::printf("%c", km::band_visible(i, j, k_len, lo, hi) ? '1' : '0');
    std::printf("\"");
  }
  auto pr = [](const km::Range<I>& r) { std::printf("[%lld, %lld]", (long long)r.begin, (long long)r.end); };
  std::printf("],\n \"kv_blocks\": [");
  for (I m = 0; m < m_blocks; ++m) {
    std::printf("%s", m ? ", " : "");
    pr(km::band_kv_blocks(m, bm, bn, q_len, k_len, lo, hi));
  }
  std::printf("],\n \"unmasked\": [");
  for (I m = 0; m < m_blocks; ++m) {
    std::printf("%s", m ? ", " : "");
    pr(km::band_unmasked_kv_blocks(m, bm, bn, q_len, k_len, lo, hi));
  }
  std::printf("],\n \"needs_mask\": [");
  for (I m = 0; m < m_blocks; ++m) {
    std::printf("%s\"", m ? ", " : "");
    for (I n = 0; n < n_blocks; ++n)
      std::printf("%c", km::band_block_needs_mask(m, n, bm, bn, q_len, k_len, lo, hi) ? '1' : '0');
    std::printf("\"");
  }
  std::printf("],\n \"q_blocks\": [");
  for (I n = 0; n < n_blocks; ++n) {
    std::printf("%s", n ? ", " : "");
    pr(km::band_q_blocks(n, bm, bn, q_len, k_len, lo, hi));
  }
  // Element-exact forms (the CPU kernels): the key range of each row tile and, walking it in
  // steps of block_n from its first key, whether each step's block is full; the row range of
  // each key tile.
  std::printf("],\n \"key_range\": [");
  for (I m = 0; m < m_blocks; ++m) {
    const I r0 = m * bm, r1 = km::min_of((m + 1) * bm, q_len);
    const km::Range<I> keys = km::band_key_range(r0, r1, k_len, lo, hi);
    std::printf("%s[%lld, %lld, \"", m ? ", " : "", (long long)keys.begin, (long long)keys.end);
    for (I c0 = keys.begin; c0 < keys.end; c0 += bn)
      std::printf("%c", km::band_block_full(r0, r1, c0, km::min_of(c0 + bn, keys.end), k_len, lo, hi) ? '1' : '0');
    std::printf("\"]");
  }
  std::printf("],\n \"row_range\": [");
  for (I n = 0; n < n_blocks; ++n) {
    std::printf("%s", n ? ", " : "");
    pr(km::band_row_range(n * bn, km::min_of((n + 1) * bn, k_len), q_len, k_len, lo, hi));
  }
  std::printf("]}");
}

void dump_band(bool wide) {
  long long sq, sk, bm, bn, lo, hi;
  std::printf("[");
  bool first = true;
  while (std::scanf("%lld %lld %lld %lld %lld %lld", &sq, &sk, &bm, &bn, &lo, &hi) == 6) {
    if (wide) dump_band_case<int64_t>(sq, sk, bm, bn, lo, hi, first);
    else dump_band_case<int>(sq, sk, bm, bn, lo, hi, first);
    first = false;
  }
  std::printf("]\n");
}

void dump_cpu_ranges(long s_q, long s_k, bool causal) {
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
}

// F: first q block of kv block n; N: kv blocks of q block m; M: block (m, n) needs the mask;
// S: the swizzle step equals the swizzle of the moved address (1).
void dump_bwd_blocks() {
  const int sizes[] = {16, 64, 128};
  const int lens[] = {1, 7, 63, 64, 65, 100, 128, 129, 200};
  for (int bm : sizes) for (int bn : sizes) for (int sq : lens) for (int sk : lens) for (int c = 0; c < 2; ++c) {
    for (int n = 0; n < km::ceil_div(sk, bn); ++n)
      std::printf("F %d %d %d %d %d %d %d\n", n, bm, bn, sq, sk, c, km::bwd_first_q_block(n, bm, bn, sq, sk, c));
    for (int m = 0; m < km::ceil_div(sq, bm); ++m) {
      std::printf("N %d %d %d %d %d %d %d\n", m, bm, bn, sq, sk, c, km::fwd_num_kv_blocks(m, bm, bn, sq, sk, c));
      for (int n = 0; n < km::ceil_div(sk, bn); ++n)
        std::printf("M %d %d %d %d %d %d %d %d\n", m, n, bm, bn, sq, sk, c,
                    static_cast<int>(km::block_needs_mask(m, n, bm, bn, sq, sk, c)));
    }
  }
  for (int re : {64, 128}) for (int r = 0; r < 16; ++r) for (int col : {0, 8})
    for (int row0 = 0; row0 < 128; row0 += 8) for (int k = 0; k < re / 16; ++k)
      std::printf("S %d %d %d %d %d %d\n", re, r, col, row0, k,
                  km::swz_step(km::swz_offset(r, col, re), row0, k, re) == km::swz_offset(row0 + r, col + 16 * k, re));
}

template <typename I>
void dump_kvcache() {
  long long q_len, leftpad, seqlen, causal, left, right, rows;
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld", &q_len, &leftpad, &seqlen, &causal, &left,
                    &right, &rows) == 7) {
    const km::KvSpan<I> s = km::kvcache_span<I>(I(q_len), I(leftpad), I(seqlen), causal != 0, I(left),
                                                I(right), rows != 0);
    std::printf("%lld %lld %lld %lld\n", (long long)s.k_start, (long long)s.k_len, (long long)s.lo,
                (long long)s.hi);
  }
}

void dump_splits() {
  long long req, q_tiles, items, key_tiles, target, min_tiles, most;
  while (std::scanf("%lld %lld %lld %lld %lld %lld %lld", &req, &q_tiles, &items, &key_tiles, &target,
                    &min_tiles, &most) == 7) {
    const int64_t n = km::kv_splits<int64_t>(req, q_tiles, items, key_tiles, target, min_tiles, most);
    std::printf("%lld", (long long)n);
    for (int64_t s = 0; s < n; ++s) {
      const km::Range<int64_t> r = km::split_blocks<int64_t>({0, key_tiles}, s, n);
      std::printf(" %lld %lld", (long long)r.begin, (long long)r.end);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "static") == 0) {
    dump_static();
  } else if (argc >= 2 && std::strcmp(argv[1], "cases") == 0) {
    dump_cases();
  } else if (argc >= 2 && (std::strcmp(argv[1], "band32") == 0 || std::strcmp(argv[1], "band64") == 0)) {
    dump_band(std::strcmp(argv[1], "band64") == 0);
  } else if (argc >= 2 && std::strcmp(argv[1], "aligned") == 0) {
    dump_aligned();
  } else if (argc == 6 && std::strcmp(argv[1], "mask") == 0) {
    dump_mask(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]) != 0, std::atoi(argv[5]));
  } else if (argc == 5 && std::strcmp(argv[1], "cpu_ranges") == 0) {
    dump_cpu_ranges(std::atol(argv[2]), std::atol(argv[3]), std::atoi(argv[4]) != 0);
  } else if (argc >= 2 && std::strcmp(argv[1], "kvcache32") == 0) {
    dump_kvcache<int>();
  } else if (argc >= 2 && std::strcmp(argv[1], "kvcache64") == 0) {
    dump_kvcache<int64_t>();
  } else if (argc >= 2 && std::strcmp(argv[1], "splits") == 0) {
    dump_splits();
  } else if (argc >= 2 && std::strcmp(argv[1], "bwd_blocks") == 0) {
    dump_bwd_blocks();
  } else {
    std::fprintf(stderr, "usage: %s static | cases | aligned | band32 | band64 | bwd_blocks | "
                 "kvcache32 | kvcache64 | splits | mask s_q s_k causal pad | cpu_ranges s_q s_k causal\n", argv[0]);
    return 2;
  }
  return 0;
}
