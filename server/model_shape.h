// The model dimensions every request is checked against.
#pragma once

#include <cstdint>

namespace sds::server {

struct ModelShape {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;   // Hq
  int32_t num_kv_heads = 0;  // Hkv
  int32_t head_dim = 0;      // D
  int32_t max_topk = 0;
};

}  // namespace sds::server
