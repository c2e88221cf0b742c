// The server stack that the batcher and service tests build on the CPU backend: the
// backend with its metrics and executor, and the staging buffers a Batcher takes.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "server/backend.h"
#include "server/executor.h"
#include "server/metrics.h"
#include "server/model_shape.h"
#include "server/staging.h"

namespace sds::server::server_test {

// Declare it before the Batcher that uses its executor, so that the Batcher is
// destroyed first.
struct CpuStack {
  // Builds the backend from `config`, the executor for `model`, and three staging
  // buffers for `model` and config.max_batch_size (two concurrent batches and one filling).
  absl::Status Init() {
    auto created = CreateCpuBackend(config);
    if (!created.ok()) return created.status();
    backend = *std::move(created);
    metrics = std::make_unique<Metrics>(BuildInfo{});
    auto made = Executor::Create(backend.get(), metrics.get(), model);
    if (!made.ok()) return made.status();
    executor = *std::move(made);
    staging.clear();
    for (int i = 0; i < 3; ++i) {
      auto buffer = StagingBuffer::Create(backend.get(), model, config.max_batch_size);
      if (!buffer.ok()) return buffer.status();
      staging.push_back(*std::move(buffer));
    }
    return absl::OkStatus();
  }

  // The staging buffers of Init, for the Batcher to take.
  std::vector<std::unique_ptr<StagingBuffer>> TakeStaging() { return std::move(staging); }

  // One layer, 2 query heads on 1 KV head, D 64; one CPU thread.
  BackendConfig config = {.cache = {.num_layers = 1,
                                    .num_kv_heads = 1,
                                    .head_dim = 64,
                                    .page_size = 16,
                                    .num_pages = 64,
                                    .scale_mode = ScaleMode::kPerTensor,
                                    .layer_k_scales = {},
                                    .layer_v_scales = {}},
                          .num_q_heads = 2,
                          .max_batch_size = 8,
                          .max_topk = 16,
                          .cpu_threads = 1};
  ModelShape model = {1, 2, 1, 64, 16};

  std::unique_ptr<Backend> backend;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Executor> executor;
  std::vector<std::unique_ptr<StagingBuffer>> staging;
};

}  // namespace sds::server::server_test
