// Dispatch of the sparse decode kernel over head_dim, group tile and scale mode.
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {
namespace {

template <int D, int kRows, bool kPerToken>
cudaError_t Launch(const DecodeParams& params, int32_t num_requests, cudaStream_t stream) {
  constexpr int kSmem = DecodeTile<D, kPerToken>::kSmemBytes;
  auto* kernel = &SparseDecodeKernel<D, kRows, kPerToken>;
  // Raising the dynamic shared memory limit is idempotent and cheap; do it every launch
  // so that a device switch or reset cannot leave it unset.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(params.num_kv_heads, params.max_chunks, num_requests);
  kernel<<<grid, kDecodeThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

template <int D>
cudaError_t LaunchForDim(const DecodeParams& params, int32_t num_requests, bool per_token,
                         cudaStream_t stream) {
  const bool wide = params.group > 8;
  if (per_token) {
    return wide ? Launch<D, 16, true>(params, num_requests, stream)
                : Launch<D, 8, true>(params, num_requests, stream);
  }
  return wide ? Launch<D, 16, false>(params, num_requests, stream)
              : Launch<D, 8, false>(params, num_requests, stream);
}

}  // namespace

cudaError_t EnqueueSparseDecode(const DecodeParams& params, int32_t head_dim, int32_t num_requests,
                                bool per_token_head, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return LaunchForDim<64>(params, num_requests, per_token_head, stream);
    case 128:
      return LaunchForDim<128>(params, num_requests, per_token_head, stream);
    case 256:
      return LaunchForDim<256>(params, num_requests, per_token_head, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sds::cuda
