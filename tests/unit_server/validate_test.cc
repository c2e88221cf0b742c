// AllFiniteBf16 (server/validate.h): every NaN / Inf pattern at every position of
// lengths around the 4-value word is found, and no finite value is flagged.
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/validate.h"

namespace sds::server {
namespace {

// Random finite bf16 bits: any sign and mantissa, exponent 0..254.
std::vector<uint16_t> FiniteValues(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> exponent(0, 254), mantissa(0, 127), sign(0, 1);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v)
    x = static_cast<uint16_t>(sign(rng) << 15 | exponent(rng) << 7 | mantissa(rng));
  return v;
}

bool Finite(const std::vector<uint16_t>& v, int64_t offset_bytes) {
  // An odd byte offset: the check must not assume aligned data (protobuf bytes). An Inf
  // before and a NaN after the n values: reading outside them is noticed.
  std::string buffer(offset_bytes, '\x7f');
  buffer.append("\x80\x7f", 2);
  buffer.append(reinterpret_cast<const char*>(v.data()), v.size() * 2);
  buffer.append("\xff\xff\xff\xff", 4);
  return AllFiniteBf16(buffer.data() + offset_bytes + 2, static_cast<int64_t>(v.size()));
}

TEST(AllFiniteBf16, FindsEveryNanAndInfAtEveryPosition) {
  std::mt19937 rng(20261129);
  // +Inf, -Inf, quiet and signalling NaNs, NaN with the top mantissa bits, -NaN.
  const uint16_t bad[] = {0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x7FFF, 0xFFC1};
  for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 9, 12, 63, 64, 65, 130}) {
    const std::vector<uint16_t> values = FiniteValues(n, rng);
    for (int64_t offset : {0, 1}) {
      ASSERT_TRUE(Finite(values, offset)) << "n " << n;
      for (int64_t at = 0; at < n; ++at) {
        for (uint16_t b : bad) {
          std::vector<uint16_t> poisoned = values;
          poisoned[at] = b;
          EXPECT_FALSE(Finite(poisoned, offset))
              << "n " << n << " at " << at << " bits 0x" << std::hex << b;
        }
      }
    }
  }
}

// Every one of the 65536 bit patterns in every lane of the 4-value word and in the
// scalar tail: flagged exactly when its exponent bits are all set.
TEST(AllFiniteBf16, EveryBitPatternInEveryLane) {
  // n = 4: the lanes of one 64-bit word; 5 adds a tail value; 8, 9, 16 and 19: the lanes
  // of the 128-bit words, with SWAR words and tails behind them.
  for (int64_t n : {4, 5, 8, 9, 16, 19}) {
    for (int64_t lane = 0; lane < n; ++lane) {
      std::vector<uint16_t> v(n, 0x3F80);  // 1.0
      int wrong = 0;
      for (uint32_t bits = 0; bits < 65536; ++bits) {
        v[lane] = static_cast<uint16_t>(bits);
        const bool finite = (bits & 0x7F80) != 0x7F80;
        if (Finite(v, lane % 2) != finite && wrong++ < 3)
          ADD_FAILURE() << "n " << n << " lane " << lane << " bits 0x" << std::hex << bits;
      }
      EXPECT_EQ(wrong, 0);
    }
  }
}

TEST(AllFiniteBf16, AcceptsTheFiniteExtremes) {
  // Largest finite, its negative, zeros, smallest normal and subnormal, 1.0.
  const std::vector<uint16_t> edges = {0x7F7F, 0xFF7F, 0x0000, 0x8000,
                                       0x0080, 0x0001, 0x3F80, 0x7F00};
  for (size_t rotate = 0; rotate < edges.size(); ++rotate) {
    std::vector<uint16_t> v(edges.begin() + rotate, edges.end());
    v.insert(v.end(), edges.begin(), edges.begin() + rotate);
    EXPECT_TRUE(Finite(v, 0));
    EXPECT_TRUE(Finite(v, 1));
  }
  EXPECT_TRUE(AllFiniteBf16(nullptr, 0));
}

}  // namespace
}  // namespace sds::server
