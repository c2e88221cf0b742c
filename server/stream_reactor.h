// DecodeStream: a bidi reactor that keeps reading while earlier requests are still in
// the batcher. Responses are written in completion order (clients match them by
// request_id); at most one write is outstanding, the rest wait in a small queue.
// Raw, like Decode and DecodeBatch: each message is parsed from its received slices
// (wire_decode.h), whose tensor bytes go straight into the staging buffer; a message
// that is not a valid encoding is answered with INVALID_ARGUMENT in its response.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/arena.h"
#include "server/decode_submit.h"
#include "server/metrics.h"
#include "server/model_shape.h"
#include "server/response_wire.h"
#include "server/task_pool.h"
#include "server/tensor_bytes.h"
#include "server/wire_decode.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

class DecodeStreamReactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  struct Env {
    const DecodeAdmission* admission = nullptr;
    const AnswerEncoder* encoder = nullptr;  // the answers (response_wire.h)
    const ModelShape* model = nullptr;       // the requests' checks
    Metrics* metrics = nullptr;
    const std::atomic<bool>* draining = nullptr;
    std::function<void(DecodeStreamReactor*)> on_done;  // called once, before deletion
    size_t call_bytes = 64 * 1024;    // first arena block of a message (DecodeCallBytes)
    TaskPool* answer_pool = nullptr;  // writes answers of multi-request batches; may be null
    // Requests read but not yet written back; beyond this the stream stops reading until
    // the client has taken half of its answers. Bounds a slow reader's memory.
    int64_t max_unanswered = 4096;
  };

  // Starts reading. When `admit` is not OK the stream finishes with it at once.
  DecodeStreamReactor(grpc::CallbackServerContext* context, Env env,
                      absl::StatusOr<std::string> tenant);

  // Stops reading; finishes with UNAVAILABLE ("server is draining") once the requests
  // already read have been answered.
  void Drain();

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // One message's request and response, on an arena whose first block (sized for the
  // model's largest request and its response) belongs to the call. Calls are recycled
  // by resetting the arena, which keeps that block: after warm-up a message costs no
  // allocation. (Clear() on heap messages does not keep capacity: it deletes every
  // Tensor sub-message, so each message cost about 30 mallocs and frees.)
  // It is also the message's DecodeSink: its answer is encoded from the executor's rows,
  // and its completion goes to the stream.
  struct Call final : DecodeSink {
    Call(DecodeStreamReactor* stream, size_t bytes);
    absl::Status Write(int32_t index, const BatchInfo& batch, const uint16_t* out,
                       const float* lse) override;
    void Done(absl::Span<DecodeItem* const> items, absl::Span<const absl::Status> status) override;
    void Reset();  // fresh, empty messages in the same first block, no slices held
    // Parses `received` into request and bytes (INVALID_ARGUMENT when malformed).
    absl::Status Parse();

    std::unique_ptr<char[]> block;  // the arena's first block; outlives the arena
    google::protobuf::Arena arena;
    grpc::ByteBuffer received;                            // StartRead's message
    WireMessage wire;                                     // its slices, which `bytes` views
    sparse_decode::v1::DecodeRequest* request = nullptr;  // on arena; tensor data in `bytes`
    DecodeTensorBytes bytes;
    DecodeItem item;                                        // the request as admission takes it
    sparse_decode::v1::DecodeResponse* response = nullptr;  // on arena: an error answer
    int32_t batch_size = 0;                                 // of the batch that answered it
    EncodedResponse encoded;  // the executor's answer (response_wire.h), when OK
    grpc::ByteBuffer reply;   // the answer as StartWrite sends it
    Clock::time_point start;
    Clock::time_point completed;  // its batch finished (or it was refused): see OnWriteDone

   private:
    DecodeStreamReactor* stream_;
    static google::protobuf::ArenaOptions Options(char* block, size_t bytes);
    void CreateMessages();
  };

  void Submit(Call* call, Batcher::SubmitterRun* run);
  // The batch's completion of `call`: answers of a batch of two or more requests go to
  // the answer pool, when there is one (writing inline is gRPC's transport write on this
  // thread, once per request); a batch of one is answered here (no hand-off on the
  // one-stream path).
  void Completed(Call* call, const absl::Status& status);
  // Takes ownership back from the batcher (or from Submit on a refusal).
  void Answer(Call* call, const absl::Status& status);
  void StartNextReadLocked();                      // requires mu_
  void RecycleLocked(std::unique_ptr<Call> call);  // requires mu_
  void MaybeFinishLocked();                        // requires mu_
  void MaybeResumeReadLocked();                    // requires mu_

  static constexpr size_t kMaxFreeCalls = 8;
  // A request read this soon after this stream's last answer was sent came in a burst:
  // no gRPC client reads an answer and sends its next request this fast (on loopback a
  // round trip takes 50 us or more), so the client pipelines (sticky for the stream).
  static constexpr std::chrono::microseconds kPipelinedWithin{25};

  grpc::CallbackServerContext* const context_;
  const Env env_;
  std::string tenant_;

  // The reactions of one call never run inline in the Start* calls, so they may be
  // issued under mu_; that keeps "no operation after Finish" easy to see.
  std::mutex mu_;
  std::unique_ptr<Call> reading_;                  // the call StartRead fills
  std::deque<std::unique_ptr<Call>> writes_;       // answered; front() is being written
  std::vector<std::unique_ptr<Call>> free_calls_;  // cleared, ready for reuse
  int64_t pending_ = 0;                            // submitted, not yet answered
  bool reads_done_ = false;
  bool read_paused_ = false;
  bool writing_ = false;
  Clock::time_point last_answer_;  // when the last request was answered
  bool pipelining_ = false;        // a request came within kPipelinedWithin (see OnReadDone)
  bool write_failed_ = false;
  bool drained_ = false;
  bool internal_error_ = false;  // a bug was caught: finish with INTERNAL
  bool finished_ = false;
};

}  // namespace sds::server
