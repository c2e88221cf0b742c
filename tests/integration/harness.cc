#include "tests/integration/harness.h"

namespace sds::itest {

Harness::Harness(TestModel model, std::vector<std::string> extra_flags)
    : model_(std::move(model)), mirror_(model_) {
  std::vector<std::string> flags = model_.Flags();
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  server_ = ServerProcess::Start(flags, &error_);
  if (server_) stub_ = NewStub();
}

std::unique_ptr<v1::DecodeService::Stub> Harness::NewStub() const {
  return v1::DecodeService::NewStub(server_->NewChannel());
}

void Harness::CreateAndPrefill(InputGen& gen, const std::string& sequence, int64_t tokens,
                               const std::string& tenant) {
  v1::CreateSequenceRequest create;
  create.set_sequence_id(sequence);
  create.set_reserve_tokens(tokens);
  v1::CreateSequenceResponse created;
  grpc::Status s = stub_->CreateSequence(Context(tenant).get(), create, &created);
  ASSERT_TRUE(s.ok()) << sequence << ": " << s.error_message();
  if (tokens == 0) return;
  for (int32_t layer = 0; layer < model_.num_layers; ++layer) {
    v1::AppendKVRequest append = RandomAppend(gen, model_, sequence, layer, 0, tokens);
    v1::AppendKVResponse appended;
    s = stub_->AppendKV(Context(tenant).get(), append, &appended);
    ASSERT_TRUE(s.ok()) << sequence << " layer " << layer << ": " << s.error_message();
    ASSERT_EQ(appended.length(), tokens);
    mirror_.Append(append);
  }
}

grpc::Status Harness::DecodeAndCheck(const v1::DecodeRequest& request, const std::string& tenant) {
  v1::DecodeResponse response;
  grpc::Status s = stub_->Decode(Context(tenant).get(), request, &response);
  if (!s.ok()) return s;
  mirror_.WriteDecodeToken(request);
  const std::string problem = mirror_.Check(request, response);
  EXPECT_EQ(problem, "") << request.sequence_id() << " layer " << request.layer() << " position "
                         << request.position();
  EXPECT_GE(response.batch().batch_size(), 1);
  EXPECT_GE(response.batch().batch_id(), 1u);
  return s;
}

}  // namespace sds::itest
