// The model every fuzz target checks requests against, and the corpus generator builds
// valid requests for: small enough for a fast CPU cache, with more than one layer and
// KV head so that the layer range and [Hkv, K] indices have something to reject.
#pragma once

#include "server/model_shape.h"

namespace sds::fuzz {

inline constexpr int kLayers = 2;
inline constexpr int kQHeads = 4;
inline constexpr int kKvHeads = 2;
inline constexpr int kHeadDim = 64;
inline constexpr int kMaxTopk = 16;
inline constexpr int kPageSize = 16;
// Tokens already in the fuzzed tenant's sequence "s" and in the witness sequence, in
// every layer: the next decode position of both.
inline constexpr int kPrefilled = 20;

inline server::ModelShape FuzzModel() {
  server::ModelShape m;
  m.num_layers = kLayers;
  m.num_q_heads = kQHeads;
  m.num_kv_heads = kKvHeads;
  m.head_dim = kHeadDim;
  m.max_topk = kMaxTopk;
  return m;
}

}  // namespace sds::fuzz
