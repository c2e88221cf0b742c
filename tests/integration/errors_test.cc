// Every bad-input class returns its DESIGN.md status code, through Decode, DecodeBatch
// and DecodeStream alike, and leaves the cache intact: the next good request still
// matches the reference. Also tenancy, authentication, deadlines, a full queue and
// invalid start-up flags.
#include <grpcpp/generic/generic_stub.h>

#include <functional>
#include <future>
#include <limits>
#include <map>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/reference/reference_decode.h"

namespace sds::itest {
namespace {

struct BadCase {
  const char* name;
  grpc::StatusCode code;
  std::function<void(v1::DecodeRequest*)> mutate;
};

std::vector<BadCase> BadDecodeCases(const TestModel& m) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto poison = [](v1::Tensor* t, float value) {
    uint16_t bits = ref::FloatToBf16(value);
    std::memcpy(t->mutable_data()->data() + 10, &bits, 2);
  };
  using C = grpc::StatusCode;
  return {
      {"q dtype", C::INVALID_ARGUMENT, [](auto* r) { r->mutable_q()->set_dtype(v1::FP16); }},
      {"k shape", C::INVALID_ARGUMENT, [](auto* r) { r->mutable_k()->set_shape(0, 3); }},
      {"v bytes", C::INVALID_ARGUMENT, [](auto* r) { r->mutable_v()->mutable_data()->resize(6); }},
      {"gate missing", C::INVALID_ARGUMENT, [](auto* r) { r->clear_gate(); }},
      {"indices dtype", C::INVALID_ARGUMENT,
       [](auto* r) { r->mutable_indices()->set_dtype(v1::FP32); }},
      {"indices shape", C::INVALID_ARGUMENT,
       [m](auto* r) {
         *r->mutable_indices() =
             Int32Tensor({m.num_kv_heads + 1, 1}, std::vector<int32_t>(m.num_kv_heads + 1, 0));
       }},
      {"layer negative", C::INVALID_ARGUMENT, [](auto* r) { r->set_layer(-1); }},
      {"layer too large", C::INVALID_ARGUMENT, [m](auto* r) { r->set_layer(m.num_layers); }},
      {"topk above max", C::INVALID_ARGUMENT,
       [m](auto* r) {
         *r->mutable_indices() =
             Int32Tensor({m.max_topk + 1}, std::vector<int32_t>(m.max_topk + 1, 0));
       }},
      {"index beyond position", C::INVALID_ARGUMENT,
       [](auto* r) {
         *r->mutable_indices() = Int32Tensor({2}, {0, static_cast<int32_t>(r->position() + 1)});
       }},
      {"index -2", C::INVALID_ARGUMENT,
       [](auto* r) {
         *r->mutable_indices() = Int32Tensor({2}, {0, -2});
       }},
      {"NaN in q", C::INVALID_ARGUMENT, [=](auto* r) { poison(r->mutable_q(), nan); }},
      {"Inf in k", C::INVALID_ARGUMENT, [=](auto* r) { poison(r->mutable_k(), inf); }},
      {"NaN in v", C::INVALID_ARGUMENT, [=](auto* r) { poison(r->mutable_v(), nan); }},
      {"-Inf in gate", C::INVALID_ARGUMENT, [=](auto* r) { poison(r->mutable_gate(), -inf); }},
      {"empty sequence id", C::INVALID_ARGUMENT, [](auto* r) { r->set_sequence_id(""); }},
      {"unknown sequence", C::NOT_FOUND, [](auto* r) { r->set_sequence_id("nope"); }},
      {"position gap", C::FAILED_PRECONDITION, [](auto* r) { r->set_position(r->position() + 1); }},
  };
}

class ErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_.max_topk = 32;
    harness_ = std::make_unique<Harness>(model_);
    ASSERT_TRUE(harness_->ok()) << harness_->error();
  }
  TestModel model_;
  std::unique_ptr<Harness> harness_;
};

// Large DecodeBatch calls: each bad item gets its own code in its own slot and every
// good one its answer; and a call that names each (sequence, layer) twice, at
// consecutive positions, checks the second after the first (an admission that took a
// call's items in any order, e.g. on several threads, fails it: session 15 tried one).
TEST_F(ErrorsTest, ALargeDecodeBatchAnswersEveryItemInItsSlot) {
  Harness& h = *harness_;
  InputGen gen(16);
  // 32 indices x 2 KV heads per item: enough rows for the CPU backend to wake its pool
  // when the call arrives (kMinRowsForPool in kernels/cpu_attention.cc).
  constexpr int32_t kTopK = 32;
  constexpr int kSequences = 40;
  std::vector<std::string> seqs;
  for (int i = 0; i < kSequences; ++i) {
    seqs.push_back("big" + std::to_string(i));
    h.CreateAndPrefill(gen, seqs.back(), 10 + i % 7);
  }
  std::map<std::string, BadCase> bad_cases;
  for (const BadCase& bad : BadDecodeCases(model_)) bad_cases.emplace(bad.name, bad);
  uint64_t id = 1;
  // Runs a call; checks each bad item's code, each good one against the reference
  // (written to the mirror in order: a repeated (sequence, layer) reads its first token).
  auto run = [&](const v1::DecodeBatchRequest& call, const std::map<int, std::string>& bad) {
    v1::DecodeBatchResponse response;
    grpc::Status s = h.stub().DecodeBatch(Context().get(), call, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(response.responses_size(), call.requests_size());
    for (int i = 0; i < call.requests_size(); ++i) {
      const v1::DecodeResponse& answer = response.responses(i);
      EXPECT_EQ(answer.request_id(), call.requests(i).request_id()) << "item " << i;
      if (auto it = bad.find(i); it != bad.end()) {
        EXPECT_EQ(answer.error_code(), bad_cases.at(it->second).code) << it->second;
        EXPECT_FALSE(answer.error_message().empty()) << it->second;
        continue;
      }
      ASSERT_EQ(answer.error_code(), 0) << "item " << i << ": " << answer.error_message();
      h.mirror().WriteDecodeToken(call.requests(i));
      EXPECT_EQ(h.mirror().Check(call.requests(i), answer), "") << "item " << i;
    }
  };
  // Every sequence's layers 0 and 1 once: 80 items, eight of them bad.
  const std::map<int, std::string> bad_at = {
      {3, "NaN in q"},  {10, "unknown sequence"}, {17, "position gap"}, {22, "k shape"},
      {41, "Inf in k"}, {56, "indices dtype"},    {63, "gate missing"}, {79, "-Inf in gate"}};
  v1::DecodeBatchRequest once;
  for (int i = 0; i < 2 * kSequences; ++i) {
    const std::string& seq = seqs[i / 2];
    const int32_t layer = i % 2;
    v1::DecodeRequest r = RandomDecode(gen, model_, seq, layer, h.mirror().Length(seq, layer),
                                       kTopK, i % 3 == 0, id++);
    if (auto it = bad_at.find(i); it != bad_at.end()) bad_cases.at(it->second).mutate(&r);
    *once.add_requests() = r;
  }
  run(once, bad_at);
  // Every sequence's layers 0 and 1 at their next two positions, each pair adjacent:
  // 160 items. Checked in any order, a second of a pair could come before its first.
  v1::DecodeBatchRequest twice;
  for (int i = 0; i < 4 * kSequences; ++i) {
    const std::string& seq = seqs[i / 4];
    const int32_t layer = (i / 2) % 2;
    const int64_t position = h.mirror().Length(seq, layer) + i % 2;
    *twice.add_requests() = RandomDecode(gen, model_, seq, layer, position, kTopK, false, id++);
  }
  run(twice, {});
}

TEST_F(ErrorsTest, EachBadDecodeGetsItsCodeAndTheCacheStaysIntact) {
  Harness& h = *harness_;
  InputGen gen(11);
  h.CreateAndPrefill(gen, "victim", 20);
  uint64_t id = 1;
  for (const BadCase& bad : BadDecodeCases(model_)) {
    const int32_t layer = static_cast<int32_t>(id % model_.num_layers);
    // A bad request built on the sequence's current length.
    auto make_bad = [&] {
      v1::DecodeRequest r = RandomDecode(gen, model_, "victim", layer,
                                         h.mirror().Length("victim", layer), 8, false, id++);
      bad.mutate(&r);
      return r;
    };
    // Unary.
    v1::DecodeRequest r = make_bad();
    v1::DecodeResponse response;
    grpc::Status s = h.stub().Decode(Context().get(), r, &response);
    EXPECT_EQ(s.error_code(), bad.code) << bad.name << ": " << s.error_message();
    EXPECT_FALSE(s.error_message().empty()) << bad.name;
    // Inside a DecodeBatch: it fails alone, its good neighbour succeeds.
    r = make_bad();
    v1::DecodeBatchRequest batch;
    *batch.add_requests() = r;
    v1::DecodeRequest good = RandomDecode(gen, model_, "victim", layer,
                                          h.mirror().Length("victim", layer), 8, true, id++);
    *batch.add_requests() = good;
    v1::DecodeBatchResponse batch_response;
    s = h.stub().DecodeBatch(Context().get(), batch, &batch_response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(batch_response.responses_size(), 2);
    EXPECT_EQ(batch_response.responses(0).error_code(), bad.code) << bad.name;
    EXPECT_EQ(batch_response.responses(0).request_id(), r.request_id());
    h.mirror().WriteDecodeToken(good);
    EXPECT_EQ(h.mirror().Check(good, batch_response.responses(1)), "") << "after " << bad.name;
    // On a stream.
    r = make_bad();
    grpc::ClientContext context;
    auto stream = h.stub().DecodeStream(&context);
    ASSERT_TRUE(stream->Write(r));
    v1::DecodeResponse streamed;
    ASSERT_TRUE(stream->Read(&streamed));
    EXPECT_EQ(streamed.error_code(), bad.code) << bad.name;
    EXPECT_EQ(streamed.request_id(), r.request_id());
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
    // And the cache is intact: a following good unary decode matches.
    v1::DecodeRequest next = RandomDecode(gen, model_, "victim", layer,
                                          h.mirror().Length("victim", layer), 12, false, id++);
    EXPECT_TRUE(h.DecodeAndCheck(next).ok()) << "after " << bad.name;
  }
}

// Sends `bytes` as the whole request message of `method` (no client-side encoding).
grpc::Status RawUnary(Harness& h, const std::string& method, const std::string& bytes) {
  grpc::GenericStub stub(h.server().NewChannel());
  grpc::Slice slice(bytes.data(), bytes.size());
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/sparse_decode.v1.DecodeService/" + method, grpc::StubOptions(),
                 &request, &response, [&done](const grpc::Status& s) { done.set_value(s); });
  return done.get_future().get();
}

// The sds_requests_total count of (rpc, code) on the server's /metrics, 0 when absent.
int64_t RequestCount(Harness& h, const std::string& rpc, const std::string& code) {
  int status = 0;
  const std::string body = HttpGet(h.server().metrics_port(), "/metrics", &status);
  EXPECT_EQ(status, 200);
  const std::string series = "sds_requests_total{rpc=\"" + rpc + "\",code=\"" + code + "\"} ";
  const size_t at = body.find(series);
  if (at == std::string::npos) return 0;
  return std::stoll(body.substr(at + series.size()));
}

// Field 1 (a string) of a message, as bytes: lets a test send any bytes, UTF-8 or not.
std::string StringField(int field, const std::string& value) {
  return std::string(1, static_cast<char>(field << 3 | 2)) +
         std::string(1, static_cast<char>(value.size())) + value;  // value < 128 bytes
}

// Every method parses its request itself: Decode and DecodeBatch from the slices
// (server/wire_decode.cc), the others whole by protobuf in the handler (TypedCall in
// server/raw_call.h), where gRPC's typed methods had answered INTERNAL with no message
// before any handler ran. Bytes that are not a valid encoding, and strings that are not
// UTF-8 (proto3 requires it), are INVALID_ARGUMENT with a message that says so, counted
// in /metrics by method, and run nothing (a truncated batch's first, complete request
// would otherwise be a valid decode; a truncated release, fork or create would change
// the sequences).
TEST_F(ErrorsTest, MalformedMessagesAreInvalidArgumentAndRunNothing) {
  Harness& h = *harness_;
  InputGen gen(12);
  h.CreateAndPrefill(gen, "victim", 20);
  const int32_t layer = 1;
  v1::DecodeBatchRequest batch;
  *batch.add_requests() =
      RandomDecode(gen, model_, "victim", layer, h.mirror().Length("victim", layer), 8, false, 1);
  *batch.add_requests() = RandomDecode(gen, model_, "other", layer, 0, 1, false, 2);  // not reached
  const std::string encoded = batch.SerializeAsString();
  const std::string one = batch.requests(0).SerializeAsString();
  const int64_t length0 = h.mirror().Length("victim", 0);
  v1::AppendKVRequest append = RandomAppend(gen, model_, "victim", 0, length0, 2);
  const std::string append_bytes = append.SerializeAsString();
  append.clear_sequence_id();
  const std::string append_not_utf8 = StringField(1, "vic\xfftim") + append.SerializeAsString();
  v1::ForkSequenceRequest fork;
  fork.set_sequence_id("victim");
  fork.set_new_sequence_id("copy");
  const std::string fork_bytes = fork.SerializeAsString();
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id("victim");
  const std::string release_bytes = release.SerializeAsString();
  v1::CreateSequenceRequest create;
  create.set_sequence_id("fresh");
  const std::string create_bytes = create.SerializeAsString();
  const std::string garbage = "\xff\xff\xff";
  struct Case {
    const char* method;
    std::string bytes;
  };
  const Case cases[] = {
      {"Decode", garbage},
      {"DecodeBatch", garbage},
      {"Decode", one.substr(0, one.size() - 1)},
      {"DecodeBatch", encoded.substr(0, encoded.size() - 1)},
      {"Decode", one + std::string(1, '\0')},  // a 0 tag
      {"GetModelInfo", garbage},
      {"CreateSequence", garbage},
      {"CreateSequence", create_bytes.substr(0, create_bytes.size() - 1)},
      {"CreateSequence", StringField(1, "fr\xc3\x28sh")},  // an invalid 2-byte sequence
      {"AppendKV", garbage},
      {"AppendKV", append_bytes.substr(0, append_bytes.size() - 1)},
      {"AppendKV", append_not_utf8},
      {"ForkSequence", garbage},
      {"ForkSequence", fork_bytes.substr(0, fork_bytes.size() - 1)},
      {"ForkSequence", StringField(1, "victim") + StringField(2, "copy\xff")},
      {"ReleaseSequence", garbage},
      {"ReleaseSequence", release_bytes.substr(0, release_bytes.size() - 1)},
      {"ReleaseSequence", StringField(1, "vic\xfftim")},
  };
  std::map<std::string, int64_t> bad_per_method;
  for (const Case& c : cases) {
    const grpc::Status s = RawUnary(h, c.method, c.bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.method << " of " << c.bytes.size() << " bytes: " << s.error_message();
    EXPECT_NE(s.error_message().find("malformed"), std::string::npos) << s.error_message();
    ++bad_per_method[c.method];
  }
  for (const auto& [method, bad] : bad_per_method) {
    // DecodeBatch counts its items; a batch that does not parse counts once.
    EXPECT_EQ(RequestCount(h, method, "INVALID_ARGUMENT"), bad) << method;
    EXPECT_EQ(RequestCount(h, method, "INTERNAL"), 0) << method;
  }
  // The complete encodings are good calls, and the first request still fits the cache
  // as it was (nothing above ran it).
  EXPECT_TRUE(RawUnary(h, "Decode", one).ok());
  h.mirror().WriteDecodeToken(batch.requests(0));
  v1::DecodeRequest next =
      RandomDecode(gen, model_, "victim", layer, h.mirror().Length("victim", layer), 12, false, 3);
  EXPECT_TRUE(h.DecodeAndCheck(next).ok());
  // Nothing else ran either: "victim" was not released and layer 0 got no tokens (the
  // position after them is still a gap), "copy" and "fresh" do not exist yet.
  v1::DecodeResponse gap;
  EXPECT_EQ(h.stub()
                .Decode(Context().get(),
                        RandomDecode(gen, model_, "victim", 0, length0 + 2, 4, false, 4), &gap)
                .error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  v1::ForkSequenceResponse forked;
  EXPECT_TRUE(h.stub().ForkSequence(Context().get(), fork, &forked).ok());
  v1::CreateSequenceResponse created;
  EXPECT_TRUE(h.stub().CreateSequence(Context().get(), create, &created).ok());
  EXPECT_TRUE(RawUnary(h, "GetModelInfo", "").ok());
}

// One DecodeStream of raw messages: each written, then its answer read (a completion
// queue and a generic stub, so that any bytes can be sent).
class RawStream {
 public:
  explicit RawStream(Harness& h) : stub_(h.server().NewChannel()) {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    call_ = stub_.PrepareCall(&context_, "/sparse_decode.v1.DecodeService/DecodeStream", &cq_);
    call_->StartCall(this);
    EXPECT_TRUE(Wait());
  }
  // Writes `bytes` as one message and reads one answer.
  v1::DecodeResponse RoundTrip(const std::string& bytes) {
    grpc::Slice slice(bytes.data(), bytes.size());
    grpc::ByteBuffer out(&slice, 1), in;
    call_->Write(out, this);
    EXPECT_TRUE(Wait());
    call_->Read(&in, this);
    EXPECT_TRUE(Wait());
    v1::DecodeResponse response;
    EXPECT_TRUE(grpc::SerializationTraits<v1::DecodeResponse>::Deserialize(&in, &response).ok());
    return response;
  }
  grpc::Status Finish() {
    call_->WritesDone(this);
    EXPECT_TRUE(Wait());
    grpc::Status status;
    call_->Finish(&status, this);
    EXPECT_TRUE(Wait());
    return status;
  }

 private:
  bool Wait() {
    void* tag = nullptr;
    bool ok = false;
    return cq_.Next(&tag, &ok) && tag == this && ok;
  }
  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
};

// A malformed DecodeStream message gets its own INVALID_ARGUMENT answer; the stream
// goes on and its next, good message is answered as usual.
TEST_F(ErrorsTest, MalformedStreamMessageIsAnsweredAndTheStreamGoesOn) {
  Harness& h = *harness_;
  InputGen gen(13);
  h.CreateAndPrefill(gen, "victim", 20);
  const v1::DecodeRequest good =
      RandomDecode(gen, model_, "victim", 0, h.mirror().Length("victim", 0), 8, true, 7);
  RawStream stream(h);
  const v1::DecodeResponse bad = stream.RoundTrip("\xff\xff\xff");
  EXPECT_EQ(bad.error_code(), static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(bad.error_message().find("malformed"), std::string::npos) << bad.error_message();
  const v1::DecodeResponse answer = stream.RoundTrip(good.SerializeAsString());
  EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
  h.mirror().WriteDecodeToken(good);
  EXPECT_EQ(h.mirror().Check(good, answer), "");
  EXPECT_TRUE(stream.Finish().ok());
}

TEST_F(ErrorsTest, BadPrefillAndSequenceCalls) {
  Harness& h = *harness_;
  InputGen gen(12);
  h.CreateAndPrefill(gen, "p", 10);
  auto append = [&](const v1::AppendKVRequest& r) {
    v1::AppendKVResponse response;
    return h.stub().AppendKV(Context().get(), r, &response).error_code();
  };
  v1::AppendKVRequest gap = RandomAppend(gen, model_, "p", 0, 12, 2);
  EXPECT_EQ(append(gap), grpc::StatusCode::FAILED_PRECONDITION);
  v1::AppendKVRequest nan = RandomAppend(gen, model_, "p", 1, 10, 3);
  uint16_t bits = 0x7FC0;
  std::memcpy(nan.mutable_v()->mutable_data()->data() + 40, &bits, 2);
  EXPECT_EQ(append(nan), grpc::StatusCode::INVALID_ARGUMENT);
  v1::AppendKVRequest shape = RandomAppend(gen, model_, "p", 1, 10, 3);
  shape.mutable_k()->set_shape(1, 1);
  EXPECT_EQ(append(shape), grpc::StatusCode::INVALID_ARGUMENT);
  v1::AppendKVRequest layer = RandomAppend(gen, model_, "p", model_.num_layers, 10, 3);
  EXPECT_EQ(append(layer), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(append(RandomAppend(gen, model_, "unknown", 0, 0, 1)), grpc::StatusCode::NOT_FOUND);
  // Re-writing a written position is allowed (a retried request is harmless).
  v1::AppendKVRequest rewrite = RandomAppend(gen, model_, "p", 2, 4, 6);
  EXPECT_EQ(append(rewrite), grpc::StatusCode::OK);
  h.mirror().Append(rewrite);
  // Nothing of the failed prefills was stored.
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    EXPECT_TRUE(h.DecodeAndCheck(RandomDecode(gen, model_, "p", l, 10, 16, l == 1, 50 + l)).ok());
  }
  // CreateSequence twice, reservations too large, fork/release of unknown ids.
  v1::CreateSequenceRequest create;
  create.set_sequence_id("p");
  v1::CreateSequenceResponse created;
  EXPECT_EQ(h.stub().CreateSequence(Context().get(), create, &created).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  create.set_sequence_id("huge");
  create.set_reserve_tokens(model_.cache_pages * model_.page_size * 2);
  grpc::Status s = h.stub().CreateSequence(Context().get(), create, &created);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  create.set_reserve_tokens(-1);
  EXPECT_EQ(h.stub().CreateSequence(Context().get(), create, &created).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id("unknown");
  v1::ReleaseSequenceResponse released;
  EXPECT_EQ(h.stub().ReleaseSequence(Context().get(), release, &released).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::ForkSequenceRequest fork;
  fork.set_sequence_id("unknown");
  fork.set_new_sequence_id("x");
  v1::ForkSequenceResponse forked;
  EXPECT_EQ(h.stub().ForkSequence(Context().get(), fork, &forked).error_code(),
            grpc::StatusCode::NOT_FOUND);
  fork.set_sequence_id("p");
  fork.set_new_sequence_id("p");
  EXPECT_EQ(h.stub().ForkSequence(Context().get(), fork, &forked).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
}

TEST_F(ErrorsTest, TenantsDoNotSeeEachOthersSequences) {
  Harness& h = *harness_;
  InputGen gen(13);
  h.CreateAndPrefill(gen, "shared-name", 8, "alice");
  v1::DecodeRequest r = RandomDecode(gen, model_, "shared-name", 0, 8, 4, false, 1);
  v1::DecodeResponse response;
  grpc::Status s = h.stub().Decode(Context("bob").get(), r, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(h.stub().Decode(Context().get(), r, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);  // the default tenant is another tenant
  v1::ReleaseSequenceRequest release;
  release.set_sequence_id("shared-name");
  v1::ReleaseSequenceResponse released;
  EXPECT_EQ(h.stub().ReleaseSequence(Context("bob").get(), release, &released).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::CreateSequenceRequest create;
  create.set_sequence_id("shared-name");
  v1::CreateSequenceResponse created;
  EXPECT_TRUE(h.stub().CreateSequence(Context("bob").get(), create, &created).ok());
  // Alice's sequence is untouched.
  EXPECT_TRUE(h.DecodeAndCheck(r, "alice").ok());
}

TEST_F(ErrorsTest, ModelInfoAndHealth) {
  Harness& h = *harness_;
  v1::ModelInfo info;
  ASSERT_TRUE(h.stub().GetModelInfo(Context().get(), v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.num_layers(), model_.num_layers);
  EXPECT_EQ(info.num_q_heads(), model_.num_q_heads);
  EXPECT_EQ(info.num_kv_heads(), model_.num_kv_heads);
  EXPECT_EQ(info.head_dim(), model_.head_dim);
  EXPECT_EQ(info.page_size(), model_.page_size);
  EXPECT_EQ(info.kv_dtype(), "fp8_e4m3");
  EXPECT_EQ(info.scale_mode(), "per_tensor");
  EXPECT_EQ(info.backend(), TestBackend());
  EXPECT_EQ(info.total_pages(), model_.cache_pages);
  EXPECT_EQ(info.free_pages(), model_.cache_pages);
  EXPECT_FALSE(info.scales_are_default());
  ASSERT_EQ(info.k_scales_size(), model_.num_layers);
  EXPECT_FLOAT_EQ(info.k_scales(1), model_.k_scales[1]);
  EXPECT_FLOAT_EQ(info.v_scales(2), model_.v_scales[2]);
  EXPECT_EQ(info.max_topk(), model_.max_topk);
  auto channel = h.server().NewChannel();
  EXPECT_EQ(HealthStatus(channel, ""), 1);
  // The port opened (and health said SERVING) only after the self-test passed.
  const std::string log = h.server().Log();
  ASSERT_NE(log.find("self-test passed"), std::string::npos) << log;
  EXPECT_LT(log.find("self-test passed"), log.find("serving on"));
  EXPECT_EQ(HealthStatus(channel, "sparse_decode.v1.DecodeService"), 1);
}

// B1: a DecodeBatch of 4M empty items (8 MB on the wire) used to be parsed whole, 3 GB
// of items, before any was refused. Past --max_decode_batch_items the call is refused as
// it is parsed, and the server serves on.
TEST(ErrorsStandalone, DecodeBatchPastItsItemCapIsRefusedAtOnce) {
  TestModel model;
  Harness h(model, {"--max_decode_batch_items=1000"});
  ASSERT_TRUE(h.ok()) << h.error();
  std::string empty_items;
  empty_items.reserve(8000000);
  for (int i = 0; i < 4000000; ++i) empty_items.append("\x0a\x00", 2);
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status s = RawUnary(h, "DecodeBatch", empty_items);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("more than 1000 requests"), std::string::npos)
      << s.error_message();
  EXPECT_LT(seconds, 3.0);
  InputGen gen(5);
  h.CreateAndPrefill(gen, "after", 4);
  EXPECT_TRUE(h.DecodeAndCheck(RandomDecode(gen, model, "after", 0, 4, 3, false, 1)).ok());
}

// B5: protobuf wrote one error line per non-UTF-8 string of a typed request; the
// server's log handler lets a burst of 10 through and then one a second.
TEST(ErrorsStandalone, MalformedStringsDoNotFloodTheLog) {
  TestModel model;
  Harness h(model);
  ASSERT_TRUE(h.ok()) << h.error();
  auto count_lines = [&] {
    const std::string log = h.server().Log();
    int lines = 0;
    for (size_t at = log.find("String field"); at != std::string::npos;
         at = log.find("String field", at + 1)) {
      ++lines;
    }
    return lines;
  };
  const int before = count_lines();
  for (int i = 0; i < 200; ++i) {
    const grpc::Status s = RawUnary(h, "CreateSequence", StringField(1, "bad\xffid"));
    ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  }
  const int logged = count_lines() - before;
  EXPECT_GT(logged, 0) << "protobuf's line no longer reaches the log at all";
  EXPECT_LE(logged, 15) << "every malformed string was logged";
}

TEST(ErrorsStandalone, DefaultScalesAreVisible) {
  TestModel model;
  std::vector<std::string> flags = {"--num_layers=2", "--num_q_heads=8", "--num_kv_heads=4",
                                    "--head_dim=64", "--cache_pages=64"};
  std::string error;
  auto server = ServerProcess::Start(flags, &error);
  ASSERT_TRUE(server) << error;
  auto stub = v1::DecodeService::NewStub(server->NewChannel());
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(Context().get(), v1::GetModelInfoRequest(), &info).ok());
  EXPECT_TRUE(info.scales_are_default());
  EXPECT_EQ(info.k_scales_size(), 2);
  EXPECT_NE(server->Log().find("default to 1.0"), std::string::npos) << "no warning logged";
}

TEST(ErrorsStandalone, AuthTokenIsRequiredWhenSet) {
  TestModel model;
  Harness h(model, {"--auth_token=s3cret"});
  ASSERT_TRUE(h.ok()) << h.error();
  v1::ModelInfo info;
  v1::GetModelInfoRequest request;
  EXPECT_EQ(h.stub().GetModelInfo(Context().get(), request, &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(h.stub()
                .GetModelInfo(Context("", std::chrono::seconds(5), "wrong").get(), request, &info)
                .error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(
      h.stub()
          .GetModelInfo(Context("", std::chrono::seconds(5), "s3cret").get(), request, &info)
          .ok());
  grpc::ClientContext context;  // a stream without the token ends at once
  auto stream = h.stub().DecodeStream(&context);
  v1::DecodeResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST(ErrorsStandalone, ExpiredRequestsAreNotRun) {
  TestModel model;
  // Batches close only after 400 ms unless full: a 50 ms deadline passes in the queue.
  Harness h(model, {"--max_queue_delay_us=400000", "--max_batch_size=64"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(14);
  h.CreateAndPrefill(gen, "slow", 5);
  v1::DecodeRequest r = RandomDecode(gen, model, "slow", 0, 5, 4, false, 1);
  v1::DecodeBatchRequest batch;
  *batch.add_requests() = r;
  v1::DecodeBatchResponse response;
  grpc::Status s =
      h.stub().DecodeBatch(Context("", std::chrono::milliseconds(50)).get(), batch, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  // It never ran: position 5 is still unwritten, so position 6 is a gap.
  v1::DecodeRequest gap = RandomDecode(gen, model, "slow", 0, 6, 4, false, 2);
  v1::DecodeResponse one;
  EXPECT_EQ(h.stub().Decode(Context().get(), gap, &one).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(h.DecodeAndCheck(RandomDecode(gen, model, "slow", 0, 5, 4, false, 3)).ok());
}

TEST(ErrorsStandalone, FullQueueIsResourceExhausted) {
  TestModel model;
  Harness h(model, {"--max_queue_delay_us=300000", "--max_batch_size=64", "--max_queue_depth=4"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(15);
  v1::DecodeBatchRequest batch;
  for (int i = 0; i < 10; ++i) {
    const std::string seq = "q" + std::to_string(i);
    h.CreateAndPrefill(gen, seq, 3);
    *batch.add_requests() = RandomDecode(gen, model, seq, 0, 3, 4, false, i + 1);
  }
  v1::DecodeBatchResponse response;
  ASSERT_TRUE(h.stub().DecodeBatch(Context().get(), batch, &response).ok());
  int exhausted = 0, ok = 0;
  for (const auto& item : response.responses()) {
    if (item.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++exhausted;
      EXPECT_NE(item.error_message().find("decode queue full: 4 requests waiting"),
                std::string::npos)
          << item.error_message();
    }
    if (item.error_code() == 0) ++ok;
  }
  EXPECT_EQ(ok, 4);
  EXPECT_EQ(exhausted, 6);
}

TEST(ErrorsStandalone, InvalidFlagsFailAtStartWithOneLine) {
  const std::vector<std::vector<std::string>> bad = {
      {"--num_q_heads=6", "--num_kv_heads=4"},
      {"--page_size=12"},
      {"--scale_mode=per_token_head", "--k_scales=0.5", "--v_scales=0.5"},
      {"--k_scales=1,2", "--v_scales=1", "--num_layers=3"},
      {"--cache_bytes=100000", "--cache_pages=10"},
      {"--backend=tpu"},
      {"--scale_mode=fp4"},
      {"--idle_spin_us=20000"},
      {"--idle_spin_us=-1"},
      {"--answer_threads=-2"},
      {"--concurrent_batches=9"},
  };
  for (const auto& flags : bad) {
    std::string output;
    const int status = RunServerToExit(flags, &output);
    EXPECT_EQ(status, 2) << output;
    EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << output;
    EXPECT_EQ(output.rfind("decode_server: invalid flags: ", 0), 0u) << output;
    EXPECT_NE(output.find("--"), std::string::npos) << "names no flag: " << output;
  }
}

TEST(ErrorsStandalone, CudaBackendWithoutGpuFailsClearly) {
  std::string output;
  const int status = RunServerToExit({"--backend=cuda", "--num_q_heads=8", "--num_kv_heads=2",
                                      "--head_dim=64", "--cache_pages=16"},
                                     &output);
  if (TestBackend() == "cuda") {  // the GPU run: the backend must start and drain cleanly
    EXPECT_EQ(status, 0) << output;
    return;
  }
  if (status == 0) GTEST_SKIP() << "a GPU is available here";
  EXPECT_EQ(status, 1) << output;
  EXPECT_NE(output.find("decode_server: backend: "), std::string::npos) << output;
}

}  // namespace
}  // namespace sds::itest
