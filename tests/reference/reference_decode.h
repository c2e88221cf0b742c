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
  std::vector<double> out;  // [Hq, D], already gated
  std::vector<double> lse;  // [Hq], -inf for rows with no valid index
};

// Reference output of request `b` of `batch`, reading `cache` (host pointers).
RowResult ReferenceDecode(const CacheView& cache, const DecodeBatch& batch, int32_t b);

// bf16 unit in the last place at magnitude |x| (2^(e-7), subnormals clamp).
double Bf16Ulp(double x);

// Checks that `got` (bf16 bits) is within `ulps` bf16 ulps of `want`, where the ulp
// is taken at max(|want|, floor_magnitude) so that values near zero (cancellation)
// are judged at the row's scale. Returns "" when it holds, else a message.
std::string CheckBf16Close(uint16_t got, double want, double ulps, double floor_magnitude);

}  // namespace sds::ref
