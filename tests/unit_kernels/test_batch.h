// Test helpers: a host paged cache in plain vectors, filled through CpuAppend with
// random bf16 rows at randomly permuted pages, and random decode batches over it.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu_attention.h"
#include "kernels/decode_params.h"

namespace sds::test {

// A paged cache held in std::vectors (host memory).
struct HostCache {
  CacheGeometry geo;
  std::vector<uint8_t> k, v;                        // [layers, pages, page_size, Hkv, D]
  std::vector<float> k_token_scale, v_token_scale;  // [layers, pages, page_size, Hkv]
  std::vector<float> layer_k_scale, layer_v_scale;  // [layers]
  CacheView view();
};

// How to build one random batch.
struct BatchSpec {
  int32_t num_q_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  int32_t page_size = 16;
  int32_t num_layers = 2;
  ScaleMode scale_mode = ScaleMode::kPerTensor;
  int32_t batch_size = 3;
  int32_t min_length = 1;  // sequence length range (tokens written)
  int32_t max_length = 200;
  int32_t min_topk = 1;  // K range; K may exceed the length (duplicates)
  int32_t max_topk = 64;
  double skip_fraction = 0.1;  // share of -1 entries
  double duplicate_fraction = 0.1;
  int per_kv_head_mode = 2;   // 0: shared lists, 1: per KV head, 2: random per request
  float q_magnitude = 1.0f;   // standard deviation of q
  float kv_magnitude = 1.0f;  // standard deviation of K/V
  // Multiplies the per_tensor layer scales; large values push the stored codes into
  // the FP8 subnormal range.
  float layer_scale_boost = 1.0f;
};

// A built batch: owns every array the DecodeBatch view points into.
struct TestBatch {
  HostCache cache;
  int32_t num_requests = 0, num_q_heads = 0;
  std::vector<uint16_t> q, gate;  // [B, Hq, D]
  std::vector<int32_t> layer, page_table, indices, topk;
  std::vector<int64_t> page_table_offset, index_offset;
  std::vector<uint8_t> indices_per_kv_head;
  std::vector<uint16_t> out;  // [B, Hq, D]
  std::vector<float> lse;     // [B, Hq]
  DecodeBatch view();
  // Fills out with 0x7FC1 and lse with NaN, so unwritten elements are detectable.
  void Poison();
};

TestBatch BuildBatch(const BatchSpec& spec, uint32_t seed);

// Test-name suffix of an explicit kernel path ("portable", "avx2", "avx512bf16").
std::string CpuKernelPathName(CpuKernelPath path);

// Compares every output element and lse of request b with sds::ref::ReferenceDecode:
// bf16 within `ulps` ulps (floor at 1/64 of the head row's max |ref|), lse within
// 1e-4 relative, nothing left poisoned. Returns "" or a description of the failures.
std::string CompareWithReference(TestBatch& batch, int32_t b, double ulps = 2.0);

}  // namespace sds::test
