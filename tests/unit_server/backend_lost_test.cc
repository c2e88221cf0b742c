// The executor's answer to a failed backend Run. A lost backend (server/backend.h,
// BackendLostError): the requests of the failed unit are answered UNAVAILABLE (a client retries
// them on another replica), the executor calls its hook once whatever the number of failed units
// (the server drains and exits on it), nothing is committed, and a plain backend error stays
// INTERNAL without calling the hook, and running out of memory stays RESOURCE_EXHAUSTED.
// A CPU backend does the work; a wrapper fails Run.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend.h"
#include "server/executor.h"
#include "sparse_decode/v1/decode.pb.h"
#include "tests/unit_server/cpu_stack.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

// The CPU backend, except that Run returns `failure` while it is not OK.
class FailingBackend final : public Backend {
 public:
  explicit FailingBackend(Backend* inner) : inner_(inner) {}
  std::string name() const override { return inner_->name(); }
  PagedKvCache& cache() override { return inner_->cache(); }
  void* AllocateStaging(size_t bytes) override { return inner_->AllocateStaging(bytes); }
  void FreeStaging(void* ptr) override { inner_->FreeStaging(ptr); }
  absl::Status Run(const BatchWork& work, BatchTiming* timing) override {
    if (!failure.ok()) return failure;
    return inner_->Run(work, timing);
  }
  absl::Status failure;

 private:
  Backend* inner_;
};

// A prefill of 2 tokens (bf16 ones) of layer 0 into `sequence`, created here.
AppendWork Prefill(PagedKvCache& cache, const std::string& sequence, v1::AppendKVRequest* request) {
  EXPECT_TRUE(cache.CreateSequence(sequence, 0).ok());
  request->set_sequence_id(sequence);
  for (v1::Tensor* t : {request->mutable_k(), request->mutable_v()}) {
    t->set_dtype(v1::BF16);
    for (int64_t dim : {2, 1, 64}) t->add_shape(dim);
    std::string bytes;
    for (int i = 0; i < 2 * 64; ++i) bytes += std::string("\x80\x3f", 2);  // bf16 1.0
    t->set_data(bytes);
  }
  AppendWork work;
  work.key = sequence;
  work.sequence_id = request->sequence_id();
  work.num_tokens = 2;
  work.k = request->k().data().data();
  work.v = request->v().data().data();
  return work;
}

TEST(BackendLostTest, AnsweredUnavailableAndTheHookRunsOnce) {
  server_test::CpuStack stack;
  ASSERT_TRUE(stack.Init().ok());
  FailingBackend backend(stack.backend.get());
  auto executor = Executor::Create(&backend, stack.metrics.get(), stack.model);
  ASSERT_TRUE(executor.ok()) << executor.status();
  std::atomic<int> hooks{0};
  (*executor)->OnBackendLost([&hooks](const absl::Status& s) {
    EXPECT_TRUE(IsBackendLost(s)) << s;
    ++hooks;
  });
  PagedKvCache& cache = stack.backend->cache();

  // A plain failure: INTERNAL, no hook, nothing written.
  backend.failure = absl::InternalError("a launch failed");
  v1::AppendKVRequest first;
  auto plain = (*executor)->RunAppend(Prefill(cache, "plain", &first));
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kInternal) << plain.status();
  EXPECT_EQ(hooks, 0);

  // The backend is lost: UNAVAILABLE, the hook once over two failed units.
  backend.failure = BackendLostError("CUDA context lost (cudaErrorIllegalAddress)");
  for (const char* id : {"a", "b"}) {
    v1::AppendKVRequest request;
    auto lost = (*executor)->RunAppend(Prefill(cache, id, &request));
    EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
    EXPECT_NE(lost.status().message().find("cudaErrorIllegalAddress"), std::string::npos)
        << lost.status();
    auto length = cache.Length(id, 0);
    ASSERT_TRUE(length.ok()) << length.status();
    EXPECT_EQ(*length, 0) << "a failed prefill committed tokens";
  }
  EXPECT_EQ(hooks, 1);

  // Out of memory stays RESOURCE_EXHAUSTED (retry later or smaller), no hook.
  backend.failure = absl::ResourceExhaustedError("cannot grow the page table buffer");
  v1::AppendKVRequest last;
  auto exhausted = (*executor)->RunAppend(Prefill(cache, "c", &last));
  EXPECT_EQ(exhausted.status().code(), absl::StatusCode::kResourceExhausted) << exhausted.status();
  EXPECT_EQ(hooks, 1);

  // The marker is what decides: the same code without it is an ordinary error.
  EXPECT_FALSE(IsBackendLost(absl::UnavailableError("busy")));
  EXPECT_TRUE(IsBackendLost(BackendLostError("lost")));
}

}  // namespace
}  // namespace sds::server
