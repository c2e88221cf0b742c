#include "server/layer_stream.h"

#include <utility>

#include "server/raw_call.h"
#include "server/rpc_util.h"
#include "spdlog/spdlog.h"

namespace sds::server {

namespace v1 = sparse_decode::v1;

namespace {
constexpr char kRpc[] = "DecodeLayerStream";
}  // namespace

LayerStreamReactor::LayerStreamReactor(grpc::CallbackServerContext* context, Env env,
                                       absl::StatusOr<std::string> tenant)
    : context_(context), env_(std::move(env)) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!tenant.ok()) {
    env_.metrics->CountRequest(kRpc, tenant.status().code());
    finished_ = true;
    reads_done_ = true;
    Finish(ToGrpc(tenant.status()));
    return;
  }
  tenant_ = *std::move(tenant);
  StartReadLocked();
}

void LayerStreamReactor::StartReadLocked() {
  reading_ = std::make_unique<Message>();
  StartRead(&reading_->received);
}

void LayerStreamReactor::OnReadDone(bool ok) {
  std::unique_ptr<Message> message;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok || env_.draining->load()) {
      reads_done_ = true;
      reading_.reset();
      MaybeFinishLocked();
      return;
    }
    message = std::move(reading_);
    ++in_flight_;
    if (in_flight_ < kMaxInFlight) {
      StartReadLocked();
    } else {
      read_paused_ = true;  // resumed by an answer
    }
  }
  Message* m = message.release();  // owned by its completion until Answered
  absl::Status parsed = m->call.Parse(m->received);
  m->received.Clear();
  if (!parsed.ok()) {
    env_.metrics->CountRequest(kRpc, parsed.code());
    return Answered(m, parsed);
  }
  env_.run(
      tenant_, &m->call.request, &m->call.response, DeadlineOf(*context_),
      [context = context_] { return context->IsCancelled(); },
      [this, m](const absl::Status& s) { Answered(m, s); });
}

void LayerStreamReactor::Answered(Message* m, const absl::Status& status) {
  std::unique_ptr<Message> message(m);
  if (!status.ok()) {
    v1::DecodeLayerResponse& response = message->call.response;
    response.Clear();
    response.set_request_id(message->call.request.request_id());
    response.set_error_code(static_cast<int32_t>(status.code()));
    response.set_error_message(std::string(status.message()));
  }
  absl::Status serialized = SerializeReply(message->call.response, &message->reply);
  if (!serialized.ok()) spdlog::error("{}: {}", kRpc, serialized.ToString());
  std::lock_guard<std::mutex> lock(mu_);
  --in_flight_;
  if (finished_) return;  // the client went away; nothing more is sent
  writes_.push_back(std::move(message));
  if (!writing_) {
    writing_ = true;
    StartWrite(&writes_.front()->reply);
  }
  if (read_paused_ && !reads_done_) {
    read_paused_ = false;
    StartReadLocked();
  }
}

void LayerStreamReactor::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  writes_.pop_front();
  writing_ = false;
  if (!ok) {  // the client is gone: answer nothing more, finish once all complete
    reads_done_ = true;
    writes_.clear();
    MaybeFinishLocked();
    return;
  }
  if (!writes_.empty()) {
    writing_ = true;
    StartWrite(&writes_.front()->reply);
    return;
  }
  MaybeFinishLocked();
}

void LayerStreamReactor::MaybeFinishLocked() {
  if (finished_ || !reads_done_ || in_flight_ > 0 || writing_ || !writes_.empty()) return;
  finished_ = true;
  Finish(grpc::Status::OK);
}

void LayerStreamReactor::OnDone() { delete this; }

}  // namespace sds::server
