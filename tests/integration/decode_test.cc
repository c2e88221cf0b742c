// Decode results of the real server against the float64 reference: unary, DecodeBatch
// and DecodeStream, mixed sequences and layers, GQA 8/2, shared and per-KV-head index
// lists with -1 and duplicates, both scale modes, many concurrent clients.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace sds::itest {
namespace {

// Scale mode, and whether the server batches eagerly (--eager_batching) and runs a
// batch on the submitting RPC thread when the batcher is idle (--inline_idle_batches);
// staging_threads > 1: batches of 16 requests or more are copied into staging by that
// many threads (--staging_threads); answer_threads > 0: stream answers of batches of two
// or more are written by that many threads (--answer_threads); idle_spin_us > 0: the
// batcher's threads spin that long for work before sleeping (--idle_spin_us);
// concurrent_batches > 1: that many decode batches run at once on as many executor
// threads, never two of one sequence (--concurrent_batches; the CPU backend runs their
// kernels one after the other, the batcher's and executor's concurrency is real).
struct DecodeTestParam {
  ScaleMode scale_mode;
  bool eager;
  bool inline_batches = false;
  int staging_threads = 1;
  int answer_threads = 0;
  int idle_spin_us = 0;
  int concurrent_batches = 1;
};

class DecodeTest : public ::testing::TestWithParam<DecodeTestParam> {
 protected:
  void SetUp() override {
    TestModel model;
    model.scale_mode = GetParam().scale_mode;
    std::vector<std::string> flags = {"--max_batch_size=16", "--max_queue_delay_us=2000"};
    if (GetParam().eager) flags.push_back("--eager_batching");
    if (GetParam().inline_batches) flags.push_back("--inline_idle_batches");
    flags.push_back("--staging_threads=" + std::to_string(GetParam().staging_threads));
    flags.push_back("--answer_threads=" + std::to_string(GetParam().answer_threads));
    flags.push_back("--idle_spin_us=" + std::to_string(GetParam().idle_spin_us));
    flags.push_back("--concurrent_batches=" + std::to_string(GetParam().concurrent_batches));
    harness_ = std::make_unique<Harness>(model, flags);
    ASSERT_TRUE(harness_->ok()) << harness_->error();
  }
  std::unique_ptr<Harness> harness_;
};

TEST_P(DecodeTest, UnaryDecodeMatchesReference) {
  Harness& h = *harness_;
  InputGen gen(1);
  h.CreateAndPrefill(gen, "seq-a", 40);  // crosses two page boundaries (page 16)
  uint64_t id = 1;
  for (int64_t position = 40; position < 44; ++position) {
    for (int32_t layer = 0; layer < h.model().num_layers; ++layer) {
      const bool per_head = (position + layer) % 2 == 1;
      v1::DecodeRequest r =
          RandomDecode(gen, h.model(), "seq-a", layer, position, 24, per_head, id++);
      grpc::Status s = h.DecodeAndCheck(r);
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
  }
}

TEST_P(DecodeTest, EdgeCasesMatchReference) {
  Harness& h = *harness_;
  InputGen gen(2);
  h.CreateAndPrefill(gen, "edge", 17);
  // All indices skipped: out = 0, lse = -inf.
  v1::DecodeRequest r = RandomDecode(gen, h.model(), "edge", 0, 17, 5, false, 2);
  *r.mutable_indices() = Int32Tensor({5}, {-1, -1, -1, -1, -1});
  ASSERT_TRUE(h.DecodeAndCheck(r).ok());
  // K = 0.
  r = RandomDecode(gen, h.model(), "edge", 1, 17, 5, false, 4);
  *r.mutable_indices() = Int32Tensor({0}, {});
  ASSERT_TRUE(h.DecodeAndCheck(r).ok());
  // Only the token itself, and a list of the maximal length with repeats.
  r = RandomDecode(gen, h.model(), "edge", 2, 17, 1, false, 6);
  *r.mutable_indices() = Int32Tensor({1}, {17});
  ASSERT_TRUE(h.DecodeAndCheck(r).ok());
  r = RandomDecode(gen, h.model(), "edge", 0, 18, h.model().max_topk, true, 8);
  ASSERT_TRUE(h.DecodeAndCheck(r).ok());
  // A fresh sequence: decode at position 0 with no prefill.
  v1::CreateSequenceRequest create;
  create.set_sequence_id("empty");
  v1::CreateSequenceResponse created;
  ASSERT_TRUE(h.stub().CreateSequence(Context().get(), create, &created).ok());
  r = RandomDecode(gen, h.model(), "empty", 1, 0, 3, false, 10);
  ASSERT_TRUE(h.DecodeAndCheck(r).ok());
}

TEST_P(DecodeTest, DecodeBatchMixesSequencesAndLayers) {
  Harness& h = *harness_;
  InputGen gen(3);
  // 6 sequences x 3 layers: 18 items, so a batch of 16 (the staging pool's threshold).
  const std::vector<std::string> seqs = {"b0", "b1", "b2", "b3", "b4", "b5"};
  for (const std::string& s : seqs) h.CreateAndPrefill(gen, s, 20 + 3 * (&s - seqs.data()));
  for (int round = 0; round < 3; ++round) {
    v1::DecodeBatchRequest batch;
    uint64_t id = 100 * (round + 1);
    for (size_t i = 0; i < seqs.size(); ++i) {
      for (int32_t layer = 0; layer < h.model().num_layers; ++layer) {
        const int64_t position = h.mirror().Length(seqs[i], layer);
        *batch.add_requests() =
            RandomDecode(gen, h.model(), seqs[i], layer, position, 16, (i + layer) % 2 == 0, id++);
      }
    }
    v1::DecodeBatchResponse response;
    grpc::Status s = h.stub().DecodeBatch(Context().get(), batch, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(response.responses_size(), batch.requests_size());
    std::set<uint64_t> batch_ids;
    int32_t largest_batch = 0;
    for (int i = 0; i < batch.requests_size(); ++i) {
      largest_batch = std::max(largest_batch, response.responses(i).batch().batch_size());
      h.mirror().WriteDecodeToken(batch.requests(i));
      EXPECT_EQ(response.responses(i).request_id(), batch.requests(i).request_id());
      EXPECT_EQ(h.mirror().Check(batch.requests(i), response.responses(i)), "") << "item " << i;
      batch_ids.insert(response.responses(i).batch().batch_id());
    }
    // The check is not vacuous: one flipped output value is noticed.
    v1::DecodeResponse tampered = response.responses(0);
    (*tampered.mutable_out()->mutable_data())[7] ^= 0x40;
    EXPECT_NE(h.mirror().Check(batch.requests(0), tampered), "");
    // 18 items with max_batch_size 16 and no (sequence, layer) repeats: few batches.
    EXPECT_LE(batch_ids.size(), 3u);
    // The staging pool fills batches of 16 or more: one must have formed for the pool
    // variant to test anything.
    if (GetParam().staging_threads > 1) {
      EXPECT_GE(largest_batch, 16);
    }
  }
}

TEST_P(DecodeTest, DecodeStreamPipelinesAndMatches) {
  Harness& h = *harness_;
  InputGen gen(4);
  const std::vector<std::string> seqs = {"s0", "s1", "s2"};
  for (const std::string& s : seqs) h.CreateAndPrefill(gen, s, 18);
  // Ten positions per (sequence, layer), all written before any answer is read: the
  // server must keep reading and keep same-(sequence, layer) requests in order.
  std::map<uint64_t, v1::DecodeRequest> sent;
  std::vector<const v1::DecodeRequest*> order;
  uint64_t id = 1;
  for (int step = 0; step < 10; ++step) {
    for (const std::string& s : seqs) {
      for (int32_t layer = 0; layer < h.model().num_layers; ++layer) {
        v1::DecodeRequest r =
            RandomDecode(gen, h.model(), s, layer, 18 + step, 12, step % 2 == 1, id++);
        h.mirror().WriteDecodeToken(r);  // tokens only ever grow: write in send order
        const uint64_t request_id = r.request_id();
        order.push_back(&(sent[request_id] = std::move(r)));
      }
    }
  }
  // Built first, then written back to back: a burst, as a pipelining client sends it.
  // (Built between writes, each request took this client longer than an idle server
  // needs to answer one, so the server rightly saw a client that did not get ahead:
  // with --inline_idle_batches it then ran them inline, and "never batched" failed
  // about 1 run in 60.)
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = h.stub().DecodeStream(&context);
  for (const v1::DecodeRequest* r : order) ASSERT_TRUE(stream->Write(*r));
  stream->WritesDone();
  v1::DecodeResponse response;
  size_t answered = 0, batched = 0;
  std::set<uint64_t> seen;
  std::map<uint64_t, std::set<std::pair<std::string, int32_t>>> batch_members;
  while (stream->Read(&response)) {
    ++answered;
    ASSERT_TRUE(sent.count(response.request_id())) << response.request_id();
    ASSERT_TRUE(seen.insert(response.request_id()).second) << "answered twice";
    const v1::DecodeRequest& request = sent[response.request_id()];
    // One batch never holds two decodes of the same (sequence, layer), nor more than
    // --max_batch_size requests.
    EXPECT_TRUE(batch_members[response.batch().batch_id()]
                    .emplace(request.sequence_id(), request.layer())
                    .second)
        << "batch " << response.batch().batch_id() << " holds two decodes of "
        << request.sequence_id() << " layer " << request.layer();
    EXPECT_LE(response.batch().batch_size(), 16);
    EXPECT_EQ(h.mirror().Check(sent[response.request_id()], response), "")
        << "request " << response.request_id();
    if (response.batch().batch_size() > 1) ++batched;
  }
  grpc::Status s = stream->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(answered, sent.size());
  // With --eager_batching, whether a pipelined stream batches depends on timing: an idle
  // executor starts on the first request at once, and when every batch of one ends
  // before the stream's next read completes, none ever forms (PerTensorEager, once in
  // six runs of the two eager variants under `ctest -j2 --repeat until-fail:3` on 2
  // cores; with --inline_idle_batches, where a stream counts as pipelining once a
  // request arrives within 25 us of an answer, in about 3 % of runs). There batching is
  // a performance property, not checked; answers, order and batch rules are. Without
  // it the first request waits up to --max_queue_delay_us (2 ms) for the burst behind it.
  if (!GetParam().eager) {
    EXPECT_GT(batched, 0u) << "pipelined stream requests were never batched together";
  }
}

TEST_P(DecodeTest, ConcurrentClientsAllMatch) {
  Harness& h = *harness_;
  constexpr int kThreads = 8, kSteps = 6;
  {
    InputGen gen(5);
    for (int t = 0; t < kThreads; ++t) h.CreateAndPrefill(gen, "c" + std::to_string(t), 10 + t);
  }
  std::mutex mu;
  std::vector<std::string> failures;
  auto fail = [&](const std::string& what) {
    std::lock_guard<std::mutex> lock(mu);
    failures.push_back(what);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      InputGen gen(100 + t);
      auto stub = h.NewStub();
      const std::string seq = "c" + std::to_string(t);
      uint64_t id = 1000 * (t + 1);
      for (int step = 0; step < kSteps; ++step) {
        const int32_t layer = (t + step) % h.model().num_layers;
        const int64_t position = h.mirror().Length(seq, layer);
        const int mode = (t + step) % 3;  // unary, batch of one per layer, stream
        if (mode == 0) {
          v1::DecodeRequest r = RandomDecode(gen, h.model(), seq, layer, position, 20, t % 2, id++);
          v1::DecodeResponse resp;
          grpc::Status s = stub->Decode(Context().get(), r, &resp);
          h.mirror().WriteDecodeToken(r);
          if (!s.ok()) fail("Decode: " + s.error_message());
          if (s.ok()) {
            if (std::string p = h.mirror().Check(r, resp); !p.empty()) fail("Decode: " + p);
          }
        } else if (mode == 1) {
          v1::DecodeBatchRequest batch;
          for (int32_t l = 0; l < h.model().num_layers; ++l) {
            *batch.add_requests() =
                RandomDecode(gen, h.model(), seq, l, h.mirror().Length(seq, l), 20, l % 2, id++);
          }
          v1::DecodeBatchResponse resp;
          grpc::Status s = stub->DecodeBatch(Context().get(), batch, &resp);
          for (int i = 0; i < batch.requests_size(); ++i)
            h.mirror().WriteDecodeToken(batch.requests(i));
          if (!s.ok() || resp.responses_size() != batch.requests_size()) {
            fail("DecodeBatch: " + s.error_message());
            continue;
          }
          for (int i = 0; i < batch.requests_size(); ++i) {
            std::string p = h.mirror().Check(batch.requests(i), resp.responses(i));
            if (!p.empty()) fail("DecodeBatch item: " + p);
          }
        } else {
          grpc::ClientContext context;
          auto stream = stub->DecodeStream(&context);
          std::map<uint64_t, v1::DecodeRequest> sent;
          for (int k = 0; k < 4; ++k) {
            v1::DecodeRequest r =
                RandomDecode(gen, h.model(), seq, layer, position + k, 20, k % 2, id++);
            h.mirror().WriteDecodeToken(r);
            sent[r.request_id()] = r;
            stream->Write(r);
          }
          stream->WritesDone();
          v1::DecodeResponse resp;
          size_t got = 0;
          while (stream->Read(&resp)) {
            ++got;
            if (!sent.count(resp.request_id())) {
              fail("DecodeStream: unknown request_id");
            } else if (std::string p = h.mirror().Check(sent[resp.request_id()], resp);
                       !p.empty()) {
              fail("DecodeStream: " + p);
            }
          }
          grpc::Status s = stream->Finish();
          if (!s.ok() || got != sent.size()) {
            fail("DecodeStream finish: " + s.error_message() + " answered " + std::to_string(got));
          }
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_TRUE(failures.empty()) << failures.size() << " failures, first: " << failures[0];
}

// A client that reads its answers late: the stream stops reading at 4096 unanswered
// requests (back-pressure) and resumes once the client reads; nothing is lost.
TEST(DecodeStreamBackPressure, SlowReaderGetsEveryAnswer) {
  TestModel model;  // large answers (8 KiB), so that they outgrow the transport's windows
  model.num_q_heads = 32;
  model.num_kv_heads = 8;
  model.head_dim = 128;
  Harness h(model, {"--max_batch_size=64", "--max_queue_delay_us=500", "--log_level=debug"});
  ASSERT_TRUE(h.ok()) << h.error();
  InputGen gen(6);
  constexpr int kSequences = 16, kSteps = 100;  // 16 x 3 layers x 100 = 4800 requests
  for (int i = 0; i < kSequences; ++i) h.CreateAndPrefill(gen, "bp" + std::to_string(i), 4);
  std::vector<v1::DecodeRequest> requests;
  uint64_t id = 1;
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < kSequences; ++i) {
      for (int32_t layer = 0; layer < model.num_layers; ++layer) {
        requests.push_back(
            RandomDecode(gen, model, "bp" + std::to_string(i), layer, 4 + step, 6, false, id++));
        h.mirror().WriteDecodeToken(requests.back());
      }
    }
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = h.stub().DecodeStream(&context);
  std::thread writer([&] {
    for (const auto& r : requests) {
      if (!stream->Write(r)) break;
    }
    stream->WritesDone();
  });
  std::this_thread::sleep_for(std::chrono::seconds(1));  // let the answers pile up
  size_t answered = 0, wrong = 0;
  v1::DecodeResponse response;
  while (stream->Read(&response)) {
    ++answered;
    const v1::DecodeRequest& r = requests.at(response.request_id() - 1);
    if (!h.mirror().Check(r, response).empty()) ++wrong;
  }
  writer.join();
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(answered, requests.size());
  EXPECT_EQ(wrong, 0u);
  EXPECT_NE(h.server().Log().find("paused reading"), std::string::npos)
      << "the stream never applied back-pressure";
}

INSTANTIATE_TEST_SUITE_P(
    ScaleModes, DecodeTest,
    ::testing::Values(DecodeTestParam{ScaleMode::kPerTensor, false},
                      DecodeTestParam{ScaleMode::kPerTokenHead, false},
                      DecodeTestParam{ScaleMode::kPerTensor, true},
                      DecodeTestParam{ScaleMode::kPerTokenHead, true, true},
                      DecodeTestParam{ScaleMode::kPerTensor, true, false, 3},
                      DecodeTestParam{ScaleMode::kPerTokenHead, false, false, 1, 4},
                      DecodeTestParam{ScaleMode::kPerTokenHead, true, true, 1, 0, 2000},
                      DecodeTestParam{ScaleMode::kPerTensor, true, false, 1, 2, 200, 2},
                      DecodeTestParam{ScaleMode::kPerTokenHead, false, false, 1, 0, 0, 3}),
    [](const ::testing::TestParamInfo<DecodeTestParam>& info) {
      std::string name =
          info.param.scale_mode == ScaleMode::kPerTensor ? "PerTensor" : "PerTokenHead";
      if (info.param.staging_threads > 1) name += "StagingPool";
      if (info.param.answer_threads > 0) name += "AnswerPool";
      if (info.param.idle_spin_us > 0) name += "Spin";
      if (info.param.concurrent_batches > 1) name += "Concurrent";
      if (info.param.inline_batches) return name + "EagerInline";
      return info.param.eager ? name + "Eager" : name;
    });

}  // namespace
}  // namespace sds::itest
