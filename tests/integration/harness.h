// A running server plus what a test needs to talk to it and to check its answers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/integration/mirror_cache.h"
#include "tests/integration/server_process.h"
#include "tests/integration/test_model.h"

namespace sds::itest {

class Harness {
 public:
  // Starts decode_server for `model` with `extra_flags`; check ok() (and error()).
  explicit Harness(TestModel model, std::vector<std::string> extra_flags = {});

  bool ok() const { return server_ != nullptr; }
  const std::string& error() const { return error_; }
  ServerProcess& server() { return *server_; }
  v1::DecodeService::Stub& stub() { return *stub_; }
  std::unique_ptr<v1::DecodeService::Stub> NewStub() const;  // own channel
  MirrorCache& mirror() { return mirror_; }
  const TestModel& model() const { return model_; }

  // CreateSequence + AppendKV of `tokens` random tokens in every layer (mirrored).
  // Failures are reported through gtest.
  void CreateAndPrefill(InputGen& gen, const std::string& sequence, int64_t tokens,
                        const std::string& tenant = "");
  // Unary Decode; on success the token is mirrored and the output checked.
  grpc::Status DecodeAndCheck(const v1::DecodeRequest& request, const std::string& tenant = "");

 private:
  TestModel model_;
  std::string error_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::DecodeService::Stub> stub_;
  MirrorCache mirror_;
};

}  // namespace sds::itest
