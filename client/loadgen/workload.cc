#include "client/loadgen/workload.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace sds::loadgen {
namespace {

uint16_t ToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

std::vector<uint16_t> RandomPool(size_t n, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> pool(n);
  for (auto& x : pool) x = ToBf16(dist(rng));
  return pool;
}

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

Workload::Workload(const Config& config, client::Shape shape, int32_t num_layers)
    : config_(config), shape_(shape), num_layers_(num_layers) {
  std::mt19937_64 rng(config.seed);
  const size_t kv = size_t(shape.num_kv_heads) * shape.head_dim;
  const size_t qd = size_t(shape.num_q_heads) * shape.head_dim;
  k_pool_ = RandomPool(kPoolRows * kv, 1.0f, rng);
  v_pool_ = RandomPool(kPoolRows * kv, 1.0f, rng);
  q_pool_ = RandomPool(kPoolRows * qd, 0.5f, rng);
  gate_pool_ = RandomPool(kPoolRows * qd, 1.0f, rng);
  // A sweep makes a Workload per point: its ids must not meet a point's before it that
  // kept its sequences (--release=false) or could not release them.
  static std::atomic<int> instances{0};
  run_id_ = absl::StrCat(getpid(), "-", rng() % 1000000, "-", instances.fetch_add(1));
}

std::string Workload::SequenceId(int seq) const {
  return absl::StrCat("loadgen-", run_id_, "-", seq);
}

void Workload::Advance(Cursor* c) const {
  if (++c->layer < num_layers_) return;
  c->layer = 0;
  if (++c->position >= int64_t{config_.prefill_len} + config_.max_new_tokens) {
    c->position = config_.prefill_len;
  }
}

uint64_t Workload::Key(int seq, int32_t layer, int64_t position) const {
  return Mix(Mix(uint64_t(seq) * 1000003ULL + uint64_t(layer)) ^ uint64_t(position));
}

const uint16_t* Workload::Row(const std::vector<uint16_t>& pool, size_t row_len,
                              uint64_t key) const {
  return pool.data() + (key % kPoolRows) * row_len;
}

absl::Status Workload::Prefill(client::DecodeClient& client, int seq) const {
  const std::string id = SequenceId(seq);
  const int64_t tokens = int64_t{config_.prefill_len} + config_.max_new_tokens + 1;
  auto created = client.CreateSequence(id, tokens);
  if (!created.ok()) return created.status();
  const size_t row = size_t(shape_.num_kv_heads) * shape_.head_dim;
  std::vector<uint16_t> k, v;
  for (int32_t layer = 0; layer < num_layers_; ++layer) {
    for (int64_t start = 0; start < config_.prefill_len; start += config_.prefill_chunk) {
      const int64_t n = std::min<int64_t>(config_.prefill_chunk, config_.prefill_len - start);
      k.resize(n * row);
      v.resize(n * row);
      for (int64_t t = 0; t < n; ++t) {
        const uint64_t key = Key(seq, layer, start + t);
        std::memcpy(&k[t * row], Row(k_pool_, row, key), row * 2);
        std::memcpy(&v[t * row], Row(v_pool_, row, key + 1), row * 2);
      }
      auto len = client.AppendKV(id, layer, start, k, v);
      if (!len.ok()) return len.status();
    }
  }
  return absl::OkStatus();
}

void Workload::FillDecode(int seq, const Cursor& c, std::mt19937_64& rng,
                          client::DecodeInput* in) const {
  const size_t kv = size_t(shape_.num_kv_heads) * shape_.head_dim;
  const size_t qd = size_t(shape_.num_q_heads) * shape_.head_dim;
  const uint64_t key = Key(seq, c.layer, c.position);
  in->sequence_id = SequenceId(seq);
  in->layer = c.layer;
  in->position = c.position;
  in->k.assign(Row(k_pool_, kv, key), Row(k_pool_, kv, key) + kv);
  in->v.assign(Row(v_pool_, kv, key + 1), Row(v_pool_, kv, key + 1) + kv);
  const uint64_t r = rng();
  in->q.assign(Row(q_pool_, qd, r), Row(q_pool_, qd, r) + qd);
  in->gate.assign(Row(gate_pool_, qd, r >> 20), Row(gate_pool_, qd, r >> 20) + qd);
  // Top-K from the prefix 0..position (a token may attend to itself).
  std::uniform_int_distribution<int32_t> pos(0, static_cast<int32_t>(c.position));
  const size_t n = size_t(config_.topk) * (config_.per_head_indices ? shape_.num_kv_heads : 1);
  in->indices.resize(n);
  for (auto& i : in->indices) i = pos(rng);
  in->per_kv_head_indices = config_.per_head_indices;
  in->return_lse = config_.return_lse;
}

}  // namespace sds::loadgen
