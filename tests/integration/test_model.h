// The small model the integration tests run, and builders for its requests.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "kernels/decode_params.h"
#include "sparse_decode/v1/decode.grpc.pb.h"

namespace sds::itest {

namespace v1 = ::sparse_decode::v1;

struct TestModel {
  int32_t num_layers = 3;
  int32_t num_q_heads = 8;  // G = 4: h / G and h % Hkv differ
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  int32_t page_size = 16;
  ScaleMode scale_mode = ScaleMode::kPerTensor;
  std::vector<float> k_scales = {0.02f, 0.03f, 0.015f};  // per_tensor, one per layer
  std::vector<float> v_scales = {0.025f, 0.01f, 0.02f};
  int32_t max_topk = 256;
  int64_t cache_pages = 512;

  // Model flags for decode_server.
  std::vector<std::string> Flags() const;
};

class InputGen {
 public:
  explicit InputGen(uint64_t seed) : rng_(seed) {}
  // Uniform in (-amplitude, amplitude), as bf16 bits.
  std::vector<uint16_t> Bf16(size_t count, float amplitude);
  // `count` indices in [0, position]; with_skips sprinkles -1 and duplicates.
  std::vector<int32_t> Indices(int64_t position, int32_t count, bool with_skips);

 private:
  std::mt19937_64 rng_;
};

v1::Tensor Bf16Tensor(const std::vector<int64_t>& shape, const std::vector<uint16_t>& bits);
v1::Tensor Int32Tensor(const std::vector<int64_t>& shape, const std::vector<int32_t>& values);

// A decode with random q/k/v/gate and `topk` indices in [0, position] per list.
v1::DecodeRequest RandomDecode(InputGen& gen, const TestModel& model, const std::string& sequence,
                               int32_t layer, int64_t position, int32_t topk, bool per_kv_head,
                               uint64_t request_id);
// A prefill of `count` random tokens at `start`.
v1::AppendKVRequest RandomAppend(InputGen& gen, const TestModel& model, const std::string& sequence,
                                 int32_t layer, int64_t start, int64_t count);

// A client context with a deadline and optional tenant / bearer metadata.
std::unique_ptr<grpc::ClientContext> Context(
    const std::string& tenant = "", std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::string& bearer = "");

}  // namespace sds::itest
