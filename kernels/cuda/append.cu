// Append: quantises a batch's new bf16 K/V rows into the paged FP8 cache in one launch.
// One warp per (token, KV head, K|V) row; the quantisation calls the same host/device
// functions of kernels/fp8.h as CpuAppend, so the bytes and scales are bit-identical.
#include <cstdint>

#include "kernels/cuda/kernel_launch.h"
#include "kernels/fp8.h"

namespace sds::cuda {
namespace {

constexpr int kAppendThreads = 256;

template <int D>
__global__ void __launch_bounds__(kAppendThreads)
    AppendKernel(const CacheView cache, const AppendBatch append) {
  constexpr int kPerLane = D / 32;  // 2, 4 or 8 elements
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * kAppendThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  const int hkv = cache.geo.num_kv_heads;
  if (warp_id >= static_cast<int64_t>(append.num_tokens) * hkv * 2) return;
  const bool is_v = warp_id & 1;
  const int64_t in_row = warp_id >> 1;  // n * Hkv + h
  const int64_t n = in_row / hkv;
  const int h = static_cast<int>(in_row % hkv);

  // src: [N, Hkv, D] bf16; this lane's kPerLane consecutive elements.
  const uint16_t* src = (is_v ? append.v_new : append.k_new) + in_row * D + lane * kPerLane;
  uint16_t bits[kPerLane];
  if constexpr (kPerLane == 2) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(src);
    bits[0] = w & 0xffff, bits[1] = w >> 16;
  } else if constexpr (kPerLane == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    const uint32_t ws[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) bits[2 * i] = ws[i] & 0xffff, bits[2 * i + 1] = ws[i] >> 16;
  } else {
    const uint4 w = *reinterpret_cast<const uint4*>(src);
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) bits[2 * i] = ws[i] & 0xffff, bits[2 * i + 1] = ws[i] >> 16;
  }
  float x[kPerLane];
  float max_abs = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = Bf16ToFloat(bits[i]);
    max_abs = fmaxf(max_abs, fabsf(x[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, o));

  const int32_t layer = append.layer[n];
  const int64_t row = append.slot[n] * hkv + h;  // row of the [.., Hkv] storage
  const bool per_token = cache.geo.scale_mode == ScaleMode::kPerTokenHead;
  const float scale = per_token ? PerTokenHeadScale(max_abs)
                                : (is_v ? cache.layer_v_scale[layer] : cache.layer_k_scale[layer]);
  uint8_t codes[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) codes[i] = QuantiseFp8E4m3(x[i], scale);

  // dst: k or v [L, P, page_size, Hkv, D] bytes.
  uint8_t* dst = (is_v ? cache.v : cache.k) +
                 static_cast<int64_t>(layer) * cache.geo.num_pages * cache.geo.page_size * hkv * D +
                 row * D + lane * kPerLane;
  if constexpr (kPerLane == 2) {
    *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(codes[0] | (codes[1] << 8));
  } else if constexpr (kPerLane == 4) {
    *reinterpret_cast<uint32_t*>(dst) =
        codes[0] | (codes[1] << 8) | (codes[2] << 16) | (static_cast<uint32_t>(codes[3]) << 24);
  } else {
    uint32_t lo =
        codes[0] | (codes[1] << 8) | (codes[2] << 16) | (static_cast<uint32_t>(codes[3]) << 24);
    uint32_t hi =
        codes[4] | (codes[5] << 8) | (codes[6] << 16) | (static_cast<uint32_t>(codes[7]) << 24);
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  }
  if (per_token && lane == 0) {
    float* scales = is_v ? cache.v_token_scale : cache.k_token_scale;
    scales[static_cast<int64_t>(layer) * cache.geo.num_pages * cache.geo.page_size * hkv + row] =
        scale;
  }
}

template <int D>
cudaError_t Launch(const CacheView& cache, const AppendBatch& append, cudaStream_t stream) {
  const int64_t warps = static_cast<int64_t>(append.num_tokens) * cache.geo.num_kv_heads * 2;
  const int64_t blocks = (warps * 32 + kAppendThreads - 1) / kAppendThreads;
  AppendKernel<D><<<static_cast<unsigned>(blocks), kAppendThreads, 0, stream>>>(cache, append);
  return cudaGetLastError();
}

}  // namespace

cudaError_t EnqueueAppend(const CacheView& cache, const AppendBatch& append, cudaStream_t stream) {
  if (append.num_tokens <= 0) return cudaSuccess;
  switch (cache.geo.head_dim) {
    case 64:
      return Launch<64>(cache, append, stream);
    case 128:
      return Launch<128>(cache, append, stream);
    case 256:
      return Launch<256>(cache, append, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sds::cuda
