#include "server/service.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/auth.h"
#include "server/raw_call.h"
#include "server/rpc_util.h"
#include "server/serve_call.h"
#include "server/stream_reactor.h"
#include "server/validate.h"
#include "spdlog/spdlog.h"

namespace sds::server {

namespace v1 = sparse_decode::v1;

namespace {

constexpr char kDecodeBatchRpc[] = "DecodeBatch";

// First arena block of one decode call: the bytes of its tensors at this model shape
// (bf16 q, gate, k, v and out; int32 indices at max_topk per KV head; lse) plus 2 KB.
// Generous now: the request's tensor data stays in the received slices (wire_decode.h)
// and the answer's out and lse go into their own slice (response_wire.h), so the arena
// holds only the small fields; one block per call either way.
size_t DecodeCallBytes(const ModelShape& m) {
  const size_t q = size_t{2} * m.num_q_heads * m.head_dim;
  const size_t kv = size_t{2} * m.num_kv_heads * m.head_dim;
  const size_t indices = size_t{4} * m.max_topk * m.num_kv_heads;
  return 3 * q + 2 * kv + indices + size_t{4} * m.num_q_heads + 2048;
}

// A Decode call as the batcher sees it: its one item, and its answer encoded into the
// reply straight from the executor's rows. Keeps itself alive until its item is done.
class UnaryDecodeCall final : public DecodeSink {
 public:
  UnaryDecodeCall(size_t arena_bytes, const AnswerEncoder* encoder, grpc::ByteBuffer* reply,
                  Finisher finished)
      : raw(arena_bytes), encoder_(encoder), reply_(reply), finished_(finished) {}

  absl::Status Write(int32_t, const BatchInfo& batch, const uint16_t* out,
                     const float* lse) override {
    encoder_->Encode(raw.request()->request_id(), batch, out, lse, raw.encoded(0));
    return absl::OkStatus();
  }
  void Done(absl::Span<DecodeItem* const>, absl::Span<const absl::Status> status) override {
    std::shared_ptr<UnaryDecodeCall> self = std::move(self_);  // freed on return
    finished_(status[0].ok() ? raw.Reply(reply_) : status[0]);
  }
  void KeepUntilDone(std::shared_ptr<UnaryDecodeCall> self) { self_ = std::move(self); }

  RawCall<v1::DecodeRequest, v1::DecodeResponse> raw;
  DecodeItem item;

 private:
  const AnswerEncoder* encoder_;
  grpc::ByteBuffer* reply_;
  Finisher finished_;
  std::shared_ptr<UnaryDecodeCall> self_;
};

// A DecodeBatch call: its items, each answered in its own slot of the reply (encoded
// from the executor's rows, or the item's error), the reply sent when the last is done.
class BatchDecodeCall final : public DecodeSink {
 public:
  BatchDecodeCall(size_t arena_bytes, const AnswerEncoder* encoder, Metrics* metrics,
                  grpc::ByteBuffer* reply, Finisher finished)
      : raw(arena_bytes),
        encoder_(encoder),
        metrics_(metrics),
        reply_(reply),
        finished_(finished) {}

  // After Parse: every item and response slot exists before the first can complete.
  void Prepare() {
    const int n = raw.request()->requests_size();
    items.resize(n);
    for (int i = 0; i < n; ++i) raw.response()->add_responses();
    remaining_.store(n);
  }
  absl::Status Write(int32_t index, const BatchInfo& batch, const uint16_t* out,
                     const float* lse) override {
    encoder_->Encode(raw.request()->requests(index).request_id(), batch, out, lse,
                     raw.encoded(index));
    return absl::OkStatus();
  }
  void Done(absl::Span<DecodeItem* const> done, absl::Span<const absl::Status> status) override {
    for (size_t i = 0; i < done.size(); ++i) {
      if (status[i].ok()) continue;
      const int index = done[i]->index;
      raw.encoded(index)->bytes = grpc::Slice();  // the typed error answer goes out instead
      v1::DecodeResponse* slot = raw.response()->mutable_responses(index);
      slot->Clear();
      slot->set_request_id(raw.request()->requests(index).request_id());
      slot->set_error_code(static_cast<int32_t>(status[i].code()));
      slot->set_error_message(std::string(status[i].message()));
    }
    CountCodes(status);
    if (remaining_.fetch_sub(static_cast<int>(done.size())) == static_cast<int>(done.size())) {
      std::shared_ptr<BatchDecodeCall> self = std::move(self_);  // freed on return
      finished_(raw.Reply(reply_));
    }
  }
  void KeepUntilDone(std::shared_ptr<BatchDecodeCall> self) { self_ = std::move(self); }

  RawCall<v1::DecodeBatchRequest, v1::DecodeBatchResponse> raw;
  std::vector<DecodeItem> items;

 private:
  // Items counted once per code and completion: a metrics lock per unit, not per item.
  void CountCodes(absl::Span<const absl::Status> status) {
    size_t ok = 0;
    for (const absl::Status& s : status) ok += s.ok() ? 1 : 0;
    if (ok > 0) metrics_->CountRequests(kDecodeBatchRpc, absl::StatusCode::kOk, ok);
    for (const absl::Status& s : status)
      if (!s.ok()) metrics_->CountRequest(kDecodeBatchRpc, s.code());
  }

  const AnswerEncoder* encoder_;
  Metrics* metrics_;
  grpc::ByteBuffer* reply_;
  Finisher finished_;
  std::atomic<int> remaining_{0};
  std::shared_ptr<BatchDecodeCall> self_;
};

absl::Status NotFound(const std::string& sequence_id) {
  return absl::NotFoundError(
      absl::StrCat("sequence '", sequence_id, "' not found; call CreateSequence first"));
}

}  // namespace

DecodeServiceImpl::DecodeServiceImpl(ServiceConfig config, Backend* backend, Batcher* batcher,
                                     Metrics* metrics)
    : config_(std::move(config)),
      backend_(backend),
      batcher_(batcher),
      metrics_(metrics),
      encoder_(config_.model),
      regions_(config_.region_limits),
      admission_(batcher, &backend->cache(), &pending_) {
  if (config_.answer_threads > 0)
    answer_pool_ = std::make_unique<TaskPool>(config_.answer_threads, "sds-answer");
}

absl::StatusOr<std::string> DecodeServiceImpl::Admit(
    const grpc::CallbackServerContext& context) const {
  if (draining_.load()) return absl::UnavailableError("server is draining");
  return config_.auth.TenantOf(context);
}

void DecodeServiceImpl::StartDraining() {
  draining_.store(true);
  std::lock_guard<std::recursive_mutex> lock(streams_mu_);
  const std::vector<DecodeStreamReactor*> open(streams_.begin(), streams_.end());
  for (DecodeStreamReactor* stream : open) stream->Drain();
}

grpc::ServerUnaryReactor* DecodeServiceImpl::GetModelInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* wire,
                                                          grpc::ByteBuffer* reply) {
  return ServeTyped<v1::GetModelInfoRequest, v1::ModelInfo>(
      context, metrics_, "GetModelInfo", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::GetModelInfoRequest&, v1::ModelInfo* response,
          const auto& finish) {
        *response = config_.info;
        const CacheStats stats = backend_->cache().Stats();
        response->set_total_pages(stats.pages_total);
        response->set_free_pages(stats.pages_free);
        const CacheStats own = backend_->cache().TenantStats(tenant);
        response->set_tenant(tenant);
        response->set_tenant_sequences(own.sequences);
        response->set_tenant_pages_used(own.pages_used);
        response->set_tenant_max_sequences(backend_->cache().config().max_sequences_per_tenant);
        response->set_tenant_max_pages(backend_->cache().config().max_pages_per_tenant);
        finish(absl::OkStatus());
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::CreateSequence(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* wire,
                                                            grpc::ByteBuffer* reply) {
  return ServeTyped<v1::CreateSequenceRequest, v1::CreateSequenceResponse>(
      context, metrics_, "CreateSequence", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::CreateSequenceRequest& request,
          v1::CreateSequenceResponse* response, const auto& finish) {
        const std::string& id = request.sequence_id();
        if (absl::Status s = ValidateSequenceId(id, "sequence_id"); !s.ok()) return finish(s);
        if (request.reserve_tokens() < 0) {
          return finish(absl::InvalidArgumentError(
              absl::StrCat("reserve_tokens ", request.reserve_tokens(), " must be >= 0")));
        }
        const std::string key = SequenceKey(tenant, id);
        absl::Status s = backend_->cache().CreateSequence(key, request.reserve_tokens(), tenant);
        if (s.code() == absl::StatusCode::kAlreadyExists) {
          s = absl::AlreadyExistsError(absl::StrCat("sequence '", id, "' already exists"));
        }
        // RESOURCE_EXHAUSTED as the cache words it: the pool ("KV cache full") or the
        // tenant's limit, each naming what ran out.
        if (s.ok()) {
          const int64_t page = config_.info.page_size();
          response->set_reserved_pages((request.reserve_tokens() + page - 1) / page);
        }
        finish(ForCaller(s, key, id));
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::AppendKV(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* wire,
                                                      grpc::ByteBuffer* reply) {
  return ServeTyped<v1::AppendKVRequest, v1::AppendKVResponse>(
      context, metrics_, "AppendKV", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::AppendKVRequest& request,
          v1::AppendKVResponse* response, const auto& finish) {
        if (absl::Status s = ValidateAppend(request, config_.model); !s.ok()) return finish(s);
        AppendWork work;
        work.key = SequenceKey(tenant, request.sequence_id());
        work.sequence_id = request.sequence_id();
        const int32_t layer = request.layer();
        const int64_t n = request.k().shape(0);
        work.layer = layer;
        work.start_position = request.start_position();
        work.num_tokens = n;
        work.k = request.k().data().data();
        work.v = request.v().data().data();
        if (absl::Status s =
                pending_.CheckStart(backend_->cache(), work.key, layer, request.start_position(),
                                    request.sequence_id(), &work.incarnation);
            !s.ok()) {
          return finish(s);
        }
        // Counted until the queued work's `done` takes the count over; taken back here on
        // a refusal or an exception before that.
        PendingHold hold(&pending_, work.key, layer, n);
        work.deadline = DeadlineOf(*context);
        work.cancelled = [context] { return context->IsCancelled(); };
        work.done = [this, finish, response, key = work.key, layer,
                     n](absl::StatusOr<int64_t> length) {
          pending_.Remove(key, layer, n);
          if (length.ok()) response->set_length(*length);
          finish(length.status());
        };
        if (absl::Status s = batcher_->SubmitAppend(std::move(work)); !s.ok()) {
          hold.Undo();
          return finish(s);
        }
        hold.Release();
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::Decode(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* wire,
                                                    grpc::ByteBuffer* reply) {
  return Serve(
      context, metrics_, "Decode", Admit(*context),
      [&](const std::string& tenant, const Finisher& finished) {
        auto call = std::make_shared<UnaryDecodeCall>(DecodeCallBytes(config_.model), &encoder_,
                                                      reply, finished);
        absl::Status s = call->raw.Parse(*wire);
        if (s.ok()) {
          s = ValidateDecode(*call->raw.request(), call->raw.bytes(0), config_.model, &call->item);
        }
        if (!s.ok()) return finished(s);
        call->item.key = SequenceKey(tenant, call->item.sequence_id);
        call->KeepUntilDone(call);
        // An idle batcher may leave the batch to this thread
        // (--inline_idle_batches): it runs when `run` does.
        Batcher::SubmitterRun run;
        DecodeItem* item = &call->item;
        UnaryDecodeCall* sink = call.get();
        call.reset();  // the call keeps itself until its item is done
        admission_.Submit(
            {&item, 1}, sink, DeadlineOf(*context), [context] { return context->IsCancelled(); },
            /*whole_batch=*/false, &run);
        // The request is answered through the call now: an exception reaching Serve
        // would finish the call a second time.
        try {
          run.Run();
        } catch (const std::exception& e) {
          spdlog::critical("Decode: exception while running a claimed batch: {}", e.what());
        }
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::DecodeBatch(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* wire,
                                                         grpc::ByteBuffer* reply) {
  return Serve(
      context, metrics_, kDecodeBatchRpc, Admit(*context),
      [&](const std::string& tenant, const Finisher& finished) {
        auto call = std::make_shared<BatchDecodeCall>(8 * DecodeCallBytes(config_.model), &encoder_,
                                                      metrics_, reply, finished);
        if (absl::Status s = call->raw.Parse(*wire, config_.max_decode_batch_items); !s.ok()) {
          metrics_->CountRequest(kDecodeBatchRpc, s.code());  // no item to count it
          return finished(s);
        }
        const v1::DecodeBatchRequest& request = *call->raw.request();
        const int n = request.requests_size();
        if (n == 0) return finished(call->raw.Reply(reply));
        // Its items are checked and staged before the batch runs: time for the backend's
        // idle threads to wake (--cpu_prewake_us). Rows: K (the indices' last dimension,
        // either form; not checked yet, so clamped to [0, max_topk]) x Hkv per request.
        int64_t gathered_rows = 0;
        for (int i = 0; i < n; ++i) {
          const v1::Tensor& indices = request.requests(i).indices();
          if (indices.shape_size() == 0) continue;
          const int64_t k = std::clamp<int64_t>(indices.shape(indices.shape_size() - 1), 0,
                                                config_.model.max_topk);
          gathered_rows += k * config_.model.num_kv_heads;
        }
        backend_->Prewake(gathered_rows);
        call->Prepare();
        call->KeepUntilDone(call);
        BatchDecodeCall* sink = call.get();
        // Checked first, every item; the valid ones are queued in one step, so that (with
        // --eager_batching) an idle backend does not start on the first items while the
        // rest are still checked.
        std::vector<DecodeItem*> valid;
        std::vector<DecodeItem*> invalid;
        std::vector<absl::Status> invalid_status;
        valid.reserve(n);
        for (int i = 0; i < n; ++i) {
          DecodeItem& item = sink->items[i];
          item.index = i;
          absl::Status s =
              ValidateDecode(request.requests(i), sink->raw.bytes(i), config_.model, &item);
          if (s.ok()) {
            item.key = SequenceKey(tenant, item.sequence_id);
            valid.push_back(&item);
          } else {
            invalid.push_back(&item);
            invalid_status.push_back(std::move(s));
          }
        }
        call.reset();  // the call keeps itself until its last item is done
        if (!invalid.empty()) sink->Done(invalid, invalid_status);
        admission_.Submit(
            valid, sink, DeadlineOf(*context), [context] { return context->IsCancelled(); },
            /*whole_batch=*/true);
      },
      /*count_rpc=*/false);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeServiceImpl::DecodeStream(
    grpc::CallbackServerContext* context) {
  DecodeStreamReactor::Env env;
  env.admission = &admission_;
  env.encoder = &encoder_;
  env.model = &config_.model;
  env.metrics = metrics_;
  env.draining = &draining_;
  env.call_bytes = DecodeCallBytes(config_.model);
  env.answer_pool = answer_pool_.get();
  env.max_unanswered = config_.max_unanswered_per_stream;
  env.on_done = [this](DecodeStreamReactor* stream) {
    std::lock_guard<std::recursive_mutex> lock(streams_mu_);
    streams_.erase(stream);
    active_streams_.fetch_sub(1);
  };
  std::lock_guard<std::recursive_mutex> lock(streams_mu_);
  auto* stream = new DecodeStreamReactor(context, std::move(env), Admit(*context));
  streams_.insert(stream);
  active_streams_.fetch_add(1);
  return stream;
}

grpc::ServerUnaryReactor* DecodeServiceImpl::ForkSequence(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* wire,
                                                          grpc::ByteBuffer* reply) {
  return ServeTyped<v1::ForkSequenceRequest, v1::ForkSequenceResponse>(
      context, metrics_, "ForkSequence", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::ForkSequenceRequest& request,
          v1::ForkSequenceResponse*, const auto& finish) {
        const std::string& src_id = request.sequence_id();
        const std::string& dst_id = request.new_sequence_id();
        if (absl::Status s = ValidateSequenceId(src_id, "sequence_id"); !s.ok()) return finish(s);
        if (absl::Status s = ValidateSequenceId(dst_id, "new_sequence_id"); !s.ok()) {
          return finish(s);
        }
        const std::string src = SequenceKey(tenant, src_id);
        const std::string dst = SequenceKey(tenant, dst_id);
        ControlWork work;
        // Runs between batches in queue order, so the fork sees every write queued before
        // it; not at all once the caller gave up (deadline, cancel), or a retry would find
        // the new sequence there and fail ALREADY_EXISTS.
        work.run = [this, src, dst, src_id, dst_id]() -> absl::Status {
          absl::Status s = backend_->cache().ForkSequence(src, dst);
          if (s.ok()) return s;
          if (s.code() == absl::StatusCode::kNotFound) return NotFound(src_id);
          if (s.code() == absl::StatusCode::kAlreadyExists) {
            return absl::AlreadyExistsError(absl::StrCat("sequence '", dst_id, "' already exists"));
          }
          // Other codes (e.g. RESOURCE_EXHAUSTED): the message may name the keys.
          return absl::Status(s.code(),
                              absl::StrReplaceAll(s.message(), {{src, src_id}, {dst, dst_id}}));
        };
        work.deadline = DeadlineOf(*context);
        work.cancelled = [context] { return context->IsCancelled(); };
        work.done = finish;
        if (absl::Status s = batcher_->SubmitControl(std::move(work)); !s.ok()) finish(s);
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::ReleaseSequence(grpc::CallbackServerContext* context,
                                                             const grpc::ByteBuffer* wire,
                                                             grpc::ByteBuffer* reply) {
  return ServeTyped<v1::ReleaseSequenceRequest, v1::ReleaseSequenceResponse>(
      context, metrics_, "ReleaseSequence", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::ReleaseSequenceRequest& request,
          v1::ReleaseSequenceResponse* response, const auto& finish) {
        const std::string& id = request.sequence_id();
        if (absl::Status s = ValidateSequenceId(id, "sequence_id"); !s.ok()) return finish(s);
        const std::string key = SequenceKey(tenant, id);
        ControlWork work;
        // Runs between batches, ahead of queued decodes: no launched batch can read the
        // freed pages, and the sequence's queued decodes fail NOT_FOUND at PrepareWrite.
        // Not at all once the caller gave up (deadline, cancel): it may retry or still use
        // the sequence.
        work.run = [this, response, key, id]() -> absl::Status {
          absl::StatusOr<int64_t> freed = backend_->cache().ReleaseSequence(key);
          if (freed.ok()) {
            response->set_freed_pages(*freed);
            return absl::OkStatus();
          }
          if (freed.status().code() == absl::StatusCode::kNotFound) return NotFound(id);
          return ForCaller(freed.status(), key, id);
        };
        work.deadline = DeadlineOf(*context);
        work.cancelled = [context] { return context->IsCancelled(); };
        work.done = finish;
        if (absl::Status s = batcher_->SubmitControl(std::move(work), /*urgent=*/true); !s.ok()) {
          finish(s);
        }
      });
}

}  // namespace sds::server
