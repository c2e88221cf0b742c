// AllFiniteBf16 (server/validate.h): every NaN / Inf pattern at every position of
// lengths around the 4-value word is found, and no finite value is flagged. The request
// checks' arithmetic at the int64 edges: INVALID_ARGUMENT, never an overflow.
#include <cstdint>
#include <cstring>
#include <limits>
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

// One layer, 2 query heads on 1 KV head, D 64, top-K up to 16.
const ModelShape kModel = {1, 2, 1, 64, 16};

void SetZeros(sparse_decode::v1::Tensor* t, const std::vector<int64_t>& shape, int element_bytes) {
  t->set_dtype(element_bytes == 2 ? sparse_decode::v1::BF16 : sparse_decode::v1::INT32);
  int64_t n = 1;
  for (int64_t dim : shape) {
    t->add_shape(dim);
    n *= dim;
  }
  t->set_data(std::string(static_cast<size_t>(n) * element_bytes, '\0'));
}

sparse_decode::v1::AppendKVRequest Append(int64_t start, int64_t n) {
  sparse_decode::v1::AppendKVRequest r;
  r.set_sequence_id("s");
  r.set_start_position(start);
  SetZeros(r.mutable_k(), {n, kModel.num_kv_heads, kModel.head_dim}, 2);
  SetZeros(r.mutable_v(), {n, kModel.num_kv_heads, kModel.head_dim}, 2);
  return r;
}

// start_position + n is checked without computing a sum that can overflow: at the
// int64 edge it is INVALID_ARGUMENT (it had wrapped negative, passed, and failed later
// as a position gap), and the last position below 2^31 still passes.
TEST(ValidateAppend, EndPositionBeyondTwoToThe31IsInvalidArgumentWithoutOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  for (const int64_t start : {kMax, kMax - 1, kInt32Max, kInt32Max + int64_t{1}}) {
    const absl::Status s = ValidateAppend(Append(start, 1), kModel);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << start << ": " << s;
    EXPECT_NE(s.message().find("exceeds 2^31 tokens"), absl::string_view::npos) << s;
  }
  sparse_decode::v1::AppendKVRequest many = Append(0, 1);
  many.mutable_k()->set_shape(0, kMax);  // n itself at the edge
  EXPECT_EQ(ValidateAppend(many, kModel).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateAppend(Append(kInt32Max - 2, 2), kModel).ok());
  EXPECT_TRUE(ValidateAppend(Append(0, 3), kModel).ok());
}

// A shape whose element count overflows int64 is refused, not wrapped to a small count
// that empty data would match (here 16 * 2^30 * 2^30 = 2^64 wraps to 0).
TEST(ValidateAppend, ShapeProductThatOverflowsIsInvalidArgument) {
  const ModelShape huge = {1, 1 << 30, 1 << 30, 1 << 30, 16};
  sparse_decode::v1::AppendKVRequest r;
  r.set_sequence_id("s");
  for (sparse_decode::v1::Tensor* t : {r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(sparse_decode::v1::BF16);
    for (int64_t dim : {int64_t{16}, int64_t{1} << 30, int64_t{1} << 30}) t->add_shape(dim);
  }
  const absl::Status s = ValidateAppend(r, huge);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("too large"), absl::string_view::npos) << s;
}

// A negative K is named as such, not as "exceeds max_topk".
TEST(ValidateDecode, NegativeTopKSaysNegative) {
  sparse_decode::v1::DecodeRequest r;
  r.set_sequence_id("s");
  r.set_position(3);
  SetZeros(r.mutable_q(), {kModel.num_q_heads, kModel.head_dim}, 2);
  SetZeros(r.mutable_gate(), {kModel.num_q_heads, kModel.head_dim}, 2);
  SetZeros(r.mutable_k(), {kModel.num_kv_heads, kModel.head_dim}, 2);
  SetZeros(r.mutable_v(), {kModel.num_kv_heads, kModel.head_dim}, 2);
  SetZeros(r.mutable_indices(), {2}, 4);
  ASSERT_TRUE(ValidateDecode(r, kModel).ok());
  r.mutable_indices()->set_shape(0, -1);
  absl::Status s = ValidateDecode(r, kModel);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "indices: K = -1 must not be negative");
  r.mutable_indices()->set_shape(0, kModel.max_topk + 1);
  s = ValidateDecode(r, kModel);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "indices: K = 17 exceeds max_topk 16");
}

}  // namespace
}  // namespace sds::server
