#include "client/loadgen/reactor_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace sds::loadgen {

void ReactorStream::Group::Add() {
  std::lock_guard<std::mutex> lock(mu_);
  ++live_;
}

void ReactorStream::Group::Remove() {
  // Notified under the lock: the waiter may destroy the group once it sees 0.
  std::lock_guard<std::mutex> lock(mu_);
  if (--live_ == 0) cv_.notify_all();
}

bool ReactorStream::Group::WaitUntilNoneLive(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, deadline, [this] { return live_ == 0; });
}

absl::StatusOr<ReactorStream::Ptr> ReactorStream::Open(client::DecodeClient* client, Group* group) {
  auto shape = client->GetShape();
  if (!shape.ok()) return shape.status();
  auto* s = new ReactorStream(*shape, client->StreamContext(), group);
  client->stub()->async()->DecodeStream(s->ctx_.get(), s);
  s->AddHold();  // open between calls, until Release or a failure (TakeHoldLocked)
  s->StartCall();
  return Ptr(s);
}

ReactorStream::ReactorStream(client::Shape shape, std::unique_ptr<grpc::ClientContext> ctx,
                             Group* group)
    : shape_(shape), ctx_(std::move(ctx)), group_(group) {
  group_->Add();
}

void ReactorStream::Call(const client::DecodeInput& in, Done done) {
  auto req = client::BuildDecodeRequest(in, shape_);
  if (!req.ok()) return done(req.status());
  std::unique_lock<std::mutex> lock(mu_);
  if (failed_) {
    const absl::Status status = final_status_;
    lock.unlock();
    // `done` may release this stream (its owner's last reference): nothing after it
    // (the unlocked lock's destructor does not touch the mutex).
    return done(status);
  }
  const uint64_t id = in.request_id != 0 ? in.request_id : next_id_++;
  request_ = *std::move(req);
  request_.set_request_id(id);
  expected_id_ = id;
  done_ = std::move(done);
  ops_in_flight_ = 2;
  read_failed_ = false;
  // The read may end, and `done` run and release the stream (on a gRPC thread), before
  // StartRead returns here: this call's own reference keeps the stream until then.
  ++refs_;
  lock.unlock();
  // The hold keeps the stream from ending under these (only a failure or the owner's
  // release removes it, and neither happened).
  StartWrite(&request_);
  StartRead(&response_);
  Unref();
}

void ReactorStream::Cancel() { ctx_->TryCancel(); }  // thread-safe in gRPC

absl::Status ReactorStream::status() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_ ? final_status_ : absl::OkStatus();
}

void ReactorStream::Release() {
  ctx_->TryCancel();
  bool remove;
  {
    std::lock_guard<std::mutex> lock(mu_);
    remove = TakeHoldLocked();
  }
  if (remove) RemoveHold();
  Unref();
}

bool ReactorStream::TakeHoldLocked() {
  const bool had = hold_;
  hold_ = false;
  return had;
}

void ReactorStream::OnWriteDone(bool /*ok*/) {
  // A failed write means the call is over: the read fails too and says so.
  std::unique_lock<std::mutex> lock(mu_);
  OpEnded(lock);
}

void ReactorStream::OnReadDone(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ok) {
    read_failed_ = true;
  } else if (response_.request_id() != expected_id_) {
    // One request in flight: the answer must be its own.
    result_ =
        absl::InternalError(absl::StrCat("DecodeStream answered request ", response_.request_id(),
                                         " while ", expected_id_, " was in flight"));
    failed_ = true;
    final_status_ = result_.status();
    ctx_->TryCancel();
  } else {
    result_ = client::ParseDecodeResponse(response_);
  }
  OpEnded(lock);
}

void ReactorStream::OpEnded(std::unique_lock<std::mutex>& lock) {
  if (--ops_in_flight_ > 0) return;
  if (read_failed_) {
    // The stream ended: its final status, the call's result, comes with OnDone, which
    // waits for the hold.
    const bool remove = TakeHoldLocked();
    lock.unlock();
    if (remove) RemoveHold();
    return;
  }
  Done done = std::move(done_);
  done_ = nullptr;
  absl::StatusOr<client::DecodeOutput> result = std::move(result_);
  lock.unlock();
  done(std::move(result));
}

void ReactorStream::OnDone(const grpc::Status& s) {
  Done done;
  absl::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      const absl::Status st = client::FromGrpc(s);
      final_status_ =
          st.ok() ? absl::UnavailableError("DecodeStream ended by the server (read)") : st;
    }
    status = final_status_;
    done = std::move(done_);  // set only when the call's read ended the stream
    done_ = nullptr;
  }
  if (done) done(status);
  Unref();
}

void ReactorStream::Unref() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--refs_ > 0) return;
  }
  Group* group = group_;
  delete this;
  group->Remove();
}

}  // namespace sds::loadgen
