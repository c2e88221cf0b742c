// Helpers shared by the cache tests: build a host cache, address a slot's bytes
// through the CacheView exactly as a kernel would.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "paged_cache/paged_kv_cache.h"

namespace sds::cache_test {

inline std::unique_ptr<PagedKvCache> MakeCache(const CacheConfig& config) {
  auto cache = PagedKvCache::Create(config, MakeHostPageMemory());
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(*cache) : nullptr;
}

// First byte of token `slot`'s K (or V) rows in `layer`: [L, P, S, Hkv, D].
inline uint8_t* SlotBytes(uint8_t* base, const CacheGeometry& g, int32_t layer, int64_t slot) {
  const int64_t row = int64_t{layer} * g.num_pages * g.page_size + slot;
  return base + row * g.num_kv_heads * g.head_dim;
}
// First scale of token `slot` in `layer`: [L, P, S, Hkv].
inline float* SlotScales(float* base, const CacheGeometry& g, int32_t layer, int64_t slot) {
  const int64_t row = int64_t{layer} * g.num_pages * g.page_size + slot;
  return base + row * g.num_kv_heads;
}

// Fills every K, V (and scale) element of one slot of one layer from `tag`.
inline void WriteSlot(const CacheView& v, int32_t layer, int64_t slot, uint8_t tag) {
  const int64_t row = int64_t{v.geo.num_kv_heads} * v.geo.head_dim;
  uint8_t* k = SlotBytes(v.k, v.geo, layer, slot);
  uint8_t* vv = SlotBytes(v.v, v.geo, layer, slot);
  for (int64_t i = 0; i < row; ++i) {
    k[i] = static_cast<uint8_t>(tag + i);
    vv[i] = static_cast<uint8_t>(~tag + i);
  }
  if (v.k_token_scale != nullptr) {
    for (int32_t h = 0; h < v.geo.num_kv_heads; ++h) {
      SlotScales(v.k_token_scale, v.geo, layer, slot)[h] = tag + 0.5f * h;
      SlotScales(v.v_token_scale, v.geo, layer, slot)[h] = -tag - 0.25f * h;
    }
  }
}

// True when the slot still holds exactly what WriteSlot(tag) put there.
inline bool SlotHolds(const CacheView& v, int32_t layer, int64_t slot, uint8_t tag) {
  const int64_t row = int64_t{v.geo.num_kv_heads} * v.geo.head_dim;
  const uint8_t* k = SlotBytes(v.k, v.geo, layer, slot);
  const uint8_t* vv = SlotBytes(v.v, v.geo, layer, slot);
  for (int64_t i = 0; i < row; ++i) {
    if (k[i] != static_cast<uint8_t>(tag + i) || vv[i] != static_cast<uint8_t>(~tag + i)) {
      return false;
    }
  }
  if (v.k_token_scale != nullptr) {
    for (int32_t h = 0; h < v.geo.num_kv_heads; ++h) {
      if (SlotScales(v.k_token_scale, v.geo, layer, slot)[h] != tag + 0.5f * h ||
          SlotScales(v.v_token_scale, v.geo, layer, slot)[h] != -tag - 0.25f * h) {
        return false;
      }
    }
  }
  return true;
}

inline std::vector<int32_t> Table(const PagedKvCache& cache, const std::string& id) {
  std::vector<int32_t> pages;
  EXPECT_TRUE(cache.AppendPageTable(id, &pages).ok());
  return pages;
}

// Stats as a tuple, so EXPECT_EQ compares and prints all fields at once.
inline std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> StatsTuple(const CacheStats& s) {
  return {s.pages_total, s.pages_used, s.pages_free, s.sequences, s.tokens};
}

}  // namespace sds::cache_test
