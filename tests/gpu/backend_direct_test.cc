// The CUDA backend's direct outputs and in-place inputs (cuda_backend.h): a small
// batch's decode writes out and lse straight into the mapped staging memory, with no
// copy back, and its kernels may read q, gate and the new K/V there, with no upload
// (those too large for the input pack).
// Three backends, one copying every input and output, one writing outputs directly up
// to 16 requests, and one also reading those inputs in place up to 16 requests, get the
// same Runs (prefill, a short append-only rewrite, then decode batches of 1, 2, 3, 8, 9,
// 15, 16, 17 and 24 requests, each with the append of its requests' new tokens, around
// the threshold and the input pack's piece size, with and without lse) and must give
// bit-identical out and lse, outputs poisoned before every Run. Each batch mixes shared
// and per-KV-head index lists, -1 entries and top-K 1..1000, and reads the token its
// append just wrote; its arrays are carved out of one staging block like the server's.
// LastCudaBatchPath proves which path each Run took, so a direct or in-place path that
// silently fell back to the copy would fail here. A two-lane backend running two batches
// at once from two threads must give the one-lane backend's bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "server/backend.h"
#include "server/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_util.h"

namespace sds::gputest {
namespace {

constexpr int kLayers = 2, kHkv = 8, kD = 128, kHq = 32, kPage = 16;
constexpr int kMaxBatch = 24, kMaxTopK = 1024, kThreshold = 16;

BackendConfig Config(ScaleMode mode) {
  BackendConfig config;
  config.cache.num_layers = kLayers;
  config.cache.num_kv_heads = kHkv;
  config.cache.head_dim = kD;
  config.cache.page_size = kPage;
  config.cache.num_pages = 1024;
  config.cache.scale_mode = mode;
  if (mode == ScaleMode::kPerTensor) {
    config.cache.layer_k_scales = {0.02f, 0.03f};
    config.cache.layer_v_scales = {0.025f, 0.015f};
  }
  config.num_q_heads = kHq;
  config.max_batch_size = kMaxBatch;
  config.max_topk = kMaxTopK;
  return config;
}

// Host data of one Run, staged into each backend's own staging memory.
struct HostWork {
  std::vector<uint16_t> k_new, v_new;  // [N, Hkv, D]
  std::vector<int32_t> a_layer;        // [N]
  std::vector<int64_t> slot;           // [N]
  // Decode (num_requests 0: append only).
  int32_t num_requests = 0;
  bool with_lse = false;
  std::vector<uint16_t> q, gate;  // [B, Hq, D]
  std::vector<int32_t> layer, topk, indices, page_table;
  std::vector<int64_t> index_offset, page_table_offset;
  std::vector<uint8_t> per_kv_head;
};

struct Outputs {
  std::vector<uint16_t> out;  // [B, Hq, D]
  std::vector<float> lse;     // [B, Hq]
  CudaBatchPath path;
};

// Arrays carved one after another (256-byte aligned) out of one staging block, as the
// server's StagingBuffer does, so that the backend must find interior pointers.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* Take(const std::vector<T>& v) {
    T* p = base_ != nullptr ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    if (p != nullptr && !v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));
    used_ += (v.size() * sizeof(T) + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// Stages `w` into `backend`'s staging, poisons out / lse, runs it, returns the outputs.
Outputs RunOn(Backend& backend, const HostWork& w) {
  const int b = w.num_requests;
  const size_t out_elems = static_cast<size_t>(b) * kHq * kD;
  // Poisoned: 0xFFFF is a bf16 NaN, which no finite input can produce.
  const std::vector<uint16_t> out_poison(out_elems, 0xFFFF);
  const std::vector<float> lse_poison(w.with_lse ? static_cast<size_t>(b) * kHq : 0, NAN);
  BatchWork work;
  uint16_t* out = nullptr;
  float* lse = nullptr;
  auto carve = [&](Carver& c) {
    work.append.num_tokens = static_cast<int32_t>(w.a_layer.size());
    work.append.k_new = c.Take(w.k_new);
    work.append.v_new = c.Take(w.v_new);
    work.append.layer = c.Take(w.a_layer);
    work.append.slot = c.Take(w.slot);
    if (b == 0) return;
    DecodeBatch& d = work.decode;
    d.num_requests = b;
    d.num_q_heads = kHq;
    d.q = c.Take(w.q);
    d.gate = c.Take(w.gate);
    d.layer = c.Take(w.layer);
    d.page_table = c.Take(w.page_table);
    d.page_table_offset = c.Take(w.page_table_offset);
    d.indices = c.Take(w.indices);
    d.index_offset = c.Take(w.index_offset);
    d.topk = c.Take(w.topk);
    d.indices_per_kv_head = c.Take(w.per_kv_head);
    d.out = out = c.Take(out_poison);
    d.lse = lse = w.with_lse ? c.Take(lse_poison) : nullptr;
  };
  Carver sizing(nullptr);
  carve(sizing);
  void* block = backend.AllocateStaging(sizing.used());
  EXPECT_NE(block, nullptr);
  if (block == nullptr) return {};
  Carver real(static_cast<char*>(block));
  carve(real);
  BatchTiming timing;
  const absl::Status st = backend.Run(work, &timing);
  EXPECT_TRUE(st.ok()) << st;
  Outputs o;
  o.path = LastCudaBatchPath(backend);
  if (out != nullptr) o.out.assign(out, out + out_elems);
  if (lse != nullptr) o.lse.assign(lse, lse + static_cast<size_t>(b) * kHq);
  backend.FreeStaging(block);
  return o;
}

// Sequences seq<first>..seq<first + n - 1> of 64 + 37 * s tokens in both layers, the
// same in every backend of a test (the same cache calls in the same order give the same
// page ids, so one set of slots and page tables serves all of them).
struct Sequences {
  std::vector<int64_t> length;              // [kMaxBatch]
  std::vector<std::vector<int64_t>> slots;  // [kMaxBatch][length]
  std::vector<std::vector<int32_t>> pages;  // [kMaxBatch] page tables
};

// Creates kMaxBatch sequences in every backend and prefills them through Run (append
// only), the same random K/V everywhere.
void PrepareSequences(const std::vector<std::unique_ptr<Backend>>& backends, std::mt19937& rng,
                      Sequences* seqs) {
  seqs->length.assign(kMaxBatch, 0);
  seqs->slots.assign(kMaxBatch, {});
  seqs->pages.assign(kMaxBatch, {});
  for (int s = 0; s < kMaxBatch; ++s) {
    seqs->length[s] = 64 + 37 * s;
    const std::string id = "seq" + std::to_string(s);
    for (size_t i = 0; i < backends.size(); ++i) {
      PagedKvCache& cache = backends[i]->cache();
      ASSERT_TRUE(cache.CreateSequence(id, 0).ok());
      std::vector<int64_t> got;
      for (int layer = 0; layer < kLayers; ++layer) {
        ASSERT_TRUE(cache.PrepareWrite(id, layer, 0, seqs->length[s], &got).ok());
        ASSERT_TRUE(cache.CommitWrite(id, layer, 0, seqs->length[s]).ok());
      }
      std::vector<int32_t> table;
      ASSERT_TRUE(cache.AppendPageTable(id, &table).ok());
      if (i == 0) seqs->slots[s] = got, seqs->pages[s] = table;
      ASSERT_EQ(got, seqs->slots[s]);
      ASSERT_EQ(table, seqs->pages[s]);
    }
  }
  for (int s = 0; s < kMaxBatch; ++s) {
    for (int layer = 0; layer < kLayers; ++layer) {
      HostWork w;
      const size_t elems = static_cast<size_t>(seqs->length[s]) * kHkv * kD;
      w.k_new.resize(elems);
      w.v_new.resize(elems);
      for (size_t e = 0; e < elems; ++e)
        w.k_new[e] = RandomBf16(rng, 1.0f), w.v_new[e] = RandomBf16(rng, 1.0f);
      w.a_layer.assign(seqs->length[s], layer);
      w.slot = seqs->slots[s];
      for (const auto& backend : backends) RunOn(*backend, w);
    }
  }
}

// A decode batch of `b` requests, one per sequence from `first` on: each rewrites its
// sequence's last token (new data) and attends to it, in shared and per-KV-head index
// lists with -1 entries and top-K 1..1000.
HostWork DecodeWork(const Sequences& seqs, int first, int b, bool with_lse, std::mt19937& rng) {
  constexpr int kTopKs[] = {1, 100, 512, 513, 1000};
  HostWork w;
  w.num_requests = b;
  w.with_lse = with_lse;
  const size_t kv = static_cast<size_t>(b) * kHkv * kD, qe = static_cast<size_t>(b) * kHq * kD;
  w.k_new.resize(kv);
  w.v_new.resize(kv);
  for (size_t e = 0; e < kv; ++e)
    w.k_new[e] = RandomBf16(rng, 1.0f), w.v_new[e] = RandomBf16(rng, 1.0f);
  w.q.resize(qe);
  w.gate.resize(qe);
  for (size_t e = 0; e < qe; ++e) w.q[e] = RandomBf16(rng, 1.0f), w.gate[e] = RandomBf16(rng, 2.0f);
  for (int r = 0; r < b; ++r) {
    const int seq = first + r;
    const int layer = (r + b) % kLayers;
    const int64_t last = seqs.length[seq] - 1;
    w.a_layer.push_back(layer);
    w.slot.push_back(seqs.slots[seq][last]);
    w.layer.push_back(layer);
    w.page_table_offset.push_back(static_cast<int64_t>(w.page_table.size()));
    w.page_table.insert(w.page_table.end(), seqs.pages[seq].begin(), seqs.pages[seq].end());
    w.index_offset.push_back(static_cast<int64_t>(w.indices.size()));
    const int k = kTopKs[(r + b) % 5];
    const bool per_head = r % 3 == 1;
    w.topk.push_back(k);
    w.per_kv_head.push_back(per_head ? 1 : 0);
    std::uniform_int_distribution<int64_t> pos(0, last);
    for (int i = 0; i < k * (per_head ? kHkv : 1); ++i)
      w.indices.push_back(i % k == 0    ? static_cast<int32_t>(last)
                          : i % 10 == 3 ? -1
                                        : static_cast<int32_t>(pos(rng)));
  }
  return w;
}

// Bitwise equality of two runs' outputs (out of every request and head, lse as float bits).
void ExpectSameBits(const Outputs& got, const Outputs& want) {
  ASSERT_EQ(got.out.size(), want.out.size());
  for (size_t e = 0; e < want.out.size(); ++e)
    ASSERT_EQ(got.out[e], want.out[e]) << "out element " << e;
  ASSERT_EQ(got.lse.size(), want.lse.size());
  for (size_t e = 0; e < want.lse.size(); ++e) {
    uint32_t x, y;
    std::memcpy(&x, &got.lse[e], 4);
    std::memcpy(&y, &want.lse[e], 4);
    ASSERT_EQ(x, y) << "lse element " << e;
  }
}

class CudaBackendDirect : public ::testing::TestWithParam<ScaleMode> {};

TEST_P(CudaBackendDirect, SameBitsAsTheCopyAroundTheThreshold) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  // [0] copies everything, [1] direct outputs, [2] direct outputs and in-place inputs.
  std::vector<std::unique_ptr<Backend>> backends;
  for (int variant = 0; variant < 3; ++variant) {
    CudaBackendOptions options;
    options.direct_out_max_requests = variant == 0 ? 0 : kThreshold;
    options.in_place_inputs_max_requests = variant == 2 ? kThreshold : 0;
    auto created = CreateCudaBackend(Config(GetParam()), options);
    ASSERT_TRUE(created.ok()) << created.status();
    backends.push_back(*std::move(created));
  }
  std::mt19937 rng(11);
  Sequences seqs;
  PrepareSequences(backends, rng, &seqs);
  if (HasFatalFailure()) return;
  const std::vector<std::vector<int64_t>>& slots = seqs.slots;
  // A prefill (append only) copies its new K/V even where a decode batch's would be read
  // in place: 12 tokens (24 KB of K, within the 16-request threshold) rewrite the end of
  // sequence 0, layer 1, with fresh data.
  {
    constexpr int kTokens = 12;
    HostWork w;
    const size_t elems = size_t{kTokens} * kHkv * kD;
    w.k_new.resize(elems);
    w.v_new.resize(elems);
    for (size_t e = 0; e < elems; ++e)
      w.k_new[e] = RandomBf16(rng, 1.0f), w.v_new[e] = RandomBf16(rng, 1.0f);
    w.a_layer.assign(kTokens, 1);
    w.slot.assign(slots[0].end() - kTokens, slots[0].end());
    for (auto& backend : backends) EXPECT_FALSE(RunOn(*backend, w).path.in_place_new_kv);
  }
  int runs = 0;
  for (int b : {1, 2, 3, 8, 9, 15, 16, 17, 24}) {
    for (bool with_lse : {false, true}) {
      SCOPED_TRACE(testing::Message() << b << " requests, lse " << with_lse);
      const HostWork w = DecodeWork(seqs, 0, b, with_lse, rng);
      std::vector<Outputs> got;
      for (auto& backend : backends) got.push_back(RunOn(*backend, w));
      ++runs;
      const bool small = b <= kThreshold;
      EXPECT_FALSE(got[0].path.direct_out);
      EXPECT_FALSE(got[0].path.direct_lse);
      for (int v = 0; v < 3; ++v) {
        SCOPED_TRACE(testing::Message() << "backend variant " << v);
        EXPECT_EQ(got[v].path.direct_out, v > 0 && small);
        EXPECT_EQ(got[v].path.direct_lse, v > 0 && small && with_lse);
        // In place only when too large for the pack: q and gate from 3 requests (8 KB
        // each per request), new K/V from 9 tokens (2 KB each per token; one per request);
        // exactly a piece (2 requests' q, 8 tokens' K) stays packed.
        EXPECT_EQ(got[v].path.in_place_q, v == 2 && small && b >= 3);
        EXPECT_EQ(got[v].path.in_place_new_kv, v == 2 && small && b >= 9);
        ExpectSameBits(got[v], got[0]);
        if (HasFatalFailure()) return;
      }
      // The reference run itself wrote every output (the poison is gone).
      for (uint16_t x : got[0].out) ASSERT_NE(x & 0x7F80, 0x7F80) << "non-finite output";
      for (float x : got[0].lse) ASSERT_FALSE(std::isnan(x));
    }
  }
  EXPECT_EQ(runs, 18);
}

// Lanes (cuda_backend.h): two Runs at once, from two threads, on decode batches of
// disjoint sequences (as the batcher sends them), give the bits that the same Runs give
// one after the other on a one-lane backend, outputs poisoned before every Run.
TEST_P(CudaBackendDirect, ConcurrentRunsOnTwoLanesGiveTheSequentialBits) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  std::vector<std::unique_ptr<Backend>> backends;  // [0]: one lane, [1]: two
  for (int lanes : {1, 2}) {
    CudaBackendOptions options;
    options.lanes = lanes;
    auto created = CreateCudaBackend(Config(GetParam()), options);
    ASSERT_TRUE(created.ok()) << created.status();
    EXPECT_EQ((*created)->max_concurrent_runs(), lanes);
    backends.push_back(*std::move(created));
  }
  std::mt19937 rng(12);
  Sequences seqs;
  PrepareSequences(backends, rng, &seqs);
  if (HasFatalFailure()) return;
  constexpr int kHalf = kMaxBatch / 2;
  int rounds = 0;
  for (int round = 0; round < 16; ++round) {
    const int b = 1 + (round * 5) % kHalf;  // 1..12 requests per batch
    const bool with_lse = round % 2 == 1;
    SCOPED_TRACE(testing::Message() << "round " << round << ", " << b << " requests");
    const HostWork x = DecodeWork(seqs, 0, b, with_lse, rng);
    const HostWork y = DecodeWork(seqs, kHalf, b, with_lse, rng);
    const Outputs want_x = RunOn(*backends[0], x);
    const Outputs want_y = RunOn(*backends[0], y);
    Outputs got_x, got_y;
    std::thread other([&] { got_y = RunOn(*backends[1], y); });
    got_x = RunOn(*backends[1], x);
    other.join();
    ExpectSameBits(got_x, want_x);
    if (HasFatalFailure()) return;
    ExpectSameBits(got_y, want_y);
    if (HasFatalFailure()) return;
    for (const Outputs* o : {&want_x, &want_y})
      for (uint16_t v : o->out) ASSERT_NE(v & 0x7F80, 0x7F80) << "non-finite output";
    ++rounds;
  }
  EXPECT_EQ(rounds, 16);
}

// A fresh backend holding one sequence "s" of 40 tokens in layer 0, their K/V random
// (written by an append-only Run, so that outputs depend on q), and the host arrays of a
// decode batch over it (index lists in the shared form, layer 0).
struct OneSequence {
  std::unique_ptr<Backend> backend;
  std::vector<int32_t> table;  // the sequence's page table
  std::vector<int32_t> layer, topk, indices;
  std::vector<int64_t> io, pto;
  std::vector<uint8_t> perkv;

  void AddRequest(const std::vector<int32_t>& list) {
    layer.push_back(0);
    topk.push_back(static_cast<int32_t>(list.size()));
    io.push_back(static_cast<int64_t>(indices.size()));
    pto.push_back(0);
    perkv.push_back(0);
    indices.insert(indices.end(), list.begin(), list.end());
  }
  // Every field of `work`'s decode but q, gate, out and lse.
  void Describe(BatchWork* work) const {
    DecodeBatch& d = work->decode;
    d.num_requests = static_cast<int32_t>(layer.size());
    d.num_q_heads = kHq;
    d.layer = layer.data();
    d.page_table = table.data();
    d.page_table_offset = pto.data();
    d.indices = indices.data();
    d.index_offset = io.data();
    d.topk = topk.data();
    d.indices_per_kv_head = perkv.data();
  }
};

void MakeOneSequence(const CudaBackendOptions& options, std::mt19937& rng, OneSequence* s) {
  auto created = CreateCudaBackend(Config(ScaleMode::kPerTensor), options);
  ASSERT_TRUE(created.ok()) << created.status();
  s->backend = *std::move(created);
  PagedKvCache& cache = s->backend->cache();
  constexpr int kTokens = 40;
  ASSERT_TRUE(cache.CreateSequence("s", 0).ok());
  std::vector<int64_t> slots;
  ASSERT_TRUE(cache.PrepareWrite("s", 0, 0, kTokens, &slots).ok());
  ASSERT_TRUE(cache.CommitWrite("s", 0, 0, kTokens).ok());
  ASSERT_TRUE(cache.AppendPageTable("s", &s->table).ok());
  const size_t kv = size_t{kTokens} * kHkv * kD;
  std::vector<uint16_t> k_new(kv), v_new(kv);
  for (size_t e = 0; e < kv; ++e)
    k_new[e] = RandomBf16(rng, 1.0f), v_new[e] = RandomBf16(rng, 1.0f);
  std::vector<int32_t> a_layer(kTokens, 0);
  BatchWork prefill;
  prefill.append = {kTokens, k_new.data(), v_new.data(), a_layer.data(), slots.data()};
  BatchTiming timing;
  const absl::Status st = s->backend->Run(prefill, &timing);
  ASSERT_TRUE(st.ok()) << st;
}

// Outputs outside AllocateStaging memory (here: a std::vector) are copied back even in
// a small batch; out in staging and lse outside it each take their own path.
TEST(CudaBackendDirectFallback, OutputsNotInStagingAreCopiedBack) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  CudaBackendOptions options;
  options.direct_out_max_requests = kThreshold;
  std::mt19937 rng(5);
  OneSequence seq;
  ASSERT_NO_FATAL_FAILURE(MakeOneSequence(options, rng, &seq));
  Backend& backend = *seq.backend;
  seq.AddRequest({0, 39, -1});
  std::vector<uint16_t> q(kHq * kD), gate(kHq * kD), out(kHq * kD, 0xFFFF);
  for (size_t e = 0; e < q.size(); ++e)
    q[e] = RandomBf16(rng, 1.0f), gate[e] = RandomBf16(rng, 1.0f);
  std::vector<float> lse(kHq, NAN);
  auto* staged_out = static_cast<uint16_t*>(backend.AllocateStaging(out.size() * 2));
  ASSERT_NE(staged_out, nullptr);
  BatchWork work;
  seq.Describe(&work);
  DecodeBatch& d = work.decode;
  d.q = q.data();
  d.gate = gate.data();
  d.lse = lse.data();
  // Run 0: out in a std::vector (copied back); run 1: out in staging (direct).
  std::vector<uint16_t> results[2];
  for (int run = 0; run < 2; ++run) {
    std::fill(out.begin(), out.end(), 0xFFFF);
    std::fill(staged_out, staged_out + out.size(), 0xFFFF);
    std::fill(lse.begin(), lse.end(), NAN);
    d.out = run == 0 ? out.data() : staged_out;
    BatchTiming timing;
    const absl::Status st = backend.Run(work, &timing);
    ASSERT_TRUE(st.ok()) << st;
    const CudaBatchPath p = LastCudaBatchPath(backend);
    EXPECT_EQ(p.direct_out, run == 1);
    EXPECT_FALSE(p.direct_lse);
    EXPECT_FALSE(p.in_place_q);  // one request: q and gate travel in the pack
    results[run].assign(d.out, d.out + out.size());
    for (uint16_t x : results[run]) ASSERT_NE(x & 0x7F80, 0x7F80);
    for (float x : lse) ASSERT_TRUE(std::isfinite(x));
  }
  EXPECT_TRUE(results[0] == results[1]);
  backend.FreeStaging(staged_out);
}

// q and gate too large for the input pack (3 requests: 24 KB each) are read in place
// only when they lie in staging: in std::vectors they are uploaded (read in place, the
// kernels would take host addresses for device ones). Same bits either way, and the
// outputs depend on q (random K/V, three different q): not all equal.
TEST(CudaBackendDirectFallback, LargeInputsNotInStagingAreUploaded) {
  if (!HaveGpu()) GTEST_SKIP() << "no sm_90 CUDA device";
  std::mt19937 rng(7);
  OneSequence seq;
  ASSERT_NO_FATAL_FAILURE(MakeOneSequence(CudaBackendOptions{}, rng, &seq));
  Backend& backend = *seq.backend;
  for (const std::vector<int32_t>& list :
       {std::vector<int32_t>{0, 39, -1}, {7, 8, 9, 10, 11}, {39, 1}})
    seq.AddRequest(list);
  const size_t qe = seq.layer.size() * kHq * kD;
  std::vector<uint16_t> q(qe), gate(qe);
  for (size_t e = 0; e < qe; ++e) q[e] = RandomBf16(rng, 1.0f), gate[e] = RandomBf16(rng, 1.0f);
  auto* staged_q = static_cast<uint16_t*>(backend.AllocateStaging(qe * 2));
  auto* staged_gate = static_cast<uint16_t*>(backend.AllocateStaging(qe * 2));
  auto* out = static_cast<uint16_t*>(backend.AllocateStaging(qe * 2));
  ASSERT_TRUE(staged_q != nullptr && staged_gate != nullptr && out != nullptr);
  std::copy(q.begin(), q.end(), staged_q);
  std::copy(gate.begin(), gate.end(), staged_gate);
  BatchWork work;
  seq.Describe(&work);
  DecodeBatch& d = work.decode;
  d.out = out;
  // Run 0: q and gate in std::vectors (uploaded); run 1: in staging (read in place).
  std::vector<uint16_t> results[2];
  for (int run = 0; run < 2; ++run) {
    d.q = run == 0 ? q.data() : staged_q;
    d.gate = run == 0 ? gate.data() : staged_gate;
    std::fill(out, out + qe, 0xFFFF);
    BatchTiming timing;
    const absl::Status st = backend.Run(work, &timing);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(LastCudaBatchPath(backend).in_place_q, run == 1) << "run " << run;
    results[run].assign(out, out + qe);
    for (uint16_t x : results[run]) ASSERT_NE(x & 0x7F80, 0x7F80) << "run " << run;
  }
  EXPECT_TRUE(results[0] == results[1]);
  const auto row = [&](int r) {
    return std::vector<uint16_t>(results[0].begin() + r * kHq * kD,
                                 results[0].begin() + (r + 1) * kHq * kD);
  };
  EXPECT_NE(row(0), row(1)) << "requests 0 and 1 gave the same outputs";
  for (void* p :
       {static_cast<void*>(staged_q), static_cast<void*>(staged_gate), static_cast<void*>(out)})
    backend.FreeStaging(p);
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaBackendDirect,
                         ::testing::Values(ScaleMode::kPerTensor, ScaleMode::kPerTokenHead));

}  // namespace
}  // namespace sds::gputest
