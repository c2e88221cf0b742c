// libFuzzer target: the whole request path on a small real CPU cache. The server's own
// stack (CPU backend, executor, staging, batcher, DecodeServiceImpl) runs in process
// behind an in-process gRPC channel, and each input is the raw body of one call, sent
// through a generic stub, so that it passes gRPC's transport, the service's raw
// handlers, the wire parser, validation, admission, the batcher and the backend.
//
// Input (fuzz_input.h): selector % 13 picks the method; unary calls get the body cut
// into that many slices, streams get one message per piece.
//
// After each input:
// - every sequence the input named (parsed as the method's request type) is released;
//   the fuzzed tenant's prefilled sequence "s" is created and filled again if named;
// - the cache has as many free pages as before the input (nothing leaked or lost);
// - a witness in another tenant (fork its sequence, decode one token, release the fork)
//   answers bit for bit what it answered at start-up;
// - no call outlived its deadline.
// Calls from the input never carry a tenant header, so they cannot reach the witness
// except through a bug in tenant separation.
#include <grpc/grpc.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "server/batcher.h"
#include "server/service.h"
#include "sparse_decode/v1/decode.pb.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_methods.h"
#include "tests/fuzz/fuzz_model.h"
#include "tests/unit_server/cpu_stack.h"

namespace {

namespace v1 = sparse_decode::v1;

constexpr char kWitnessTenant[] = "witness";
constexpr char kPrefilledId[] = "s";
// Long enough for the slowest legitimate call under ASan on a loaded 2-core machine; a
// call still unanswered then is a hang (the check aborts).
constexpr auto kDeadline = std::chrono::seconds(20);

using namespace sds::fuzz;  // the model, Method and its names

bool Verbose() {
  static const bool verbose = std::getenv("SDS_FUZZ_VERBOSE") != nullptr;
  return verbose;
}

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

std::string StringOf(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Valid() || !buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

std::string Path(Method m) {
  return std::string("/sparse_decode.v1.DecodeService/") + kMethodNames[m];
}

// bf16 of a float (round toward zero; the values here are small and exact enough).
uint16_t Bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

// `count` bf16 values in [-1, 1), a function of `seed` and the index.
std::string Bf16Data(int64_t count, uint32_t seed) {
  std::string out(static_cast<size_t>(count) * 2, '\0');
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t h = (static_cast<uint32_t>(i) + seed * 7919u) * 2654435761u;
    const uint16_t v = Bf16(static_cast<float>(h >> 8) / 8388608.0f - 1.0f);
    std::memcpy(&out[2 * i], &v, 2);
  }
  return out;
}

void SetBf16(v1::Tensor* t, std::vector<int64_t> shape, uint32_t seed) {
  t->set_dtype(v1::BF16);
  int64_t count = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    count *= d;
  }
  t->set_data(Bf16Data(count, seed));
}

// A bidi call that writes `messages` in order, then WritesDone, and reads every answer.
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit StreamCall(std::vector<grpc::ByteBuffer> messages) : messages_(std::move(messages)) {}

  grpc::Status Run(grpc::GenericStub* stub, const std::string& method,
                   grpc::ClientContext* context) {
    stub->PrepareBidiStreamingCall(context, method, grpc::StubOptions(), this);
    StartRead(&answer_);
    if (messages_.empty()) {
      StartWritesDone();
    } else {
      StartWrite(&messages_[0]);
    }
    StartCall();
    return done_.get_future().get();
  }
  int answers() const { return answers_; }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the server ended the stream; OnDone follows
    if (++next_ < messages_.size()) {
      StartWrite(&messages_[next_]);
    } else {
      StartWritesDone();
    }
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    ++answers_;
    StartRead(&answer_);
  }
  void OnDone(const grpc::Status& s) override { done_.set_value(s); }

 private:
  std::vector<grpc::ByteBuffer> messages_;
  size_t next_ = 0;
  grpc::ByteBuffer answer_;
  int answers_ = 0;
  std::promise<grpc::Status> done_;
};

struct Server {
  sds::server::server_test::CpuStack cpu;
  std::unique_ptr<sds::server::Batcher> batcher;
  std::unique_ptr<sds::server::DecodeServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::GenericStub> stub;
  int64_t free_pages = 0;  // with "s" and the witness's sequence filled
  std::string witness_answer;

  void Start() {
    cpu.config.cache.num_layers = kLayers;
    cpu.config.cache.num_kv_heads = kKvHeads;
    cpu.config.cache.head_dim = kHeadDim;
    cpu.config.cache.page_size = sds::fuzz::kPageSize;
    cpu.config.cache.num_pages = 64;
    cpu.config.num_q_heads = kQHeads;
    cpu.config.max_topk = sds::fuzz::kMaxTopk;
    cpu.model = sds::fuzz::FuzzModel();
    const absl::Status built = cpu.Init();
    SDS_FUZZ_CHECK(built.ok(), "%s", built.ToString().c_str());
    sds::server::BatcherOptions options;
    options.max_batch_size = cpu.config.max_batch_size;
    options.eager = true;  // no 500 us wait for company on every decode
    batcher =
        std::make_unique<sds::server::Batcher>(options, cpu.executor.get(), cpu.TakeStaging());
    batcher->Start();
    sds::server::ServiceConfig config;
    config.model = cpu.model;
    config.info.set_page_size(cpu.config.cache.page_size);
    service = std::make_unique<sds::server::DecodeServiceImpl>(config, cpu.backend.get(),
                                                               batcher.get(), cpu.metrics.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    SDS_FUZZ_CHECK(server != nullptr, "the in-process server did not start");
    stub = std::make_unique<grpc::GenericStub>(server->InProcessChannel(grpc::ChannelArguments()));

    Fill(nullptr, kPrefilledId);
    Fill(kWitnessTenant, "w");
    free_pages = FreePages();
    witness_answer = Witness();
    SDS_FUZZ_CHECK(FreePages() == free_pages, "the witness leaked pages");
  }

  grpc::Status Unary(Method m, const grpc::ByteBuffer& request, grpc::ByteBuffer* response,
                     const char* tenant) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kDeadline);
    if (tenant != nullptr) context.AddMetadata("x-tenant-id", tenant);
    std::promise<grpc::Status> done;
    stub->UnaryCall(&context, Path(m), grpc::StubOptions(), &request, response,
                    [&done](grpc::Status s) { done.set_value(std::move(s)); });
    grpc::Status s = done.get_future().get();
    SDS_FUZZ_CHECK(s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED,
                   "%s unanswered after %lld s", kMethodNames[m],
                   static_cast<long long>(kDeadline.count()));
    return s;
  }

  // A typed call of the harness itself, which must succeed.
  template <typename Response>
  Response Typed(Method m, const google::protobuf::Message& request, const char* tenant) {
    grpc::ByteBuffer answer;
    const grpc::Status s = Unary(m, BufferOf(request.SerializeAsString()), &answer, tenant);
    SDS_FUZZ_CHECK(s.ok(), "%s: %s (%s)", kMethodNames[m], s.error_message().c_str(),
                   request.ShortDebugString().c_str());
    Response response;
    SDS_FUZZ_CHECK(response.ParseFromString(StringOf(answer)), "%s: unparsable answer",
                   kMethodNames[m]);
    return response;
  }

  // Creates `id` with kPrefilled tokens in every layer.
  void Fill(const char* tenant, const std::string& id) {
    v1::CreateSequenceRequest create;
    create.set_sequence_id(id);
    Typed<v1::CreateSequenceResponse>(kCreateSequence, create, tenant);
    for (int layer = 0; layer < kLayers; ++layer) {
      v1::AppendKVRequest append;
      append.set_sequence_id(id);
      append.set_layer(layer);
      SetBf16(append.mutable_k(), {kPrefilled, kKvHeads, kHeadDim}, 10 + layer);
      SetBf16(append.mutable_v(), {kPrefilled, kKvHeads, kHeadDim}, 20 + layer);
      const auto r = Typed<v1::AppendKVResponse>(kAppendKV, append, tenant);
      SDS_FUZZ_CHECK(r.length() == kPrefilled, "prefill length %lld",
                     static_cast<long long>(r.length()));
    }
  }

  int64_t FreePages() {
    return Typed<v1::ModelInfo>(kGetModelInfo, v1::GetModelInfoRequest(), nullptr).free_pages();
  }

  // Fork the witness sequence, decode one token on the fork, release it: the answer's
  // out and lse bytes.
  std::string Witness() {
    v1::ForkSequenceRequest fork;
    fork.set_sequence_id("w");
    fork.set_new_sequence_id("w2");
    Typed<v1::ForkSequenceResponse>(kForkSequence, fork, kWitnessTenant);
    v1::DecodeRequest decode;
    decode.set_sequence_id("w2");
    decode.set_layer(kLayers - 1);
    decode.set_position(kPrefilled);
    decode.set_return_lse(true);
    SetBf16(decode.mutable_q(), {kQHeads, kHeadDim}, 1);
    SetBf16(decode.mutable_k(), {kKvHeads, kHeadDim}, 2);
    SetBf16(decode.mutable_v(), {kKvHeads, kHeadDim}, 3);
    SetBf16(decode.mutable_gate(), {kQHeads, kHeadDim}, 4);
    v1::Tensor* ix = decode.mutable_indices();
    ix->set_dtype(v1::INT32);
    ix->add_shape(kKvHeads);
    ix->add_shape(sds::fuzz::kMaxTopk);
    std::string indices;
    for (int h = 0; h < kKvHeads; ++h) {
      for (int i = 0; i < sds::fuzz::kMaxTopk; ++i) {
        const int32_t index = i == 3 ? -1 : (i * 7 + h * 5) % (kPrefilled + 1);
        indices.append(reinterpret_cast<const char*>(&index), 4);
      }
    }
    ix->set_data(indices);
    const auto answer = Typed<v1::DecodeResponse>(kDecode, decode, kWitnessTenant);
    SDS_FUZZ_CHECK(answer.error_code() == 0, "witness decode: %s", answer.error_message().c_str());
    v1::ReleaseSequenceRequest release;
    release.set_sequence_id("w2");
    Typed<v1::ReleaseSequenceResponse>(kReleaseSequence, release, kWitnessTenant);
    return answer.out().data() + answer.lse().data();
  }
};

Server* g_server = nullptr;  // never destroyed: gRPC's threads run until exit

// Every sequence id `body` names as a request of method `m` (nothing if it does not parse).
void NamedIds(Method m, const std::string& body, std::set<std::string>* ids) {
  switch (m) {
    case kCreateSequence: {
      v1::CreateSequenceRequest r;
      if (r.ParseFromString(body)) ids->insert(r.sequence_id());
      break;
    }
    case kAppendKV: {
      v1::AppendKVRequest r;
      if (r.ParseFromString(body)) ids->insert(r.sequence_id());
      break;
    }
    case kDecode:
    case kDecodeStream: {
      v1::DecodeRequest r;
      if (r.ParseFromString(body)) ids->insert(r.sequence_id());
      break;
    }
    case kDecodeBatch: {
      v1::DecodeBatchRequest r;
      if (r.ParseFromString(body)) {
        for (const auto& item : r.requests()) ids->insert(item.sequence_id());
      }
      break;
    }
    case kForkSequence: {
      v1::ForkSequenceRequest r;
      if (r.ParseFromString(body)) {
        ids->insert(r.sequence_id());
        ids->insert(r.new_sequence_id());
      }
      break;
    }
    case kReleaseSequence: {
      v1::ReleaseSequenceRequest r;
      if (r.ParseFromString(body)) ids->insert(r.sequence_id());
      break;
    }
    case kDecodeLayer:
    case kDecodeLayerStream: {
      v1::DecodeLayerRequest r;
      if (r.ParseFromString(body)) ids->insert(r.sequence_ids().begin(), r.sequence_ids().end());
      break;
    }
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  g_server = new Server;
  g_server->Start();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sds::fuzz::FramedInput in;
  if (!sds::fuzz::ParseFramed(data, size, &in)) return -1;
  Server& server = *g_server;
  const Method method = static_cast<Method>(in.selector % kNumMethods);
  std::set<std::string> named;
  grpc::Status status;
  if (method == kDecodeStream || method == kDecodeLayerStream) {
    std::vector<grpc::ByteBuffer> messages;
    for (const std::string& piece : sds::fuzz::Pieces(in)) {
      messages.push_back(BufferOf(piece));
      NamedIds(method, piece, &named);
    }
    StreamCall call(std::move(messages));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kDeadline);
    status = call.Run(server.stub.get(), Path(method), &context);
    SDS_FUZZ_CHECK(status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED, "%s unanswered",
                   kMethodNames[method]);
  } else {
    grpc::ByteBuffer answer;
    status = server.Unary(method, sds::fuzz::SlicedBuffer(in), &answer, nullptr);
    NamedIds(method, in.body, &named);
  }
  if (Verbose()) {
    std::fprintf(stderr, "%s: code %d %s\n", kMethodNames[method],
                 static_cast<int>(status.error_code()), status.error_message().c_str());
  }
  SDS_FUZZ_CHECK(status.error_code() != grpc::StatusCode::INTERNAL &&
                     status.error_code() != grpc::StatusCode::UNKNOWN,
                 "%s answered %d: %s", kMethodNames[method], static_cast<int>(status.error_code()),
                 status.error_message().c_str());

  for (const std::string& id : named) {
    if (id.empty()) continue;
    v1::ReleaseSequenceRequest release;
    release.set_sequence_id(id);
    grpc::ByteBuffer answer;
    server.Unary(kReleaseSequence, BufferOf(release.SerializeAsString()), &answer, nullptr);
  }
  if (named.count(kPrefilledId) != 0) server.Fill(nullptr, kPrefilledId);
  const int64_t free_pages = server.FreePages();
  SDS_FUZZ_CHECK(free_pages == server.free_pages,
                 "%lld free pages after %s and releasing what it named, %lld before",
                 static_cast<long long>(free_pages), kMethodNames[method],
                 static_cast<long long>(server.free_pages));
  SDS_FUZZ_CHECK(server.Witness() == server.witness_answer,
                 "the witness answered differently after %s", kMethodNames[method]);
  return 0;
}
