// decode_loadgen's settings, parsed from flags.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace sds::loadgen {

enum class Mode { kUnary, kBatch, kStream };

struct Config {
  std::string target;
  Mode mode = Mode::kUnary;
  std::string mode_name;
  int concurrency = 1;     // workers: closed-loop callers, or the open loop's in-flight cap
  double rate = 0;         // calls/s, Poisson arrivals; 0 = closed loop
  double duration_s = 10;  // measured time after the warm-up
  int64_t requests = 0;    // bound on measured+warm-up calls; 0 = none
  double warmup_s = 1;
  int channels = 1;
  int batch_size = 1;  // requests per DecodeBatch call
  int prefill_len = 1024;
  int prefill_chunk = 256;
  int max_new_tokens = 256;  // then positions wrap back to prefill_len (same data)
  int topk = 512;
  bool per_head_indices = false;
  bool return_lse = false;
  int timeout_ms = 2000;
  int keepalive_ms = 10000;  // HTTP/2 keepalive ping interval; 0 = off
  double stall_s = 5;        // abort when nothing succeeded for this long and errors were seen
  uint64_t seed = 1;
  std::string tenant_id;
  std::string token;
  std::string label;
  std::string json_out;
  std::string plot_prefix;
  bool plot_render = true;  // false: the plots' data and gnuplot script, no PNGs
  bool release = true;      // release the sequences at the end

  int SequencesPerWorker() const { return mode == Mode::kBatch ? batch_size : 1; }
  int NumSequences() const { return concurrency * SequencesPerWorker(); }
};

// Reads the absl flags (after absl::ParseCommandLine) and checks them.
absl::StatusOr<Config> ConfigFromFlags();

}  // namespace sds::loadgen
