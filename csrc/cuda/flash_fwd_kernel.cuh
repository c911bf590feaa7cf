// Forward flash-attention kernel (FlashAttention-2 design) in plain CUDA.
//
// One CTA = 4 warps computes a kBlockM-row tile of one (batch, head). Each warp owns
// kMTiles = kBlockM / 64 consecutive m16 row slabs, so the online softmax needs only quad
// shuffles and warps never exchange statistics. K/V tiles of kBlockN keys are walked from the
// last visible block down to the first ("newest first"): with causal masking the diagonal and
// ragged blocks, the only ones that need the per-element predicate, come first.
//
// Spans and bands (docs/kernels.md): a CTA computes one q tile of one span and walks only the
// kv blocks its band reaches (km::band_kv_blocks), masking per element only the blocks that
// straddle a band edge or the ragged tail (outside km::band_unmasked_kv_blocks).
//
// Per kv block: S = Q K^T (ldmatrix + mma.sync m16n8k16, float32 accumulators), the optional
// soft-cap (kSoftcap: S = tanh(S * scale / softcap), the softmax then runs with scale softcap,
// as flash-attn does), optional mask, online softmax in base 2 (log2(e) folded into the scale), O = alpha O + P V with P
// converted in registers from the C layout straight into the A layout. V_j is fetched with
// cp.async while S is computed and K_{j-1} while P V runs, so one K and one V buffer suffice.
// All shared tiles are XOR-swizzled through km::swz_offset. Tile choices and what they cost:
// km::fwd_block_m / fwd_block_n and docs/kernels.md.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>

#include "launch.h"
#include "primitives.cuh"

namespace ringseq {
namespace fwd {

template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_>
struct Traits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = km::kFwdWarps;
  static constexpr int kThreads = km::kFwdThreads;
  static constexpr int kMTiles = kBlockM / (16 * kWarps);  // m16 slabs per warp
  static constexpr int kNTiles = kBlockN / 8;              // n8 tiles of S
  static constexpr int kDTiles = kHeadDim / 8;             // n8 tiles of O
  static constexpr int kQkSteps = kHeadDim / 16;           // k16 steps of Q K^T
  static constexpr int kPvSteps = kBlockN / 16;            // k16 steps of P V
  // Q fragments stay in registers when they cost at most 32 registers; otherwise they are
  // re-read from shared memory each block (the accumulators need the room).
  static constexpr bool kQInRegs = kMTiles * kQkSteps * 4 <= 32;
  // m16 slabs whose S is computed together. All of them, so each K fragment read from shared
  // memory feeds every slab, unless S and O of all slabs would not fit next to each other in
  // 255 registers (d=128 with 64-key blocks: 64 + 128 floats): then one slab at a time, K is
  // read once per slab, and only one slab's S is ever live.
  static constexpr int kSTiles = kMTiles * (kNTiles + kDTiles) * 4 <= 160 ? kMTiles : 1;
  static constexpr int kSmemBytes = km::fwd_tile_smem_bytes(kBlockM, kBlockN, kHeadDim);
  // Static shared memory where it fits (ptxas then reports it, so the compile gate shows each
  // kernel's whole budget); larger tiles take dynamic shared memory with an opt-in.
  static constexpr bool kDynamicSmem = kSmemBytes > km::kMaxStaticSmemBytes;

  static_assert(kHeadDim % 64 == 0, "head dim must be a multiple of 64 (swizzled rows)");
  static_assert(kBlockM % (16 * kWarps) == 0, "kBlockM must be a multiple of 64");
  static_assert(kBlockN % 16 == 0, "kBlockN must be a multiple of 16");
  static_assert(sizeof(Element) == 2, "16-bit elements only");
  // sm_86/sm_89 let a block opt in to 99 KB at most; the forward must run on every sm_8x.
  static_assert(kSmemBytes <= 99 * 1024, "forward tile needs more shared memory than sm_86 has");
};

// The CTA's shared memory: a static array, or the dynamic allocation the launch sized.
template <typename T>
__device__ __forceinline__ unsigned char* cta_smem() {
  if constexpr (T::kDynamicSmem) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    return smem_raw;
  } else {
    __shared__ __align__(128) unsigned char smem_raw[T::kSmemBytes];
    return smem_raw;
  }
}

// The kernel body; flash_fwd_kernel (the dense path), flash_fwd_spans_kernel (spans and/or
// soft-cap) and flash_fwd_split_kernel (KV-cache calls and key splits) below are its
// instantiations (see run_flash_fwd).
//
// kSplit: blockIdx.x = q tile rank * num_splits + split. The span comes from the KV-cache
// arrays of batch row blockIdx.z (prim::load_kvcache_tile), K/V from its cache row, and the
// CTA walks only split `split` of its tile's kv blocks (km::split_blocks). With more than one
// split it writes its normalized rows and their lse in float32 to FwdParams::split_scratch
// ([split][batch][head][row][d], then [split][batch][head][row]); flash_fwd_combine_kernel
// merges them.
template <typename T, bool kSpans, bool kSoftcap, bool kSplit = false>
__device__ __forceinline__ void flash_fwd_body(const FwdParams& p) {
  using Element = typename T::Element;
  constexpr int kHeadDim = T::kHeadDim;
  constexpr int kBlockM = T::kBlockM;
  constexpr int kBlockN = T::kBlockN;
  constexpr int kThreads = T::kThreads;
  constexpr int kMTiles = T::kMTiles;

  Element* sQ = reinterpret_cast<Element*>(cta_smem<T>());
  Element* sK = sQ + kBlockM * kHeadDim;
  Element* sV = sK + kBlockN * kHeadDim;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  // The span and its q tile (prim::load_span_tile); the heaviest causal tiles (largest m) are
  // launched first so the tail of the grid is short. Rows and keys below are span-local.
  const int n_splits = kSplit ? p.num_splits : 1;
  const int split = kSplit ? static_cast<int>(blockIdx.x) % n_splits : 0;
  prim::SpanTile sp;
  int batch_kv = blockIdx.z;  // the K/V batch row (a KV-cache call's cache row)
  bool bad = false;           // KV-cache values out of range: NaN rows
  if constexpr (kSplit) {
    const prim::KvTile kt = prim::load_kvcache_tile(p, kBlockM, static_cast<int>(blockIdx.x) / n_splits);
    sp = kt.t;
    batch_kv = kt.batch_kv;
    bad = kt.bad;
  } else {
    sp = prim::load_span_tile<kSpans>(p.spans, p.shape, kBlockM, true, true);
  }
  if (!sp.valid) return;
  const int m_block = sp.block;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int k_len = sp.k_len;
  const int head_kv = head / static_cast<int>(p.shape.nheads / p.shape.nheads_kv);
  const int m0 = m_block * kBlockM;

  const Element* gQ = static_cast<const Element*>(p.q) + batch * p.q_strides.batch +
                      head * p.q_strides.head + int64_t(sp.q_start + m0) * p.q_strides.row;
  const Element* gK = static_cast<const Element*>(p.k) + batch_kv * p.k_strides.batch +
                      head_kv * p.k_strides.head + int64_t(sp.k_start) * p.k_strides.row;
  const Element* gV = static_cast<const Element*>(p.v) + batch_kv * p.v_strides.batch +
                      head_kv * p.v_strides.head + int64_t(sp.k_start) * p.v_strides.row;
  Element* gO = static_cast<Element*>(p.out) + batch * p.out_strides.batch +
                head * p.out_strides.head + int64_t(sp.q_start + m0) * p.out_strides.row;
  float* gLse = static_cast<float*>(p.lse) + batch * p.lse_strides.batch +
                head * p.lse_strides.head + sp.q_start + m0;
  const int rows_q = sp.q_len - m0;  // valid rows of this tile (may exceed kBlockM)
  // A split of several writes its partial rows to the scratch, see above.
  const bool to_parts = kSplit && n_splits > 1;
  const int64_t part_row0 = ((int64_t(split) * p.shape.batch + batch) * p.shape.nheads + head) *
                                p.shape.seqlen_q + sp.q_start + m0;
  float* gPartO = kSplit ? p.split_scratch + part_row0 * kHeadDim : nullptr;
  float* gPartLse = kSplit ? p.split_scratch + n_splits * p.shape.batch * p.shape.nheads *
                                                   p.shape.seqlen_q * kHeadDim + part_row0
                           : nullptr;

  km::Range<int> kv = km::band_kv_blocks(m_block, kBlockM, kBlockN, sp.q_len, k_len, sp.lo, sp.hi);
  if constexpr (kSplit) kv = km::split_blocks(kv, split, n_splits);
  if (kv.empty() || bad) {
    // No row of this tile (split) sees a key (e.g. causal with seqlen_q > seqlen_k, a shifted
    // band, a split past the keys): out = 0, lse = -inf; NaN for a KV-cache row out of range.
    if (to_parts) {  // the merge skips a part with lse = -inf; its rows stay unwritten
      for (int row = tid; row < kBlockM; row += kThreads) {
        if (row < rows_q) gPartLse[row] = bad ? NAN : -INFINITY;
      }
      return;
    }
    const uint32_t fill = bad ? prim::pack2<Element>(NAN, NAN) : 0u;
    constexpr int kChunksPerRow = kHeadDim / km::kChunkElems;
#pragma unroll
    for (int it = 0; it < kBlockM * kChunksPerRow / kThreads; ++it) {
      const int row = tid / kChunksPerRow + it * (kThreads / kChunksPerRow);
      if (row < rows_q) {
        *reinterpret_cast<uint4*>(gO + row * p.out_strides.row +
                                  (tid % kChunksPerRow) * km::kChunkElems) = make_uint4(fill, fill, fill, fill);
      }
    }
    for (int row = tid; row < kBlockM; row += kThreads) {
      if (row < rows_q) gLse[row] = bad ? NAN : -INFINITY;
    }
    return;
  }
  // kv blocks outside [unmasked.begin, unmasked.end) straddle a band edge or the ragged tail.
  const km::Range<int> unmasked =
      km::band_unmasked_kv_blocks(m_block, kBlockM, kBlockN, sp.q_len, k_len, sp.lo, sp.hi);

  prim::copy_tile_g2s_async<kBlockM, kHeadDim, kThreads>(sQ, gQ, p.q_strides.row, rows_q, tid);
  prim::cp_async_commit();
  {
    const int n = kv.end - 1;
    prim::copy_tile_g2s_async<kBlockN, kHeadDim, kThreads>(
        sK, gK + int64_t(n) * kBlockN * p.k_strides.row, p.k_strides.row, k_len - n * kBlockN, tid);
    prim::cp_async_commit();
  }

  const uint32_t sQ_addr = prim::smem_addr(sQ);
  const uint32_t sK_addr = prim::smem_addr(sK);
  const uint32_t sV_addr = prim::smem_addr(sV);
  const int warp_row0 = warp * 16 * kMTiles;  // first tile row of this warp
  // Per-lane element offsets of the first ldmatrix of each operand; the others are
  // km::swz_advance steps (multiples of 16 rows / 16 columns) from these.
  const int q_off = km::swz_offset(warp_row0 + km::ldsm_a_row(lane), km::ldsm_a_col(lane), kHeadDim);
  const int k_off = km::swz_offset(km::ldsm_b_row(lane), km::ldsm_b_col(lane), kHeadDim);
  const int v_off = km::swz_offset(km::ldsm_a_row(lane), km::ldsm_a_col(lane), kHeadDim);

  float acc_o[kMTiles][T::kDTiles][4];
  float row_max[kMTiles][2];
  float row_sum[kMTiles][2];  // per-lane partial sums; reduced over the quad at the end
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < T::kDTiles; ++dt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_o[mt][dt][r] = 0.f;
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      row_max[mt][hf] = -INFINITY;
      row_sum[mt][hf] = 0.f;
    }
  }
  // With the soft-cap S holds tanh(scale * q.k / softcap) and the softmax's scale is softcap
  // (p.consts, read from the parameter bank).
  const float scale_log2 = p.consts.sm_scale_log2;

  prim::cp_async_wait<0>();
  __syncthreads();

  uint32_t q_frag[T::kQInRegs ? kMTiles : 1][T::kQInRegs ? T::kQkSteps : 1][4];
  if constexpr (T::kQInRegs) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int kk = 0; kk < T::kQkSteps; ++kk) {
        prim::ldmatrix_x4(q_frag[mt][kk], sQ_addr + 2u * km::swz_advance(q_off, mt * 16, kk * 16, kHeadDim));
      }
    }
  }

  for (int n = kv.end - 1; n >= kv.begin; --n) {
    // K_n is resident and every warp is done with the previous V: fetch V_n behind Q K^T.
    prim::copy_tile_g2s_async<kBlockN, kHeadDim, kThreads>(
        sV, gV + int64_t(n) * kBlockN * p.v_strides.row, p.v_strides.row, k_len - n * kBlockN, tid);
    prim::cp_async_commit();

    // S, its mask and softmax, and P for kSTiles m16 slabs at a time (see Traits::kSTiles).
    uint32_t p_frag[kMTiles][T::kPvSteps][4];
#pragma unroll
    for (int m_pass = 0; m_pass < kMTiles; m_pass += T::kSTiles) {
      float s[T::kSTiles][T::kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < T::kSTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < T::kNTiles; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) s[mt][nt][r] = 0.f;
        }
      }
#pragma unroll
      for (int kk = 0; kk < T::kQkSteps; ++kk) {
        uint32_t qa[T::kSTiles][4];
#pragma unroll
        for (int mt = 0; mt < T::kSTiles; ++mt) {
          if constexpr (T::kQInRegs) {
#pragma unroll
            for (int r = 0; r < 4; ++r) qa[mt][r] = q_frag[m_pass + mt][kk][r];
          } else {
            prim::ldmatrix_x4(qa[mt], sQ_addr + 2u * km::swz_advance(q_off, (m_pass + mt) * 16, kk * 16, kHeadDim));
          }
        }
#pragma unroll
        for (int np = 0; np < T::kNTiles / 2; ++np) {
          uint32_t kb[4];
          prim::ldmatrix_x4(kb, sK_addr + 2u * km::swz_advance(k_off, np * 16, kk * 16, kHeadDim));
#pragma unroll
          for (int mt = 0; mt < T::kSTiles; ++mt) {
            prim::mma_16816<Element>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
            prim::mma_16816<Element>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
          }
        }
      }

      if constexpr (kSoftcap) {
        // Before the mask: tanh would turn a masked -inf into a finite -1.
#pragma unroll
        for (int mt = 0; mt < T::kSTiles; ++mt) {
#pragma unroll
          for (int nt = 0; nt < T::kNTiles; ++nt) {
#pragma unroll
            for (int r = 0; r < 4; ++r) s[mt][nt][r] = prim::fast_tanh(s[mt][nt][r] * p.consts.cap_pre);
          }
        }
      }

      if (n < unmasked.begin || n >= unmasked.end) {  // band edge or ragged block
#pragma unroll
        for (int mt = 0; mt < T::kSTiles; ++mt) {
#pragma unroll
          for (int nt = 0; nt < T::kNTiles; ++nt) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              const int row = m0 + warp_row0 + (m_pass + mt) * 16 + km::mma_c_row(lane, r);
              const int col = n * kBlockN + nt * 8 + km::mma_c_col(lane, r);
              if (!km::band_visible(row, col, k_len, sp.lo, sp.hi)) s[mt][nt][r] = -INFINITY;
            }
          }
        }
      }

      // Online softmax. A row that has seen no key yet keeps max -inf; it is shifted by 0
      // instead, so exp2(-inf - shift) = 0 and alpha = 0 and no (-inf) - (-inf) appears.
#pragma unroll
      for (int mt = 0; mt < T::kSTiles; ++mt) {
        const int gm = m_pass + mt;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float mx = row_max[gm][hf];
#pragma unroll
          for (int nt = 0; nt < T::kNTiles; ++nt) {
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
          }
          mx = prim::quad_max(mx);
          const float shift = mx == -INFINITY ? 0.f : mx * scale_log2;
          const float alpha = prim::fast_exp2(row_max[gm][hf] * scale_log2 - shift);
          row_max[gm][hf] = mx;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < T::kNTiles; ++nt) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float e = prim::fast_exp2(fmaf(s[mt][nt][2 * hf + c], scale_log2, -shift));
              s[mt][nt][2 * hf + c] = e;
              sum += e;
            }
          }
          row_sum[gm][hf] = row_sum[gm][hf] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < T::kDTiles; ++dt) {
            acc_o[gm][dt][2 * hf] *= alpha;
            acc_o[gm][dt][2 * hf + 1] *= alpha;
          }
        }
      }

      // P leaves the float accumulators right away: the C fragments of n-tiles (2kk, 2kk+1)
      // are the A fragment of k-step kk, and packed P needs half the registers of S while
      // the next K copy is issued and P V runs.
#pragma unroll
      for (int mt = 0; mt < T::kSTiles; ++mt) prim::c_to_a<Element>(p_frag[m_pass + mt], s[mt]);
    }

    // V_n resident; every warp is done reading K_n: fetch K_{n-1} behind P V.
    prim::cp_async_wait<0>();
    __syncthreads();
    if (n > kv.begin) {
      prim::copy_tile_g2s_async<kBlockN, kHeadDim, kThreads>(
          sK, gK + int64_t(n - 1) * kBlockN * p.k_strides.row, p.k_strides.row,
          k_len - (n - 1) * kBlockN, tid);
      prim::cp_async_commit();
    }

#pragma unroll
    for (int kk = 0; kk < T::kPvSteps; ++kk) {
#pragma unroll
      for (int dp = 0; dp < T::kDTiles / 2; ++dp) {
        uint32_t vb[4];
        prim::ldmatrix_x4_trans(vb, sV_addr + 2u * km::swz_advance(v_off, kk * 16, dp * 16, kHeadDim));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          prim::mma_16816<Element>(acc_o[mt][2 * dp], p_frag[mt][kk], vb[0], vb[1]);
          prim::mma_16816<Element>(acc_o[mt][2 * dp + 1], p_frag[mt][kk], vb[2], vb[3]);
        }
      }
    }

    // K_{n-1} resident; every warp is done reading V_n (and, after the last block, Q).
    prim::cp_async_wait<0>();
    __syncthreads();
  }

  // Epilogue: O /= l, lse = max * scale + ln(l) in natural-log units (scale = sm_scale, the
  // soft-cap when on); rows that saw no key (l == 0) get O = 0 and lse = -inf. O goes through
  // this warp's own rows of sQ so the global stores are 16 bytes wide and coalesced.
  const float softmax_scale = p.consts.sm_scale;
  if (to_parts) {
    // A split's rows go to the scratch in float32, straight from the fragments (a few rows).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float l = prim::quad_sum(row_sum[mt][hf]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int row = warp_row0 + mt * 16 + km::mma_c_row(lane, 2 * hf);
        if (row < rows_q) {
          if (km::lane_in_group(lane) == 0) {
            gPartLse[row] = l > 0.f ? row_max[mt][hf] * softmax_scale + logf(l) : -INFINITY;
          }
#pragma unroll
          for (int dt = 0; dt < T::kDTiles; ++dt) {
            float* dst = gPartO + row * kHeadDim + dt * 8 + km::mma_c_col(lane, 2 * hf);
            dst[0] = acc_o[mt][dt][2 * hf] * inv;
            dst[1] = acc_o[mt][dt][2 * hf + 1] * inv;
          }
        }
      }
    }
    return;
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float l = prim::quad_sum(row_sum[mt][hf]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = warp_row0 + mt * 16 + km::mma_c_row(lane, 2 * hf);
      if (km::lane_in_group(lane) == 0 && row < rows_q) {
        gLse[row] = l > 0.f ? row_max[mt][hf] * softmax_scale + logf(l) : -INFINITY;
      }
#pragma unroll
      for (int dt = 0; dt < T::kDTiles; ++dt) {
        prim::store_pair_s<kHeadDim>(sQ, row, dt * 8 + km::mma_c_col(lane, 2 * hf),
                                     acc_o[mt][dt][2 * hf] * inv, acc_o[mt][dt][2 * hf + 1] * inv);
      }
    }
  }
  __syncthreads();
  prim::copy_tile_s2g<kBlockM, kHeadDim, kThreads>(gO, sQ, p.out_strides.row, rows_q, tid);
}

// minBlocksPerSM = 1 explicitly: without it ptxas sometimes caps a kernel at 128 registers
// (seen for d=64, 64x64 on sm_80) and spills instead of using the registers it may have.
template <typename T>
__global__ void __launch_bounds__(T::kThreads, 1) flash_fwd_kernel(const FwdParams p) {
  flash_fwd_body<T, false, false>(p);
}

template <typename T, bool kSoftcap>
__global__ void __launch_bounds__(T::kThreads, 1) flash_fwd_spans_kernel(const FwdParams p) {
  flash_fwd_body<T, true, kSoftcap>(p);
}

template <typename T, bool kSoftcap>
__global__ void __launch_bounds__(T::kThreads, 1) flash_fwd_split_kernel(const FwdParams p) {
  flash_fwd_body<T, true, kSoftcap, true>(p);
}

// The merge of a split-KV call: one warp per (batch, head, row) of the call's (viewed) shape
// reads the splits' lse, then sums their rows with weights exp(lse_s - max) and writes
// out = sum / weights and lse = max + ln(weights) (0 and -inf when no split saw a key, NaN
// when one was NaN). Each lane owns headdim / 32 consecutive columns.
struct CombineParams {
  const float* part = nullptr;  // FwdParams::split_scratch
  int n_splits = 0;
  int batch = 0, heads = 0, rows = 0;
  void* out = nullptr;
  RowStrides out_strides;
  float* lse = nullptr;
  StatStrides lse_strides;
};

constexpr int kCombineWarps = 4;

template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps) flash_fwd_combine_kernel(const CombineParams c) {
  constexpr int kCols = kHeadDim / 32;
  static_assert(kCols == 2 || kCols == 4, "head dim 64 or 128");
  const int lane = threadIdx.x % 32;
  const int64_t total = int64_t(c.batch) * c.heads * c.rows;
  const int64_t id = int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32;  // (batch, head, row)
  if (id >= total) return;
  const int row = static_cast<int>(id % c.rows);
  const int head = static_cast<int>((id / c.rows) % c.heads);
  const int batch = static_cast<int>(id / (int64_t(c.rows) * c.heads));
  const float* lse_part = c.part + int64_t(c.n_splits) * total * kHeadDim + id;
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < c.n_splits; ++s) {
    const float x = lse_part[s * total];
    nan |= x != x;
    m = fmaxf(m, x);
  }
  float acc[kCols];
#pragma unroll
  for (int i = 0; i < kCols; ++i) acc[i] = 0.f;
  float l = 0.f;
  if (!nan && m != -INFINITY) {
    for (int s = 0; s < c.n_splits; ++s) {
      const float x = lse_part[s * total];
      if (x == -INFINITY) continue;  // a split that saw no key: its rows were not written
      const float w = expf(x - m);
      const float* src = c.part + (s * total + id) * kHeadDim + lane * kCols;
      l += w;
#pragma unroll
      for (int i = 0; i < kCols; ++i) acc[i] += w * src[i];
    }
  }
  const float inv = nan ? NAN : (l > 0.f ? 1.f / l : 0.f);
  Element* dst = static_cast<Element*>(c.out) + batch * c.out_strides.batch + row * c.out_strides.row +
                 head * c.out_strides.head + lane * kCols;
#pragma unroll
  for (int i = 0; i < kCols; i += 2) {
    *reinterpret_cast<uint32_t*>(dst + i) = prim::pack2<Element>(acc[i] * inv, acc[i + 1] * inv);
  }
  if (lane == 0) {
    c.lse[batch * c.lse_strides.batch + head * c.lse_strides.head + row] =
        nan ? NAN : (l > 0.f ? m + logf(l) : -INFINITY);
  }
}

template <int kHeadDim, int kConfig, typename Element, bool kSpans, bool kSoftcap>
void launch_flash_fwd(const FwdParams& p, cudaStream_t stream) {
  constexpr int kBlockM = km::fwd_block_m(kHeadDim, kConfig);
  using T = Traits<kHeadDim, kBlockM, km::fwd_block_n(kHeadDim, kConfig), Element>;
  static_assert(T::kSmemBytes == km::fwd_smem_bytes(kHeadDim, kConfig) &&
                    T::kDynamicSmem == km::fwd_smem_dynamic(kHeadDim, kConfig),
                "kernel_math.h and the kernel disagree on the shared memory budget");
  static_assert(kSpans || !kSoftcap, "the soft-cap runs in the spans kernel");
  void (*kernel)(const FwdParams);
  if constexpr (kSpans) {
    kernel = &flash_fwd_spans_kernel<T, kSoftcap>;
  } else {
    kernel = &flash_fwd_kernel<T>;
  }
  const int dyn_smem = T::kDynamicSmem ? T::kSmemBytes : 0;
  if constexpr (T::kDynamicSmem) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn_smem),
               "flash fwd: cudaFuncSetAttribute(max dynamic shared memory)");
  }
  // (q tiles of the longest span x spans, heads, batch); flash_api.cu checked the limits.
  const int64_t max_q = p.spans.count > 0 ? p.spans.max_q_len : p.shape.seqlen_q;
  const int64_t n_spans = p.spans.count > 0 ? p.spans.count : 1;
  const dim3 grid(static_cast<unsigned>(km::ceil_div(static_cast<int>(max_q), kBlockM) * n_spans),
                  static_cast<unsigned>(p.shape.nheads), static_cast<unsigned>(p.shape.batch));
  if (grid.x == 0) return;  // every span is empty
  FwdParams kp = p;
  kp.consts = cuda_consts(p.shape);
  kernel<<<grid, T::kThreads, dyn_smem, stream>>>(kp);
  check_cuda(cudaGetLastError(), "flash_fwd_kernel launch");
}

// A KV-cache or split-KV call (flash_api.cu resolved p.num_splits >= 1): the split kernel on
// config km::kSplitConfig's tile, then the merge when there is more than one split.
template <int kHeadDim, typename Element, bool kSoftcap>
void launch_flash_fwd_split(const FwdParams& p, cudaStream_t stream) {
  constexpr int kBlockM = km::fwd_block_m(kHeadDim, km::kSplitConfig);
  using T = Traits<kHeadDim, kBlockM, km::fwd_block_n(kHeadDim, km::kSplitConfig), Element>;
  static_assert(!T::kDynamicSmem, "the split tile fits static shared memory");
  void (*kernel)(const FwdParams) = &flash_fwd_split_kernel<T, kSoftcap>;
  // (q tiles x splits, heads, batch); flash_api.cu checked the limits.
  const dim3 grid(static_cast<unsigned>(km::ceil_div(static_cast<int>(p.shape.seqlen_q), kBlockM) * p.num_splits),
                  static_cast<unsigned>(p.shape.nheads), static_cast<unsigned>(p.shape.batch));
  FwdParams kp = p;
  kp.consts = cuda_consts(p.shape);
  kernel<<<grid, T::kThreads, 0, stream>>>(kp);
  check_cuda(cudaGetLastError(), "flash_fwd_split_kernel launch");
  if (p.num_splits == 1) return;
  CombineParams cp;
  cp.part = p.split_scratch;
  cp.n_splits = p.num_splits;
  cp.batch = static_cast<int>(p.shape.batch);
  cp.heads = static_cast<int>(p.shape.nheads);
  cp.rows = static_cast<int>(p.shape.seqlen_q);
  cp.out = p.out;
  cp.out_strides = p.out_strides;
  cp.lse = static_cast<float*>(p.lse);
  cp.lse_strides = p.lse_strides;
  void (*combine)(const CombineParams) = &flash_fwd_combine_kernel<kHeadDim, Element>;
  const int64_t rows = p.shape.batch * p.shape.nheads * p.shape.seqlen_q;
  const dim3 cgrid(static_cast<unsigned>((rows + kCombineWarps - 1) / kCombineWarps));
  combine<<<cgrid, 32 * kCombineWarps, 0, stream>>>(cp);
  check_cuda(cudaGetLastError(), "flash_fwd_combine_kernel launch");
}

}  // namespace fwd

// flash_api.cu has checked 0 <= p.config < km::kNumFwdConfigs. Three kernels per tile:
// <kSpans, kSoftcap> = <false, false> for the dense path (the registers it had before spans
// existed), <true, false> and <true, true> for calls with spans and/or a soft-cap (kSpans
// also takes a call without spans: the default span). Config 2 for d=128 has no register to
// spare for the span state (255 on the dense path), so those calls run config 0's tile, as
// its backward does.
template <int kHeadDim, typename Element, bool kSpans, bool kSoftcap>
void run_flash_fwd_variant(const FwdParams& p, cudaStream_t stream) {
  static_assert(km::kNumFwdConfigs == 3, "dispatch every tile configuration");
  constexpr bool kHasConfig2 = !(kSpans && kHeadDim == 128);
  if (p.config == 1) {
    fwd::launch_flash_fwd<kHeadDim, 1, Element, kSpans, kSoftcap>(p, stream);
  } else if (p.config == 2 && kHasConfig2) {
    fwd::launch_flash_fwd<kHeadDim, kHasConfig2 ? 2 : 0, Element, kSpans, kSoftcap>(p, stream);
  } else {
    fwd::launch_flash_fwd<kHeadDim, 0, Element, kSpans, kSoftcap>(p, stream);
  }
}

template <int kHeadDim, typename Element>
void run_flash_fwd(const FwdParams& p, cudaStream_t stream) {
  if (p.kv.seqlens != nullptr || p.num_splits > 1) {  // KV-cache call or key splits
    if (p.shape.softcap > 0.0) {
      fwd::launch_flash_fwd_split<kHeadDim, Element, true>(p, stream);
    } else {
      fwd::launch_flash_fwd_split<kHeadDim, Element, false>(p, stream);
    }
  } else if (p.shape.softcap > 0.0) {
    run_flash_fwd_variant<kHeadDim, Element, true, true>(p, stream);
  } else if (p.spans.count > 0) {
    run_flash_fwd_variant<kHeadDim, Element, true, false>(p, stream);
  } else {
    run_flash_fwd_variant<kHeadDim, Element, false, false>(p, stream);
  }
}

}  // namespace ringseq
