// Independent float64 reference for the decode maths of DESIGN.md, over the FP8
// values stored in a host copy of the cache. Deliberately naive: no shared code with
// kernels/ (its own FP8 and bf16 decoding), two passes, max subtraction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/decode_params.h"

namespace sds::ref {

// Exact value of an FP8 E4M3FN byte (NaN for 0x7F/0xFF).
double Fp8E4m3ToDouble(uint8_t bits);
double Bf16ToDouble(uint16_t bits);
// Round-to-nearest-even float -> bf16 bits (for building inputs).
uint16_t FloatToBf16(float x);

struct RowResult {
  std::vector<double> out;      // [Hq, D], already gated
  std::vector<double> lse;      // [Hq], -inf for rows with no valid index
  std::vector<double> row_max;  // [Hq], max |out| over the row's D elements
  // [Hq, D]: how far out[h][j] may move when every score s_t carries a float32
  // error (2 float32 ulps of sum_i |q_i * k_i| * k_scale / sqrt(D), the dot product's
  // error bound scale): sigmoid(gate) * err * sum_t p_t * |v_tj - o_j|, the first-order
  // change of the softmax-weighted sum. Negligible for scores of order 1; for scores
  // near 1e4 (lse beyond float exp's range) it is what any float32 kernel must be
  // allowed where two near-equal top scores weigh V rows of opposite sign.
  std::vector<double> score_slack;
};

// Reference output of request `b` of `batch`, reading `cache` (host pointers).
RowResult ReferenceDecode(const CacheView& cache, const DecodeBatch& batch, int32_t b);

// bf16 unit in the last place at magnitude |x| (2^(e-7), subnormals clamp).
double Bf16Ulp(double x);

// Checks that `got` (bf16 bits) is within `ulps` bf16 ulps of `want`, where the ulp
// is taken at max(|want|, floor_magnitude) so that values near zero (cancellation)
// are judged at the row's scale. Returns "" when it holds, else a message.
std::string CheckBf16Close(uint16_t got, double want, double ulps, double floor_magnitude,
                           double abs_slack = 0.0);

// Checks output element [h][j] (`got`, bf16 bits) against `want`: within `ulps` bf16
// ulps at max(|want|, row max / 64), plus the row's float32-score slack.
std::string CheckOutputElement(const RowResult& want, int h, int j, int head_dim, uint16_t got,
                               double ulps);

}  // namespace sds::ref
