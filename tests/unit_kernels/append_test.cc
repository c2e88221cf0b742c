// CpuAppend: slot/layer addressing, both scale modes, rows it must not touch.
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_append.h"
#include "kernels/fp8.h"
#include "tests/unit_kernels/test_batch.h"

namespace sds {
namespace {

struct AppendFixture {
  test::HostCache cache;
  std::vector<uint16_t> k_new, v_new;  // [N, Hkv, D]
  std::vector<int32_t> layer;          // [N]
  std::vector<int64_t> slot;           // [N]
};

AppendFixture MakeFixture(ScaleMode mode, uint32_t seed) {
  std::mt19937 rng(seed);
  AppendFixture f;
  f.cache.geo = CacheGeometry{3, 4, 32, 16, 5, mode};
  const CacheGeometry& geo = f.cache.geo;
  f.cache.k.assign(geo.num_layers * geo.LayerElements(), 0xAA);
  f.cache.v.assign(geo.num_layers * geo.LayerElements(), 0xAA);
  f.cache.k_token_scale.assign(geo.num_layers * geo.LayerScales(), -5.0f);
  f.cache.v_token_scale.assign(geo.num_layers * geo.LayerScales(), -5.0f);
  f.cache.layer_k_scale = {0.01f, 0.02f, 0.03f};
  f.cache.layer_v_scale = {0.04f, 0.05f, 0.06f};
  const int n = 6;
  std::normal_distribution<float> normal(0.0f, 1.5f);
  for (int i = 0; i < n * geo.num_kv_heads * geo.head_dim; ++i) {
    f.k_new.push_back(FloatToBf16(normal(rng)));
    f.v_new.push_back(FloatToBf16(normal(rng)));
  }
  // Row 3, head 1 of K is all zeros (per_token_head scale 1).
  for (int j = 0; j < geo.head_dim; ++j) f.k_new[(3 * geo.num_kv_heads + 1) * geo.head_dim + j] = 0;
  f.layer = {0, 2, 1, 2, 0, 1};
  f.slot = {0, 17, 79, 40, 33, 5};  // pages 0, 1, 4, 2, 2, 0
  return f;
}

void RunAppendChecks(ScaleMode mode) {
  const uint32_t seed = 1234u + static_cast<uint32_t>(mode);
  SCOPED_TRACE("seed " + std::to_string(seed));
  AppendFixture f = MakeFixture(mode, seed);
  const CacheGeometry& geo = f.cache.geo;
  const int n = static_cast<int>(f.layer.size());
  CpuAppend(f.cache.view(),
            AppendBatch{n, f.k_new.data(), f.v_new.data(), f.layer.data(), f.slot.data()});
  std::vector<bool> written(geo.num_layers * geo.LayerScales(), false);
  for (int i = 0; i < n; ++i) {
    for (int h = 0; h < geo.num_kv_heads; ++h) {
      const int64_t row = f.slot[i] * geo.num_kv_heads + h;
      const int64_t scale_index = f.layer[i] * geo.LayerScales() + row;
      written[scale_index] = true;
      for (int is_v = 0; is_v < 2; ++is_v) {
        const uint16_t* input = (is_v ? f.v_new : f.k_new).data() +
                                (static_cast<int64_t>(i) * geo.num_kv_heads + h) * geo.head_dim;
        float scale;
        if (mode == ScaleMode::kPerTokenHead) {
          float max_abs = 0;
          for (int j = 0; j < geo.head_dim; ++j)
            max_abs = std::fmax(max_abs, std::fabs(Bf16ToFloat(input[j])));
          scale = max_abs == 0 ? 1.0f : max_abs / 448.0f;
          EXPECT_EQ((is_v ? f.cache.v_token_scale : f.cache.k_token_scale)[scale_index], scale);
        } else {
          scale = (is_v ? f.cache.layer_v_scale : f.cache.layer_k_scale)[f.layer[i]];
        }
        const uint8_t* stored = (is_v ? f.cache.v : f.cache.k).data() +
                                f.layer[i] * geo.LayerElements() + row * geo.head_dim;
        for (int j = 0; j < geo.head_dim; ++j)
          ASSERT_EQ(stored[j], FloatToFp8E4m3(Bf16ToFloat(input[j]) / scale))
              << "token " << i << " head " << h << " elem " << j << (is_v ? " V" : " K");
      }
    }
  }
  // Every other row keeps its old bytes and scales.
  for (int64_t r = 0; r < geo.num_layers * geo.LayerScales(); ++r) {
    if (written[r]) continue;
    for (int j = 0; j < geo.head_dim; ++j) {
      ASSERT_EQ(f.cache.k[r * geo.head_dim + j], 0xAA) << "row " << r;
      ASSERT_EQ(f.cache.v[r * geo.head_dim + j], 0xAA) << "row " << r;
    }
    ASSERT_EQ(f.cache.k_token_scale[r], -5.0f);
    ASSERT_EQ(f.cache.v_token_scale[r], -5.0f);
  }
}

TEST(CpuAppendTest, PerTensorQuantisesWithLayerScale) { RunAppendChecks(ScaleMode::kPerTensor); }

TEST(CpuAppendTest, PerTokenHeadStoresScaleAndQuantises) {
  RunAppendChecks(ScaleMode::kPerTokenHead);
}

TEST(CpuAppendTest, PerTokenHeadRowMaximumMapsTo448) {
  AppendFixture f = MakeFixture(ScaleMode::kPerTokenHead, 99);
  const CacheGeometry& geo = f.cache.geo;
  CpuAppend(f.cache.view(),
            AppendBatch{1, f.k_new.data(), f.v_new.data(), f.layer.data(), f.slot.data()});
  for (int h = 0; h < geo.num_kv_heads; ++h) {
    int max_code = 0;
    for (int j = 0; j < geo.head_dim; ++j)
      max_code = std::max(max_code,
                          f.cache.k[(f.slot[0] * geo.num_kv_heads + h) * geo.head_dim + j] & 0x7F);
    EXPECT_EQ(max_code, 0x7E) << "head " << h;
  }
}

// Every finite bf16 value, appended in rows of D = 64 (the vectorised path on AVX-512
// machines, D % 16 == 0), must store the same byte as the scalar definition, at scales
// that reach saturation, every normal and subnormal code, and zero.
TEST(CpuAppendTest, EveryFiniteBf16MatchesTheScalarDefinition) {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw"))
    GTEST_SKIP() << "no AVX-512 on this CPU: the vector quantiser does not run here";
  constexpr int kD = 64;
  std::vector<uint16_t> values;
  for (uint32_t bits = 0; bits < 0x10000; ++bits)
    if ((bits & 0x7F80) != 0x7F80) values.push_back(static_cast<uint16_t>(bits));
  while (values.size() % kD != 0) values.push_back(0);
  const int n = static_cast<int>(values.size() / kD);
  for (ScaleMode mode : {ScaleMode::kPerTensor, ScaleMode::kPerTokenHead}) {
    for (float layer_scale : {1.0f, 0.0123f, 3.0e-30f, 700.0f, 1.0f / 512.0f}) {
      SCOPED_TRACE(testing::Message()
                   << "mode " << static_cast<int>(mode) << " scale " << layer_scale);
      test::HostCache cache;
      cache.geo = CacheGeometry{1, 1, kD, 64, (n + 63) / 64, mode};
      cache.k.assign(cache.geo.LayerElements(), 0xAA);
      cache.v.assign(cache.geo.LayerElements(), 0xAA);
      cache.k_token_scale.assign(cache.geo.LayerScales(), -5.0f);
      cache.v_token_scale.assign(cache.geo.LayerScales(), -5.0f);
      cache.layer_k_scale = {layer_scale};
      cache.layer_v_scale = {layer_scale};
      std::vector<int32_t> layer(n, 0);
      std::vector<int64_t> slot(n);
      for (int i = 0; i < n; ++i) slot[i] = i;
      CpuAppend(cache.view(),
                AppendBatch{n, values.data(), values.data(), layer.data(), slot.data()});
      for (int i = 0; i < n; ++i) {
        float scale = layer_scale;
        if (mode == ScaleMode::kPerTokenHead) {
          float max_abs = 0;
          for (int j = 0; j < kD; ++j)
            max_abs = std::fmax(max_abs, std::fabs(Bf16ToFloat(values[i * kD + j])));
          scale = PerTokenHeadScale(max_abs);
          ASSERT_EQ(cache.k_token_scale[i], scale) << "row " << i;
        }
        for (int j = 0; j < kD; ++j) {
          const uint16_t x = values[i * kD + j];
          ASSERT_EQ(cache.k[i * kD + j], FloatToFp8E4m3(Bf16ToFloat(x) / scale))
              << "bf16 0x" << std::hex << x;
          ASSERT_EQ(cache.v[i * kD + j], cache.k[i * kD + j]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace sds
