// Portable (plain C++) kernel of one (request, KV head) work item. Inner loops keep
// eight independent partial sums so the compiler can vectorise them without
// reassociating floating-point additions.
#include <array>
#include <cmath>
#include <limits>

#include "kernels/cpu_attention_item.h"
#include "kernels/fp8.h"

namespace sds::cpu_internal {
namespace {

const std::array<float, 256>& Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code)
      values[code] = Fp8E4m3ToFloat(static_cast<uint8_t>(code));
    return values;
  }();
  return table;
}

// codes: [D] FP8 bytes -> values: [D] float (exact).
void DequantiseRow(const uint8_t* codes, int head_dim, float* values) {
  const std::array<float, 256>& table = Fp8Table();
  for (int j = 0; j < head_dim; ++j) values[j] = table[codes[j]];
}

// a, b: [D]. Eight partial sums in a fixed order.
float Dot(const float* a, const float* b, int head_dim) {
  float partial[8] = {};
  int j = 0;
  for (; j + 8 <= head_dim; j += 8)
    for (int lane = 0; lane < 8; ++lane) partial[lane] += a[j + lane] * b[j + lane];
  for (; j < head_dim; ++j) partial[0] += a[j] * b[j];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// values: [N]. Eight partial sums in a fixed order.
float Sum(const float* values, int count) {
  float partial[8] = {};
  int n = 0;
  for (; n + 8 <= count; n += 8)
    for (int lane = 0; lane < 8; ++lane) partial[lane] += values[n + lane];
  for (; n < count; ++n) partial[0] += values[n];
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

}  // namespace

void DecodeItemPortable(const DecodeItem& item) {
  const int group = item.group, head_dim = item.head_dim, num_rows = item.num_rows;
  const int stride = (num_rows + 7) / 8 * 8;  // of scores
  for (int e = 0; e < group * head_dim; ++e) item.q_f32[e] = Bf16ToFloat(item.q[e]);

  // Scores: each K row is dequantised once and used by all G heads.
  float* row = item.row_buffer;
  for (int n = 0; n < num_rows; ++n) {
    DequantiseRow(item.k_layer + item.rows[n] * head_dim, head_dim, row);
    const float factor = item.k_scale[n] * item.inv_sqrt_d;
    for (int g = 0; g < group; ++g)
      item.scores[g * stride + n] = Dot(item.q_f32 + g * head_dim, row, head_dim) * factor;
  }

  // Softmax per head with max subtraction; scores become normalised probabilities.
  for (int g = 0; g < group; ++g) {
    float* p = item.scores + g * stride;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int n = 0; n < num_rows; ++n) max_score = std::fmax(max_score, p[n]);
    for (int n = 0; n < num_rows; ++n) p[n] = ExpNonPositive(p[n] - max_score);
    const float sum = Sum(p, num_rows);
    if (item.lse) item.lse[g] = max_score + std::log(sum);
    const float inv_sum = 1.0f / sum;
    for (int n = 0; n < num_rows; ++n) p[n] *= inv_sum;
  }

  // Weighted V sum: each V row is dequantised once and used by all G heads.
  for (int e = 0; e < group * head_dim; ++e) item.acc[e] = 0.0f;
  for (int n = 0; n < num_rows; ++n) {
    DequantiseRow(item.v_layer + item.rows[n] * head_dim, head_dim, row);
    for (int g = 0; g < group; ++g) {
      const float weight = item.scores[g * stride + n] * item.v_scale[n];
      float* acc = item.acc + g * head_dim;
      for (int j = 0; j < head_dim; ++j) acc[j] += weight * row[j];
    }
  }

  for (int e = 0; e < group * head_dim; ++e)
    item.out[e] = FloatToBf16(item.acc[e] * Sigmoid(Bf16ToFloat(item.gate[e])));
}

}  // namespace sds::cpu_internal
