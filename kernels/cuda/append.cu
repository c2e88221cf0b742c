// Append: quantises a batch's new bf16 K/V rows into the paged FP8 cache in one launch.
// D / 8 lanes per (token, KV head, K|V) row, 8 elements per lane: one 16-byte load, one
// 8-byte store (16 elements per lane and a 16-byte store measured no faster). The row's layer and
// slot are loaded together with its data. stored = fp8(x / scale) with the IEEE division and scale
// of kernels/fp8.h (as CpuAppend) and the hardware E4M3 conversion (round to nearest even,
// saturating to
// +-448: the same bytes as FloatToFp8E4m3 for every non-NaN quotient; a NaN quotient
// goes through FloatToFp8E4m3 itself), so the bytes and scales are bit-identical.
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/kernel_launch.h"
#include "kernels/fp8.h"

namespace sds::cuda {
namespace {

constexpr int kAppendThreads = 256;

// Two quotients -> two E4M3 bytes (first in the low byte).
__device__ __forceinline__ uint32_t QuantisePair(float a, float b, float scale) {
  const float qa = DivideRoundNearest(a, scale), qb = DivideRoundNearest(b, scale);
  if (qa != qa || qb != qb)
    return FloatToFp8E4m3(qa) | (static_cast<uint32_t>(FloatToFp8E4m3(qb)) << 8);
  return __nv_cvt_float2_to_fp8x2(make_float2(qa, qb), __NV_SATFINITE, __NV_E4M3);
}

template <int D, int kPerLane>
__global__ void __launch_bounds__(kAppendThreads)
    AppendKernel(const CacheView cache, const AppendBatch append) {
  static_assert(kPerLane == 8 || kPerLane == 16, "elements per lane");
  constexpr int kLanes = D / kPerLane;  // lanes per row (4..32), aligned in the warp
  constexpr int kLoads = kPerLane / 8;  // 16-byte loads per lane
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kAppendThreads + threadIdx.x;
  const int hkv = cache.geo.num_kv_heads;
  const int64_t num_rows = static_cast<int64_t>(append.num_tokens) * hkv * 2;
  const int64_t row_id = thread / kLanes;  // (n * Hkv + h) * 2 + is_v
  const int piece = static_cast<int>(thread % kLanes);
  // Rows past the end still take part in the shuffles (whole groups fall out together,
  // but a warp may hold both kinds), with a clamped row whose store is skipped.
  const bool live = row_id < num_rows;
  const int64_t rid = live ? row_id : num_rows - 1;
  const bool is_v = rid & 1;
  const int64_t in_row = rid >> 1;  // n * Hkv + h
  const int64_t n = in_row / hkv;
  const int h = static_cast<int>(in_row % hkv);

  // src: [N, Hkv, D] bf16; this lane's kPerLane consecutive elements.
  const uint4* src = reinterpret_cast<const uint4*>((is_v ? append.v_new : append.k_new) +
                                                    in_row * D + piece * kPerLane);
  uint32_t ws[kPerLane / 2];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const uint4 w = src[i];
    ws[4 * i] = w.x, ws[4 * i + 1] = w.y, ws[4 * i + 2] = w.z, ws[4 * i + 3] = w.w;
  }
  const int32_t layer = append.layer[n];  // [N]
  const int64_t slot = append.slot[n];    // [N]
  float x[kPerLane];
  float max_abs = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane / 2; ++i) {
    x[2 * i] = Bf16ToFloat(static_cast<uint16_t>(ws[i] & 0xffff));
    x[2 * i + 1] = Bf16ToFloat(static_cast<uint16_t>(ws[i] >> 16));
    max_abs = fmaxf(max_abs, fmaxf(fabsf(x[2 * i]), fabsf(x[2 * i + 1])));
  }
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1)
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, o));
  // A negative slot: the row failed the device-side checks of its request (device_rows.cu)
  // and stores nothing.
  if (!live || slot < 0) return;

  const int64_t row = slot * hkv + h;  // row of the [.., Hkv] storage
  const bool per_token = cache.geo.scale_mode == ScaleMode::kPerTokenHead;
  const float scale = per_token ? PerTokenHeadScale(max_abs)
                                : (is_v ? cache.layer_v_scale[layer] : cache.layer_k_scale[layer]);
  uint32_t packed[kPerLane / 4];
#pragma unroll
  for (int i = 0; i < kPerLane / 4; ++i)
    packed[i] = QuantisePair(x[4 * i], x[4 * i + 1], scale) |
                (QuantisePair(x[4 * i + 2], x[4 * i + 3], scale) << 16);
  // dst: k or v [L, P, page_size, Hkv, D] bytes; this lane's 16 bytes.
  uint8_t* dst = (is_v ? cache.v : cache.k) +
                 static_cast<int64_t>(layer) * cache.geo.num_pages * cache.geo.page_size * hkv * D +
                 row * D + piece * kPerLane;
  if constexpr (kPerLane == 16) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  }
  if (per_token && piece == 0) {
    // k_token_scale / v_token_scale: [L, P, page_size, Hkv] float.
    float* scales = is_v ? cache.v_token_scale : cache.k_token_scale;
    scales[static_cast<int64_t>(layer) * cache.geo.num_pages * cache.geo.page_size * hkv + row] =
        scale;
  }
  // The decode that follows with programmatic dependent launch may be scheduled once every
  // row is stored (its cache reads still wait for this grid's completion).
  AllowDependentLaunch();
}

template <int D, int kPerLane>
cudaError_t LaunchLanes(const CacheView& cache, const AppendBatch& append, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(append.num_tokens) * cache.geo.num_kv_heads * 2;
  const int64_t blocks = (rows * (D / kPerLane) + kAppendThreads - 1) / kAppendThreads;
  AppendKernel<D, kPerLane>
      <<<static_cast<unsigned>(blocks), kAppendThreads, 0, stream>>>(cache, append);
  return cudaGetLastError();
}

template <int D>
cudaError_t Launch(const CacheView& cache, const AppendBatch& append, cudaStream_t stream) {
  return LaunchLanes<D, 8>(cache, append, stream);
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
