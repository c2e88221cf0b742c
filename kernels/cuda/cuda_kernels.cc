#include "kernels/cuda/cuda_kernels.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/decode_params_cuda.h"
#include "kernels/cuda/kernel_launch.h"

namespace sds::cuda {

absl::Status CudaCall(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(std::string(what), ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

absl::Status CheckDecodeShape(int32_t num_q_heads, const CacheGeometry& geo) {
  const int d = geo.head_dim;
  if (d != 64 && d != 128 && d != 256)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA decode supports head_dim 64, 128 or 256, not ", d));
  if (geo.num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % geo.num_kv_heads != 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "num_q_heads ", num_q_heads, " is not a multiple of num_kv_heads ", geo.num_kv_heads));
  const int group = num_q_heads / geo.num_kv_heads;
  if (group > kDecodeMaxGroup)
    return absl::InvalidArgumentError(absl::StrCat("CUDA decode supports up to ", kDecodeMaxGroup,
                                                   " query heads per KV head, not ", group));
  if (geo.page_size <= 0 || (geo.page_size & (geo.page_size - 1)) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("page_size ", geo.page_size, " is not a power of two"));
  if (geo.num_pages * geo.page_size * static_cast<int64_t>(geo.num_kv_heads) >
      std::numeric_limits<int32_t>::max())
    return absl::InvalidArgumentError(
        "CUDA decode needs num_pages * page_size * num_kv_heads below 2^31");
  return absl::OkStatus();
}

int32_t DecodeChunks(int32_t topk) {
  return topk > kDecodeChunkTokens ? (topk + kDecodeChunkTokens - 1) / kDecodeChunkTokens : 1;
}

int64_t DecodeWorkspaceFloats(int32_t num_requests, int32_t num_q_heads, int32_t head_dim,
                              int32_t max_topk) {
  const int32_t chunks = DecodeChunks(max_topk);
  if (chunks == 1) return 0;
  return static_cast<int64_t>(num_requests) * chunks * num_q_heads * (head_dim + kDecodeStatFloats);
}

int64_t DecodeWorkspaceCounters(int32_t num_requests, int32_t num_kv_heads) {
  return static_cast<int64_t>(num_requests) * num_kv_heads;
}

absl::Status LaunchDecode(const CacheView& cache, const DecodeBatch& batch, int32_t max_topk,
                          const DecodeWorkspace& workspace, cudaStream_t stream) {
  if (batch.num_requests <= 0) return absl::OkStatus();
  const CacheGeometry& geo = cache.geo;
  if (absl::Status s = CheckDecodeShape(batch.num_q_heads, geo); !s.ok()) return s;
  const bool per_token = geo.scale_mode == ScaleMode::kPerTokenHead;
  const int32_t chunks = DecodeChunks(max_topk);
  const int64_t need_floats =
      DecodeWorkspaceFloats(batch.num_requests, batch.num_q_heads, geo.head_dim, max_topk);
  const int64_t need_counters = DecodeWorkspaceCounters(batch.num_requests, geo.num_kv_heads);
  if (need_floats > workspace.capacity_floats ||
      (chunks > 1 && need_counters > workspace.capacity_counters))
    return absl::InternalError(absl::StrCat(
        "decode workspace too small: needs ", need_floats, " floats and ", need_counters,
        " counters, has ", workspace.capacity_floats, " and ", workspace.capacity_counters));
  if (batch.num_requests > 65535 || chunks > 65535)
    return absl::InvalidArgumentError("CUDA decode: at most 65535 requests and chunks per launch");

  DecodeParams p{};
  p.k = cache.k;
  p.v = cache.v;
  p.k_token_scale = cache.k_token_scale;
  p.v_token_scale = cache.v_token_scale;
  p.layer_k_scale = cache.layer_k_scale;
  p.layer_v_scale = cache.layer_v_scale;
  p.layer_elements = geo.LayerElements();
  p.layer_scales = geo.LayerScales();
  p.num_kv_heads = geo.num_kv_heads;
  p.page_size = geo.page_size;
  p.page_shift = 0;
  while ((1 << p.page_shift) < geo.page_size) ++p.page_shift;
  p.num_q_heads = batch.num_q_heads;
  p.group = batch.num_q_heads / geo.num_kv_heads;
  p.q = batch.q;
  p.gate = batch.gate;
  p.layer = batch.layer;
  p.page_table = batch.page_table;
  p.page_table_offset = batch.page_table_offset;
  p.indices = batch.indices;
  p.index_offset = batch.index_offset;
  p.topk = batch.topk;
  p.indices_per_kv_head = batch.indices_per_kv_head;
  p.out = batch.out;
  p.lse = batch.lse;
  p.partial_o = workspace.partial;
  p.partial_stats = workspace.partial == nullptr
                        ? nullptr
                        : workspace.partial + static_cast<int64_t>(batch.num_requests) * chunks *
                                                  batch.num_q_heads * geo.head_dim;
  p.counters = workspace.counters;
  p.max_chunks = chunks;
  p.score_scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(geo.head_dim));
  return CudaCall(EnqueueSparseDecode(p, geo.head_dim, batch.num_requests, per_token, stream),
                  "sparse decode kernel launch");
}

absl::Status LaunchAppend(const CacheView& cache, const AppendBatch& append, cudaStream_t stream) {
  if (append.num_tokens <= 0) return absl::OkStatus();
  const int d = cache.geo.head_dim;
  if (d != 64 && d != 128 && d != 256)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA append supports head_dim 64, 128 or 256, not ", d));
  return CudaCall(EnqueueAppend(cache, append, stream), "append kernel launch");
}

}  // namespace sds::cuda
