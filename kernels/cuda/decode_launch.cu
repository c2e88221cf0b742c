// Dispatch of the sparse decode kernel over head_dim, group tile and scale mode.
#include "kernels/cuda/decode_kernel.cuh"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {
namespace {

// Once per process and instance: raise the dynamic shared memory limit, ask for the
// largest shared-memory carveout and read the resident CTAs per SM and the SM count.
struct KernelConfig {
  cudaError_t error = cudaSuccess;
  int ctas_per_sm = 0;
  int sms = 0;
};

template <int D, int kRows, bool kPerToken>
const KernelConfig& Configure() {
  static const KernelConfig config = [] {
    constexpr int kStages = kDecodeDefaultStages<D>;
    constexpr int kSmem = DecodeTile<D, kRows, kPerToken, kStages>::kSmemBytes;
    auto* kernel = &SparseDecodeKernel<D, kRows, kPerToken, kStages>;
    KernelConfig c;
    c.error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (c.error != cudaSuccess) return c;
    c.error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   static_cast<int>(cudaSharedmemCarveoutMaxShared));
    if (c.error != cudaSuccess) return c;
    c.error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.ctas_per_sm, kernel, kDecodeThreads,
                                                            kSmem);
    if (c.error != cudaSuccess) return c;
    int device = 0;
    c.error = cudaGetDevice(&device);
    if (c.error != cudaSuccess) return c;
    c.error = cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, device);
    return c;
  }();
  return config;
}

template <int D, int kRows, bool kPerToken>
cudaError_t Launch(DecodeParams params, int32_t num_requests, bool pdl, cudaStream_t stream) {
  constexpr int kStages = kDecodeDefaultStages<D>;
  constexpr int kSmem = DecodeTile<D, kRows, kPerToken, kStages>::kSmemBytes;
  auto* kernel = &SparseDecodeKernel<D, kRows, kPerToken, kStages>;
  const KernelConfig& config = Configure<D, kRows, kPerToken>();
  if (config.error != cudaSuccess) return config.error;
  const dim3 grid(params.num_kv_heads, params.max_chunks, num_requests);
  // Split requests merge over distributed shared memory where the instance fits it, a
  // cluster of max_chunks CTAs is portable (<= 8: top-K <= 4096) and the grid is at most
  // one CTA per SM, if the caller allows. On the H200 the cluster merge took 1 request
  // from 17.9 to 17.0 us but 64 x 2048 from 96 to 108 us and 8 requests from 25.3 to
  // 25.8 (clusters constrain where CTAs run): bench/RESULTS.md. Same bits either way.
  const int64_t ctas = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  params.cluster_merge = params.cluster_merge &&
                         DecodeTile<D, kRows, kPerToken, kStages>::kClusterMergeFits &&
                         params.max_chunks >= 2 && params.max_chunks <= 8 && ctas <= config.sms;
  cudaLaunchConfig_t launch = {};
  launch.gridDim = grid;
  launch.blockDim = dim3(kDecodeThreads);
  launch.dynamicSmemBytes = kSmem;
  launch.stream = stream;
  cudaLaunchAttribute attrs[2];
  // Programmatic dependent launch: the CTAs may start while the previous kernel of the
  // stream runs (the kernel waits for it before its first cache read).
  auto add_pdl = [&] {
    if (!pdl) return;
    cudaLaunchAttribute& a = attrs[launch.numAttrs++];
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  };
  // Without clusters: one CTA merges through the global workspace.
  auto launch_plain = [&] {
    params.cluster_merge = 0;
    launch.numAttrs = 0;
    launch.attrs = attrs;
    add_pdl();
    return cudaLaunchKernelEx(&launch, kernel, params);
  };
  if (!params.cluster_merge) return launch_plain();
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 1;
  attrs[0].val.clusterDim.y = static_cast<unsigned>(params.max_chunks);  // cluster rank = chunk
  attrs[0].val.clusterDim.z = 1;
  launch.attrs = attrs;
  launch.numAttrs = 1;
  add_pdl();
  const cudaError_t err = cudaLaunchKernelEx(&launch, kernel, params);
  if (err != cudaErrorInvalidClusterSize && err != cudaErrorLaunchOutOfResources) return err;
  // The context cannot place such a cluster (e.g. a partitioned GPU): clear the error
  // and merge through the global workspace instead (same bits; a plain launch that still
  // fails reports its own error).
  cudaGetLastError();
  return launch_plain();
}

template <int D>
cudaError_t LaunchForDim(const DecodeParams& params, int32_t num_requests, bool per_token, bool pdl,
                         cudaStream_t stream) {
  const bool wide = params.group > 8;
  if (per_token) {
    return wide ? Launch<D, 16, true>(params, num_requests, pdl, stream)
                : Launch<D, 8, true>(params, num_requests, pdl, stream);
  }
  return wide ? Launch<D, 16, false>(params, num_requests, pdl, stream)
              : Launch<D, 8, false>(params, num_requests, pdl, stream);
}

}  // namespace

cudaError_t DecodeOccupancy(int32_t head_dim, int32_t group, bool per_token_head, int* blocks) {
  *blocks = 0;
  if (head_dim != 128) return cudaErrorInvalidValue;
  const bool wide = group > 8;
  const KernelConfig& c = per_token_head
                              ? (wide ? Configure<128, 16, true>() : Configure<128, 8, true>())
                              : (wide ? Configure<128, 16, false>() : Configure<128, 8, false>());
  *blocks = c.ctas_per_sm;
  return c.error;
}

cudaError_t EnqueueSparseDecode(const DecodeParams& params, int32_t head_dim, int32_t num_requests,
                                bool per_token_head, bool pdl, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return LaunchForDim<64>(params, num_requests, per_token_head, pdl, stream);
    case 128:
      return LaunchForDim<128>(params, num_requests, per_token_head, pdl, stream);
    case 256:
      return LaunchForDim<256>(params, num_requests, per_token_head, pdl, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sds::cuda
