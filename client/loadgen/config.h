// decode_loadgen's settings, parsed from flags.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace sds::loadgen {

enum class Mode { kUnary, kBatch, kStream };

// How stream mode drives its streams (--stream_api): a thread per stream on the
// synchronous API (one wake-up per answer: the least latency per call), or gRPC's
// callback API (no thread per stream: the least CPU per call when many are open).
enum class StreamApi { kSync, kCallback };
inline const char* StreamApiName(StreamApi api) {
  return api == StreamApi::kSync ? "sync" : "callback";
}
// --stream_api=auto: the synchronous API up to this many streams. As measured, the
// callback API cut the echo's ceiling on the H200 host at one stream from 8.5k to
// 5.5-5.9k calls/s (111 us of client CPU per call against 47); at 16 streams it matched
// the synchronous API there and beat it 1.6x on the 2-core VM; at 256 streams on the
// H200 host it beat it 1.2x (bench/RESULTS.md, session 18).
constexpr int kSyncStreamsUpTo = 4;

// --sweep=DIMENSION:V1,V2,...: one run (a point) per value, each for --duration_s.
struct SweepSpec {
  std::string dimension;  // "concurrency", "rate" or "batch_size"; empty: no sweep
  std::vector<double> values;
};

struct Config {
  std::string target;
  Mode mode = Mode::kUnary;
  std::string mode_name;
  StreamApi stream_api = StreamApi::kCallback;  // stream mode only
  bool stream_api_auto = false;                 // chosen by --concurrency (kSyncStreamsUpTo)
  int concurrency = 1;     // workers: closed-loop callers, or the open loop's in-flight cap
  double rate = 0;         // calls/s, Poisson arrivals; 0 = closed loop
  double duration_s = 10;  // measured time after the warm-up
  int64_t requests = 0;    // bound on measured+warm-up calls; 0 = none
  double warmup_s = 1;
  int channels = 1;
  int batch_size = 1;  // requests per DecodeBatch call
  // --mode=batch: false sends each batch as a DecodeBatch (tensors in the message), true
  // as DecodeLayer calls with the tensors in a POSIX shared-memory region per worker.
  bool shm_transport = false;
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
  bool plot_render = true;         // false: the plots' data and gnuplot script, no PNGs
  bool release = true;             // release the sequences at the end
  int release_timeout_ms = 10000;  // all the releases together, at most
  double progress_s = 5;           // a progress line on stderr this often; 0 = none
  std::string csv;                 // one row per run (per sweep point) here
  SweepSpec sweep;

  int SequencesPerWorker() const { return mode == Mode::kBatch ? batch_size : 1; }
  int NumSequences() const { return concurrency * SequencesPerWorker(); }
};

// Reads the absl flags (after absl::ParseCommandLine) and checks them.
absl::StatusOr<Config> ConfigFromFlags();

}  // namespace sds::loadgen
