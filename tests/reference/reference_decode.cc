#include "tests/reference/reference_decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace sds::ref {

double Fp8E4m3ToDouble(uint8_t bits) {
  const int sign = bits >> 7;
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<double>::quiet_NaN();
  double magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0, -6)
                                   : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

double Bf16ToDouble(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

uint16_t FloatToBf16(float x) {
  uint32_t word;
  std::memcpy(&word, &x, sizeof word);
  if (std::isnan(x)) return 0x7FC0;
  uint32_t rounding = 0x7FFF + ((word >> 16) & 1);
  return static_cast<uint16_t>((word + rounding) >> 16);
}

double Bf16Ulp(double x) {
  double a = std::fabs(x);
  if (a < std::ldexp(1.0, -126)) return std::ldexp(1.0, -133);
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0, e - 1 - 7);
}

std::string CheckBf16Close(uint16_t got, double want, double ulps, double floor_magnitude,
                           double abs_slack) {
  double g = Bf16ToDouble(got);
  double scale = std::max(std::fabs(want), floor_magnitude);
  double tol = ulps * Bf16Ulp(scale) + abs_slack;
  if (std::isfinite(g) && std::fabs(g - want) <= tol) return "";
  std::ostringstream msg;
  msg << "got " << g << " want " << want << " |diff| " << std::fabs(g - want) << " > tol " << tol
      << " (" << ulps << " bf16 ulps at " << scale << " + float32-score slack " << abs_slack << ")";
  return msg.str();
}

std::string CheckOutputElement(const RowResult& want, int h, int j, int head_dim, uint16_t got,
                               double ulps) {
  const size_t at = static_cast<size_t>(h) * head_dim + j;
  return CheckBf16Close(got, want.out[at], ulps, want.row_max[h] / 64.0, want.score_slack[at]);
}

namespace {

// Unit in the last place of a float32 of magnitude |x| (normal range).
double Float32Ulp(double x) {
  int e;
  std::frexp(std::max(std::fabs(x), std::ldexp(1.0, -126)), &e);
  return std::ldexp(1.0, e - 1 - 23);
}

}  // namespace

RowResult ReferenceDecode(const CacheView& cache, const DecodeBatch& batch, int32_t b) {
  const CacheGeometry& geo = cache.geo;
  const int hq = batch.num_q_heads, hkv = geo.num_kv_heads, d = geo.head_dim;
  const int group = hq / hkv;
  const int layer = batch.layer[b];
  const int k_count = batch.topk[b];
  const int32_t* list = batch.indices + batch.index_offset[b];
  const int32_t* pages = batch.page_table + batch.page_table_offset[b];
  const int64_t layer_base = static_cast<int64_t>(layer) * geo.LayerElements();
  const int64_t layer_scale_base = static_cast<int64_t>(layer) * geo.LayerScales();

  RowResult result;
  result.out.assign(static_cast<size_t>(hq) * d, 0.0);
  result.lse.assign(hq, -std::numeric_limits<double>::infinity());
  result.row_max.assign(hq, 0.0);
  result.score_slack.assign(static_cast<size_t>(hq) * d, 0.0);
  for (int h = 0; h < hq; ++h) {
    const int kvh = h / group;
    const int32_t* idx = list + (batch.indices_per_kv_head[b] ? kvh * k_count : 0);
    std::vector<double> score;
    std::vector<int64_t> slot_of;
    double max_abs_terms = 0;  // max over t of sum_i |q_i * k_i| * k_scale / sqrt(D)
    for (int i = 0; i < k_count; ++i) {
      int32_t t = idx[i];
      if (t < 0) continue;
      int64_t slot =
          static_cast<int64_t>(pages[t / geo.page_size]) * geo.page_size + t % geo.page_size;
      int64_t row = slot * hkv + kvh;
      double k_scale = geo.scale_mode == ScaleMode::kPerTokenHead
                           ? cache.k_token_scale[layer_scale_base + row]
                           : cache.layer_k_scale[layer];
      double dot = 0, abs_terms = 0;
      for (int j = 0; j < d; ++j) {
        const double term = Bf16ToDouble(batch.q[(static_cast<int64_t>(b) * hq + h) * d + j]) *
                            Fp8E4m3ToDouble(cache.k[layer_base + row * d + j]);
        dot += term;
        abs_terms += std::fabs(term);
      }
      const double to_score = k_scale / std::sqrt(static_cast<double>(d));
      score.push_back(dot * to_score);
      max_abs_terms = std::max(max_abs_terms, abs_terms * to_score);
      slot_of.push_back(row);
    }
    if (score.empty()) continue;
    double max_score = -std::numeric_limits<double>::infinity();
    for (double s : score) max_score = std::max(max_score, s);
    double denom = 0;
    for (double s : score) denom += std::exp(s - max_score);
    result.lse[h] = max_score + std::log(denom);
    // V rows (dequantised) and their weights, kept for the slack's second pass.
    std::vector<double> p(score.size());
    std::vector<double> v(score.size() * d);
    double* o = result.out.data() + static_cast<size_t>(h) * d;
    for (size_t i = 0; i < score.size(); ++i) {
      p[i] = std::exp(score[i] - max_score) / denom;
      int64_t row = slot_of[i];
      double v_scale = geo.scale_mode == ScaleMode::kPerTokenHead
                           ? cache.v_token_scale[layer_scale_base + row]
                           : cache.layer_v_scale[layer];
      for (int j = 0; j < d; ++j) {
        v[i * d + j] = Fp8E4m3ToDouble(cache.v[layer_base + row * d + j]) * v_scale;
        o[j] += p[i] * v[i * d + j];
      }
    }
    const double score_error = 2.0 * Float32Ulp(max_abs_terms);
    double* slack = result.score_slack.data() + static_cast<size_t>(h) * d;
    for (int j = 0; j < d; ++j) {
      double spread = 0;  // sum_t p_t |v_tj - o_j|
      for (size_t i = 0; i < score.size(); ++i) spread += p[i] * std::fabs(v[i * d + j] - o[j]);
      double g = Bf16ToDouble(batch.gate[(static_cast<int64_t>(b) * hq + h) * d + j]);
      const double sigmoid = 1.0 / (1.0 + std::exp(-g));
      o[j] *= sigmoid;
      slack[j] = sigmoid * score_error * spread;
      result.row_max[h] = std::max(result.row_max[h], std::fabs(o[j]));
    }
  }
  return result;
}

}  // namespace sds::ref
