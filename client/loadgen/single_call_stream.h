// One DecodeStream driven by one thread with one request in flight: the load
// generator's stream mode with --stream_api=sync (auto up to 4 streams; the callback
// API's ReactorStream above). Call writes the request and reads its answer on the
// calling thread. client::DecodeStream allows many requests in flight, so it reads on a thread
// of its own and hands each answer over; with one in flight that hand-off is a thread
// wake-up per request for nothing (the load generator's own CPU per decode is in its
// report).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/decode_client.h"

namespace sds::loadgen {

class SingleCallStream {
 public:
  static absl::StatusOr<std::unique_ptr<SingleCallStream>> Open(client::DecodeClient* client);
  // Cancels the stream if it is still open and collects its final status.
  ~SingleCallStream();
  SingleCallStream(const SingleCallStream&) = delete;
  SingleCallStream& operator=(const SingleCallStream&) = delete;

  // Sends `in` and waits for its answer. No deadline of its own: another thread ends a
  // call that takes too long with Cancel. After a failure of the stream (not of the
  // request alone) every later Call fails with the stream's final status.
  absl::StatusOr<client::DecodeOutput> Call(const client::DecodeInput& in);
  // Ends the stream; callable from any thread, while another is in Call.
  void Cancel();
  // OK while the stream is open and healthy. The calling thread's only.
  absl::Status status() const { return final_status_; }

 private:
  SingleCallStream(client::Shape shape, std::unique_ptr<grpc::ClientContext> ctx,
                   client::v1::DecodeService::Stub* stub);
  // Collects the final status of a stream that failed in `what` and keeps it.
  absl::Status End(const char* what);

  client::Shape shape_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<client::v1::DecodeRequest, client::v1::DecodeResponse>>
      rw_;
  bool finished_ = false;
  absl::Status final_status_;
  uint64_t next_id_ = 1;
};

}  // namespace sds::loadgen
