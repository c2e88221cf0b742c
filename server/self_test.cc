#include "server/self_test.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/auth.h"
#include "server/response_wire.h"
#include "server/validate.h"
#include "sparse_decode/v1/decode.pb.h"
#include "spdlog/spdlog.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

uint16_t ToBf16(float x) {  // round to nearest even; inputs are finite
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

float FromBf16(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

double Bf16Ulp(double x) {
  int e;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);
  return std::ldexp(1.0, e - 8);
}

// FP8-exact value (before the per-tensor scale) of V/K element d of token t, KV head j.
double Pattern(int64_t t, int32_t j, int32_t d) {
  static constexpr double kSteps[] = {2, 1, 0.5, -2, -1, -0.5};
  return std::ldexp(kSteps[(t + d) % 6], j % 3);
}

// Everything a call needs, shared with the completion callback so a timed-out
// wait never leaves a dangling reference. It is the decode's sink: its answer is
// encoded as the bytes path's RPCs encode theirs.
struct Pending final : DecodeSink {
  explicit Pending(const ModelShape& model) : encoder(model) {}
  absl::Status Write(int32_t, const BatchInfo& batch, const uint16_t* out,
                     const float* lse) override {
    encoder.Encode(decode.request_id(), batch, out, lse, &encoded);
    return absl::OkStatus();
  }
  void Done(absl::Span<DecodeItem* const>, absl::Span<const absl::Status> result) override {
    std::shared_ptr<Pending> keep = std::move(self);  // a timed-out wait let go of it
    status = result[0];
    done.Notify();
  }

  AnswerEncoder encoder;
  v1::AppendKVRequest append;
  v1::DecodeRequest decode;
  DecodeItem item;
  v1::DecodeResponse response;
  EncodedResponse encoded;  // the decode's answer, as the RPCs get it
  absl::Status status;
  absl::Notification done;
  std::shared_ptr<Pending> self;  // held by the batcher's unit until Done
};

absl::Status Wait(const std::shared_ptr<Pending>& p, const char* what) {
  if (!p->done.WaitForNotificationWithTimeout(absl::Seconds(120))) {
    return absl::DeadlineExceededError(absl::StrCat("self-test: ", what, " did not complete"));
  }
  return p->status;
}

void SetBf16(v1::Tensor* t, const std::vector<int64_t>& shape, const std::vector<float>& values) {
  t->set_dtype(v1::BF16);
  for (int64_t dim : shape) t->add_shape(dim);
  std::string bytes(values.size() * 2, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t b = ToBf16(values[i]);
    std::memcpy(bytes.data() + 2 * i, &b, 2);
  }
  t->set_data(std::move(bytes));
}

absl::Status CheckLayer(Batcher& batcher, PagedKvCache& cache, const ModelShape& m, int32_t layer) {
  const CacheConfig& config = cache.config();
  const bool per_tensor = config.scale_mode == ScaleMode::kPerTensor;
  const float k_scale =
      per_tensor && !config.layer_k_scales.empty() ? config.layer_k_scales[layer] : 1.0f;
  const float v_scale =
      per_tensor && !config.layer_v_scales.empty() ? config.layer_v_scales[layer] : 1.0f;
  const int64_t tokens = std::min<int64_t>(config.page_size + 3, m.max_topk);
  const std::string key = SequenceKey(kInternalTenant, absl::StrCat("self-test-", layer));
  const int32_t hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim, group = hq / hkv;

  auto kv_values = [&](int64_t first, int64_t count, float scale) {
    std::vector<float> values;
    for (int64_t t = first; t < first + count; ++t)
      for (int32_t j = 0; j < hkv; ++j)
        for (int32_t e = 0; e < d; ++e)
          values.push_back(static_cast<float>(Pattern(t, j, e) * scale));
    return values;
  };

  if (absl::Status s = cache.CreateSequence(key, 0); !s.ok()) return s;
  absl::Status result = [&]() -> absl::Status {
    if (tokens > 1) {  // prefill positions 0 .. tokens-2
      auto p = std::make_shared<Pending>(m);
      p->append.set_sequence_id("self-test");
      p->append.set_layer(layer);
      SetBf16(p->append.mutable_k(), {tokens - 1, hkv, d}, kv_values(0, tokens - 1, k_scale));
      SetBf16(p->append.mutable_v(), {tokens - 1, hkv, d}, kv_values(0, tokens - 1, v_scale));
      AppendWork work;
      work.key = key;
      work.sequence_id = p->append.sequence_id();
      work.layer = layer;
      work.num_tokens = tokens - 1;
      work.k = p->append.k().data().data();
      work.v = p->append.v().data().data();
      work.done = [p](const absl::StatusOr<int64_t>& length) {
        p->status = length.status();
        p->done.Notify();
      };
      if (absl::Status s = batcher.SubmitAppend(std::move(work)); !s.ok()) return s;
      if (absl::Status s = Wait(p, "prefill"); !s.ok()) return s;
    }
    // Decode the last position, attending to every token (and one skipped index).
    auto p = std::make_shared<Pending>(m);
    v1::DecodeRequest& req = p->decode;
    req.set_sequence_id("self-test");
    req.set_layer(layer);
    req.set_position(tokens - 1);
    req.set_return_lse(true);
    req.set_request_id(42);
    SetBf16(req.mutable_q(), {hq, d}, std::vector<float>(static_cast<size_t>(hq) * d, 0.0f));
    SetBf16(req.mutable_k(), {hkv, d}, kv_values(tokens - 1, 1, k_scale));
    SetBf16(req.mutable_v(), {hkv, d}, kv_values(tokens - 1, 1, v_scale));
    std::vector<float> gate;
    gate.reserve(static_cast<size_t>(hq) * d);
    for (int32_t h = 0; h < hq; ++h)
      for (int32_t e = 0; e < d; ++e)
        gate.push_back(0.5f * static_cast<float>((h * 7 + e) % 9 - 4));
    SetBf16(req.mutable_gate(), {hq, d}, gate);
    std::vector<int32_t> indices;
    for (int32_t t = 0; t < tokens; ++t) indices.push_back(t);
    if (tokens < m.max_topk) indices.push_back(-1);
    v1::Tensor* idx = req.mutable_indices();
    idx->set_dtype(v1::INT32);
    idx->add_shape(static_cast<int64_t>(indices.size()));
    idx->set_data(indices.data(), indices.size() * 4);

    if (absl::Status s = ValidateDecode(p->decode, DecodeBytesOf(p->decode), m, &p->item);
        !s.ok()) {
      return s;
    }
    p->item.key = key;
    DecodeWork work;
    work.items.push_back(&p->item);
    work.sink = p.get();
    p->self = p;
    if (absl::Status s = batcher.SubmitDecode(std::move(work)); !s.ok()) {
      p->self.reset();
      return s;
    }
    // A batch closes at the first non-decode entry behind it (queue order is kept), so
    // a no-op control entry runs this decode now instead of after --max_queue_delay_us
    // (start-up took twice that; tests run with delays of seconds).
    ControlWork flush;
    flush.run = [] { return absl::OkStatus(); };
    flush.done = [](const absl::Status&) {};
    if (absl::Status s = batcher.SubmitControl(std::move(flush)); !s.ok()) return s;
    if (absl::Status s = Wait(p, "decode"); !s.ok()) return s;

    // The answer as the decode RPCs send it: encoded from the staging rows.
    if (p->encoded.empty() ||
        !p->response.ParseFromArray(p->encoded.bytes.begin(),
                                    static_cast<int>(p->encoded.bytes.size()))) {
      return absl::InternalError("self-test: the encoded decode answer is missing or malformed");
    }
    const v1::DecodeResponse& resp = p->response;
    if (resp.request_id() != 42 || resp.out().data().size() != static_cast<size_t>(hq) * d * 2 ||
        resp.lse().data().size() != static_cast<size_t>(hq) * 4) {
      return absl::InternalError("self-test: response has the wrong request_id or sizes");
    }
    for (int32_t h = 0; h < hq; ++h) {
      const int32_t j = h / group;
      float lse;
      std::memcpy(&lse, resp.lse().data().data() + 4 * h, 4);
      if (std::fabs(lse - std::log(static_cast<double>(tokens))) > 1e-3) {
        return absl::InternalError(absl::StrCat("self-test: layer ", layer, " head ", h, ": lse ",
                                                lse, ", expected log(", tokens, ")"));
      }
      for (int32_t e = 0; e < d; ++e) {
        double mean = 0;
        for (int64_t t = 0; t < tokens; ++t) mean += Pattern(t, j, e) * v_scale;
        mean /= static_cast<double>(tokens);
        const double g = FromBf16(ToBf16(gate[static_cast<size_t>(h) * d + e]));
        const double want = mean / (1.0 + std::exp(-g));
        uint16_t bits;
        std::memcpy(&bits, resp.out().data().data() + 2 * (static_cast<size_t>(h) * d + e), 2);
        const double got = FromBf16(bits);
        const double tol = 3 * Bf16Ulp(std::max(std::fabs(want), 0.05 * v_scale));
        if (!(std::fabs(got - want) <= tol)) {
          return absl::InternalError(absl::StrCat("self-test: layer ", layer, " out[", h, "][", e,
                                                  "] = ", got, ", expected ", want));
        }
      }
    }
    return absl::OkStatus();
  }();
  if (auto freed = cache.ReleaseSequence(key); !freed.ok() && result.ok()) result = freed.status();
  return result;
}

}  // namespace

absl::Status RunSelfTest(Batcher& batcher, PagedKvCache& cache, const ModelShape& model) {
  for (int32_t layer : {0, model.num_layers - 1}) {
    if (absl::Status s = CheckLayer(batcher, cache, model, layer); !s.ok()) return s;
    if (model.num_layers == 1) break;
  }
  spdlog::info("self-test passed (prefill + decode through the batcher and backend)");
  return absl::OkStatus();
}

}  // namespace sds::server
