#include "server/stream_reactor.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/raw_call.h"
#include "server/rpc_util.h"
#include "server/validate.h"
#include "spdlog/spdlog.h"

namespace sds::server {

namespace v1 = sparse_decode::v1;

namespace {
constexpr char kRpc[] = "DecodeStream";
}  // namespace

DecodeStreamReactor::DecodeStreamReactor(grpc::CallbackServerContext* context, Env env,
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
  StartNextReadLocked();
}

google::protobuf::ArenaOptions DecodeStreamReactor::Call::Options(char* block, size_t bytes) {
  google::protobuf::ArenaOptions options;
  options.initial_block = block;
  options.initial_block_size = bytes;
  options.start_block_size = bytes;  // beyond the first block (a larger message): heap
  options.max_block_size = 8 * bytes;
  return options;
}

DecodeStreamReactor::Call::Call(DecodeStreamReactor* stream, size_t bytes)
    : block(new char[bytes]), arena(Options(block.get(), bytes)), stream_(stream) {
  CreateMessages();
}

absl::Status DecodeStreamReactor::Call::Write(int32_t, const BatchInfo& batch, const uint16_t* out,
                                              const float* lse) {
  batch_size = batch.batch_size;
  stream_->env_.encoder->Encode(request->request_id(), batch, out, lse, &encoded);
  return absl::OkStatus();
}

void DecodeStreamReactor::Call::Done(absl::Span<DecodeItem* const>,
                                     absl::Span<const absl::Status> status) {
  stream_->Completed(this, status[0]);
}

void DecodeStreamReactor::Call::CreateMessages() {
  request = google::protobuf::Arena::CreateMessage<v1::DecodeRequest>(&arena);
  response = google::protobuf::Arena::CreateMessage<v1::DecodeResponse>(&arena);
}

void DecodeStreamReactor::Call::Reset() {
  received.Clear();
  wire.Clear();
  bytes.Clear();
  item = DecodeItem();
  batch_size = 0;
  encoded = EncodedResponse{};
  reply.Clear();
  completed = Clock::time_point{};
  arena.Reset();  // frees any extra blocks, keeps the first
  CreateMessages();
}

absl::Status DecodeStreamReactor::Call::Parse() {
  absl::Status s = wire.Take(received);
  received.Clear();  // `wire` holds the slices now
  if (s.ok()) s = wire.ParseDecodeRequest(request, &bytes);
  return s;
}

void DecodeStreamReactor::StartNextReadLocked() {
  if (free_calls_.empty()) {
    reading_ = std::make_unique<Call>(this, env_.call_bytes);
  } else {
    reading_ = std::move(free_calls_.back());
    free_calls_.pop_back();
  }
  StartRead(&reading_->received);
}

void DecodeStreamReactor::RecycleLocked(std::unique_ptr<Call> call) {
  if (free_calls_.size() >= kMaxFreeCalls) return;
  call->Reset();
  free_calls_.push_back(std::move(call));
}

void DecodeStreamReactor::OnReadDone(bool ok) {
  const Clock::time_point read_done = Clock::now();  // before the lock: see below
  Call* call;
  bool pipelined;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok || finished_) {  // half-close or cancellation
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    call = reading_.release();  // owned by the batcher until Answer
    call->start = read_done;
    ++pending_;
    // A request that arrives this soon after the last answer was sent was sent before
    // the client could have read that answer: the client pipelines. Only the answer can
    // anchor this: a client that waits for each answer may reply before this thread has
    // even started the next read (the answer goes out mid-reaction), so "soon after the
    // read started" or "after the write completed" also catches waiting clients (with
    // either anchor a one-stream ping-pong load was judged pipelining for 99% of its
    // requests and lost the inline run). Sticky: once seen, the stream never runs a
    // batch inline again; the gap is timing (a slow or loaded host stretches it), so
    // one short gap must be enough. Deciding per request left a pipelining stream
    // running inline one request at a time, never batched, whenever every gap happened
    // to be long. The clock is read before the lock, which is not part of the gap.
    pipelining_ = pipelining_ || read_done - last_answer_ < kPipelinedWithin;
    pipelined = pipelining_;
  }
  // Queue this request before reading the next one: requests of one stream enter the
  // batcher in the order they were sent (same-(sequence, layer) pipelining relies on it).
  // With --inline_idle_batches an idle batcher may leave the batch to this thread: it
  // runs here, and the answer is written before the next read starts. Not for a
  // pipelining client: gRPC (1.51) delivers the next OnReadDone of this call only after
  // this reaction returns (the completion is queued on this thread's callback exec
  // context), even when StartRead is issued before the run and the message is already
  // buffered; an attempt that started the read first lost all batching. So its requests
  // would run one by one, each into an idle batcher; queued instead, they batch.
  absl::Status parsed;
  try {
    parsed = call->Parse();
  } catch (const std::exception& e) {  // bad_alloc: no exception may leave a reaction
    parsed = absl::InternalError(absl::StrCat("cannot parse the request: ", e.what()));
  }
  if (!parsed.ok()) {
    Answer(call, parsed);  // a malformed message: its own answer, the stream goes on
  } else {
    Batcher::SubmitterRun run;
    Submit(call, pipelined ? nullptr : &run);  // answered UNAVAILABLE when draining
    try {
      run.Run();  // outside mu_: the batch's answers take it
    } catch (const std::exception& e) {
      // The batcher answers its items even when a batch fails; this is a bug. No
      // exception may leave a reaction: stop reading and end the stream with INTERNAL
      // once the requests already read are answered.
      spdlog::critical("DecodeStream: exception while running a claimed batch: {}", e.what());
      std::lock_guard<std::mutex> lock(mu_);
      internal_error_ = true;
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || drained_) {
      reads_done_ = true;
      MaybeFinishLocked();
    } else if (pending_ + static_cast<int64_t>(writes_.size()) >= env_.max_unanswered) {
      read_paused_ = true;  // back-pressure: the client reads its answers too slowly
      spdlog::debug("DecodeStream: paused reading at {} unanswered requests", env_.max_unanswered);
    } else {
      try {
        StartNextReadLocked();
      } catch (const std::exception& e) {  // bad_alloc for the next message's arena
        spdlog::error("DecodeStream: cannot start the next read: {}", e.what());
        internal_error_ = true;
        reads_done_ = true;
        MaybeFinishLocked();
      }
    }
  }
}

void DecodeStreamReactor::MaybeResumeReadLocked() {
  if (!read_paused_ || finished_ || drained_ || reads_done_) return;
  if (pending_ + static_cast<int64_t>(writes_.size()) > env_.max_unanswered / 2) return;
  read_paused_ = false;
  StartNextReadLocked();
}

void DecodeStreamReactor::Submit(Call* call, Batcher::SubmitterRun* run) {
  absl::Status status;
  try {
    if (env_.draining->load()) {
      status = absl::UnavailableError("server is draining");
    } else {
      status = ValidateDecode(*call->request, call->bytes, *env_.model, &call->item);
    }
    if (status.ok()) call->item.key = SequenceKey(tenant_, call->item.sequence_id);
  } catch (const std::exception& e) {
    spdlog::error("DecodeStream: exception while submitting: {}", e.what());
    status = absl::InternalError("internal error while queueing the request");
  }
  if (!status.ok()) return Answer(call, status);
  // Answered through the call's Done from here, a refusal included.
  DecodeItem* item = &call->item;
  env_.admission->Submit(
      {&item, 1}, call, DeadlineOf(*context_), [this] { return context_->IsCancelled(); },
      /*whole_batch=*/false, run);
}

void DecodeStreamReactor::Completed(Call* call, const absl::Status& status) {
  call->completed = Clock::now();
  if (env_.answer_pool != nullptr && status.ok() && call->batch_size > 1) {
    try {
      // The stream cannot finish before this runs: the request stays pending until
      // Answer, and Finish waits for no pending requests.
      env_.answer_pool->Post([this, call, status] { Answer(call, status); });
      return;
    } catch (const std::exception& e) {  // bad_alloc queueing the task: answer here
      spdlog::warn("DecodeStream: answer pool refused a task: {}", e.what());
    }
  }
  Answer(call, status);
}

void DecodeStreamReactor::Answer(Call* raw_call, const absl::Status& status) {
  std::unique_ptr<Call> call(raw_call);
  if (call->completed == Clock::time_point{}) call->completed = Clock::now();  // refused
  if (!status.ok()) {
    v1::DecodeResponse* response = call->response;
    response->Clear();
    response->set_request_id(call->request->request_id());
    response->set_error_code(static_cast<int32_t>(status.code()));
    response->set_error_message(std::string(status.message()));
    if (status.code() == absl::StatusCode::kInternal) {
      spdlog::error("DecodeStream request {} of '{}': {}", call->request->request_id(),
                    call->request->sequence_id(), status.ToString());
    }
  }
  env_.metrics->CountRequest(kRpc, status.code());
  env_.metrics->ObserveLatency(kRpc, SecondsSince(call->start));
  // An answer the executor encoded from staging is sent as it is; an error answer is
  // serialized here, on the answering thread, as a typed StartWrite would at its call.
  absl::Status serialized;
  if (status.ok()) {
    absl::StatusOr<grpc::ByteBuffer> reply = DecodeReply(call->encoded);
    serialized = reply.status();
    if (reply.ok()) call->reply.Swap(&*reply);
  } else {
    serialized = SerializeReply(*call->response, &call->reply);
  }
  if (!serialized.ok()) spdlog::error("DecodeStream: {}", serialized.ToString());

  std::lock_guard<std::mutex> lock(mu_);
  if (!serialized.ok()) {  // a bug: end the stream with INTERNAL
    internal_error_ = true;
    reads_done_ = true;
  }
  --pending_;
  last_answer_ = Clock::now();
  if (!finished_ && !write_failed_ && serialized.ok()) {
    writes_.push_back(std::move(call));
    if (!writing_) {
      writing_ = true;
      StartWrite(&writes_.front()->reply);
    }
  } else {
    RecycleLocked(std::move(call));
  }
  MaybeResumeReadLocked();
  MaybeFinishLocked();
}

void DecodeStreamReactor::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ok) env_.metrics->ObserveStreamAnswerSend(SecondsSince(writes_.front()->completed));
  RecycleLocked(std::move(writes_.front()));
  writes_.pop_front();
  if (!ok) {
    write_failed_ = true;  // the client went away; answers have nowhere to go
    writes_.clear();
  }
  if (!writes_.empty()) {
    StartWrite(&writes_.front()->reply);
  } else {
    writing_ = false;
  }
  MaybeResumeReadLocked();
  MaybeFinishLocked();
}

void DecodeStreamReactor::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  drained_ = true;
  reads_done_ = true;
  MaybeFinishLocked();
}

void DecodeStreamReactor::MaybeFinishLocked() {
  if (finished_ || !reads_done_ || pending_ > 0 || writing_) return;
  finished_ = true;
  if (internal_error_) {
    Finish(grpc::Status(grpc::StatusCode::INTERNAL, "internal error while running a batch"));
  } else if (drained_) {
    Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is draining"));
  } else {
    Finish(grpc::Status::OK);
  }
}

void DecodeStreamReactor::OnDone() {
  if (env_.on_done) env_.on_done(this);
  delete this;
}

}  // namespace sds::server
