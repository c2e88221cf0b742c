// The decode's output finish: the merge of a request's chunk partials in chunk order
// (MergeChunks, shared by the cluster and the global-workspace merges) and the grouped
// loads of partials and gates it and the one-chunk path use. Device code only.
#pragma once

#include <cstdint>

#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/cuda/decode_softmax.cuh"
#include "kernels/cuda/device_utils.cuh"

namespace sds::cuda {

// Outputs are finished in groups of kDecodeFinishWidth consecutive elements of one head
// (D % 4 == 0): group q = tid + k * kThreads (k < kDecodeFinishGroups) holds elements
// W q .. W q + W - 1 of the G x D outputs of one KV head (G <= kRows), so each load moves
// W floats (partials) or W bf16 (gates) at once. W = 4 for 128-thread CTAs, 2 for the
// 256 threads of PV-warp CTAs: at G = 4, D = 128 one group per thread either way (the
// per-element finish is long: wider groups would leave threads idle).
template <int kThreads>
inline constexpr int kDecodeFinishWidth = kThreads >= 256 ? 2 : 4;
template <int D, int kRows, int kThreads>
inline constexpr int kDecodeFinishGroups =
    (kRows * D / kDecodeFinishWidth<kThreads> + kThreads - 1) / kThreads;

// W floats of a partial (float4 or float2) and W bf16 gates (uint2 or one word).
template <int W>
struct FinishVec {
  using Floats = float4;
  using Gates = uint2;
};
template <>
struct FinishVec<2> {
  using Floats = float2;
  using Gates = uint32_t;
};
template <int W>
__device__ __forceinline__ float VecElem(const typename FinishVec<W>::Floats& v, int j) {
  return reinterpret_cast<const float*>(&v)[j];
}
template <int W>
__device__ __forceinline__ uint16_t GateBits(const typename FinishVec<W>::Gates& g, int j) {
  const uint32_t w = reinterpret_cast<const uint32_t*>(&g)[j >> 1];
  return static_cast<uint16_t>((j & 1) ? w >> 16 : w & 0xffffu);
}

// Gate bits of this thread's finish groups of [G, D] `gate` (the heads of one KV head,
// 8-byte aligned), loaded at once so that one round trip serves all.
template <int D, int kRows, int kThreads>
__device__ __forceinline__ void LoadFinishGates(
    const uint16_t* gate, int G,
    typename FinishVec<kDecodeFinishWidth<kThreads>>::Gates (
        &bits)[kDecodeFinishGroups<D, kRows, kThreads>]) {
  constexpr int W = kDecodeFinishWidth<kThreads>;
  using Gates = typename FinishVec<W>::Gates;
#pragma unroll
  for (int k = 0; k < kDecodeFinishGroups<D, kRows, kThreads>; ++k) {
    const int q = threadIdx.x + k * kThreads;
    bits[k] = W * q < G * D ? reinterpret_cast<const Gates*>(gate)[q] : Gates{};
  }
}

// Merges the chunk partials of one (request, KV head) in chunk order and hands each
// group of W elements to finish(g, d0, val[W], gate_bits, max_s, max_u, l) (elements d0 ..
// d0 + W - 1 of head g, their W gates). stat(c, g, k): statistic k (0
// max_s, 1 max_u, 2 l) of head g in chunk c; part(c, q): elements W q .. W q + W - 1
// (e = g * D + d) of chunk c's partial (FinishVec<W>::Floats); gate: [G, D] bf16 bits
// of these heads. The
// global workspace and the cluster's shared memory both go through here, so both give
// the same bits (and so does any kThreads, the CTA's thread count: each element's
// operations do not depend on which thread runs them). Every load of a phase is issued
// before any result is used (gates with the statistics; the partials of four chunks for
// all of the thread's groups at once), so the merge costs a few round trips, not one per
// element. cf: [16 * num_chunks + 64] f32 of shared memory.
template <int D, int kRows, int kThreads, class Stat, class Part, class Finish>
__device__ __forceinline__ void MergeChunks(float* cf, int num_chunks, int G, const Stat& stat,
                                            const Part& part, const uint16_t* gate,
                                            const Finish& finish) {
  constexpr int kGroups = kDecodeFinishGroups<D, kRows, kThreads>;
  constexpr int W = kDecodeFinishWidth<kThreads>;
  const int tid = threadIdx.x;
  typename FinishVec<W>::Gates gate_bits[kGroups];
  LoadFinishGates<D, kRows, kThreads>(gate, G, gate_bits);
  float* hm = cf + kDecodeMaxGroup * num_chunks;  // [G][4]: ms, mu, l
  if (tid < G) {
    const int g = tid;
    float ms = NegInf(), mu = NegInf();
#pragma unroll 4
    for (int c = 0; c < num_chunks; ++c) {
      ms = fmaxf(ms, stat(c, g, 0));
      mu = fmaxf(mu, stat(c, g, 1));
    }
    const float bs = ms == NegInf() ? 0.0f : ms, bu = mu == NegInf() ? 0.0f : mu;
    float l = 0.0f;
#pragma unroll 4
    for (int c = 0; c < num_chunks; ++c) {
      l = __fmaf_rn(stat(c, g, 2), FastExp2(stat(c, g, 0) - bs), l);
      cf[g * num_chunks + c] = FastExp2(stat(c, g, 1) - bu);
    }
    hm[g * 4 + 0] = ms;
    hm[g * 4 + 1] = mu;
    hm[g * 4 + 2] = l;
  }
  __syncthreads();
  // val[k][j] of element W q_k + j: the sum over chunks in chunk order (chunks outermost,
  // so the loads of several chunks for all groups are in flight together).
  float val[kGroups][W];
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
#pragma unroll
    for (int j = 0; j < W; ++j) val[k][j] = 0.0f;
#pragma unroll 4
  for (int c = 0; c < num_chunks; ++c) {
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const int q = tid + k * kThreads;
      if (W * q >= G * D) continue;
      const typename FinishVec<W>::Floats v = part(c, q);
      const float f = cf[(W * q / D) * num_chunks + c];
#pragma unroll
      for (int j = 0; j < W; ++j) val[k][j] = __fmaf_rn(VecElem<W>(v, j), f, val[k][j]);
    }
  }
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    const int q = tid + k * kThreads, g = W * q / D;
    if (W * q >= G * D) continue;
    finish(g, (W * q) % D, val[k], gate_bits[k], hm[g * 4 + 0], hm[g * 4 + 1], hm[g * 4 + 2]);
  }
}

}  // namespace sds::cuda
