// FP8 E4M3FN and bf16 conversions of kernels/fp8.h against the float64 reference.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "tests/reference/fresh_seed.h"
#include "tests/reference/reference_decode.h"

namespace sds {
namespace {

TEST(Fp8Test, AllCodesDecodeExactly) {
  for (int code = 0; code < 256; ++code) {
    const double want = ref::Fp8E4m3ToDouble(static_cast<uint8_t>(code));
    const float got = Fp8E4m3ToFloat(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code " << code;
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "code " << code;
    }
  }
}

TEST(Fp8Test, EncodesBoundaryValues) {
  EXPECT_EQ(FloatToFp8E4m3(0.0f), 0x00);
  EXPECT_EQ(FloatToFp8E4m3(-0.0f), 0x80);
  EXPECT_EQ(FloatToFp8E4m3(1.0f), 0x38);
  EXPECT_EQ(FloatToFp8E4m3(-2.0f), 0xC0);
  EXPECT_EQ(FloatToFp8E4m3(448.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(-448.0f), 0xFE);
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(1.0f, -6)), 0x08);         // smallest normal
  EXPECT_EQ(FloatToFp8E4m3(7.0f * std::ldexp(1.0f, -9)), 0x07);  // largest subnormal
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(1.0f, -9)), 0x01);         // smallest subnormal
  EXPECT_EQ(FloatToFp8E4m3(-std::ldexp(1.0f, -9)), 0x81);
}

TEST(Fp8Test, Saturates) {
  EXPECT_EQ(FloatToFp8E4m3(449.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(464.0f), 0x7E);  // tie between 448 and (NaN) 480
  EXPECT_EQ(FloatToFp8E4m3(479.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(480.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(1e6f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(-1e6f), 0xFE);
  EXPECT_EQ(FloatToFp8E4m3(3e38f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
}

TEST(Fp8Test, RoundsTiesToEven) {
  // Normal range: 1.0 (0x38, even) and 1.125 (0x39) -> tie 1.0625 goes to 0x38.
  EXPECT_EQ(FloatToFp8E4m3(1.0625f), 0x38);
  EXPECT_EQ(FloatToFp8E4m3(1.1875f), 0x3A);  // between 0x39 and 0x3A -> 0x3A
  EXPECT_EQ(FloatToFp8E4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(FloatToFp8E4m3(std::nextafter(1.0625f, 0.0f)), 0x38);
  EXPECT_EQ(FloatToFp8E4m3(-1.0625f), 0xB8);
  // 15.5 lies between 15 (0x57) and 16 (0x58): goes to 16 (even mantissa 0), carrying
  // into the exponent.
  EXPECT_EQ(FloatToFp8E4m3(15.5f), 0x58);
  // Subnormals (step 2^-9): 0.5 step -> 0, 1.5 steps -> 2, 2.5 steps -> 2, 7.5 -> 8 (normal).
  const float step = std::ldexp(1.0f, -9);
  EXPECT_EQ(FloatToFp8E4m3(0.5f * step), 0x00);
  EXPECT_EQ(FloatToFp8E4m3(std::nextafter(0.5f * step, 1.0f)), 0x01);
  EXPECT_EQ(FloatToFp8E4m3(1.5f * step), 0x02);
  EXPECT_EQ(FloatToFp8E4m3(2.5f * step), 0x02);
  EXPECT_EQ(FloatToFp8E4m3(7.5f * step), 0x08);
  EXPECT_EQ(FloatToFp8E4m3(1e-30f), 0x00);
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8Test, RoundTripsAllFiniteCodes) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(FloatToFp8E4m3(Fp8E4m3ToFloat(static_cast<uint8_t>(code))), code) << code;
  }
}

// Brute force: the nearest finite code (ties to even mantissa), saturating at 448.
uint8_t NearestCode(float x) {
  const double value = std::fmin(std::fmax(static_cast<double>(x), -448.0), 448.0);
  int best = -1;
  double best_error = 0;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F || code == 0x80) continue;  // NaN; -0 handled by sign below
    const double error = std::fabs(ref::Fp8E4m3ToDouble(static_cast<uint8_t>(code)) - value);
    if (best < 0 || error < best_error || (error == best_error && (code & 1) == 0)) {
      best = code;
      best_error = error;
    }
  }
  if (best == 0 && std::signbit(x)) best = 0x80;
  return static_cast<uint8_t>(best);
}

TEST(Fp8Test, EncodeMatchesBruteForceNearest) {
  const uint32_t seed = test::FreshSeed();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> exponent(-12.0f, 10.0f);
  std::uniform_int_distribution<int> sign(0, 1);
  for (int i = 0; i < 20000; ++i) {
    const float x = (sign(rng) ? -1.0f : 1.0f) * std::exp2(exponent(rng));
    ASSERT_EQ(FloatToFp8E4m3(x), NearestCode(x)) << "x=" << x << " seed " << seed;
  }
}

TEST(Bf16Test, MatchesReferenceRounding) {
  const uint32_t seed = test::FreshSeed();
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 100000; ++i) {
    uint32_t word = bits(rng);
    if (i % 4 == 0) word = (word & 0xFFFF0000u) | 0x8000u;  // exact ties
    float x;
    std::memcpy(&x, &word, sizeof x);
    if (std::isnan(x)) continue;
    ASSERT_EQ(FloatToBf16(x), ref::FloatToBf16(x)) << "bits " << word << " seed " << seed;
    ASSERT_EQ(static_cast<double>(Bf16ToFloat(FloatToBf16(x))),
              ref::Bf16ToDouble(ref::FloatToBf16(x)));
  }
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::quiet_NaN()) & 0x7FC0, 0x7FC0);
}

TEST(Fp8Test, PerTokenHeadScaleRule) {
  EXPECT_EQ(PerTokenHeadScale(0.0f), 1.0f);
  EXPECT_EQ(PerTokenHeadScale(448.0f), 1.0f);
  EXPECT_EQ(PerTokenHeadScale(3.0f), 3.0f / 448.0f);
  // The row maximum quantises to +-448 exactly.
  for (float max_abs : {1e-3f, 0.37f, 3.0f, 1000.0f, 3e30f}) {
    const float scale = PerTokenHeadScale(max_abs);
    EXPECT_EQ(QuantiseFp8E4m3(max_abs, scale), 0x7E) << max_abs;
    EXPECT_EQ(QuantiseFp8E4m3(-max_abs, scale), 0xFE) << max_abs;
  }
  EXPECT_EQ(QuantiseFp8E4m3(0.0f, PerTokenHeadScale(0.0f)), 0x00);
  // A quotient that underflows to zero falls back to 1 (no division by zero).
  EXPECT_EQ(PerTokenHeadScale(std::numeric_limits<float>::denorm_min()), 1.0f);
}

}  // namespace
}  // namespace sds
