// The CPU backend: a PagedKvCache in host memory, CpuAppend then CpuDecode on a
// persistent thread pool, timed with a steady clock.
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu_append.h"
#include "kernels/cpu_attention.h"
#include "kernels/cpu_thread_pool.h"
#include "server/backend.h"

namespace sds {
namespace {

constexpr size_t kStagingAlignment = 64;

class CpuBackend : public Backend {
 public:
  CpuBackend(std::unique_ptr<PagedKvCache> cache, int threads, int32_t num_q_heads,
             int32_t prewake_us)
      : cache_(std::move(cache)),
        pool_(threads),
        num_q_heads_(num_q_heads),
        prewake_us_(prewake_us) {}

  std::string name() const override { return "cpu"; }
  PagedKvCache& cache() override { return *cache_; }

  void* AllocateStaging(size_t bytes) override {
    const size_t rounded = (bytes + kStagingAlignment - 1) / kStagingAlignment * kStagingAlignment;
    return std::aligned_alloc(kStagingAlignment, rounded == 0 ? kStagingAlignment : rounded);
  }
  void FreeStaging(void* ptr) override { std::free(ptr); }

  // Wakes the pool only for a batch that CpuDecode will spread over it.
  void Prewake(int64_t gathered_rows) override {
    if (prewake_us_ > 0 && gathered_rows >= CpuDecodeMinPooledRows()) pool_.Prewake(prewake_us_);
  }

  absl::Status Run(const BatchWork& work, BatchTiming* timing) override {
    const CacheView view = cache_->view();
    if (work.decode.num_requests > 0 && work.decode.device_rows != nullptr) {
      return absl::InternalError("CPU backend: a batch with rows in device memory");
    }
    if (work.decode.num_requests > 0 && work.decode.num_q_heads != num_q_heads_) {
      return absl::InternalError(
          "CPU backend: decode batch has " + std::to_string(work.decode.num_q_heads) +
          " query heads, backend was configured for " + std::to_string(num_q_heads_));
    }
    // One batch at a time: the pool serves one job (max_concurrent_runs() is 1; a caller
    // that runs batches side by side anyway gets them one after the other).
    std::lock_guard<std::mutex> lock(run_mu_);
    const auto start = std::chrono::steady_clock::now();
    if (work.append.num_tokens > 0) CpuAppend(view, work.append);
    if (work.decode.num_requests > 0) CpuDecode(view, work.decode, &pool_);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    if (timing != nullptr) {
      timing->compute_us = std::chrono::duration_cast<std::chrono::microseconds>(elapsed).count();
    }
    return absl::OkStatus();
  }

 private:
  std::mutex run_mu_;
  std::unique_ptr<PagedKvCache> cache_;
  CpuThreadPool pool_;
  int32_t num_q_heads_;
  int32_t prewake_us_;  // 0: Prewake does nothing
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const BackendConfig& config) {
  const int32_t num_kv_heads = config.cache.num_kv_heads;
  if (config.num_q_heads <= 0 || num_kv_heads <= 0 || config.num_q_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError("num_q_heads (" + std::to_string(config.num_q_heads) +
                                      ") must be a positive multiple of num_kv_heads (" +
                                      std::to_string(num_kv_heads) + ")");
  }
  if (config.cpu_threads < 0) {
    return absl::InvalidArgumentError("cpu_threads must be >= 0 (0 = all cores), got " +
                                      std::to_string(config.cpu_threads));
  }
  if (config.cpu_prewake_us < 0 || config.cpu_prewake_us > kMaxCpuPrewakeUs) {
    return absl::InvalidArgumentError("cpu_prewake_us must be in [0, " +
                                      std::to_string(kMaxCpuPrewakeUs) + "] (0 = off), got " +
                                      std::to_string(config.cpu_prewake_us));
  }
  absl::StatusOr<std::unique_ptr<PagedKvCache>> cache =
      PagedKvCache::Create(config.cache, MakeHostPageMemory());
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<Backend>(new CpuBackend(*std::move(cache), config.cpu_threads,
                                                 config.num_q_heads, config.cpu_prewake_us));
}

}  // namespace sds
