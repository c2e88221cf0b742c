// decode_demo_driver: a tiny client for scripts/demo.sh. `--mode=health` waits until
// the server reports SERVING; `--mode=load` prefills sequences and runs a closed-loop
// unary Decode load, then prints throughput and latency percentiles. The full load
// generator is client/loadgen (decode_loadgen); this is the fallback without it.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "sparse_decode/v1/decode.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server host:port");
ABSL_FLAG(std::string, mode, "load", "health | load");
ABSL_FLAG(double, wait_s, 60, "health: give up after this many seconds");
ABSL_FLAG(int32_t, sequences, 8, "load: sequences (one client thread each)");
ABSL_FLAG(int32_t, prefill, 512, "load: tokens prefilled per sequence and layer");
ABSL_FLAG(int32_t, topk, 256, "load: indices per request");
ABSL_FLAG(double, duration_s, 10, "load: seconds of decoding");

namespace {

namespace v1 = sparse_decode::v1;
using Clock = std::chrono::steady_clock;

bool Serving(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  grpc::Slice empty(std::string{});  // an empty HealthCheckRequest: the whole server
  grpc::ByteBuffer request(&empty, 1), response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](const grpc::Status& s) { done.set_value(s); });
  if (!done.get_future().get().ok()) return false;
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  // HealthCheckResponse { status = 1 (SERVING) } encodes as 08 01.
  return !slices.empty() && slices[0].size() >= 2 && slices[0].begin()[0] == 0x08 &&
         slices[0].begin()[1] == 0x01;
}

v1::Tensor Bf16(std::mt19937& rng, const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(v1::BF16);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::string bytes(n * 2, '\0');
  for (int64_t i = 0; i < n; ++i) {
    float x = dist(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    uint16_t b = static_cast<uint16_t>(bits >> 16);
    std::memcpy(bytes.data() + 2 * i, &b, 2);
  }
  t.set_data(std::move(bytes));
  return t;
}

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return c;
}

int Load(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::DecodeService::NewStub(channel);
  v1::ModelInfo info;
  grpc::Status s = stub->GetModelInfo(Ctx().get(), v1::GetModelInfoRequest(), &info);
  if (!s.ok()) {
    std::fprintf(stderr, "GetModelInfo: %s\n", s.error_message().c_str());
    return 1;
  }
  const int hq = info.num_q_heads(), hkv = info.num_kv_heads(), d = info.head_dim();
  const int layers = info.num_layers(), prefill = absl::GetFlag(FLAGS_prefill);
  const int sequences = absl::GetFlag(FLAGS_sequences);
  const int topk = std::min<int>(absl::GetFlag(FLAGS_topk), info.max_topk());
  std::mt19937 rng(7);
  const auto prefill_start = Clock::now();
  for (int i = 0; i < sequences; ++i) {
    v1::CreateSequenceRequest create;
    create.set_sequence_id("demo-" + std::to_string(i));
    v1::CreateSequenceResponse created;
    s = stub->CreateSequence(Ctx().get(), create, &created);
    if (!s.ok()) {
      std::fprintf(stderr, "CreateSequence: %s\n", s.error_message().c_str());
      return 1;
    }
    for (int layer = 0; layer < layers; ++layer) {
      v1::AppendKVRequest append;
      append.set_sequence_id(create.sequence_id());
      append.set_layer(layer);
      *append.mutable_k() = Bf16(rng, {prefill, hkv, d});
      *append.mutable_v() = Bf16(rng, {prefill, hkv, d});
      v1::AppendKVResponse appended;
      s = stub->AppendKV(Ctx().get(), append, &appended);
      if (!s.ok()) {
        std::fprintf(stderr, "AppendKV: %s\n", s.error_message().c_str());
        return 1;
      }
    }
  }
  std::printf("prefilled %d sequences x %d layers x %d tokens in %.2f s\n", sequences, layers,
              prefill, std::chrono::duration<double>(Clock::now() - prefill_start).count());

  const auto stop =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(absl::GetFlag(FLAGS_duration_s)));
  std::vector<std::vector<double>> latencies(sequences);
  std::vector<int64_t> batch_sizes(sequences, 0);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  threads.reserve(sequences);
  const auto load_start = Clock::now();
  for (int i = 0; i < sequences; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937 local(100 + i);
      std::uniform_int_distribution<int> pick(0, prefill - 1);
      const std::string id = "demo-" + std::to_string(i);
      for (int64_t step = 0; Clock::now() < stop; ++step) {
        v1::DecodeRequest r;
        r.set_sequence_id(id);
        r.set_layer(static_cast<int>(step % layers));
        r.set_position(prefill + step / layers);
        *r.mutable_q() = Bf16(local, {hq, d});
        *r.mutable_k() = Bf16(local, {hkv, d});
        *r.mutable_v() = Bf16(local, {hkv, d});
        *r.mutable_gate() = Bf16(local, {hq, d});
        std::vector<int32_t> idx(topk);
        for (int32_t& t : idx) t = pick(local);
        r.mutable_indices()->set_dtype(v1::INT32);
        r.mutable_indices()->add_shape(topk);
        r.mutable_indices()->set_data(idx.data(), idx.size() * 4);
        v1::DecodeResponse response;
        const auto start = Clock::now();
        grpc::Status st = stub->Decode(Ctx().get(), r, &response);
        if (!st.ok()) {
          if (errors++ < 3) std::fprintf(stderr, "Decode: %s\n", st.error_message().c_str());
          continue;
        }
        latencies[i].push_back(std::chrono::duration<double>(Clock::now() - start).count());
        batch_sizes[i] += response.batch().batch_size();
      }
    });
  }
  for (auto& t : threads) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - load_start).count();
  std::vector<double> all;
  int64_t batch_sum = 0;
  for (int i = 0; i < sequences; ++i) {
    all.insert(all.end(), latencies[i].begin(), latencies[i].end());
    batch_sum += batch_sizes[i];
  }
  std::sort(all.begin(), all.end());
  auto pct = [&](double p) {
    return all.empty() ? 0.0 : all[std::min(all.size() - 1, static_cast<size_t>(p * all.size()))];
  };
  std::printf("decode: %zu requests in %.2f s = %.1f req/s, %d errors, mean batch size %.2f\n",
              all.size(), elapsed, all.size() / elapsed, errors.load(),
              all.empty() ? 0.0 : static_cast<double>(batch_sum) / all.size());
  std::printf("latency ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n", 1e3 * pct(0.5),
              1e3 * pct(0.9), 1e3 * pct(0.99), all.empty() ? 0.0 : 1e3 * all.back());
  for (int i = 0; i < sequences; ++i) {
    v1::ReleaseSequenceRequest release;
    release.set_sequence_id("demo-" + std::to_string(i));
    v1::ReleaseSequenceResponse released;
    stub->ReleaseSequence(Ctx().get(), release, &released);
  }
  return errors.load() == 0 && !all.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto channel =
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials());
  if (absl::GetFlag(FLAGS_mode) == "health") {
    const auto give_up =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(absl::GetFlag(FLAGS_wait_s)));
    while (Clock::now() < give_up) {
      if (Serving(channel)) return 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::fprintf(stderr, "decode_demo_driver: %s never reported SERVING\n",
                 absl::GetFlag(FLAGS_target).c_str());
    return 1;
  }
  return Load(channel);
}
