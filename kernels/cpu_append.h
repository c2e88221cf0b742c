// Quantises new bf16 K/V rows into the paged FP8 cache (host memory).
#pragma once

#include "kernels/decode_params.h"

namespace sds {

// cache: host CacheView (k, v: [num_layers, num_pages, page_size, Hkv, D] FP8 bytes;
//   k/v_token_scale: [num_layers, num_pages, page_size, Hkv] in per_token_head mode;
//   layer_k/v_scale: [num_layers] in per_tensor mode).
// append: k_new, v_new: [N, Hkv, D] bf16 bits; layer: [N]; slot: [N] (already allocated).
// per_tensor: stored = fp8(x / layer scale). per_token_head: scale = max|x| / 448 per
// (token, KV head) (1 for an all-zero row), stored = fp8(x / scale), scale stored too.
// Inputs are assumed finite (the server rejects NaN/Inf).
void CpuAppend(const CacheView& cache, const AppendBatch& append);

}  // namespace sds
