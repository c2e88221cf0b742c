// The fused item's AVX-512 gate pass must give the bits of the AVX2 gate pass (which the
// reference tests cover) for every bf16 gate value, with accumulators of every kind
// (zeros of both signs, subnormal, small, large, negative, bf16 rounding ties).
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu_attention.h"
#include "kernels/cpu_attention_item.h"

namespace sds {
namespace {

float FromBits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

TEST(GatePassTest, Avx512MatchesAvx2ForEveryBf16Gate) {
  if (!CpuSupportsAvx512Bf16Path()) GTEST_SKIP() << "no AVX-512 BF16 on this CPU";
  constexpr int kGroup = 8, kHeadDim = 64, kElements = kGroup * kHeadDim;
  // Accumulator values cycled over the elements, offset per pass.
  std::vector<float> specials = {0.0f, -0.0f, FromBits(1), -FromBits(0x7FFFF), 1e-30f, -3.5f, 1.0f,
                                 65504.0f, -1.7e38f, 1e-3f, 0.33333334f, -2.0f,
                                 // bf16 rounding ties and near-ties: where sigmoid(gate)
                                 // is exactly 1 or 0.5 the product keeps these low bits.
                                 FromBits(0x3F808000), FromBits(0x3F818000), FromBits(0xBF817FFF),
                                 FromBits(0x40007FFF)};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int i = 0; i < 52; ++i) specials.push_back(normal(rng));
  std::vector<uint16_t> gate(kElements), out_avx2(kElements), out_avx512(kElements);
  std::vector<float> acc(kElements);
  cpu_internal::DecodeItem item;
  item.group = kGroup;
  item.head_dim = kHeadDim;
  item.gate = gate.data();
  item.acc = acc.data();
  int mismatches = 0;
  for (int pass = 0; pass < 3; ++pass) {
    for (uint32_t first = 0; first < 65536; first += kElements) {
      for (int e = 0; e < kElements; ++e) {
        gate[e] = static_cast<uint16_t>(first + e);
        acc[e] = specials[(e + pass * 5 + first / kElements) % specials.size()];
      }
      item.out = out_avx2.data();
      cpu_internal::GatePassX86(item);
      item.out = out_avx512.data();
      cpu_internal::GatePassAvx512(item);
      for (int e = 0; e < kElements; ++e)
        if (out_avx2[e] != out_avx512[e] && ++mismatches <= 5)
          ADD_FAILURE() << "gate 0x" << std::hex << gate[e] << " acc " << acc[e] << ": avx2 0x"
                        << out_avx2[e] << " avx512 0x" << out_avx512[e];
    }
  }
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace sds
