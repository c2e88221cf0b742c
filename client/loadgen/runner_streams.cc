// Runner's stream workers: on the callback API (no thread: each call issued from the
// last one's callback, an idle worker woken by the scheduler, a failed one backing off
// on Run's loop) and on the synchronous API (StreamCall on the worker's thread); the
// claim of a call back from the canceller, stream replacement and cancelling.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/loadgen/runner.h"
#include "client/loadgen/runner_worker.h"

namespace sds::loadgen {

void Runner::ReplaceStream(Worker* w, ReactorStream::Ptr s,
                           std::unique_ptr<SingleCallStream> sync) {
  // Released after the unlock: each cancels its stream (a SingleCallStream also waits
  // for its final status).
  ReactorStream::Ptr old;
  std::unique_ptr<SingleCallStream> old_sync;
  std::lock_guard<std::mutex> lock(w->stream_mu);
  old = std::move(w->stream);
  old_sync = std::move(w->sync_stream);
  w->stream = std::move(s);
  w->sync_stream = std::move(sync);
  w->stream_cancelled = false;
  // Opened after CancelStreams(true) went by this worker: it would not come back.
  if ((w->stream || w->sync_stream) && cancel_all_streams_.load()) {
    if (w->stream) w->stream->Cancel();
    if (w->sync_stream) w->sync_stream->Cancel();
    w->stream_cancelled = true;
  }
}

absl::Status Runner::StreamStatus(Worker* w) {
  if (w->stream) return w->stream->status();
  if (w->sync_stream) return w->sync_stream->status();
  return absl::OkStatus();
}

void Runner::CancelStreams(bool all) {
  if (all) cancel_all_streams_ = true;
  const int64_t now = Clock::now().time_since_epoch().count();
  const int64_t limit = std::chrono::duration_cast<Clock::duration>(
                            std::chrono::milliseconds(config_.timeout_ms) + kStreamCallSlack)
                            .count();
  for (auto& w : workers_) {
    std::lock_guard<std::mutex> lock(w->stream_mu);
    if ((!w->stream && !w->sync_stream) || w->stream_cancelled) continue;
    const int64_t start = w->stream_call_ns.load();
    if (all || (start != 0 && now - start > limit)) {
      if (w->stream) w->stream->Cancel();
      if (w->sync_stream) w->sync_stream->Cancel();
      w->stream_cancelled = true;
    }
  }
}

absl::StatusOr<client::DecodeOutput> Runner::StreamCall(Worker* w) {
  if (!w->sync_stream) {
    auto s = SingleCallStream::Open(w->client);
    if (!s.ok()) return s.status();
    ReplaceStream(w, nullptr, *std::move(s));
  }
  w->stream_call_ns = Clock::now().time_since_epoch().count();
  auto r = w->sync_stream->Call(w->inputs[0]);
  if (after_stream_call_for_test_) after_stream_call_for_test_();
  return ClaimStreamCall(w, std::move(r));
}

Runner::Ticket Runner::TakeStreamTicket(Worker* w, Clock::time_point* intended) {
  if (config_.rate <= 0) {
    if (stop_.load()) return Ticket::kDone;
    if (config_.requests > 0 && issued_.fetch_add(1) >= config_.requests) return Ticket::kDone;
    *intended = Clock::now();
    return Ticket::kGot;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_.load()) return Ticket::kDone;
  if (!tickets_.empty()) {
    *intended = tickets_.front();
    tickets_.pop_front();
    return Ticket::kGot;
  }
  if (generation_done_) return Ticket::kDone;
  idle_.push_back(w);  // the scheduler's next arrival goes on with it
  return Ticket::kIdle;
}

void Runner::StreamNext(Worker* w) {
  Clock::time_point intended;
  switch (TakeStreamTicket(w, &intended)) {
    case Ticket::kGot:
      return StreamIssue(w, intended);
    case Ticket::kIdle:
      return;
    case Ticket::kDone:
      return FinishStreamWorker(w);
  }
}

void Runner::FinishStreamWorker(Worker* w) {
  DropStream(w);
  --active_workers_;  // last: Run may merge the worker's stats from here on
}

void Runner::StreamIssue(Worker* w, Clock::time_point intended) {
  w->intended = intended;
  workload_.FillDecode(w->seqs[0], w->cursors[0], w->rng, &w->inputs[0]);
  if (!w->stream) {
    auto s = ReactorStream::Open(w->client, &streams_);
    if (!s.ok()) {
      w->call_end = Clock::now();
      RecordError(w, intended, s.status());
      return StreamBackOff(w);
    }
    ReplaceStream(w, *std::move(s), nullptr);
  }
  w->stream_call_ns = Clock::now().time_since_epoch().count();
  // The answer comes on a gRPC thread, or at once when the call fails before it is sent.
  w->stream->Call(w->inputs[0], [this, w](absl::StatusOr<client::DecodeOutput> r) {
    StreamAnswered(w, std::move(r));
  });
}

void Runner::StreamAnswered(Worker* w, absl::StatusOr<client::DecodeOutput> r) {
  if (after_stream_call_for_test_) after_stream_call_for_test_();
  r = ClaimStreamCall(w, std::move(r));
  w->call_end = Clock::now();
  if (!r.ok()) {
    RecordError(w, w->intended, r.status());
    return StreamBackOff(w);
  }
  RecordSuccess(w, w->intended, r->batch, true);
  workload_.Advance(&w->cursors[0]);
  StreamNext(w);
}

absl::StatusOr<client::DecodeOutput> Runner::ClaimStreamCall(
    Worker* w, absl::StatusOr<client::DecodeOutput> r) {
  bool cancelled;
  {
    // Claims the call back: from here CancelStreams sees no call in flight, and before
    // here it may have cancelled the stream, even after the answer arrived.
    std::lock_guard<std::mutex> lock(w->stream_mu);
    w->stream_call_ns = 0;
    cancelled = w->stream_cancelled;
  }
  if (r.ok()) {
    // Answered, though the stream was cancelled meanwhile (the call was slow, or the
    // run is ending): the answer counts, the stream is of no further use.
    if (cancelled) DropStream(w);
    return r;
  }
  // A broken, stuck or cancelled stream is replaced; a request that failed alone is not.
  if (cancelled || !StreamStatus(w).ok() ||
      r.status().code() == absl::StatusCode::kDeadlineExceeded) {
    DropStream(w);
  }
  if (cancelled) {
    return absl::DeadlineExceededError(
        absl::StrCat(cancel_all_streams_.load() ? "stream call cut off at the end of the run"
                                                : "stream call not done within --timeout_ms",
                     " (a write waits while the server does not read); stream cancelled: ",
                     r.status().ToString()));
  }
  return r;
}

void Runner::StreamBackOff(Worker* w) {
  // Back off a failing server a little, as the threads of the other modes do; a dead one
  // then costs no CPU.
  const int shift = std::min(w->consecutive_errors, 7);
  const auto due = Clock::now() + std::chrono::milliseconds(1 << shift);
  bool stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped = stop_.load();
    if (!stopped) backing_off_.emplace_back(due, w);
  }
  if (stopped) return StreamNext(w);  // its end
  backoff_cv_.notify_one();
}

std::vector<Runner::Worker*> Runner::DueBackOffs(Clock::time_point now) {
  std::vector<Worker*> due;
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < backing_off_.size();) {
    if (backing_off_[i].first <= now) {
      due.push_back(backing_off_[i].second);
      backing_off_[i] = backing_off_.back();
      backing_off_.pop_back();
    } else {
      ++i;
    }
  }
  return due;
}

void Runner::FinishWaitingStreamWorkers() {
  std::vector<Worker*> waiting;
  {
    std::lock_guard<std::mutex> lock(mu_);  // stop_ is set: none is added from here on
    waiting.swap(idle_);
    for (const auto& b : backing_off_) waiting.push_back(b.second);
    backing_off_.clear();
  }
  for (Worker* w : waiting) FinishStreamWorker(w);
}

}  // namespace sds::loadgen
