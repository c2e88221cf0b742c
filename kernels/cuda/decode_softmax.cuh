// Online-softmax pieces shared by the v1 and v2 decode kernels (base 2). The S^T layout
// helpers serve a QK accumulator S^T[16 heads x 8 tokens] per n-tile nt (m16n8 C
// layout): lane (grp, tig) holds heads grp + 8 r (r < 2) at tokens nt * 8 + 2 tig, + 1.
#pragma once

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"

namespace sds::cuda {

__device__ __forceinline__ float NegInf() { return __int_as_float(0xff800000); }

// One online-softmax step of a running maximum m: m <- max(m, tile_max).
// base: what this tile's exponents are taken against (0 while nothing was valid);
// alpha: the factor that rescales what was accumulated against the old maximum.
struct MaxStep {
  float base, alpha;
};
__device__ __forceinline__ MaxStep RaiseMax(float& m, float tile_max) {
  const float m_new = fmaxf(m, tile_max);
  const float base = m_new == NegInf() ? 0.0f : m_new;
  const MaxStep step{base, FastExp2(m - base)};
  m = m_new;
  return step;
}

// Max over the 8 lanes that share this lane's tig (xor 4, 8, 16).
__device__ __forceinline__ float MaxOverGrpLanes(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

// Per-token inputs of this lane's S^T columns: tokens j0 + nt * 8 + e (j0 = the step's
// first table entry + 2 tig). rows: [chunk] cache rows (-1: skipped); kf_tab, vl_tab:
// [chunk] k_scale * log2(e) / sqrt(D) and log2 v_scale (per_token_head mode only).
// valid: the row exists; kf: score factor (times qinv); vl: log2 v_scale (0 per_tensor).
template <bool kPerToken>
__device__ __forceinline__ void LoadTokenColumns(const int32_t* rows, const float* kf_tab,
                                                 const float* vl_tab, int j0, float qinv,
                                                 float kf_const, bool (&valid)[2][2],
                                                 float (&kf)[2][2], float (&vl)[2][2]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int j = j0 + nt * 8;
    const int2 rr = *reinterpret_cast<const int2*>(rows + j);
    valid[nt][0] = rr.x >= 0;
    valid[nt][1] = rr.y >= 0;
    if constexpr (kPerToken) {
      const float2 kk = *reinterpret_cast<const float2*>(kf_tab + j);
      const float2 vv = *reinterpret_cast<const float2*>(vl_tab + j);
      kf[nt][0] = kk.x * qinv, kf[nt][1] = kk.y * qinv, vl[nt][0] = vv.x, vl[nt][1] = vv.y;
    } else {
      kf[nt][0] = kf[nt][1] = kf_const;
      vl[nt][0] = vl[nt][1] = 0.0f;
    }
  }
}

// The online-softmax step of row r (head grp + 8 r) of an S^T tile pair s[nt][c]:
// masks skipped tokens, scales to log2 units, raises the running maxima m_s (scores) and
// m_u (score + log2 v_scale, per_token_head mode), adds this step's sum to l_s, writes P
// (f32, the accumulator layout) into pr[nt][2 r + e]. Returns the factor that rescales
// the row's accumulated output. The sum over the 4 tig lanes happens at the end.
template <bool kPerToken>
__device__ __forceinline__ float SoftmaxRowStep(const float (&s)[2][4], int r,
                                                const bool (&valid)[2][2], const float (&kf)[2][2],
                                                const float (&vl)[2][2], float& m_s, float& m_u,
                                                float& l_s, float (&pr)[2][4]) {
  float sv[2][2], uv[2][2];
  float mx = NegInf(), mxu = NegInf();
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      sv[nt][e] = valid[nt][e] ? s[nt][2 * r + e] * kf[nt][e] : NegInf();
      uv[nt][e] = sv[nt][e] + vl[nt][e];
      mx = fmaxf(mx, sv[nt][e]);
      mxu = fmaxf(mxu, uv[nt][e]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const MaxStep ms = RaiseMax(m_s, mx);
  float sum = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float ps = FastExp2(sv[nt][e] - ms.base);
      sum += ps;
      pr[nt][2 * r + e] = ps;
    }
  l_s = __fmaf_rn(l_s, ms.alpha, sum);
  float alpha_o = ms.alpha;
  if constexpr (kPerToken) {
    mxu = fmaxf(mxu, __shfl_xor_sync(0xffffffffu, mxu, 1));
    mxu = fmaxf(mxu, __shfl_xor_sync(0xffffffffu, mxu, 2));
    const MaxStep mu = RaiseMax(m_u, mxu);
    alpha_o = mu.alpha;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) pr[nt][2 * r + e] = FastExp2(uv[nt][e] - mu.base);
  }
  return alpha_o;
}

}  // namespace sds::cuda
