// The fused item's AVX-512 softmax must give the bits of the AVX2 softmax (which the
// reference tests cover, and which the unfused path runs): every probability and lse,
// for row counts with and without a padded tail, scores near and far apart, ties.
#include <bit>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_attention.h"
#include "kernels/cpu_attention_item.h"
#include "tests/reference/fresh_seed.h"

namespace sds {
namespace {

uint32_t Bits(float x) { return std::bit_cast<uint32_t>(x); }

TEST(SoftmaxPassTest, Avx512MatchesAvx2Bits) {
  if (!CpuSupportsAvx512Bf16Path()) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  const uint32_t seed = test::FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  constexpr int kGroup = 4;
  int compared = 0;
  for (float spread : {0.01f, 1.0f, 8.0f, 200.0f}) {
    std::normal_distribution<float> normal(0.0f, spread);
    for (int num_rows = 1; num_rows <= 72; ++num_rows) {
      const int stride = (num_rows + 7) / 8 * 8;  // as DecodeItemFusedAvx512
      std::vector<float> scores(kGroup * stride);
      for (int g = 0; g < kGroup; ++g)
        for (int n = 0; n < stride; ++n)  // the padded tail is garbage to both passes
          scores[g * stride + n] = n < num_rows ? normal(rng) + 3.0f * static_cast<float>(g)
                                                : std::numeric_limits<float>::quiet_NaN();
      if (num_rows > 2) scores[1] = scores[0];  // a tie at the maximum, sometimes
      std::vector<float> avx2 = scores, avx512 = scores;
      std::vector<float> lse2(kGroup, -1.0f), lse512(kGroup, -2.0f);
      cpu_internal::DecodeItem item;
      item.group = kGroup;
      item.num_rows = num_rows;
      item.scores = avx2.data();
      item.lse = lse2.data();
      cpu_internal::SoftmaxPassX86(item, stride);
      item.scores = avx512.data();
      item.lse = lse512.data();
      cpu_internal::SoftmaxPassAvx512(item, stride);
      for (int g = 0; g < kGroup; ++g) {
        ASSERT_EQ(Bits(lse2[g]), Bits(lse512[g])) << "rows " << num_rows << " head " << g;
        double total = 0;
        for (int n = 0; n < stride; ++n) {
          const float want = avx2[g * stride + n], got = avx512[g * stride + n];
          ASSERT_EQ(Bits(want), Bits(got)) << "rows " << num_rows << " head " << g << " slot " << n
                                           << ": " << want << " vs " << got;
          if (n >= num_rows) {
            ASSERT_EQ(got, 0.0f) << "padded slot " << n;
          }
          total += got;
          ++compared;
        }
        EXPECT_NEAR(total, 1.0, 1e-5) << "rows " << num_rows << " head " << g;
      }
    }
  }
  EXPECT_GT(compared, 0);
}

}  // namespace
}  // namespace sds
