// The server's host work for one DecodeBatch message, from the received gRPC slices to
// filled staging rows, and for its answer, at the seed shape (32/8 heads, D 128, top-K 512, shared
// index lists; 64 requests, 1.4 MB). Run through bench/run_server_bench.sh.
//
// 1. BM_CopyPass (the ceiling, runs first): one memcpy of the message's bytes into a
//    buffer of the same size: what moving the bytes once costs on this machine.
// 2. BM_TypedPath: what the server did before its methods were raw: protobuf parses the
//    message from the slices into an arena (as gRPC's typed handler does, through
//    ProtoBufferReader), copying every tensor into a string; then validation and
//    StagingBuffer::FillRow per request, from those strings.
// 3. BM_RawPath: what it does now (server/raw_call.h, wire_decode.h): the slices are
//    parsed with the tensors' data left in place; validation and FillRow read the views.
// Each prints us_per_batch and ratio_to_copy = its time / BM_CopyPass's time.
//
// The answer of the same call (64 responses: out [32, 128] bf16 and lse [32] f32 from
// the staging rows, batch info), into the ByteBuffer gRPC sends:
// 4. BM_AnswerCopyPass (its ceiling, runs before the answer cases): one memcpy of the
//    answers' out and lse bytes.
// 5. BM_TypedAnswer: what the server did: set_data into an arena DecodeBatchResponse,
//    then protobuf serialization into slices (two copies of every byte).
// 6. BM_EncodedAnswer: what it does now (response_wire.h): each response encoded
//    straight from staging into its own slice, the reply those slices (one copy).
// Their ratio_to_copy is to BM_AnswerCopyPass.
#include <benchmark/benchmark.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "google/protobuf/arena.h"
#include "server/backend.h"
#include "server/model_shape.h"
#include "server/raw_call.h"
#include "server/response_wire.h"
#include "server/staging.h"
#include "server/validate.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

constexpr int kRequests = 64;
constexpr int kHq = 32, kHkv = 8, kD = 128, kTopK = 512, kPosition = 600;
// HTTP/2 carries a message in frames of at most 16 KB by default; gRPC hands the
// received message over as slices of about that size.
constexpr size_t kSliceBytes = 16 << 10;

double g_copy_seconds = 0;         // BM_CopyPass's time per message
double g_answer_copy_seconds = 0;  // BM_AnswerCopyPass's time per answer

ModelShape Model() {
  ModelShape m;
  m.num_layers = 2;
  m.num_q_heads = kHq;
  m.num_kv_heads = kHkv;
  m.head_dim = kD;
  m.max_topk = 2048;
  return m;
}

void SetBf16(v1::Tensor* t, const std::vector<int64_t>& shape, std::mt19937& rng) {
  t->set_dtype(v1::BF16);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::string data(static_cast<size_t>(n) * 2, '\0');
  for (int64_t i = 0; i < n; ++i) {  // finite values: exponent below 255
    const uint16_t bits = static_cast<uint16_t>((rng() % 255) << 7 | (rng() & 0x807F));
    std::memcpy(&data[2 * i], &bits, 2);
  }
  t->set_data(std::move(data));
}

// The serialized message and its slices (as gRPC would receive them).
struct Message {
  std::string bytes;
  grpc::ByteBuffer received;
};

const Message& SeedBatch() {
  static const Message* message = [] {
    std::mt19937 rng(20261129);
    v1::DecodeBatchRequest batch;
    for (int r = 0; r < kRequests; ++r) {
      v1::DecodeRequest* q = batch.add_requests();
      q->set_sequence_id("sequence-" + std::to_string(r));
      q->set_layer(r % 2);
      q->set_position(kPosition);
      q->set_request_id(static_cast<uint64_t>(r) + 1);
      SetBf16(q->mutable_q(), {kHq, kD}, rng);
      SetBf16(q->mutable_k(), {kHkv, kD}, rng);
      SetBf16(q->mutable_v(), {kHkv, kD}, rng);
      SetBf16(q->mutable_gate(), {kHq, kD}, rng);
      std::vector<int32_t> indices(kTopK);
      for (int32_t& i : indices) i = static_cast<int32_t>(rng() % (kPosition + 1));
      v1::Tensor* idx = q->mutable_indices();
      idx->set_dtype(v1::INT32);
      idx->add_shape(kTopK);
      idx->set_data(indices.data(), indices.size() * 4);
    }
    auto* m = new Message;
    m->bytes = batch.SerializeAsString();
    std::vector<grpc::Slice> slices;
    for (size_t at = 0; at < m->bytes.size(); at += kSliceBytes) {
      slices.emplace_back(m->bytes.data() + at, std::min(kSliceBytes, m->bytes.size() - at));
    }
    m->received = grpc::ByteBuffer(slices.data(), slices.size());
    return m;
  }();
  return *message;
}

[[noreturn]] void Die(const absl::Status& s) {
  std::fprintf(stderr, "bench_request_path: %s\n", s.ToString().c_str());
  std::abort();
}

// A CPU backend (for its staging memory) and one staging buffer of kRequests rows.
struct Staging {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<StagingBuffer> buffer;
  static Staging Make() {
    BackendConfig config;
    config.cache.num_layers = 2;
    config.cache.num_kv_heads = kHkv;
    config.cache.head_dim = kD;
    config.cache.page_size = 16;
    config.cache.num_pages = 64;
    config.num_q_heads = kHq;
    config.max_batch_size = kRequests;
    config.cpu_threads = 1;
    Staging s;
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCpuBackend(config);
    if (!backend.ok()) Die(backend.status());
    s.backend = *std::move(backend);
    absl::StatusOr<std::unique_ptr<StagingBuffer>> buffer =
        StagingBuffer::Create(s.backend.get(), Model(), kRequests);
    if (!buffer.ok()) Die(buffer.status());
    s.buffer = *std::move(buffer);
    return s;
  }
};

void SetCounters(benchmark::State& state, double seconds) {
  const double per_batch = seconds / static_cast<double>(state.iterations());
  state.counters["us_per_batch"] = per_batch * 1e6;
  state.counters["ratio_to_copy"] = g_copy_seconds > 0 ? per_batch / g_copy_seconds : 0.0;
  state.counters["MB"] = static_cast<double>(SeedBatch().bytes.size()) / 1e6;
}

void BM_CopyPass(benchmark::State& state) {
  const Message& m = SeedBatch();
  std::vector<char> dst(m.bytes.size());
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    std::memcpy(dst.data(), m.bytes.data(), m.bytes.size());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  g_copy_seconds = seconds / static_cast<double>(state.iterations());
  SetCounters(state, seconds);
}

void BM_TypedPath(benchmark::State& state) {
  const Message& m = SeedBatch();
  Staging staging = Staging::Make();
  const ModelShape model = Model();
  google::protobuf::ArenaOptions options;
  options.start_block_size = m.bytes.size() + (64 << 10);
  std::vector<DecodeItem> all;  // each request as the batcher takes it, reused across calls
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    google::protobuf::Arena arena(options);
    auto* batch = google::protobuf::Arena::CreateMessage<v1::DecodeBatchRequest>(&arena);
    grpc::ByteBuffer received(m.received);  // shares the slices
    grpc::ProtoBufferReader reader(&received);
    if (!batch->ParseFromZeroCopyStream(&reader)) {
      state.SkipWithError("protobuf could not parse the message");
      return;
    }
    all.resize(batch->requests_size());
    for (int r = 0; r < batch->requests_size(); ++r) {
      if (!ValidateDecode(batch->requests(r), DecodeBytesOf(batch->requests(r)), model, &all[r])
               .ok()) {
        state.SkipWithError("a request failed validation");
        return;
      }
    }
    staging.buffer->PlanIndices(batch->requests_size(), [&](int32_t r) -> const DecodeTensorBytes& {
      return all[r].bytes;
    });
    for (int r = 0; r < batch->requests_size(); ++r) staging.buffer->FillRow(r, all[r]);
    benchmark::ClobberMemory();
  }
  SetCounters(state,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

void BM_RawPath(benchmark::State& state) {
  const Message& m = SeedBatch();
  Staging staging = Staging::Make();
  const ModelShape model = Model();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    RawCall<v1::DecodeBatchRequest, v1::DecodeBatchResponse> call(64 << 10);
    if (!call.Parse(m.received).ok()) {
      state.SkipWithError("the wire parser could not parse the message");
      return;
    }
    const v1::DecodeBatchRequest& batch = *call.request();
    std::vector<DecodeItem> items(batch.requests_size());
    for (int r = 0; r < batch.requests_size(); ++r) {
      if (!ValidateDecode(batch.requests(r), call.bytes(r), model, &items[r]).ok()) {
        state.SkipWithError("a request failed validation");
        return;
      }
    }
    staging.buffer->PlanIndices(batch.requests_size(), [&](int32_t r) -> const DecodeTensorBytes& {
      return items[r].bytes;
    });
    for (int r = 0; r < batch.requests_size(); ++r) staging.buffer->FillRow(r, items[r]);
    benchmark::ClobberMemory();
  }
  SetCounters(state,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

constexpr size_t kOutBytes = kHq * kD * 2, kLseBytes = kHq * 4;

// Staging rows with outputs in them, as the backend leaves them.
Staging StagingWithOutputs() {
  Staging staging = Staging::Make();
  std::mt19937 rng(7);
  for (int r = 0; r < kRequests; ++r) {
    auto* out = const_cast<uint16_t*>(staging.buffer->out_row(r));
    auto* lse = const_cast<float*>(staging.buffer->lse_row(r));
    for (size_t i = 0; i < kOutBytes / 2; ++i) out[i] = static_cast<uint16_t>(rng());
    for (size_t i = 0; i < kLseBytes / 4; ++i) lse[i] = static_cast<float>(rng() % 1000) * 0.01f;
  }
  return staging;
}

void SetBatchInfo(int r, v1::DecodeResponse* resp) {
  resp->set_request_id(static_cast<uint64_t>(r) + 1);
  v1::BatchInfo* info = resp->mutable_batch();
  info->set_batch_id(12345);
  info->set_batch_size(kRequests);
  info->set_queue_us(150);
  info->set_compute_us(900);
}

void SetAnswerCounters(benchmark::State& state, double seconds) {
  const double per_answer = seconds / static_cast<double>(state.iterations());
  state.counters["us_per_batch"] = per_answer * 1e6;
  state.counters["ratio_to_copy"] =
      g_answer_copy_seconds > 0 ? per_answer / g_answer_copy_seconds : 0.0;
  state.counters["MB"] = static_cast<double>(kRequests * (kOutBytes + kLseBytes)) / 1e6;
}

void BM_AnswerCopyPass(benchmark::State& state) {
  Staging staging = StagingWithOutputs();
  std::vector<char> dst(kRequests * (kOutBytes + kLseBytes));
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    char* p = dst.data();
    for (int r = 0; r < kRequests; ++r) {
      std::memcpy(p, staging.buffer->out_row(r), kOutBytes);
      std::memcpy(p + kOutBytes, staging.buffer->lse_row(r), kLseBytes);
      p += kOutBytes + kLseBytes;
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  g_answer_copy_seconds = seconds / static_cast<double>(state.iterations());
  SetAnswerCounters(state, seconds);
}

void BM_TypedAnswer(benchmark::State& state) {
  Staging staging = StagingWithOutputs();
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    RawCall<v1::DecodeBatchRequest, v1::DecodeBatchResponse> call(64 << 10);
    v1::DecodeBatchResponse* response = call.response();
    for (int r = 0; r < kRequests; ++r) {
      v1::DecodeResponse* resp = response->add_responses();
      SetBatchInfo(r, resp);
      v1::Tensor* out = resp->mutable_out();
      out->set_dtype(v1::BF16);
      out->add_shape(kHq);
      out->add_shape(kD);
      out->set_data(staging.buffer->out_row(r), kOutBytes);
      v1::Tensor* lse = resp->mutable_lse();
      lse->set_dtype(v1::FP32);
      lse->add_shape(kHq);
      lse->set_data(staging.buffer->lse_row(r), kLseBytes);
    }
    grpc::ByteBuffer reply;
    if (!SerializeReply(*response, &reply).ok()) {
      state.SkipWithError("serialization failed");
      return;
    }
    benchmark::DoNotOptimize(reply.Length());
  }
  SetAnswerCounters(
      state, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

void BM_EncodedAnswer(benchmark::State& state) {
  Staging staging = StagingWithOutputs();
  const AnswerEncoder encoder(Model());
  const BatchInfo info{12345, kRequests, 150, 900};  // as SetBatchInfo
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    RawCall<v1::DecodeBatchRequest, v1::DecodeBatchResponse> call(64 << 10);
    v1::DecodeBatchResponse* response = call.response();
    std::vector<EncodedResponse> encoded(kRequests);
    for (int r = 0; r < kRequests; ++r) {
      response->add_responses();
      encoded[r].batch_item = true;
      // As a DecodeBatch call's DecodeSink::Write does, from the executor's rows.
      encoder.Encode(static_cast<uint64_t>(r) + 1, info, staging.buffer->out_row(r),
                     staging.buffer->lse_row(r), &encoded[r]);
    }
    absl::StatusOr<grpc::ByteBuffer> reply = DecodeBatchReply(*response, &encoded);
    if (!reply.ok()) {
      state.SkipWithError("an answer was not encoded");
      return;
    }
    benchmark::DoNotOptimize(reply->Length());
  }
  SetAnswerCounters(
      state, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

BENCHMARK(BM_CopyPass)->UseRealTime();
BENCHMARK(BM_TypedPath)->UseRealTime();
BENCHMARK(BM_RawPath)->UseRealTime();
BENCHMARK(BM_AnswerCopyPass)->UseRealTime();
BENCHMARK(BM_TypedAnswer)->UseRealTime();
BENCHMARK(BM_EncodedAnswer)->UseRealTime();

}  // namespace
}  // namespace sds::server

BENCHMARK_MAIN();
