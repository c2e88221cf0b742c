// DecodeLayerStream: DecodeLayerRequest messages in, one DecodeLayerResponse out per
// message, written in the order the messages complete (match them by request_id). A
// message whose shapes or references are bad is answered with its error_code; the
// stream goes on. At most kMaxInFlight messages are read ahead of their answers.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/metrics.h"
#include "server/raw_call.h"
#include "server/work.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

class LayerStreamReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // DecodeServiceImpl::RunLayerCall.
  using RunCall = std::function<void(
      const std::string& tenant, const sparse_decode::v1::DecodeLayerRequest* request,
      sparse_decode::v1::DecodeLayerResponse* response, Clock::time_point deadline,
      const std::function<bool()>& cancelled,
      const std::function<void(const absl::Status&)>& done)>;
  struct Env {
    Metrics* metrics = nullptr;
    const std::atomic<bool>* draining = nullptr;
    RunCall run;
  };

  // Starts reading; when `tenant` is not OK the stream finishes with it at once.
  LayerStreamReactor(grpc::CallbackServerContext* context, Env env,
                     absl::StatusOr<std::string> tenant);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  struct Message {
    grpc::ByteBuffer received;
    TypedCall<sparse_decode::v1::DecodeLayerRequest, sparse_decode::v1::DecodeLayerResponse>
        call;  // the parsed request and its response, on one arena
    grpc::ByteBuffer reply;
  };
  static constexpr int kMaxInFlight = 16;

  void Answered(Message* message, const absl::Status& status);
  void StartReadLocked();    // requires mu_
  void MaybeFinishLocked();  // requires mu_

  grpc::CallbackServerContext* const context_;
  const Env env_;
  std::string tenant_;
  std::mutex mu_;
  std::unique_ptr<Message> reading_;
  std::deque<std::unique_ptr<Message>> writes_;  // answered; front() is being written
  int in_flight_ = 0;                            // read, not yet answered
  bool reads_done_ = false;
  bool read_paused_ = false;
  bool writing_ = false;
  bool finished_ = false;
};

}  // namespace sds::server
