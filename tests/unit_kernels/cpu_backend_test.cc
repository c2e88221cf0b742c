// The CPU backend end to end over the real PagedKvCache: prefill through Run's append,
// then a decode step (append of the new token + attention) checked against the
// float64 reference reading the same cache.
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "server/backend.h"
#include "tests/reference/fresh_seed.h"
#include "tests/reference/reference_decode.h"

namespace sds {
namespace {

BackendConfig SmallConfig(ScaleMode mode) {
  BackendConfig config;
  config.cache.num_layers = 2;
  config.cache.num_kv_heads = 2;
  config.cache.head_dim = 64;
  config.cache.page_size = 16;
  config.cache.num_pages = 32;
  config.cache.scale_mode = mode;
  if (mode == ScaleMode::kPerTensor) {
    config.cache.layer_k_scales = {0.01f, 0.02f};
    config.cache.layer_v_scales = {0.015f, 0.025f};
  }
  config.num_q_heads = 8;
  config.cpu_threads = 2;
  config.cpu_prewake_us = 500;  // the decode step below is announced with Prewake
  return config;
}

std::vector<uint16_t> RandomBf16(size_t count, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<uint16_t> values(count);
  for (uint16_t& value : values) value = FloatToBf16(normal(rng));
  return values;
}

class CpuBackendTest : public ::testing::TestWithParam<ScaleMode> {};

TEST_P(CpuBackendTest, PrefillThenDecodeMatchesReference) {
  const uint32_t seed = test::FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const BackendConfig config = SmallConfig(GetParam());
  absl::StatusOr<std::unique_ptr<Backend>> created = CreateCpuBackend(config);
  ASSERT_TRUE(created.ok()) << created.status();
  Backend& backend = **created;
  EXPECT_EQ(backend.name(), "cpu");
  PagedKvCache& cache = backend.cache();
  const int hkv = config.cache.num_kv_heads, d = config.cache.head_dim, hq = config.num_q_heads;
  const int32_t layer = 1;
  const int64_t prefill = 40;  // crosses two page boundaries

  ASSERT_TRUE(cache.CreateSequence("seq", 0).ok());
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache.PrepareWrite("seq", layer, 0, prefill, &slots).ok());
  std::vector<uint16_t> k = RandomBf16(prefill * hkv * d, 1.0f, rng);
  std::vector<uint16_t> v = RandomBf16(prefill * hkv * d, 1.0f, rng);
  std::vector<int32_t> layers(prefill, layer);
  BatchWork prefill_work;
  prefill_work.append =
      AppendBatch{static_cast<int32_t>(prefill), k.data(), v.data(), layers.data(), slots.data()};
  BatchTiming timing;
  ASSERT_TRUE(backend.Run(prefill_work, &timing).ok());
  ASSERT_TRUE(cache.CommitWrite("seq", layer, 0, prefill).ok());

  // Decode at position `prefill`: its K/V are appended in the same Run.
  std::vector<int64_t> new_slot;
  ASSERT_TRUE(cache.PrepareWrite("seq", layer, prefill, 1, &new_slot).ok());
  std::vector<uint16_t> k_new = RandomBf16(hkv * d, 1.0f, rng);
  std::vector<uint16_t> v_new = RandomBf16(hkv * d, 1.0f, rng);
  std::vector<uint16_t> q = RandomBf16(hq * d, 1.0f, rng);
  std::vector<uint16_t> gate = RandomBf16(hq * d, 2.0f, rng);
  std::vector<int32_t> page_table;
  ASSERT_TRUE(cache.AppendPageTable("seq", &page_table).ok());
  std::vector<int32_t> indices = {static_cast<int32_t>(prefill), -1, 0, 15, 16, 17, 33, 39, 16};
  const int32_t topk = static_cast<int32_t>(indices.size());
  const int64_t zero = 0;
  const uint8_t shared_indices = 0;
  std::vector<uint16_t> out(hq * d, 0x7FC1);
  std::vector<float> lse(hq, std::nanf(""));
  BatchWork decode_work;
  decode_work.append = AppendBatch{1, k_new.data(), v_new.data(), &layer, new_slot.data()};
  decode_work.decode = DecodeBatch{1,
                                   hq,
                                   q.data(),
                                   gate.data(),
                                   &layer,
                                   page_table.data(),
                                   &zero,
                                   indices.data(),
                                   &zero,
                                   &topk,
                                   &shared_indices,
                                   out.data(),
                                   lse.data()};
  timing.compute_us = -1;
  backend.Prewake(int64_t{1} << 20);  // as the server does when a large DecodeBatch arrives
  ASSERT_TRUE(backend.Run(decode_work, &timing).ok());
  EXPECT_GE(timing.compute_us, 0);

  // The new token's K went into the cache (the reference reads the cache, so check it).
  const CacheView view = cache.view();
  for (int h = 0; h < hkv; ++h) {
    const int64_t row = new_slot[0] * hkv + h;
    float scale = 0;
    if (GetParam() == ScaleMode::kPerTokenHead) {
      float max_abs = 0;
      for (int j = 0; j < d; ++j)
        max_abs = std::fmax(max_abs, std::fabs(Bf16ToFloat(k_new[h * d + j])));
      scale = PerTokenHeadScale(max_abs);
      ASSERT_EQ(view.k_token_scale[layer * view.geo.LayerScales() + row], scale);
    } else {
      scale = view.layer_k_scale[layer];
    }
    for (int j = 0; j < d; ++j)
      ASSERT_EQ(view.k[layer * view.geo.LayerElements() + row * d + j],
                QuantiseFp8E4m3(Bf16ToFloat(k_new[h * d + j]), scale))
          << "head " << h << " elem " << j;
  }

  const ref::RowResult want = ref::ReferenceDecode(view, decode_work.decode, 0);
  for (int h = 0; h < hq; ++h) {
    for (int j = 0; j < d; ++j) {
      const std::string problem = ref::CheckOutputElement(want, h, j, d, out[h * d + j], 2.0);
      ASSERT_TRUE(problem.empty()) << "h " << h << " j " << j << ": " << problem;
    }
    EXPECT_NEAR(lse[h], want.lse[h], 1e-4 * std::max(1.0, std::fabs(want.lse[h])));
  }
}

TEST_P(CpuBackendTest, StagingIsAlignedAndWritable) {
  absl::StatusOr<std::unique_ptr<Backend>> created = CreateCpuBackend(SmallConfig(GetParam()));
  ASSERT_TRUE(created.ok()) << created.status();
  for (size_t bytes : {size_t{1}, size_t{100}, size_t{1} << 20}) {
    void* staging = (*created)->AllocateStaging(bytes);
    ASSERT_NE(staging, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(staging) % 64, 0u);
    std::fill_n(static_cast<uint8_t*>(staging), bytes, uint8_t{0xAB});
    (*created)->FreeStaging(staging);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CpuBackendTest,
                         ::testing::Values(ScaleMode::kPerTensor, ScaleMode::kPerTokenHead),
                         [](const auto& info) {
                           return std::string(info.param == ScaleMode::kPerTensor
                                                  ? "per_tensor"
                                                  : "per_token_head");
                         });

TEST(CpuBackendConfigTest, RejectsHeadCountsThatDoNotDivide) {
  BackendConfig config = SmallConfig(ScaleMode::kPerTensor);
  config.num_q_heads = 7;
  EXPECT_EQ(CreateCpuBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendConfigTest, RejectsAPrewakeTimeOutOfRange) {
  BackendConfig config = SmallConfig(ScaleMode::kPerTensor);
  config.cpu_prewake_us = -1;
  EXPECT_EQ(CreateCpuBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
  config.cpu_prewake_us = kMaxCpuPrewakeUs + 1;
  EXPECT_EQ(CreateCpuBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
  config.cpu_prewake_us = 0;  // off
  EXPECT_TRUE(CreateCpuBackend(config).ok());
}

}  // namespace
}  // namespace sds
