// The synthetic model runner's data: sequences, their positions, and tensors.
//
// K/V of a (sequence, layer, position) are a deterministic function of it, so a retried
// or wrapped-around write sends the same data again, which the contract allows.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "client/decode_client.h"
#include "client/loadgen/config.h"

namespace sds::loadgen {

// Where a sequence's next decode goes: layer 0..L-1 at `position`, then position + 1.
struct Cursor {
  int32_t layer = 0;
  int64_t position = 0;
};

class Workload {
 public:
  Workload(const Config& config, client::Shape shape, int32_t num_layers);

  int32_t num_layers() const { return num_layers_; }
  std::string SequenceId(int seq) const;
  Cursor Start() const { return Cursor{0, config_.prefill_len}; }
  void Advance(Cursor* c) const;

  // Creates sequence `seq` and writes its prefix into every layer.
  absl::Status Prefill(client::DecodeClient& client, int seq) const;
  // Fills `in` for the decode at `c` (reuses its buffers).
  void FillDecode(int seq, const Cursor& c, std::mt19937_64& rng, client::DecodeInput* in) const;

 private:
  const uint16_t* Row(const std::vector<uint16_t>& pool, size_t row_len, uint64_t key) const;
  uint64_t Key(int seq, int32_t layer, int64_t position) const;

  Config config_;
  client::Shape shape_;
  int32_t num_layers_;
  std::string run_id_;
  static constexpr size_t kPoolRows = 97;
  std::vector<uint16_t> k_pool_, v_pool_;     // kPoolRows x [Hkv, D]
  std::vector<uint16_t> q_pool_, gate_pool_;  // kPoolRows x [Hq, D]
};

}  // namespace sds::loadgen
