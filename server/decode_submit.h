// Admission of one decode request: validation, tenancy, existence, position gap (see
// pending_writes.h), then the queue.
// Shared by Decode, DecodeBatch and DecodeStream.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "paged_cache/paged_kv_cache.h"
#include "server/batcher.h"
#include "server/model_shape.h"
#include "server/pending_writes.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

class DecodeAdmission {
 public:
  DecodeAdmission(Batcher* batcher, const PagedKvCache* cache, PendingWrites* pending,
                  const ModelShape& model)
      : batcher_(batcher), cache_(cache), pending_(pending), model_(model) {}

  // On error nothing was queued and `done` will not be called. `request`, the data
  // that `bytes` views (tensor_bytes.h), `response` and `encoded` (required: see
  // DecodeWork::encoded) must stay alive until `done` has run. `claim`: see
  // Batcher::SubmitDecode.
  absl::Status Submit(const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
                      const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
                      EncodedResponse* encoded, Clock::time_point deadline,
                      std::function<bool()> cancelled,
                      std::function<void(const absl::Status&)> done,
                      Batcher::SubmitterRun* claim = nullptr) const;

  // The checks of Submit without the queue: on OK `work` is ready for SubmitAll (and
  // counted as pending); on error nothing changed and `done` will not be called.
  absl::Status Prepare(const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
                       const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
                       EncodedResponse* encoded, Clock::time_point deadline,
                       std::function<bool()> cancelled,
                       std::function<void(const absl::Status&)> done, DecodeWork* work) const;
  // Queues prepared items in one step (the last one closes the batch under eager
  // batching, so a DecodeBatch call's items stay together); an item the queue refuses
  // is answered through its `done` at once.
  void SubmitAll(std::vector<DecodeWork> works) const;

 private:
  // The checks; on OK `work` is ready and its pending count is in `hold` (the caller
  // releases it to the work's `done` once the work is queued, or lets it undo).
  absl::Status Admit(const std::string& tenant, const sparse_decode::v1::DecodeRequest* request,
                     const DecodeTensorBytes& bytes, sparse_decode::v1::DecodeResponse* response,
                     EncodedResponse* encoded, Clock::time_point deadline,
                     std::function<bool()> cancelled, std::function<void(const absl::Status&)> done,
                     DecodeWork* work, PendingHold* hold) const;

  Batcher* batcher_;
  const PagedKvCache* cache_;
  PendingWrites* pending_;
  ModelShape model_;
};

}  // namespace sds::server
