// The canonical arithmetic shared by every path of the v2 decode kernel: the fold of
// one unit's partial into a request's running state, and the gated bf16 output. Every
// operation is an explicit round-to-nearest intrinsic so that the compiler can neither
// contract nor reorder it: the v2 main kernel (folding in registers) and the merge
// kernel (folding partials read back from global memory) produce the same bits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/decode_softmax.cuh"
#include "kernels/cuda/device_utils.cuh"

namespace sds::cuda {

// Per (query head) softmax statistics of a unit or of a running fold, base 2:
// ms: max score, mu: max of score + log2 v_scale (== ms in per_tensor mode), l: sum of
// 2^(s - ms). An empty state is {-inf, -inf, 0} with o = 0.
struct V2Stats {
  float ms, mu, l;
};

// Fold factors of acc and unit: l = acc.l * fa + unit.l * fu; o = acc.o * ga + unit.o * gu.
struct V2FoldFactors {
  float ga, gu;
};

__device__ __forceinline__ V2FoldFactors V2FoldStats(V2Stats& acc, const V2Stats& unit) {
  const float ms = fmaxf(acc.ms, unit.ms);
  const float bs = ms == NegInf() ? 0.0f : ms;
  const float fa = FastExp2(__fsub_rn(acc.ms, bs)), fu = FastExp2(__fsub_rn(unit.ms, bs));
  const float mu = fmaxf(acc.mu, unit.mu);
  const float bu = mu == NegInf() ? 0.0f : mu;
  V2FoldFactors f;
  f.ga = FastExp2(__fsub_rn(acc.mu, bu));
  f.gu = FastExp2(__fsub_rn(unit.mu, bu));
  acc.l = __fmaf_rn(acc.l, fa, __fmul_rn(unit.l, fu));
  acc.ms = ms;
  acc.mu = mu;
  return f;
}

__device__ __forceinline__ float V2FoldO(float acc_o, float unit_o, const V2FoldFactors& f) {
  return __fmaf_rn(acc_o, f.ga, __fmul_rn(unit_o, f.gu));
}

// Gated bf16 output of one element from the folded state (0 for a row with no valid index).
__device__ __forceinline__ uint16_t V2Output(float o, const V2Stats& st, float v_layer,
                                             uint16_t gate_bits) {
  float res = 0.0f;
  if (st.l > 0.0f)
    res = __fmul_rn(o, __fdiv_rn(__fmul_rn(FastExp2(__fsub_rn(st.mu, st.ms)), v_layer), st.l));
  const float gate = __uint_as_float(static_cast<uint32_t>(gate_bits) << 16);
  const float sig = __frcp_rn(__fadd_rn(1.0f, expf(-gate)));
  return __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(res, sig)));
}

// Natural-log lse of a folded state (-inf for a row with no valid index).
__device__ __forceinline__ float V2Lse(const V2Stats& st) {
  return st.l > 0.0f ? __fmul_rn(__fadd_rn(st.ms, log2f(st.l)), 0.69314718055994531f) : NegInf();
}

}  // namespace sds::cuda
