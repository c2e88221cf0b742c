#include "tests/integration/mirror_cache.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "kernels/fp8.h"
#include "tests/reference/reference_decode.h"

namespace sds::itest {

MirrorCache::Token MirrorCache::Quantise(int32_t layer, const uint16_t* k,
                                         const uint16_t* v) const {
  const int32_t hkv = model_.num_kv_heads, d = model_.head_dim;
  Token token;
  token.k.resize(static_cast<size_t>(hkv) * d);
  token.v.resize(static_cast<size_t>(hkv) * d);
  auto quantise = [&](const uint16_t* x, std::vector<uint8_t>* codes, std::vector<float>* scales,
                      float layer_scale) {
    for (int32_t j = 0; j < hkv; ++j) {
      float scale = layer_scale;
      if (model_.scale_mode == ScaleMode::kPerTokenHead) {
        float max_abs = 0;
        for (int32_t e = 0; e < d; ++e)
          max_abs = std::max(max_abs, std::fabs(Bf16ToFloat(x[j * d + e])));
        scale = PerTokenHeadScale(max_abs);
        scales->push_back(scale);
      }
      for (int32_t e = 0; e < d; ++e) {
        (*codes)[j * d + e] = QuantiseFp8E4m3(Bf16ToFloat(x[j * d + e]), scale);
      }
    }
  };
  const bool per_tensor = model_.scale_mode == ScaleMode::kPerTensor;
  quantise(k, &token.k, &token.k_scale, per_tensor ? model_.k_scales[layer] : 1.0f);
  quantise(v, &token.v, &token.v_scale, per_tensor ? model_.v_scales[layer] : 1.0f);
  return token;
}

void MirrorCache::Write(const std::string& sequence, int32_t layer, int64_t position,
                        const uint16_t* k, const uint16_t* v) {
  Token token = Quantise(layer, k, v);
  std::lock_guard<std::mutex> lock(mu_);
  auto& layers = sequences_[sequence];
  layers.resize(model_.num_layers);
  auto& tokens = layers[layer];
  if (static_cast<int64_t>(tokens.size()) <= position) tokens.resize(position + 1);
  tokens[position] = std::move(token);
}

void MirrorCache::Append(const v1::AppendKVRequest& request) {
  const int64_t n = request.k().shape(0);
  const int64_t row = static_cast<int64_t>(model_.num_kv_heads) * model_.head_dim;
  const auto* k = reinterpret_cast<const uint16_t*>(request.k().data().data());
  const auto* v = reinterpret_cast<const uint16_t*>(request.v().data().data());
  for (int64_t i = 0; i < n; ++i) {
    Write(request.sequence_id(), request.layer(), request.start_position() + i, k + i * row,
          v + i * row);
  }
}

void MirrorCache::WriteDecodeToken(const v1::DecodeRequest& request) {
  Write(request.sequence_id(), request.layer(), request.position(),
        reinterpret_cast<const uint16_t*>(request.k().data().data()),
        reinterpret_cast<const uint16_t*>(request.v().data().data()));
}

void MirrorCache::Fork(const std::string& src, const std::string& dst) {
  std::lock_guard<std::mutex> lock(mu_);
  sequences_[dst] = sequences_.at(src);
}

void MirrorCache::Release(const std::string& sequence) {
  std::lock_guard<std::mutex> lock(mu_);
  sequences_.erase(sequence);
}

int64_t MirrorCache::Length(const std::string& sequence, int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(sequence);
  if (it == sequences_.end() || it->second.empty()) return 0;
  return static_cast<int64_t>(it->second[layer].size());
}

std::string MirrorCache::Check(const v1::DecodeRequest& request,
                               const v1::DecodeResponse& response) const {
  const int32_t hq = model_.num_q_heads, hkv = model_.num_kv_heads, d = model_.head_dim;
  const int32_t layer = request.layer();
  const int64_t tokens = request.position() + 1;
  std::ostringstream why;
  if (response.error_code() != 0) {
    why << "error " << response.error_code() << ": " << response.error_message();
    return why.str();
  }
  if (response.request_id() != request.request_id()) return "request_id mismatch";
  if (response.out().dtype() != v1::BF16 || response.out().shape_size() != 2 ||
      response.out().shape(0) != hq || response.out().shape(1) != d ||
      response.out().data().size() != static_cast<size_t>(hq) * d * 2) {
    return "out has the wrong dtype, shape or size";
  }
  if (request.return_lse() && (response.lse().dtype() != v1::FP32 ||
                               response.lse().shape_size() != 1 || response.lse().shape(0) != hq ||
                               response.lse().data().size() != static_cast<size_t>(hq) * 4)) {
    return "lse missing or of the wrong dtype, shape or size";
  }
  if (!request.return_lse() && response.has_lse()) return "lse sent but not asked for";

  // Lay the sequence's pages out as pages 0..P-1 of a private cache.
  CacheView view;
  view.geo.num_layers = model_.num_layers;
  view.geo.num_kv_heads = hkv;
  view.geo.head_dim = d;
  view.geo.page_size = model_.page_size;
  view.geo.num_pages = (tokens + model_.page_size - 1) / model_.page_size;
  view.geo.scale_mode = model_.scale_mode;
  std::vector<uint8_t> k(view.geo.LayerElements() * model_.num_layers, 0);
  std::vector<uint8_t> v(k.size(), 0);
  std::vector<float> ks(view.geo.LayerScales() * model_.num_layers, 1.0f);
  std::vector<float> vs(ks.size(), 1.0f);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sequences_.find(request.sequence_id());
    if (it == sequences_.end()) return "sequence not in the mirror";
    const auto& list = it->second[layer];
    if (static_cast<int64_t>(list.size()) < tokens) return "mirror lacks tokens";
    for (int64_t t = 0; t < tokens; ++t) {
      const Token& token = list[t];
      if (token.k.empty()) return "mirror has a hole";
      const int64_t row = view.geo.LayerElements() * layer + t * hkv * d;
      std::memcpy(k.data() + row, token.k.data(), token.k.size());
      std::memcpy(v.data() + row, token.v.data(), token.v.size());
      if (model_.scale_mode == ScaleMode::kPerTokenHead) {
        const int64_t srow = view.geo.LayerScales() * layer + t * hkv;
        std::memcpy(ks.data() + srow, token.k_scale.data(), hkv * sizeof(float));
        std::memcpy(vs.data() + srow, token.v_scale.data(), hkv * sizeof(float));
      }
    }
  }
  view.k = k.data();
  view.v = v.data();
  if (model_.scale_mode == ScaleMode::kPerTokenHead) {
    view.k_token_scale = ks.data();
    view.v_token_scale = vs.data();
  }
  view.layer_k_scale = model_.k_scales.data();
  view.layer_v_scale = model_.v_scales.data();

  std::vector<int32_t> pages(view.geo.num_pages);
  for (int32_t p = 0; p < view.geo.num_pages; ++p) pages[p] = p;
  const bool per_head = request.indices().shape_size() == 2;
  const int32_t topk = static_cast<int32_t>(request.indices().shape(per_head ? 1 : 0));
  const int64_t page_offset = 0, index_offset = 0;
  const uint8_t per_head_flag = per_head ? 1 : 0;
  DecodeBatch batch;
  batch.num_requests = 1;
  batch.num_q_heads = hq;
  batch.q = reinterpret_cast<const uint16_t*>(request.q().data().data());
  batch.gate = reinterpret_cast<const uint16_t*>(request.gate().data().data());
  batch.layer = &layer;
  batch.page_table = pages.data();
  batch.page_table_offset = &page_offset;
  batch.indices = reinterpret_cast<const int32_t*>(request.indices().data().data());
  batch.index_offset = &index_offset;
  batch.topk = &topk;
  batch.indices_per_kv_head = &per_head_flag;
  const ref::RowResult want = ref::ReferenceDecode(view, batch, 0);

  int failures = 0;
  const auto* out = reinterpret_cast<const uint16_t*>(response.out().data().data());
  for (int32_t h = 0; h < hq; ++h) {
    for (int32_t e = 0; e < d; ++e) {
      std::string problem = ref::CheckOutputElement(want, h, e, d, out[h * d + e], 2.0);
      if (!problem.empty() && failures++ < 4) {
        why << "out[" << h << "][" << e << "]: " << problem << "\n";
      }
    }
    if (request.return_lse()) {
      float got;
      std::memcpy(&got, response.lse().data().data() + 4 * h, 4);
      const double w = want.lse[h];
      const bool ok = std::isinf(w) ? (std::isinf(got) && got < 0)
                                    : std::fabs(got - w) <= 1e-4 * std::max(1.0, std::fabs(w));
      if (!ok && failures++ < 4) why << "lse[" << h << "]: got " << got << " want " << w << "\n";
    }
  }
  return why.str();
}

}  // namespace sds::itest
