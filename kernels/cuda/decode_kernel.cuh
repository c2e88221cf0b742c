// Sparse top-K GQA decode over the paged FP8 cache, one CTA per (request, KV head,
// chunk of kDecodeChunkTokens = 512 tokens). Every selected K/V row is copied from HBM into shared
// memory once (cp.async, a ring of kStages steps per warp sequence) and serves all G query heads of
// its KV head through f16 tensor-core MMAs (m16n8k16, f32 accumulate):
//   QK, G > 8:  S^T[16 heads x 8 tokens] += Q[16 heads x 16 d] * K^T[16 d x 8 tokens]
//   QK, G <= 8: S[16 tokens x 8 heads]   += K[16 tokens x 16 d] * Q^T[16 d x 8 heads]
//   PV, G > 8:  O[16 heads x 8 d]    += P[16 heads x 16 tokens] * V[16 tokens x 8 d]
//   PV, G <= 8: O^T[16 d x 8 heads]  += V^T[16 d x 16 tokens] * P^T[16 tokens x 8 heads]
// so G <= 8 spends no MMA on padded head rows. The QK accumulator layout is the PV
// A-operand layout (G > 8); for G <= 8 two movmatrix transposes per 16 tokens turn it
// into the P^T B-operand layout. P stays in registers, except in small grids at G <= 8,
// where each warp sequence's P*V runs on a second warp (the PV warp) and P^T travels
// there through shared memory (see SparseDecodeKernel).
// Online softmax in base 2. In per_token_head mode the V scale is folded into the
// exponent (u = s + log2 v_scale, its own running max) so P stays within f16 range.
// A request with several chunks makes f32 partials, merged in chunk order by chunk 0
// (small grids, launched as clusters: the other chunks push their partials into chunk
// 0's shared memory with st.async) or by the last CTA of its (request, KV head) to
// finish through a global workspace; both run MergeChunks
// with the same operations in the same order, so results are bitwise independent of the
// batch. The ring depth only sets how far each warp prefetches, never the
// arithmetic order (deeper rings for small grids measured no faster: bench/RESULTS.md).
// Prologue: every thread loads its Q values first; then each warp sequence resolves its
// own tokens (steps s, s + W, ...) to cache rows and issues its first cp.async stages, so
// the Q round trip and the f16 fragment build overlap the index -> page table -> K/V
// chain. Launched with programmatic dependent launch (after the append), the CTA waits
// for the previous kernel between resolving its rows and issuing its first cache reads.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/decode_finish.cuh"
#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/cuda/decode_softmax.cuh"
#include "kernels/cuda/decode_tile.cuh"
#include "kernels/cuda/device_utils.cuh"

// G <= 8: QK accumulator chains per warp (part of the arithmetic: the k-steps' sum
// order). With Q as the A operand (session 3) 2 chains measured 0.3 us faster than 1 for
// one request; with K as the A operand 4 measured no faster than 2 (bench/RESULTS.md).
// `cmake -DSDS_DECODE_QK_CHAINS=4` builds that experiment.
#ifndef SDS_DECODE_QK_CHAINS
#define SDS_DECODE_QK_CHAINS 2
#endif

// Minimum resident CTAs per SM asked of the register allocator (launch bounds).
#ifndef SDS_DECODE_MIN_CTAS
#define SDS_DECODE_MIN_CTAS 1
#endif

namespace sds::cuda {

inline constexpr int kDecodeQkChains = SDS_DECODE_QK_CHAINS;
static_assert(kDecodeQkChains == 1 || kDecodeQkChains == 2 || kDecodeQkChains == 4, "QK chains");

// The explicit add keeps nvcc from folding the 1 + into expf's last step (a contraction
// it may or may not make per kernel instance; the gate must not depend on the instance).
__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / __fadd_rn(1.0f, expf(-x)); }

// Bytes each chunk CTA other than chunk 0 pushes into chunk 0's receive area (cluster
// merge): its partial [G][D] f32 and the statistics [G][kDecodeStatFloats] f32.
__device__ __forceinline__ uint32_t ClusterPushBytes(int group, int head_dim) {
  return static_cast<uint32_t>(group) * (head_dim + kDecodeStatFloats) * 4;
}

// kRows: 8 when G <= 8 (MMA rows 8..15 are padding and skipped), else 16.
// Resident CTAs per SM asked of the register allocator (at most 128 registers) where the
// head_dim 128 shared memory fits that many: 4 CTAs of 4 warps (per_tensor, and
// per_token_head at G <= 8) or 2 of 8. CTAs with PV warps (8 warps, small grids): 2
// (head_dim 256: 1, which 128 registers would make spill).
template <int D, int kRows, bool kPerToken, int kStages, bool kPvWarp = false>
inline constexpr int kDecodeMinCtas = kPvWarp ? (D == 256 ? 1 : 2)
                                      : D != 128 || kStages != kDecodeDefaultStagesD128
                                          ? SDS_DECODE_MIN_CTAS
                                      : kDecodeWarps == 8        ? 2
                                      : !kPerToken || kRows == 8 ? 4
                                                                 : SDS_DECODE_MIN_CTAS;

// Named barriers of a sequence s's two warps (PV warps only): kHandOffBarrier + s (once
// per step), kSeqBarrier + s (the sequence's rows resolved). 0 is __syncthreads. (The
// launch uses PV warps only with 4 sequences: see LaunchNarrow.)
inline constexpr int kHandOffBarrier = 1;
inline constexpr int kSeqBarrier = kHandOffBarrier + kDecodeWarps;

// kPvWarp (G <= 8 only): the CTA always runs kDecodeWarps warp sequences (steps s,
// s + W, ... of the chunk, each with its own online softmax, merged in sequence order).
// Without a PV warp one warp runs each sequence. With one, the sequence's softmax warp
// copies K, computes QK and the softmax and hands P^T and the rescale factors to the
// sequence's PV warp through shared memory, which copies V, rescales O and runs the P*V
// MMAs while the softmax warp goes on to the next step. The hand-off of step i is one
// barrier that both warps sync on: the softmax warp has written step i's slot (two
// slots, by step parity) and the PV warp is done with step i - 1's slot. The two
// warps of a sequence share a scheduler (warps s and s + W), whose issue slots a lone
// warp leaves mostly idle (Nsight Compute: one warp per scheduler issues every ~4
// cycles). Every floating-point operation is the one the lone warp performs, in the same
// order, so the bits do not depend on kPvWarp, and the launch picks it from the grid
// size. kQkAheadT: with PV warps at G <= 8, the softmax warp computes QK one step ahead
// (see the main loop; same bits too).
template <int D, int kRows, bool kPerToken, int kStages, bool kPvWarp, bool kQkAheadT>
__global__ void __launch_bounds__(kDecodeThreads*(kPvWarp ? 2 : 1),
                                  (kDecodeMinCtas<D, kRows, kPerToken, kStages, kPvWarp>))
    SparseDecodeKernel(const __grid_constant__ DecodeParams p) {
  using T = DecodeTile<D, kRows, kPerToken, kStages, kPvWarp>;
  static_assert(!kPvWarp || kSeqBarrier + kDecodeWarps <= 16, "named barriers");
  constexpr int kChunk = kDecodeChunkTokens;
  constexpr int kR = kRows / 8;  // accumulator rows per thread (1 or 2)
  extern __shared__ __align__(128) uint8_t smem[];

  const int kvh = blockIdx.x;
  const int chunk = blockIdx.y;
  const int b = blockIdx.z;
  // Request b's scalars: from the parameters (small batches) or global memory.
  const DecodeRequestScalars rq =
      p.inline_requests
          ? p.req[b]
          : DecodeRequestScalars{p.index_offset[b], p.page_table_offset[b],   p.topk[b],
                                 p.layer[b],        p.indices_per_kv_head[b], 0};
  const int topk = rq.topk;
  // At most the grid's max_chunks: a list longer than the launch's max_topk breaks
  // LaunchDecode's precondition, and counting chunks no CTA runs would leave chunk 0
  // waiting forever for their partials (a hung GPU instead of a wrong answer).
  const int num_chunks = min(p.max_chunks, topk > kChunk ? (topk + kChunk - 1) / kChunk : 1);
  // Cluster merge: the other chunk CTAs push their partials into chunk 0's receive area
  // (after the layout of T, see DecodeTile), whose mbarrier chunk 0 initialises here and
  // arms with the bytes it will receive. Every CTA of the cluster arrives on the cluster
  // barrier now and waits on it before it touches another CTA's shared memory (the
  // pushes need chunk 0 started and its mbarrier initialised) or exits.
  const bool cluster_merge = T::kClusterMergeFits && p.cluster_merge;
  uint8_t* recv = smem + T::kSmemBytes;  // cluster launches only
  const uint32_t recv_bar = SmemAddress(recv);
  float* recv_stats = reinterpret_cast<float*>(recv + 16);  // [max_chunks][16][4]
  float* recv_part = recv_stats + p.max_chunks * kDecodeMaxGroup * kDecodeStatFloats;
  if (cluster_merge) {
    if (chunk == 0 && threadIdx.x == 0 && num_chunks > 1) {
      MbarrierInit(recv_bar, 1);
      FenceMbarrierInitCluster();
      MbarrierArriveExpectTx(recv_bar, (num_chunks - 1) * ClusterPushBytes(p.group, D));
    }
    ClusterArriveRelaxed();
  }
  if (chunk >= num_chunks) {
    if (cluster_merge) ClusterWait();
    return;
  }

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // seq: this warp's sequence (the warp of the 4-warp CTA whose arithmetic it shares);
  // role 0 / 1: its softmax / PV warp (one warp does both without kPvWarp).
  const int seq = warp % kDecodeWarps, role = warp / kDecodeWarps;
  const bool softmax_warp = !kPvWarp || role == 0, pv_warp = !kPvWarp || role == 1;
  const int grp = lane >> 2, tig = lane & 3;
  const int G = p.group;
  const int hkv = p.num_kv_heads;
  const int layer = rq.layer;
  const int begin = chunk * kChunk;
  const int count = max(0, min(kChunk, topk - begin));

  int32_t* rows = reinterpret_cast<int32_t*>(smem + T::kRowsOffset);
  float* kf_tab = reinterpret_cast<float*>(smem + T::kKfOffset);
  float* vl_tab = reinterpret_cast<float*>(smem + T::kVlOffset);
  float* stats = reinterpret_cast<float*>(smem + T::kStatsOffset);
  float* head = reinterpret_cast<float*>(smem + T::kHeadOffset);
  float* qmax_w = reinterpret_cast<float*>(smem + T::kQMaxOffset);  // [T::kWarps], prologue
  // [kKSteps][32] fragments: uint4 {x, y, z, w} (kRows 16) or uint2 {x, z} (kRows 8).
  uint8_t* qfrag = smem + T::kQFragOffset;

  const int64_t head0 = static_cast<int64_t>(b) * p.num_q_heads + static_cast<int64_t>(kvh) * G;
  // Q [G, D] bf16 of these heads, loaded first: each thread exactly the Q values of its own
  // f16 fragments (fragment e = (ks, lane): rows g0, g0 + 8, columns d0 .. d0 + 3), used
  // in step 2. Issued before the index list -> page table -> rows chain, so that its
  // round trip overlaps the chain's (issued after it, Q arrived after the first K/V stage
  // and the CTA waited for it: Nsight Compute, bench/RESULTS.md).
  uint2 raw[T::kQFragPerThread][2];  // [it][row g0 | g0 + 8]: q[row][d0 .. d0 + 3]
  {
    const uint16_t* qg = p.q + head0 * D;
#pragma unroll
    for (int it = 0; it < T::kQFragPerThread; ++it) {
      const int e = min(tid + it * T::kThreads, T::kKSteps * 32 - 1);
      const int ks = e >> 5, ln = e & 31, g0 = ln >> 2, d0 = (ln & 3) * (D / 4) + 4 * ks;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int g = g0 + 8 * h;
        raw[it][h] = g < G ? *reinterpret_cast<const uint2*>(qg + g * D + d0) : make_uint2(0, 0);
      }
    }
  }
  // The finishing CTA reads gate [G, D] bf16 of these heads last: start it towards L2 now
  // (128-byte lines; every chunk CTA asks, any of them may finish). Layer scales too.
  if (tid * 64 < G * D) {
    const uint16_t* line = p.gate + head0 * D + tid * 64;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
  const float k_layer = kPerToken ? 0.0f : p.layer_k_scale[layer];
  const float v_layer = kPerToken ? 1.0f : p.layer_v_scale[layer];
  const int64_t scale_base = static_cast<int64_t>(layer) * p.layer_scales;
  const int num_steps = (count + kDecodeStepTokens - 1) / kDecodeStepTokens;
  const int my_steps = seq < num_steps ? (num_steps - seq + kDecodeWarps - 1) / kDecodeWarps : 0;
  uint8_t* ring = smem + seq * T::kStages * T::kStageBytes;  // this sequence's ring

  const int64_t elem_base = static_cast<int64_t>(layer) * p.layer_elements;
  const uint8_t* kbase = p.k + elem_base;  // [P, page_size, Hkv, D] of this layer
  const uint8_t* vbase = p.v + elem_base;

  // Copies step i of this sequence (chunk step seq + 4 i) into ring slot i % kStages: its
  // K and V rows, or with PV warps, the rows this warp reads (K: the softmax warp, V: the
  // PV warp, so that each refills only what it has itself consumed, and the copies' issue
  // work is shared between the two warps). Lane l copies piece l % kRowChunks of the
  // kRowsPerLane adjacent rows from r0 = (l / kRowChunks) kRowsPerLane, so each copy
  // instruction still reads whole rows, and the lane's row numbers come from shared
  // memory in one vector load before its first copy: a cp.async writes shared memory, so
  // the compiler keeps every rows[] load after it behind it (one load round trip per row,
  // 45 % of the softmax warp's step with per-row loads: Nsight Compute, bench/RESULTS.md).
  constexpr int kRowsPerLane = T::kRowChunks / 2;  // 16 rows x kRowChunks pieces / 32 lanes
  static_assert(kRowsPerLane == 2 || kRowsPerLane % 4 == 0, "row vector loads");
  const int issue_c = lane % T::kRowChunks, issue_r0 = (lane / T::kRowChunks) * kRowsPerLane;
  using IssueRows = int32_t[kRowsPerLane];
  auto load_rows = [&](int i, IssueRows& rr) {
    const int32_t* src = rows + (seq + kDecodeWarps * i) * kDecodeStepTokens + issue_r0;
    if constexpr (kRowsPerLane == 2) {
      const int2 v = *reinterpret_cast<const int2*>(src);
      rr[0] = v.x, rr[1] = v.y;
    } else {
#pragma unroll
      for (int q = 0; q < kRowsPerLane / 4; ++q) {
        const int4 v = reinterpret_cast<const int4*>(src)[q];
        rr[4 * q] = v.x, rr[4 * q + 1] = v.y, rr[4 * q + 2] = v.z, rr[4 * q + 3] = v.w;
      }
    }
  };
  // PV warps: per lane and fixed over the steps, the shared address of the ring and the
  // global address of this lane's piece of cache row 0 in the rows this warp copies (K or
  // V; the empty asm keeps it in registers: rebuilt from the parameters, it cost a 64-bit
  // multiply per copy). 1 and 4 requests measured 2 % faster with it; the fused kernel
  // (larger grids) measured 1 % slower, so it keeps the plain form (bench/RESULTS.md).
  const uint32_t ring_addr = SmemAddress(ring);
  const uint8_t* src_half = (role == 1 ? vbase : kbase) + issue_c * 16;
  if constexpr (kPvWarp) asm volatile("" : "+l"(src_half));
  const uint32_t half_offset = role == 1 ? kDecodeStepTokens * D : 0;
  auto issue_rows = [&](int i, const IssueRows& rr) {
#pragma unroll
    for (int it = 0; it < kRowsPerLane; ++it) {
      const int32_t row = rr[it];
      const bool valid = row >= 0;
      if constexpr (kPvWarp) {
        const uint32_t st = ring_addr + (i % T::kStages) * T::kStageBytes + half_offset;
        const int64_t off = static_cast<int64_t>(max(row, 0)) * D;
        CpAsync16(st + T::Piece(issue_r0 + it, issue_c), src_half + off, valid);
      } else {
        uint8_t* st = ring + (i % T::kStages) * T::kStageBytes;
        const int64_t off = valid ? static_cast<int64_t>(row) * D + issue_c * 16 : 0;
        const int piece = T::Piece(issue_r0 + it, issue_c);
        CpAsync16(SmemAddress(st + piece), kbase + off, valid);
        CpAsync16(SmemAddress(st + kDecodeStepTokens * D + piece), vbase + off, valid);
      }
    }
  };
  auto issue = [&](int i) {
    IssueRows rr;
    load_rows(i, rr);
    issue_rows(i, rr);
  };

  // ---- 1. This warp's tokens -> cache rows, then its first ring stages (no CTA barrier). ----
  {
    // list: [count] int32 logical positions of this chunk (this KV head's list when the
    // request has one list per KV head); pages: the request's page table.
    const int32_t* list = p.indices + rq.index_offset +
                          (rq.indices_per_kv_head ? static_cast<int64_t>(kvh) * topk : 0) + begin;
    const int32_t* pages = p.page_table + rq.page_table_offset;
    // Tokens per lane; the last round may leave lanes idle when a sequence has fewer
    // tokens than threads (split CTAs in the smaller-chunk experiment builds).
    constexpr int kSeqTokens = kChunk / kDecodeWarps, kSeqThreads = 32 * (kPvWarp ? 2 : 1);
    constexpr int kPer = (kSeqTokens + kSeqThreads - 1) / kSeqThreads;
    int idx[kPer], t[kPer], page[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = 32 * role + lane + kSeqThreads * u;  // j-th token of this sequence's steps
      const bool mine = kSeqTokens % kSeqThreads == 0 || j < kSeqTokens;
      // Out of range: idx = kChunk, no table entry (the writes below skip it).
      idx[u] = mine ? (seq + kDecodeWarps * (j / kDecodeStepTokens)) * kDecodeStepTokens +
                          j % kDecodeStepTokens
                    : kChunk;
      t[u] = idx[u] < count ? list[idx[u]] : -1;
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) page[u] = t[u] >= 0 ? pages[t[u] >> p.page_shift] : -1;
    int32_t row[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      row[u] = page[u] >= 0 ? (page[u] * p.page_size + (t[u] & (p.page_size - 1))) * hkv + kvh : -1;
      if (idx[u] < kChunk) rows[idx[u]] = row[u];
    }
    __syncwarp();
    if (kPvWarp) NamedBarrierSync(kSeqBarrier + seq, 64);  // rows from both of its warps
    // Launched after the batch's append with programmatic dependent launch, the CTA got
    // here (Q, index list, page table, layer scales: inputs the append does not write)
    // while the append may still be running; the K/V rows and token scales are read only
    // after it is done.
    GridDependencyWait();
    // Stages in flight ahead of the step being computed: kStages - 1, or kStages - 2 with
    // PV warps, each of which issues its half of every stage (see issue). (Since each
    // refills only rows it has read itself, kStages - 1 would be safe for them too; the
    // depth is kept: deeper rings measured no faster, bench/RESULTS.md.)
    constexpr int kAhead = kPvWarp ? T::kStages - 2 : T::kStages - 1;
    {
      // Every row number first, then the copies (see issue).
      IssueRows rr[kAhead];
#pragma unroll
      for (int i = 0; i < kAhead; ++i)
        if (i < my_steps) load_rows(i, rr[i]);
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        if (i < my_steps) issue_rows(i, rr[i]);
        CpAsyncCommit();
      }
    }
    if constexpr (kPerToken) {
      // kf_tab: k_scale * log2(e) / sqrt(D) (times the power-of-two qinv in the loop, an
      // exact product); vl_tab: log2 v_scale.
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const float ks = row[u] >= 0 ? p.k_token_scale[scale_base + row[u]] : 0.0f;
        const float vs = row[u] >= 0 ? p.v_token_scale[scale_base + row[u]] : 1.0f;
        if (idx[u] >= kChunk) continue;
        kf_tab[idx[u]] = ks * p.score_scale_log2;
        vl_tab[idx[u]] = log2f(vs);
      }
    }
  }

  // ---- 2. Q of the G query heads of this KV head: max |q| and f16 MMA fragments. ----
  float qinv_all;
  // Each thread loaded (raw, at the top) exactly the Q values of its own fragments; over
  // the CTA they cover Q [G, D] once, so max |q| comes from the same registers. (A
  // shared-memory staging copy read back per bf16 cost 16-way bank conflicts:
  // bench/RESULTS.md.)
  {
    float local_max = 0.0f;
#pragma unroll
    for (int it = 0; it < T::kQFragPerThread; ++it) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t w[2] = {raw[it][h].x, raw[it][h].y};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          local_max = fmaxf(local_max, fabsf(__uint_as_float(w[i] << 16)));
          local_max = fmaxf(local_max, fabsf(__uint_as_float(w[i] & 0xffff0000u)));
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, o));
    if (lane == 0) qmax_w[warp] = local_max;
    __syncthreads();
    float qmax = 0.0f;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) qmax = fmaxf(qmax, qmax_w[w]);
    // q * 2^(15 - e) < 2^15 fits f16; scores are scaled back by 2^(e - 15).
    int e2 = 0;
    if (qmax > 0.0f) frexpf(qmax, &e2);
    const float qscale = qmax > 0.0f ? ldexpf(1.0f, 15 - e2) : 1.0f;
    const float qinv = qmax > 0.0f ? ldexpf(1.0f, e2 - 15) : 1.0f;
    // bf16 bits -> float times the power-of-two scale (exact), low or high half of w.
    auto lo = [&](uint32_t w) { return __uint_as_float(w << 16) * qscale; };
    auto hi = [&](uint32_t w) { return __uint_as_float(w & 0xffff0000u) * qscale; };
#pragma unroll
    for (int it = 0; it < T::kQFragPerThread; ++it) {
      const int e = tid + it * T::kThreads;
      if (e >= T::kKSteps * 32) continue;
      const uint2 a = raw[it][0], c = raw[it][1];
      uint4 frag;
      frag.x = PackHalf2(lo(a.x), hi(a.x));
      frag.y = PackHalf2(lo(c.x), hi(c.x));
      frag.z = PackHalf2(lo(a.y), hi(a.y));
      frag.w = PackHalf2(lo(c.y), hi(c.y));
      if constexpr (kRows == 16) {
        reinterpret_cast<uint4*>(qfrag)[e] = frag;
      } else {
        reinterpret_cast<uint2*>(qfrag)[e] = make_uint2(frag.x, frag.z);
      }
    }
    // Every thread computed the same qinv from the same per-warp maxima.
    qinv_all = qinv;
  }
  __syncthreads();

  // ---- 3. Main loop: each sequence runs its own cp.async ring over steps seq, seq+4, ... ----
  const float qinv = qinv_all;
  const float kf_const = kPerToken ? 0.0f : k_layer * p.score_scale_log2 * qinv;

  // PV accumulators. G > 8: O[16 heads x 8 d] tiles, o[j][c] = (head grp + 8 (c / 2),
  // d = (2 tig + c % 2) * D/8 + j). G <= 8 (kTransposed): O^T[16 d x 8 heads] tiles,
  // half the MMAs of padded head rows: o[mt][c] = (d = grp * D/8 + 2 mt + c / 2,
  // head 2 tig + c % 2).
  constexpr bool kTransposed = kRows == 8;
  constexpr int kAccTiles = kTransposed ? D / 16 : T::kPvTiles;
  constexpr int kAccRegs = kTransposed ? 4 : 2 * kR;
  // (Unused in a softmax warp.)
  float o[kAccTiles][kAccRegs];
#pragma unroll
  for (int j = 0; j < kAccTiles; ++j)
#pragma unroll
    for (int c = 0; c < kAccRegs; ++c) o[j][c] = 0.0f;
  // Running softmax statistics. G > 8: of heads grp + 8 r (r < kR), summed over this
  // lane's tokens. G <= 8 (kTransposed): of heads 2 tig + e (e < 2), summed over this
  // lane's tokens grp, grp + 8 (the QK tile is S[16 tokens x 8 heads] there).
  constexpr int kStats = kTransposed ? 2 : kR;
  float m_s[kStats], m_u[kStats], l_s[kStats];
#pragma unroll
  for (int r = 0; r < kStats; ++r) m_s[r] = m_u[r] = NegInf(), l_s[r] = 0.0f;

  // With a PV warp: the softmax warp hands step i's P^T fragments and rescale factors to
  // the PV warp through slot i % 2 of its sequence; the slot of step i - 2 is free once
  // the PV warp has passed the hand-off of i - 1.
  auto pslot = [&](int i) {
    return reinterpret_cast<DecodePSlot*>(smem + T::kPSlotOffset) + seq * 2 + (i & 1);
  };
  // This step's K rows grp (half 0) and grp + 8 (half 1), this lane's d pieces:
  // kw[half][ks] = the 4 fp8 values of k-step ks, in the d order of the Q fragments.
  // st: the step's ring stage.
  auto load_k = [&](const uint8_t* st, uint32_t(&kw)[2][T::kKSteps]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int c = 0; c < D / 64; ++c) {
        const uint4 v = LoadShared16(st + T::Piece(half * 8 + grp, tig * (D / 64) + c));
        kw[half][4 * c + 0] = v.x;
        kw[half][4 * c + 1] = v.y;
        kw[half][4 * c + 2] = v.z;
        kw[half][4 * c + 3] = v.w;
      }
    }
  };
  // G <= 8: QK with K as the A operand: S[16 tokens x 8 heads] = K[16 tokens x 16 d] *
  // Q^T[16 d x 8 heads] per k-step, half the MMAs of Q as the A operand (whose rows
  // 8..15 would be padding). A: K rows grp, grp + 8, this lane's d pieces (the same d
  // order as the Q fragments, so the dot products pair up); B: the Q fragment (head
  // grp). sc (C): sc0, sc1 = tokens grp x heads 2tig, 2tig + 1; sc2, sc3 = grp + 8.
  auto qk_transposed = [&](const uint8_t* st, float(&sc)[4]) {
    uint32_t kw[2][T::kKSteps];
    load_k(st, kw);
    // k-step ks into accumulator ks % kDecodeQkChains: shorter dependent MMA chains,
    // summed in chain order after the last k-step.
    float acc[kDecodeQkChains][4] = {};
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) {
      const uint2 q = reinterpret_cast<const uint2*>(qfrag)[ks * 32 + lane];
      uint32_t k0lo, k0hi, k1lo, k1hi;
      Fp8x4ToHalf2x2(kw[0][ks], k0lo, k0hi);
      Fp8x4ToHalf2x2(kw[1][ks], k1lo, k1hi);
      MmaF16(acc[ks % kDecodeQkChains], k0lo, k1lo, k0hi, k1hi, q.x, q.y);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      sc[c] = acc[0][c];
#pragma unroll
      for (int ch = 1; ch < kDecodeQkChains; ++ch) sc[c] += acc[ch][c];
    }
  };
  // kQkAheadT (PV warps, G <= 8): the softmax warp computes QK one step ahead: step i +
  // 1's MMA chain is independent of step i's softmax (shuffles, exponentials), so the
  // two latency chains overlap in the one warp. The ring then keeps kStages - 3 steps in
  // flight ahead of the QK (the launch gives such kernels one stage more). Same
  // operations on the same values: the bits do not change. It pays where a sequence's
  // two warps have their scheduler to themselves (at most one CTA per SM): the extra QK
  // after the last step costs where two CTAs share an SM (bench/RESULTS.md).
  constexpr bool kQkAhead = kQkAheadT && kPvWarp && kTransposed;
  static_assert(!kQkAhead || T::kStages >= 4, "QK one step ahead needs 4 ring stages");
  float sc_next[4] = {};  // kQkAhead: the next step's scores
  if constexpr (kQkAhead) {
    if (softmax_warp && my_steps > 0) {
      CpAsyncWait<T::kStages - 3>();  // step 0 of the kStages - 2 the prologue issued
      __syncwarp();
      qk_transposed(ring, sc_next);
    }
  }
  for (int i = 0; i < my_steps; ++i) {
    if (!kPvWarp) {
      if (i + T::kStages - 1 < my_steps) issue(i + T::kStages - 1);
      CpAsyncCommit();
      CpAsyncWait<T::kStages - 1>();
      __syncwarp();
    } else if (softmax_warp) {
      // Refills the K rows of step i - 2's ring slot, whose QK this warp has done.
      if (i + T::kStages - 2 < my_steps) issue(i + T::kStages - 2);
      CpAsyncCommit();
      // Step i's K (kQkAhead: step i + 1's, whose QK this iteration computes).
      CpAsyncWait<kQkAhead ? T::kStages - 3 : T::kStages - 2>();
      __syncwarp();
    } else {
      // Refills the V rows of step i - 2's ring slot, whose P*V this warp has done; then
      // step i's V (its own copies, made visible to the whole warp by the __syncwarp).
      if (i + T::kStages - 2 < my_steps) issue(i + T::kStages - 2);
      CpAsyncCommit();
      CpAsyncWait<T::kStages - 2>();
      __syncwarp();
      NamedBarrierSync(kHandOffBarrier + seq, 64);  // step i's P
    }
    const uint8_t* st = ring + (i % T::kStages) * T::kStageBytes;
    const int tok0 = (seq + kDecodeWarps * i) * kDecodeStepTokens;

    // P as f16 words for the PV MMAs, hi + lo (PackHalf2Split): two MMAs per tile keep
    // ~22 bits of each p. G > 8: the A operand P[16 heads x 16 tokens]; G <= 8: the B
    // operand P^T[16 tokens x 8 heads] (pa1, pa3, pl1, pl3 unused).
    uint32_t pa0, pa1 = 0u, pa2, pa3 = 0u, pl0, pl1 = 0u, pl2, pl3 = 0u;
    // Rescale factors of this lane's O^T columns (heads 2 tig + e; PV warp only).
    float alpha_pv[2] = {1.0f, 1.0f};
    if (softmax_warp) {
      if constexpr (kTransposed) {
        // S[16 tokens x 8 heads] of this step (qk_transposed's C layout).
        float sc[4];
        if constexpr (kQkAhead) {
#pragma unroll
          for (int c = 0; c < 4; ++c) sc[c] = sc_next[c];
          // Step i + 1's scores. After the last step this reads the K rows of a stale
          // stage (no K copy is pending into it; with fewer steps than stages, bytes
          // never written) and the result goes unused: no branch, so that the MMAs
          // interleave with the softmax (with one, 1 request measured 0.6-0.9 us slower,
          // bench/RESULTS.md).
          qk_transposed(ring + ((i + 1) % T::kStages) * T::kStageBytes, sc_next);
        } else {
          qk_transposed(st, sc);
        }
        // Tokens grp (row a) and grp + 8 (row b): skipped ones masked, scaled to log2.
        const int ja = tok0 + grp, jb = tok0 + 8 + grp;
        const bool valid_a = rows[ja] >= 0, valid_b = rows[jb] >= 0;
        const float kf_a = kPerToken ? kf_tab[ja] * qinv : kf_const;
        const float kf_b = kPerToken ? kf_tab[jb] * qinv : kf_const;
        const float vl_a = kPerToken ? vl_tab[ja] : 0.0f, vl_b = kPerToken ? vl_tab[jb] : 0.0f;
        float pr[4];  // P (f32) in the C layout: [e] token grp, [2 + e] token grp + 8
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // head 2 tig + e
          const float sa = valid_a ? sc[e] * kf_a : NegInf();
          const float sb = valid_b ? sc[2 + e] * kf_b : NegInf();
          // Max over the 16 tokens: this lane's two, then the 8 lanes of this tig.
          const MaxStep ms = RaiseMax(m_s[e], MaxOverGrpLanes(fmaxf(sa, sb)));
          const float pa = FastExp2(sa - ms.base), pb = FastExp2(sb - ms.base);
          // Explicit fused multiply-adds here and in every sum the kernel instances and
          // the merges share: contracting a * b + c is nvcc's choice per instance, and
          // the bits must not depend on the instance (fused or PV warps, batch size).
          l_s[e] = __fmaf_rn(l_s[e], ms.alpha, pa + pb);
          pr[e] = pa;
          pr[2 + e] = pb;
          float alpha_o = ms.alpha;
          if constexpr (kPerToken) {
            const float ua = sa + vl_a, ub = sb + vl_b;
            const MaxStep mu = RaiseMax(m_u[e], MaxOverGrpLanes(fmaxf(ua, ub)));
            alpha_o = mu.alpha;
            pr[e] = FastExp2(ua - mu.base);
            pr[2 + e] = FastExp2(ub - mu.base);
          }
          // O^T columns are heads 2 tig, 2 tig + 1: this lane's own statistics (with a
          // PV warp, that warp rescales them with the same factor).
          alpha_pv[e] = alpha_o;
          if constexpr (!kPvWarp) {
#pragma unroll
            for (int mt = 0; mt < kAccTiles; ++mt) {
              o[mt][e] *= alpha_o;
              o[mt][2 + e] *= alpha_o;
            }
          }
        }
        // [token][head] words -> P^T B fragments (tokens 2tig, 2tig + 1 | + 8, head grp).
        uint32_t ha, la, hb, lb;
        PackHalf2Split(pr[0], pr[1], ha, la);
        PackHalf2Split(pr[2], pr[3], hb, lb);
        pa0 = TransposeHalf8x8(ha);
        pl0 = TransposeHalf8x8(la);
        pa2 = TransposeHalf8x8(hb);
        pl2 = TransposeHalf8x8(lb);
      } else {
        uint32_t kw[2][T::kKSteps];
        load_k(st, kw);
        // QK^T for tokens tok0 + nt * 8 + n (n = grp holds the K row in the B operand).
        float s[2][4] = {};
        {
          // One accumulator chain per n-tile: a split like G <= 8's would cost registers
          // that G > 8 cannot spare (bench/RESULTS.md).
#pragma unroll
          for (int ks = 0; ks < T::kKSteps; ++ks) {
            const uint4 a = reinterpret_cast<const uint4*>(qfrag)[ks * 32 + lane];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              uint32_t b0, b1;
              Fp8x4ToHalf2x2(kw[nt][ks], b0, b1);
              MmaF16(s[nt], a.x, a.y, a.z, a.w, b0, b1);
            }
          }
        }

        // Scale to log2 units, mask skipped tokens, online softmax per head row.
        float kf[2][2], vl[2][2];
        bool valid[2][2];
        LoadTokenColumns<kPerToken>(rows, kf_tab, vl_tab, tok0 + 2 * tig, qinv, kf_const, valid, kf,
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
        PackHalf2Split(pr[0][0], pr[0][1], pa0, pl0);
        PackHalf2Split(pr[1][0], pr[1][1], pa2, pl2);
        PackHalf2Split(pr[0][2], pr[0][3], pa1, pl1);
        PackHalf2Split(pr[1][2], pr[1][3], pa3, pl3);
      }
      if constexpr (kPvWarp) {
        // Hand step i to the PV warp (which waits there once done with step i - 1).
        DecodePSlot* slot = pslot(i);
        slot->p[lane] = make_uint4(pa0, pa2, pl0, pl2);
        slot->alpha[lane] = make_uint2(__float_as_uint(alpha_pv[0]), __float_as_uint(alpha_pv[1]));
        NamedBarrierSync(kHandOffBarrier + seq, 64);
      }
    }  // softmax_warp

    // PV: thread (grp, tig) feeds V rows 2tig, 2tig+1, 2tig+8, 2tig+9 at d = grp*D/8 + j.
    if (pv_warp) {
      if constexpr (kPvWarp) {
        // The softmax warp's P^T fragments and factors of step i; the rescale is the
        // multiplication the fused warp does in its softmax.
        const uint4 pw = pslot(i)->p[lane];
        const uint2 aw = pslot(i)->alpha[lane];
        pa0 = pw.x, pa2 = pw.y, pl0 = pw.z, pl2 = pw.w;
        alpha_pv[0] = __uint_as_float(aw.x), alpha_pv[1] = __uint_as_float(aw.y);
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
          for (int mt = 0; mt < kAccTiles; ++mt) {
            o[mt][e] *= alpha_pv[e];
            o[mt][2 + e] *= alpha_pv[e];
          }
      }
      const uint8_t* vs = st + kDecodeStepTokens * D;
      constexpr int kWords = D / 32;  // 32-bit words per thread per row
      uint32_t w[4][kWords];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = 2 * tig + (q & 1) + (q >> 1) * 8;
        if constexpr (D == 64) {
          const uint2 v =
              *reinterpret_cast<const uint2*>(vs + T::Piece(r, grp >> 1) + (grp & 1) * 8);
          w[q][0] = v.x;
          w[q][1] = v.y;
        } else {
#pragma unroll
          for (int c = 0; c < D / 128; ++c) {
            const uint4 v = LoadShared16(vs + T::Piece(r, grp * (D / 128) + c));
            w[q][4 * c + 0] = v.x;
            w[q][4 * c + 1] = v.y;
            w[q][4 * c + 2] = v.z;
            w[q][4 * c + 3] = v.w;
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
        if constexpr (kTransposed) {
          // A = V^T rows (d0, d0 + 1) x tokens: b0[2h], b0[2h + 1] (tokens 2tig, 2tig + 1)
          // and b1[2h], b1[2h + 1] (2tig + 8, 2tig + 9) for d0 = grp * D/8 + 4k + 2h;
          // B = P^T (tokens 2tig, 2tig + 1 | + 8 x head grp), transposed from the QK tile.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float(&oj)[4] = o[2 * k + h];
            MmaF16(oj, b0[2 * h], b0[2 * h + 1], b1[2 * h], b1[2 * h + 1], pa0, pa2);
            MmaF16(oj, b0[2 * h], b0[2 * h + 1], b1[2 * h], b1[2 * h + 1], pl0, pl2);
          }
        } else {
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            float(&oj)[4] = o[4 * k + x];  // G > 8: kAccRegs = 4
            MmaF16(oj, pa0, pa1, pa2, pa3, b0[x], b1[x]);
            MmaF16(oj, pl0, pl1, pl2, pl3, b0[x], b1[x]);
          }
        }
      }
    }
    __syncwarp();
  }
  if constexpr (kPvWarp) {
    // Sequences with a step fewer than sequence 0 pass the hand-off barrier as often as
    // it does (an empty hand-off), so that every warp passes the same number of named
    // barriers. Each sequence's two warps already pass its barrier equally often, so this
    // changes no ordering; without it compute-sanitizer's racecheck reported thousands of
    // RAW hazards across the __syncthreads below (with it: 0, H200, 2026-11-30).
    const int max_steps = (num_steps + kDecodeWarps - 1) / kDecodeWarps;
    for (int i = my_steps; i < max_steps; ++i) NamedBarrierSync(kHandOffBarrier + seq, 64);
  }
  CpAsyncWait<0>();

  // A one-chunk request's CTA finishes its heads itself: its gate loads (towards L2 since
  // the prologue) go out now, under the sequence merge's barriers.
  constexpr int kFinishW = kDecodeFinishWidth<T::kThreads>;
  constexpr int kFinishGroups = kDecodeFinishGroups<D, kRows, T::kThreads>;
  typename FinishVec<kFinishW>::Gates gate_bits[kFinishGroups];
  if (num_chunks == 1) {
    LoadFinishGates<D, kRows, T::kThreads>(p.gate + head0 * D, G, gate_bits);
  }

  // ---- 4. Merge the 4 sequences (fixed order) through shared memory. ----
  // l: the sum over the lanes that hold a head's other tokens (G > 8: the 4 tig lanes;
  // G <= 8: the 8 grp lanes).
#pragma unroll
  for (int r = 0; r < kStats; ++r) {
    if constexpr (kTransposed) {
      l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 4);
      l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 8);
      l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 16);
    } else {
      l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 1);
      l_s[r] += __shfl_xor_sync(0xffffffffu, l_s[r], 2);
    }
    if constexpr (!kPerToken) m_u[r] = m_s[r];
  }
  __syncthreads();  // every warp is done with the ring: reuse it as scratch
  // [sequences][G][D], columns at T::OutColT (G <= 8) or T::OutCol (G > 8). With PV
  // warps, a sequence's PV warp writes its outputs and its softmax warp the statistics.
  float* ow = reinterpret_cast<float*>(smem);
  if constexpr (kTransposed) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int g = 2 * tig + e;
      if (g < G) {
        float* dst = ow + (seq * G + g) * D;
#pragma unroll
        for (int mt = 0; mt < kAccTiles && pv_warp; ++mt) {
          const int d = grp * (D / 8) + 2 * mt;
          dst[T::OutColT(g, d)] = o[mt][e];
          dst[T::OutColT(g, d + 1)] = o[mt][2 + e];
        }
        if (grp == 0 && softmax_warp) {
          float* sp = stats + (seq * kDecodeMaxGroup + g) * 4;
          sp[0] = m_s[e];
          sp[1] = m_u[e];
          sp[2] = l_s[e];
        }
      }
    }
  }
  if constexpr (!kTransposed) {
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const int g = grp + 8 * r;
      if (g < G) {
        float* dst = ow + (seq * G + g) * D;
#pragma unroll
        for (int j = 0; j < T::kPvTiles; ++j) {
          dst[T::OutCol(g, 2 * tig * (D / 8) + j)] = o[j][2 * r];
          dst[T::OutCol(g, (2 * tig + 1) * (D / 8) + j)] = o[j][2 * r + 1];
        }
        if (tig == 0) {
          float* sp = stats + (seq * kDecodeMaxGroup + g) * 4;
          sp[0] = m_s[r];
          sp[1] = m_u[r];
          sp[2] = l_s[r];
        }
      }
    }
  }
  __syncthreads();
  // head[g]: {max_s, max_u, l, unused, factor of sequence 0..3}
  if (tid < G) {
    const int g = tid;
    float ms = NegInf(), mu = NegInf();
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      ms = fmaxf(ms, stats[(w * kDecodeMaxGroup + g) * 4 + 0]);
      mu = fmaxf(mu, stats[(w * kDecodeMaxGroup + g) * 4 + 1]);
    }
    const float bs = ms == NegInf() ? 0.0f : ms, bu = mu == NegInf() ? 0.0f : mu;
    float l = 0.0f;
    float* hp = head + g * (4 + kDecodeWarps);
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float* sp = stats + (w * kDecodeMaxGroup + g) * 4;
      l = __fmaf_rn(sp[2], FastExp2(sp[0] - bs), l);
      hp[4 + w] = FastExp2(sp[1] - bu);
    }
    hp[0] = ms;
    hp[1] = mu;
    hp[2] = l;
  }
  __syncthreads();

  // Writes the gated bf16 outputs d0 .. d0 + W - 1 of head g from merged (unnormalised)
  // values, in one store (W bf16: consecutive threads' groups are adjacent, so a warp
  // writes whole sectors), and lse of head g with its group d0 = 0. gate_bits: p.gate at
  // the same elements. One store per group matters where out is mapped host memory (the
  // server's staging): per-element 2-byte stores of groups W elements apart each become a
  // partial write there.
  using FinishOut = typename FinishVec<kFinishW>::Gates;  // W bf16
  auto finish = [&](int g, int d0, const float(&val)[kFinishW], const FinishOut& gate_bits,
                    float ms, float mu, float l) {
    const float f = l > 0.0f ? FastExp2(mu - ms) * v_layer / l : 0.0f;
    FinishOut res_bits;
    uint16_t* res = reinterpret_cast<uint16_t*>(&res_bits);
#pragma unroll
    for (int j = 0; j < kFinishW; ++j) {
      const float r = l > 0.0f ? val[j] * f : 0.0f;
      const float gate =
          __uint_as_float(static_cast<uint32_t>(GateBits<kFinishW>(gate_bits, j)) << 16);
      res[j] = __bfloat16_as_ushort(__float2bfloat16_rn(r * Sigmoid(gate)));
    }
    *reinterpret_cast<FinishOut*>(p.out + (head0 + g) * D + d0) = res_bits;
    if (d0 == 0 && p.lse != nullptr)
      p.lse[head0 + g] = l > 0.0f ? (ms + log2f(l)) * 0.69314718055994531f : NegInf();
  };

  // This chunk's value of element e = g * D + d: the sequences' outputs in sequence order.
  auto chunk_value = [&](int g, int d) {
    const float* hp = head + g * (4 + kDecodeWarps);
    float val = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w)
      val = __fmaf_rn(ow[(w * G + g) * D + T::template ScratchCol<kTransposed>(g, d)], hp[4 + w],
                      val);
    return val;
  };

  if (num_chunks == 1) {
    constexpr int W = kFinishW;
#pragma unroll
    for (int k = 0; k < kFinishGroups; ++k) {
      const int q = tid + k * T::kThreads, g = W * q / D;
      if (W * q >= G * D) break;
      const float* hp = head + g * (4 + kDecodeWarps);
      const int d0 = (W * q) % D;
      float val[W];
#pragma unroll
      for (int j = 0; j < W; ++j) val[j] = chunk_value(g, d0 + j);
      finish(g, d0, val, gate_bits[k], hp[0], hp[1], hp[2]);
    }
    if (cluster_merge) ClusterWait();
    return;
  }

  // ---- 5. Split-K: this chunk's partial [G][D] and statistics [G][4] f32, merged in
  // chunk order: by chunk 0 from its receive area (cluster launch), or by the last chunk
  // CTA to finish through the global workspace. ----
  // Merge factors of the merging CTA at ring start (the sequences' outputs are consumed).
  float* cf = reinterpret_cast<float*>(smem);
  using MergeFloats = typename FinishVec<kDecodeFinishWidth<T::kThreads>>::Floats;
  // This chunk's partial into part [G][D] and its statistics {max_s, max_u, l, 0} into
  // stat [G][kDecodeStatFloats] (chunk 0's own slot, or the global workspace).
  auto store_partial = [&](float* part, float* stat) {
    for (int e = tid; e < G * D; e += T::kThreads) part[e] = chunk_value(e / D, e % D);
    if (tid < G) {
      const float* hp = head + tid * (4 + kDecodeWarps);
      float* sp = stat + tid * kDecodeStatFloats;
      sp[0] = hp[0];
      sp[1] = hp[1];
      sp[2] = hp[2];
      sp[3] = 0.0f;
    }
  };
  if (cluster_merge) {
    if (chunk != 0) {
      // Push into chunk 0's slot `chunk`: no fence and no wait for chunk 0; its mbarrier
      // counts the bytes, and this CTA may exit once the stores are issued.
      ClusterWait();  // chunk 0 has started and initialised its mbarrier
      const uint32_t bar0 = ClusterMapShared(recv_bar, 0);
      const uint32_t part0 =
          ClusterMapShared(SmemAddress(recv_part + static_cast<int64_t>(chunk) * G * D), 0);
      for (int e = tid; e < G * D; e += T::kThreads)
        StoreAsyncCluster(part0 + 4 * e, chunk_value(e / D, e % D), bar0);
      if (tid < G * kDecodeStatFloats) {
        const int g = tid / kDecodeStatFloats, k = tid % kDecodeStatFloats;
        const float* hp = head + g * (4 + kDecodeWarps);
        const uint32_t stat0 = ClusterMapShared(
            SmemAddress(recv_stats + (chunk * kDecodeMaxGroup + g) * kDecodeStatFloats + k), 0);
        StoreAsyncCluster(stat0, k < 3 ? hp[k] : 0.0f, bar0);
      }
      return;
    }
    store_partial(recv_part, recv_stats);
    ClusterWait();                     // pairs this CTA's arrive (long since complete)
    MbarrierWaitCluster(recv_bar, 0);  // every other chunk's bytes have landed
    __syncthreads();                   // and slot 0 is written
    MergeChunks<D, kRows, T::kThreads>(
        cf, num_chunks, G,
        [&](int c, int g, int k) {
          return recv_stats[(c * kDecodeMaxGroup + g) * kDecodeStatFloats + k];
        },
        [&](int c, int q) {
          return reinterpret_cast<const MergeFloats*>(recv_part +
                                                      static_cast<int64_t>(c) * G * D)[q];
        },
        p.gate + head0 * D, finish);
    return;
  }
  const int64_t pair = static_cast<int64_t>(b) * hkv + kvh;
  float* po = p.partial_o + (pair * p.max_chunks) * G * D;                      // [chunks][G][D]
  float* ps = p.partial_stats + (pair * p.max_chunks) * G * kDecodeStatFloats;  // [chunks][G][4]
  store_partial(po + static_cast<int64_t>(chunk) * G * D, ps + chunk * G * kDecodeStatFloats);
  __threadfence();
  __syncthreads();
  int* last_flag = reinterpret_cast<int*>(smem + T::kFlagOffset);
  if (tid == 0) *last_flag = atomicAdd(p.counters + pair, 1) == num_chunks - 1;
  __syncthreads();
  if (!*last_flag) return;
  __threadfence();
  MergeChunks<D, kRows, T::kThreads>(
      cf, num_chunks, G,
      [&](int c, int g, int k) { return __ldcg(ps + (c * G + g) * kDecodeStatFloats + k); },
      [&](int c, int q) {
        return __ldcg(reinterpret_cast<const MergeFloats*>(po + static_cast<int64_t>(c) * G * D) +
                      q);
      },
      p.gate + head0 * D, finish);
  if (tid == 0) p.counters[pair] = 0;
}

}  // namespace sds::cuda
