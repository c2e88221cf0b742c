#include "kernels/cpu_append.h"

#include <cmath>
#include <cstdint>

#include "kernels/fp8.h"

namespace sds {
namespace {

// Quantises one row. row: [D] bf16 bits; codes: [D] FP8 bytes out; token_scale: one
// float out (per_token_head) or nullptr (per_tensor, using layer_scale).
void QuantiseRow(const uint16_t* row, int head_dim, float layer_scale, uint8_t* codes,
                 float* token_scale) {
  float scale = layer_scale;
  if (token_scale != nullptr) {
    float max_abs = 0.0f;
    for (int j = 0; j < head_dim; ++j) max_abs = std::fmax(max_abs, std::fabs(Bf16ToFloat(row[j])));
    scale = PerTokenHeadScale(max_abs);
    *token_scale = scale;
  }
  for (int j = 0; j < head_dim; ++j) codes[j] = QuantiseFp8E4m3(Bf16ToFloat(row[j]), scale);
}

}  // namespace

void CpuAppend(const CacheView& cache, const AppendBatch& append) {
  const CacheGeometry& geo = cache.geo;
  const int num_kv_heads = geo.num_kv_heads;
  const int head_dim = geo.head_dim;
  const bool per_token_head = geo.scale_mode == ScaleMode::kPerTokenHead;
  // The new tokens' slots are scattered over the cache and cold: request every line to
  // be written first (a batch's stores then miss in parallel, not one after another).
  const int64_t slot_bytes = static_cast<int64_t>(num_kv_heads) * head_dim;
  for (int32_t n = 0; n < append.num_tokens; ++n) {
    const int64_t offset =
        static_cast<int64_t>(append.layer[n]) * geo.LayerElements() + append.slot[n] * slot_bytes;
    for (int64_t byte = 0; byte < slot_bytes; byte += 64) {
      __builtin_prefetch(cache.k + offset + byte, 1, 3);
      __builtin_prefetch(cache.v + offset + byte, 1, 3);
    }
  }
  for (int32_t n = 0; n < append.num_tokens; ++n) {
    const int32_t layer = append.layer[n];
    const int64_t element_base = static_cast<int64_t>(layer) * geo.LayerElements();
    const int64_t scale_base = static_cast<int64_t>(layer) * geo.LayerScales();
    const float layer_k_scale = per_token_head ? 1.0f : cache.layer_k_scale[layer];
    const float layer_v_scale = per_token_head ? 1.0f : cache.layer_v_scale[layer];
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t row = append.slot[n] * num_kv_heads + h;  // row of [.., Hkv] storage
      const int64_t input_offset = (static_cast<int64_t>(n) * num_kv_heads + h) * head_dim;
      const int64_t cache_offset = element_base + row * head_dim;
      QuantiseRow(append.k_new + input_offset, head_dim, layer_k_scale, cache.k + cache_offset,
                  per_token_head ? cache.k_token_scale + scale_base + row : nullptr);
      QuantiseRow(append.v_new + input_offset, head_dim, layer_v_scale, cache.v + cache_offset,
                  per_token_head ? cache.v_token_scale + scale_base + row : nullptr);
    }
  }
}

}  // namespace sds
