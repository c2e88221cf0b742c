// Runner's worker state, shared by runner.cc (the run, the threads, the records) and
// runner_streams.cc (the stream workers).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

#include "client/loadgen/runner.h"
#include "client/shared_memory.h"

namespace sds::loadgen {

struct Runner::Worker {
  int index = 0;
  client::DecodeClient* client = nullptr;
  std::vector<int> seqs;
  std::vector<Cursor> cursors;
  std::vector<client::DecodeInput> inputs;
  // --transport=shm: the worker's region (its batch's tensors, registered on the first
  // call under region_name) and the packed call over it.
  std::unique_ptr<client::SharedMemoryRegion> region;
  std::string region_name;
  client::LayerBatch layer;
  std::mt19937_64 rng;
  WorkerStats stats;
  int consecutive_errors = 0;
  Clock::time_point call_end;
  // The open stream (stream mode). Only the worker's flow replaces it, always under
  // stream_mu, so that the runner can cancel it (CancelStreams) while a call is in it.
  std::mutex stream_mu;
  ReactorStream::Ptr stream;                      // --stream_api=callback
  std::unique_ptr<SingleCallStream> sync_stream;  // --stream_api=sync
  Clock::time_point intended;                     // of the callback stream's call in flight
  bool stream_cancelled = false;                  // by the runner; guarded by stream_mu
  // Start of the stream call in flight; 0: none. Set by the worker alone; reset by it
  // under stream_mu once the call returned, which is how it claims the call back from
  // CancelStreams (which reads it under stream_mu too).
  std::atomic<int64_t> stream_call_ns{0};
};

// A stream call has no deadline of its own (either stream kind): the runner cancels its
// stream once the call has taken --timeout_ms and this slack, which ends a slow answer's
// read and a write the server does not take alike.
inline constexpr auto kStreamCallSlack = std::chrono::milliseconds(100);

}  // namespace sds::loadgen
