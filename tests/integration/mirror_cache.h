// A client-side copy of what the server's cache holds: the same K/V quantised the same
// way (kernels/fp8.h), per sequence, layer and position. Check() lays one sequence out
// in a host CacheView and compares a response with the float64 reference.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tests/integration/test_model.h"

namespace sds::itest {

class MirrorCache {
 public:
  explicit MirrorCache(const TestModel& model) : model_(model) {}

  void Append(const v1::AppendKVRequest& request);
  void WriteDecodeToken(const v1::DecodeRequest& request);  // its k/v at its position
  void Fork(const std::string& src, const std::string& dst);
  void Release(const std::string& sequence);
  int64_t Length(const std::string& sequence, int32_t layer) const;

  // "" when `response` holds the reference output of `request` (whose token must have
  // been written), else a description of the first differences.
  std::string Check(const v1::DecodeRequest& request, const v1::DecodeResponse& response) const;

 private:
  struct Token {
    std::vector<uint8_t> k, v;            // [Hkv * D] FP8 codes
    std::vector<float> k_scale, v_scale;  // [Hkv], per_token_head only
  };
  void Write(const std::string& sequence, int32_t layer, int64_t position, const uint16_t* k,
             const uint16_t* v);
  Token Quantise(int32_t layer, const uint16_t* k, const uint16_t* v) const;

  const TestModel model_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<std::vector<Token>>> sequences_;  // [layer][position]
};

}  // namespace sds::itest
