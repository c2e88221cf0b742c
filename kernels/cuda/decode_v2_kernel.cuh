// v2 sparse top-K GQA decode: one CTA per (request, group of H KV heads[, unit]), one
// warp per KV head. The CTA copies whole cache slots: for each token the H KV heads'
// rows are adjacent in the cache ([.., page_size, Hkv, D]), so with shared index lists
// a token is one contiguous H * D-byte read (1 KiB at H = 8, D = 128); per-KV-head lists
// gather the same shared-memory layout row by row.
//
// Batch invariance by construction: the top-K list is cut into fixed units of 64
// indices. A unit's partial (per query head: max, sum, unnormalised o) is computed by
// the warp of its KV head in 4 sequential 16-token steps from an empty state, the same
// instructions whatever CTA runs it, and a request's units are folded left to right
// (decode_v2_fold.cuh). Large batches (coarse): one CTA walks all units of its request
// and folds in registers. Small batches (fine): one CTA per unit writes the unit's
// partial and SparseDecodeV2MergeKernel folds them in the same order with the same
// operations. The launcher picks H and coarse/fine from the batch; the bits do not move.
//
// Per 16-token step each warp runs v1's tensor-core tile (decode_kernel.cuh): QK with
// m16n8k16 f16 MMAs on e4m3 -> f16 converted K, online softmax in base 2 (per_token_head
// mode folds log2 v_scale into a second max), PV with P kept in registers.
// Pipeline: a CTA-wide ring of kStages steps (cp.async, one barrier per step); the
// row table of unit u + 1 is built while unit u runs (two table buffers).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/cuda/decode_v2_fold.cuh"
#include "kernels/cuda/device_utils.cuh"

namespace sds::cuda {

template <int D, bool kPerToken>
struct V2Tile {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static constexpr int kStages = D == 256 ? 2 : (D == 128 ? 3 : 4);
  static constexpr int kRowChunks = D / 16;                      // 16-byte pieces of a row
  static constexpr int kHeadStage = 2 * kDecodeStepTokens * D;   // one head: 16 K rows, 16 V rows
  static constexpr int kKSteps = D / 16;                         // QK MMA k-steps
  static constexpr int kPvTiles = D / 8;                         // PV MMA n-tiles
  static constexpr int kQFragBytes = kKSteps * 32 * 16;          // per head (warp)
  static constexpr int kTableBytes = 2 * kDecodeUnitTokens * 4;  // per head: two unit buffers
  // Shared memory map for h heads (bytes):
  //   ring     [kStages][h][kHeadStage]
  //   qfrag    [h][kKSteps][32] uint4 (first the bf16 Q staging copy [G][D] of the warp)
  //   rows     [2][h][64] int32 cache rows of the unit (-1: skip)
  //   kf, vl   [2][h][64] float (per_token_head only): k_scale * log2(e)/sqrt(D), log2 v_scale
  __host__ __device__ static constexpr int QOffset(int h) { return kStages * h * kHeadStage; }
  __host__ __device__ static constexpr int RowsOffset(int h) {
    return QOffset(h) + h * kQFragBytes;
  }
  __host__ __device__ static constexpr int KfOffset(int h) {
    return RowsOffset(h) + h * kTableBytes;
  }
  __host__ __device__ static constexpr int VlOffset(int h) {
    return KfOffset(h) + (kPerToken ? h * kTableBytes : 0);
  }
  __host__ __device__ static constexpr int SmemBytes(int h) {
    return VlOffset(h) + (kPerToken ? h * kTableBytes : 0);
  }
  static_assert(kDecodeMaxGroup * D * 2 <= kQFragBytes, "q staging");

  // 16-byte piece `chunk` of ring row `row`, XOR-swizzled against bank conflicts.
  __device__ static __forceinline__ int Piece(int row, int chunk) {
    constexpr int kMask = kRowChunks >= 8 ? 7 : kRowChunks - 1;
    return row * D + ((chunk ^ (row & kMask)) << 4);
  }
};

// kRows: 8 when G <= 8 (MMA rows 8..15 are padding and skipped), else 16.
template <int D, int kRows, bool kPerToken>
__global__ void __launch_bounds__(kDecodeV2MaxHeads * 32, 1)
    SparseDecodeV2Kernel(const DecodeParams p) {
  using T = V2Tile<D, kPerToken>;
  constexpr int kU = kDecodeUnitTokens;
  constexpr int kSteps = kDecodeUnitSteps;
  constexpr int kS = T::kStages;
  constexpr int kR = kRows / 8;  // accumulator rows per thread (1 or 2)
  extern __shared__ __align__(128) uint8_t smem[];

  const int H = p.heads_per_cta;
  const int h_shift = __ffs(H) - 1;
  const int nthreads = H * 32;
  const int b = blockIdx.z;
  const int kvh0 = blockIdx.y * H;
  const int topk = p.topk[b];
  const int units = topk > kU ? (topk + kU - 1) / kU : 1;
  const int unit0 = p.fine ? static_cast<int>(blockIdx.x) : 0;
  if (unit0 >= units) return;
  const bool split = p.fine && units > 1;  // unit partials go to the merge kernel
  const int n_units = p.fine ? 1 : units;
  const int n_steps = n_units * kSteps;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int grp = lane >> 2, tig = lane & 3;
  const int G = p.group;
  const int hkv = p.num_kv_heads;
  const int kvh = kvh0 + warp;
  const int layer = p.layer[b];
  const int stage_bytes = H * T::kHeadStage;

  int32_t* rows = reinterpret_cast<int32_t*>(smem + T::RowsOffset(H));  // [2][H][64]
  float* kf_tab = reinterpret_cast<float*>(smem + T::KfOffset(H));      // [2][H][64]
  float* vl_tab = reinterpret_cast<float*>(smem + T::VlOffset(H));      // [2][H][64]

  const int64_t head0 = static_cast<int64_t>(b) * p.num_q_heads + static_cast<int64_t>(kvh) * G;
  if (!split && lane * 64 < G * D) {  // this warp's gate rows [G, D] bf16, read at the end
    const uint16_t* line = p.gate + head0 * D + lane * 64;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
  const float k_layer = kPerToken ? 0.0f : p.layer_k_scale[layer];
  const float v_layer = kPerToken ? 1.0f : p.layer_v_scale[layer];
  const int64_t scale_base = static_cast<int64_t>(layer) * p.layer_scales;
  const int64_t elem_base = static_cast<int64_t>(layer) * p.layer_elements;
  const uint8_t* kbase = p.k + elem_base;  // [P, page_size, Hkv, D] of this layer
  const uint8_t* vbase = p.v + elem_base;
  const int32_t* list = p.indices + p.index_offset[b];  // [K] or [Hkv, K]
  const bool per_kv = p.indices_per_kv_head[b] != 0;
  const int32_t* pages = p.page_table + p.page_table_offset[b];

  // Table entries of this thread: e = tid + nthreads * k = h * 64 + j (k = 0, 1).
  auto load_positions = [&](int u, int(&t)[2]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int e = tid + nthreads * k;
      const int h = e / kU, j = e % kU;
      const int tok = (unit0 + u) * kU + j;
      const int64_t at = (per_kv ? static_cast<int64_t>(kvh0 + h) * topk : 0) + tok;
      t[k] = u < n_units && tok < topk ? list[at] : -1;
    }
  };
  auto load_pages = [&](const int(&t)[2], int(&pg)[2]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) pg[k] = t[k] >= 0 ? pages[t[k] >> p.page_shift] : -1;
  };
  auto store_rows = [&](int u, const int(&t)[2], const int(&pg)[2]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int e = tid + nthreads * k;
      const int h = e / kU;
      const int32_t row =
          pg[k] >= 0 ? (pg[k] * p.page_size + (t[k] & (p.page_size - 1))) * hkv + kvh0 + h : -1;
      const int at = (u & 1) * H * kU + e;
      rows[at] = row;
      if constexpr (kPerToken) {
        const float ks = row >= 0 ? p.k_token_scale[scale_base + row] : 0.0f;
        const float vs = row >= 0 ? p.v_token_scale[scale_base + row] : 1.0f;
        kf_tab[at] = ks * p.score_scale_log2;
        vl_tab[at] = log2f(vs);
      }
    }
  };
  // Copies CTA step `step` (unit step / 4, rows 16 * (step % 4) ..) into ring slot step % kS:
  // piece e = (r * H + h) * kRowChunks + c, so consecutive threads walk whole slots.
  auto issue = [&](int step) {
    uint8_t* st = smem + (step % kS) * stage_bytes;
    const int32_t* rt = rows + ((step / kSteps) & 1) * H * kU + (step % kSteps) * kDecodeStepTokens;
#pragma unroll
    for (int it = 0; it < T::kRowChunks / 2; ++it) {
      const int e = tid + nthreads * it;
      const int c = e % T::kRowChunks, hr = e / T::kRowChunks;
      const int h = hr & (H - 1), r = hr >> h_shift;
      const int32_t row = rt[h * kU + r];
      const bool valid = row >= 0;
      const int64_t off = valid ? static_cast<int64_t>(row) * D + c * 16 : 0;
      const int piece = h * T::kHeadStage + T::Piece(r, c);
      CpAsync16(SmemAddress(st + piece), kbase + off, valid);
      CpAsync16(SmemAddress(st + piece + kDecodeStepTokens * D), vbase + off, valid);
    }
  };

  // ---- 1. Rows of unit 0, positions of unit 1, first ring stages. ----
  int t_next[2], pg[2];
  {
    int t0[2];
    load_positions(0, t0);
    load_pages(t0, pg);
    store_rows(0, t0, pg);
    load_positions(1, t_next);
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < kS - 1; ++s) {
    if (s < n_steps) issue(s);
    CpAsyncCommit();
  }

  // ---- 2. Q of this warp's G query heads: max |q| and f16 MMA fragments. ----
  uint4* qfrag = reinterpret_cast<uint4*>(smem + T::QOffset(H) + warp * T::kQFragBytes);
  float qinv;
  {
    const uint16_t* qg = p.q + head0 * D;                   // [G, D] bf16
    uint16_t* qstage = reinterpret_cast<uint16_t*>(qfrag);  // [G, D] bf16
    float local_max = 0.0f;
    for (int e = lane * 8; e < G * D; e += 32 * 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(qg + e);
      *reinterpret_cast<uint4*>(qstage + e) = raw;
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        local_max = fmaxf(local_max, fabsf(__uint_as_float(w[i] << 16)));
        local_max = fmaxf(local_max, fabsf(__uint_as_float(w[i] & 0xffff0000u)));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, o));
    __syncwarp();
    // q * 2^(15 - e) < 2^15 fits f16; scores are scaled back by 2^(e - 15).
    int e2 = 0;
    if (local_max > 0.0f) frexpf(local_max, &e2);
    const float qscale = local_max > 0.0f ? ldexpf(1.0f, 15 - e2) : 1.0f;
    qinv = local_max > 0.0f ? ldexpf(1.0f, e2 - 15) : 1.0f;
    auto qh = [&](int g, int d) {
      return g < G ? __uint_as_float(static_cast<uint32_t>(qstage[g * D + d]) << 16) * qscale
                   : 0.0f;
    };
    uint4 frag[T::kKSteps];  // the fragments overwrite the staging copy
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
      const int d0 = tig * (D / 4) + 4 * ks;
      frag[ks].x = PackHalf2(qh(grp, d0), qh(grp, d0 + 1));
      frag[ks].y = PackHalf2(qh(grp + 8, d0), qh(grp + 8, d0 + 1));
      frag[ks].z = PackHalf2(qh(grp, d0 + 2), qh(grp, d0 + 3));
      frag[ks].w = PackHalf2(qh(grp + 8, d0 + 2), qh(grp + 8, d0 + 3));
    }
    __syncwarp();
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) qfrag[ks * 32 + lane] = frag[ks];
    __syncwarp();
  }
  const float kf_const = kPerToken ? 0.0f : k_layer * p.score_scale_log2 * qinv;

  // ---- 3. Main loop over the CTA's steps; unit partials folded (or written) every 4. ----
  float o[T::kPvTiles][2 * kR], acc_o[T::kPvTiles][2 * kR];
  float m_s[kR], m_u[kR], l_s[kR];
  V2Stats acc[kR];
#pragma unroll
  for (int j = 0; j < T::kPvTiles; ++j)
#pragma unroll
    for (int c = 0; c < 2 * kR; ++c) o[j][c] = acc_o[j][c] = 0.0f;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    m_s[r] = m_u[r] = NegInf(), l_s[r] = 0.0f;
    acc[r] = V2Stats{NegInf(), NegInf(), 0.0f};
  }

  for (int i = 0; i < n_steps; ++i) {
    CpAsyncWait<kS - 2>();
    __syncthreads();  // step i landed for all; everyone is done with step i - 1's slot
    const int u = i / kSteps, q = i % kSteps;
    const bool build = q == 0 && u + 1 < n_units;
    if (build) load_pages(t_next, pg);  // unit u + 1, stored after this step's maths
    if (i + kS - 1 < n_steps) issue(i + kS - 1);
    CpAsyncCommit();

    const int tok_unit = (unit0 + u) * kU + q * kDecodeStepTokens;  // first token of the step
    if (tok_unit < topk) {
      const uint8_t* st = smem + (i % kS) * stage_bytes + warp * T::kHeadStage;
      const int tab = ((u & 1) * H + warp) * kU + q * kDecodeStepTokens;  // step's table entries
      // QK^T for tokens nt * 8 + n (n = grp holds the K row in the B operand).
      float s[2][4];
      {
        uint32_t kw[2][T::kKSteps];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int r = nt * 8 + grp;
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            const uint4 v = LoadShared16(st + T::Piece(r, tig * (D / 64) + c));
            kw[nt][4 * c + 0] = v.x;
            kw[nt][4 * c + 1] = v.y;
            kw[nt][4 * c + 2] = v.z;
            kw[nt][4 * c + 3] = v.w;
          }
#pragma unroll
          for (int c = 0; c < 4; ++c) s[nt][c] = 0.0f;
        }
#pragma unroll
        for (int ks = 0; ks < T::kKSteps; ++ks) {
          const uint4 a = qfrag[ks * 32 + lane];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t b0, b1;
            Fp8x4ToHalf2x2(kw[nt][ks], b0, b1);
            if constexpr (kRows == 16) {
              MmaF16(s[nt], a.x, a.y, a.z, a.w, b0, b1);
            } else {
              MmaF16(s[nt], a.x, 0u, a.z, 0u, b0, b1);
            }
          }
        }
      }

      // Scale to log2 units, mask skipped tokens, online softmax per head row.
      float kf[2][2], vl[2][2];
      bool valid[2][2];
      LoadTokenColumns<kPerToken>(rows, kf_tab, vl_tab, tab + 2 * tig, qinv, kf_const, valid, kf,
                                  vl);
      float pr[2][4];  // P (f32) in the QK accumulator layout
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const float alpha_o =
            SoftmaxRowStep<kPerToken>(s, r, valid, kf, vl, m_s[r], m_u[r], l_s[r], pr);
#pragma unroll
        for (int j = 0; j < T::kPvTiles; ++j) {
          o[j][2 * r] *= alpha_o;
          o[j][2 * r + 1] *= alpha_o;
        }
      }
      // P as f16 hi + lo (PackHalf2Split): two MMAs per tile keep ~22 bits of each p.
      uint32_t pa0, pa1 = 0u, pa2, pa3 = 0u, pl0, pl1 = 0u, pl2, pl3 = 0u;
      PackHalf2Split(pr[0][0], pr[0][1], pa0, pl0);
      PackHalf2Split(pr[1][0], pr[1][1], pa2, pl2);
      if constexpr (kRows == 16) {
        PackHalf2Split(pr[0][2], pr[0][3], pa1, pl1);
        PackHalf2Split(pr[1][2], pr[1][3], pa3, pl3);
      }

      // PV: thread (grp, tig) feeds V rows 2tig, 2tig+1, 2tig+8, 2tig+9 at d = grp*D/8 + j.
      {
        const uint8_t* vs = st + kDecodeStepTokens * D;
        constexpr int kWords = D / 32;  // 32-bit words per thread per row
        uint32_t w[4][kWords];
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
          const int r = 2 * tig + (qq & 1) + (qq >> 1) * 8;
          if constexpr (D == 64) {
            const uint2 v =
                *reinterpret_cast<const uint2*>(vs + T::Piece(r, grp >> 1) + (grp & 1) * 8);
            w[qq][0] = v.x;
            w[qq][1] = v.y;
          } else {
#pragma unroll
            for (int c = 0; c < D / 128; ++c) {
              const uint4 v = LoadShared16(vs + T::Piece(r, grp * (D / 128) + c));
              w[qq][4 * c + 0] = v.x;
              w[qq][4 * c + 1] = v.y;
              w[qq][4 * c + 2] = v.z;
              w[qq][4 * c + 3] = v.w;
            }
          }
        }
#pragma unroll
        for (int k = 0; k < kWords; ++k) {
          uint32_t b0[4], b1[4];
          Fp8x4ToHalf2x2(__byte_perm(w[0][k], w[1][k], 0x5140), b0[0], b0[1]);
          Fp8x4ToHalf2x2(__byte_perm(w[0][k], w[1][k], 0x7362), b0[2], b0[3]);
          Fp8x4ToHalf2x2(__byte_perm(w[2][k], w[3][k], 0x5140), b1[0], b1[1]);
          Fp8x4ToHalf2x2(__byte_perm(w[2][k], w[3][k], 0x7362), b1[2], b1[3]);
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            float* oj = o[4 * k + x];
            float c[4] = {oj[0], oj[1], kRows == 16 ? oj[2 % (2 * kR)] : 0.0f,
                          kRows == 16 ? oj[3 % (2 * kR)] : 0.0f};
            MmaF16(c, pa0, pa1, pa2, pa3, b0[x], b1[x]);
            MmaF16(c, pl0, pl1, pl2, pl3, b0[x], b1[x]);
            oj[0] = c[0];
            oj[1] = c[1];
            if constexpr (kRows == 16) {
              oj[2 % (2 * kR)] = c[2];
              oj[3 % (2 * kR)] = c[3];
            }
          }
        }
      }
    }

    if (build) {  // rows of unit u + 1 (visible after the next barrier), positions of u + 2
      store_rows(u + 1, t_next, pg);
      load_positions(u + 2, t_next);
    }

    if (q == kSteps - 1) {  // end of a unit: its partial is complete
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 1);
        l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 2);
        if constexpr (!kPerToken) m_u[r] = m_s[r];
      }
      if (split) {
        const int64_t slot = (static_cast<int64_t>(b) * hkv + kvh) * p.max_units + unit0 + u;
        float* po = p.partial_o + slot * G * D;                      // [G][D]
        float* ps = p.partial_stats + slot * G * kDecodeStatFloats;  // [G][4]
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          const int g = grp + 8 * r;
          if (g < G) {
#pragma unroll
            for (int j = 0; j < T::kPvTiles; ++j) {
              po[g * D + 2 * tig * (D / 8) + j] = o[j][2 * r];
              po[g * D + (2 * tig + 1) * (D / 8) + j] = o[j][2 * r + 1];
            }
            if (tig == 0)
              *reinterpret_cast<float4*>(ps + g * kDecodeStatFloats) =
                  make_float4(m_s[r], m_u[r], l_s[r], 0.0f);
          }
        }
      } else {
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          const V2FoldFactors f = V2FoldStats(acc[r], V2Stats{m_s[r], m_u[r], l_s[r]});
#pragma unroll
          for (int j = 0; j < T::kPvTiles; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              acc_o[j][2 * r + e] = V2FoldO(acc_o[j][2 * r + e], o[j][2 * r + e], f);
        }
      }
#pragma unroll
      for (int j = 0; j < T::kPvTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2 * kR; ++c) o[j][c] = 0.0f;
#pragma unroll
      for (int r = 0; r < kR; ++r) m_s[r] = m_u[r] = NegInf(), l_s[r] = 0.0f;
    }
  }
  CpAsyncWait<0>();
  if (split) return;

    // ---- 4. Gated bf16 output (and lse) of this warp's heads from the folded state. ----
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int g = grp + 8 * r;
    if (g >= G) continue;
#pragma unroll
    for (int j = 0; j < T::kPvTiles; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t at = (head0 + g) * D + (2 * tig + e) * (D / 8) + j;
        p.out[at] = V2Output(acc_o[j][2 * r + e], acc[r], v_layer, p.gate[at]);
      }
    if (tig == 0 && p.lse != nullptr) p.lse[head0 + g] = V2Lse(acc[r]);
  }
}

// Fine split: folds the unit partials of (request blockIdx.y, KV head blockIdx.x) left to
// right, exactly as the coarse path folds them in registers, and writes out and lse.
// Requests of one unit were finished by the main kernel.
template <int D, bool kPerToken>
__global__ void __launch_bounds__(128) SparseDecodeV2MergeKernel(const DecodeParams p) {
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int topk = p.topk[b];
  const int units =
      topk > kDecodeUnitTokens ? (topk + kDecodeUnitTokens - 1) / kDecodeUnitTokens : 1;
  if (units <= 1) return;
  const int G = p.group;
  const int64_t slot0 = (static_cast<int64_t>(b) * p.num_kv_heads + kvh) * p.max_units;
  const float* po = p.partial_o + slot0 * G * D;                      // [units][G][D]
  const float* ps = p.partial_stats + slot0 * G * kDecodeStatFloats;  // [units][G][4]
  const float v_layer = kPerToken ? 1.0f : p.layer_v_scale[p.layer[b]];
  const int64_t head0 = static_cast<int64_t>(b) * p.num_q_heads + static_cast<int64_t>(kvh) * G;
  for (int e4 = threadIdx.x; e4 < G * D / 4; e4 += blockDim.x) {
    const int g = e4 * 4 / D, d = e4 * 4 % D;
    V2Stats acc{NegInf(), NegInf(), 0.0f};
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
    for (int u = 0; u < units; ++u) {
      const float4 st = __ldcg(reinterpret_cast<const float4*>(ps + (u * G + g) * 4));
      const float4 v =
          __ldcg(reinterpret_cast<const float4*>(po + static_cast<int64_t>(u) * G * D + 4 * e4));
      const V2FoldFactors f = V2FoldStats(acc, V2Stats{st.x, st.y, st.z});
      o[0] = V2FoldO(o[0], v.x, f);
      o[1] = V2FoldO(o[1], v.y, f);
      o[2] = V2FoldO(o[2], v.z, f);
      o[3] = V2FoldO(o[3], v.w, f);
    }
    const int64_t at = (head0 + g) * D + d;
#pragma unroll
    for (int x = 0; x < 4; ++x) p.out[at + x] = V2Output(o[x], acc, v_layer, p.gate[at + x]);
    if (d == 0 && p.lse != nullptr) p.lse[head0 + g] = V2Lse(acc);
  }
}

}  // namespace sds::cuda
