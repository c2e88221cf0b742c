// One DecodeStream on gRPC's callback API with one request in flight: the load
// generator's stream mode with --stream_api=callback (auto from 5 streams; the
// synchronous SingleCallStream below that). Call sends a request; its answer (or the
// stream's failure) is handed to a callback on one of gRPC's threads, which may issue
// the stream's next call at once. No thread of ours waits on a stream: on the
// synchronous API every stream needs a thread of its own blocked in Read, and each
// answer cost about three thread wake-ups in the load generator (~40-50 us of its CPU
// per decode on a 2-core host at 256 streams, bench/RESULTS.md), which a benchmark
// sharing the host with the server cannot afford.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/decode_client.h"

namespace sds::loadgen {

class ReactorStream final
    : private grpc::ClientBidiReactor<client::v1::DecodeRequest, client::v1::DecodeResponse> {
 public:
  // Counts the streams of one owner still known to gRPC, so that the owner can wait for
  // them all to end before the channels they run on go away. Outlives its streams.
  class Group {
   public:
    // True when every stream of the group ended before `deadline`.
    bool WaitUntilNoneLive(std::chrono::steady_clock::time_point deadline);

   private:
    friend class ReactorStream;
    void Add();
    void Remove();

    std::mutex mu_;
    std::condition_variable cv_;
    int64_t live_ = 0;
  };

  // The owner's handle: dropping it ends the stream (Release).
  struct Releaser {
    void operator()(ReactorStream* s) const { s->Release(); }
  };
  using Ptr = std::unique_ptr<ReactorStream, Releaser>;
  using Done = std::function<void(absl::StatusOr<client::DecodeOutput>)>;

  // Opens a stream on `client`'s channel (no deadline: the owner ends a call that takes
  // too long with Cancel). The client's shape must be known already: this runs on gRPC's
  // threads too, where a blocking GetModelInfo must not run.
  static absl::StatusOr<Ptr> Open(client::DecodeClient* client, Group* group);

  // Sends `in`; the previous call's `done` must have run. `done` runs exactly once: on a
  // gRPC thread with the answer or the stream's failure, or before Call returns when
  // the request cannot be built or the stream failed earlier. After a failure of the
  // stream (not of the request alone) every later call fails with its final status; a
  // stream cancelled or ended by the server between calls finds out on its next call,
  // which then fails on the wire.
  void Call(const client::DecodeInput& in, Done done);
  // Ends the stream; any thread, also while a call is in flight (which then fails).
  void Cancel();
  // OK while the stream is open and healthy; else its final status.
  absl::Status status();

 private:
  ReactorStream(client::Shape shape, std::unique_ptr<grpc::ClientContext> ctx, Group* group);
  ~ReactorStream() = default;
  // The owner's end: cancels the stream; it is deleted once gRPC is done with it too.
  void Release();

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& s) override;

  // Requires mu_. Removes the hold that keeps the stream open between calls, once.
  bool TakeHoldLocked();
  // One of the two operations of the call in flight ended; after both, its result.
  void OpEnded(std::unique_lock<std::mutex>& lock);
  // Drops a reference (refs_); the last deletes the stream.
  void Unref();

  const client::Shape shape_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  Group* const group_;
  client::v1::DecodeRequest request_;    // the call in flight's
  client::v1::DecodeResponse response_;  // its answer

  std::mutex mu_;
  Done done_;                 // the call in flight's; empty when none
  int ops_in_flight_ = 0;     // of the call in flight: its write and its read
  bool read_failed_ = false;  // the read ended the stream: the result waits for OnDone
  // The call's outcome once its read succeeded (its answer, or INTERNAL for an answer to
  // another request).
  absl::StatusOr<client::DecodeOutput> result_;
  uint64_t expected_id_ = 0;
  uint64_t next_id_ = 1;
  bool hold_ = true;  // held from Open until the owner's release or the stream's failure
  bool failed_ = false;
  absl::Status final_status_;  // when failed_
  // The owner's and gRPC's (until OnDone), and one per Call still in its Start* calls.
  int refs_ = 2;
};

}  // namespace sds::loadgen
