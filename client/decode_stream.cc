// DecodeStream: one bidirectional stream, responses filed by request_id.
#include "absl/strings/str_cat.h"
#include "client/decode_client.h"

namespace sds::client {

DecodeStream::DecodeStream(Shape shape, std::unique_ptr<grpc::ClientContext> ctx,
                           v1::DecodeService::Stub* stub)
    : shape_(shape), ctx_(std::move(ctx)) {
  rw_ = stub->DecodeStream(ctx_.get());
  reader_ = std::thread([this] { ReadLoop(); });
}

DecodeStream::~DecodeStream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!reader_done_) ctx_->TryCancel();
  }
  if (reader_.joinable()) reader_.join();
}

void DecodeStream::ReadLoop() {
  v1::DecodeResponse resp;
  while (rw_->Read(&resp)) {
    std::lock_guard<std::mutex> lock(mu_);
    ready_[resp.request_id()] = std::move(resp);
    cv_.notify_all();
    resp = v1::DecodeResponse();
  }
  absl::Status st;
  {
    // No write may be in flight during Finish, and none may follow it.
    std::lock_guard<std::mutex> wl(write_mu_);
    writes_done_ = true;
    st = FromGrpc(rw_->Finish());
  }
  std::lock_guard<std::mutex> lock(mu_);
  reader_done_ = true;
  final_status_ = st.ok() ? absl::OkStatus() : st;
  cv_.notify_all();
}

absl::Status DecodeStream::status() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!reader_done_) return absl::OkStatus();
  return final_status_.ok() ? absl::FailedPreconditionError("stream closed") : final_status_;
}

absl::StatusOr<uint64_t> DecodeStream::Send(const DecodeInput& in) {
  uint64_t id = in.request_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reader_done_) {
      return final_status_.ok() ? absl::FailedPreconditionError("stream closed") : final_status_;
    }
    if (id == 0) id = next_id_++;
  }
  auto req = BuildDecodeRequest(in, shape_);
  if (!req.ok()) return req.status();
  req->set_request_id(id);
  std::lock_guard<std::mutex> lock(write_mu_);
  if (writes_done_) return absl::FailedPreconditionError("DecodeStream is closed");
  if (!rw_->Write(*req)) {
    if (cancelled_.load()) return absl::CancelledError("DecodeStream cancelled by the caller");
    return absl::UnavailableError("DecodeStream write failed: the stream is broken");
  }
  return id;
}

absl::StatusOr<DecodeOutput> DecodeStream::Receive(uint64_t request_id,
                                                   std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    auto it = ready_.find(request_id);
    if (it != ready_.end()) {
      v1::DecodeResponse resp = std::move(it->second);
      ready_.erase(it);
      lock.unlock();
      return ParseDecodeResponse(resp);
    }
    if (reader_done_) {
      if (!final_status_.ok()) return final_status_;
      return absl::UnavailableError(
          absl::StrCat("stream ended without a response to request ", request_id));
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout &&
        ready_.find(request_id) == ready_.end() && !reader_done_) {
      return absl::DeadlineExceededError(
          absl::StrCat("no response to request ", request_id, " within ", timeout.count(), " ms"));
    }
  }
}

absl::StatusOr<DecodeOutput> DecodeStream::Call(const DecodeInput& in,
                                                std::chrono::milliseconds timeout) {
  auto id = Send(in);
  if (!id.ok()) return id.status();
  return Receive(*id, timeout);
}

void DecodeStream::Cancel() {
  cancelled_ = true;
  // Thread-safe in gRPC; the reader then sees the stream end and Finish()es it, once a
  // Write blocked under write_mu_ has returned (it does, failed).
  ctx_->TryCancel();
}

absl::Status DecodeStream::Close() {
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (!writes_done_) {
      writes_done_ = true;
      rw_->WritesDone();
    }
  }
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return final_status_;
}

}  // namespace sds::client
