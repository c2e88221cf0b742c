// Which thread runs a unit of batcher work (server/batcher.h):
// - the assembler runs a unit itself only when nothing else is queued, the executor is
//   idle and the unit is not a prefill; otherwise the executor thread runs it;
// - with run_on_submitter, a decode submitted into an idle batcher runs on the
//   submitting thread, and never while another unit runs.
// The units are real (CPU backend, executor, staging buffers); control work that blocks
// on a notification holds the assembler or the executor thread where a case needs it.
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/batcher.h"
#include "server/decode_submit.h"
#include "server/pending_writes.h"
#include "server/validate.h"
#include "sparse_decode/v1/decode.pb.h"
#include "tests/unit_server/cpu_stack.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

constexpr absl::Duration kWait = absl::Seconds(30);

std::string ThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

// Zero bf16 values: finite, so every request is valid.
void SetZeros(v1::Tensor* t, const std::vector<int64_t>& shape, int bytes_per_element) {
  t->set_dtype(bytes_per_element == 2 ? v1::BF16 : v1::INT32);
  int64_t n = 1;
  for (int64_t dim : shape) {
    t->add_shape(dim);
    n *= dim;
  }
  t->set_data(std::string(static_cast<size_t>(n) * bytes_per_element, '\0'));
}

// A valid decode request for `sequence` at `position`, attending to the new token only.
std::shared_ptr<v1::DecodeRequest> NewDecodeRequest(const std::string& sequence, int64_t position) {
  auto request = std::make_shared<v1::DecodeRequest>();
  request->set_sequence_id(sequence);
  request->set_position(position);
  SetZeros(request->mutable_q(), {2, 64}, 2);
  SetZeros(request->mutable_gate(), {2, 64}, 2);
  SetZeros(request->mutable_k(), {1, 64}, 2);
  SetZeros(request->mutable_v(), {1, 64}, 2);
  SetZeros(request->mutable_indices(), {1}, 4);
  request->mutable_indices()->set_data(
      std::string(reinterpret_cast<const char*>(&position), 4));  // little-endian
  return request;
}

// Runs `body` on a new thread named "test-submitter" and joins it.
template <class Body>
void OnSubmitterThread(Body body) {
  std::thread submitter([&] {
    pthread_setname_np(pthread_self(), "test-submitter");
    body();
  });
  submitter.join();
}

// Where and how one unit finished.
struct Record {
  absl::Notification done;
  std::string thread;
  absl::Status status;
  uint64_t batch_id = 0;  // of the batch that answered it (0: not answered)
};

// One decode as the batcher sees it: its request's data, its item, and its own sink,
// which finishes in `record` (and throws from Done when `throws`). It keeps itself alive
// until Done.
struct TestDecode final : DecodeSink {
  absl::Status Write(int32_t, const BatchInfo& batch, const uint16_t*, const float*) override {
    record->batch_id = batch.batch_id;
    return absl::OkStatus();
  }
  void Done(absl::Span<DecodeItem* const>, absl::Span<const absl::Status> status) override {
    std::shared_ptr<TestDecode> keep = std::move(self);
    if (throws) throw std::runtime_error("injected");
    record->thread = ThreadName();
    record->status = status[0];
    if (entered != nullptr) entered->Notify();
    if (release != nullptr) release->WaitForNotificationWithTimeout(kWait);
    record->done.Notify();
  }

  std::shared_ptr<v1::DecodeRequest> request;
  DecodeItem item;
  std::shared_ptr<Record> record = std::make_shared<Record>();
  bool throws = false;
  absl::Notification* entered = nullptr;
  absl::Notification* release = nullptr;
  std::shared_ptr<TestDecode> self;
};

// A checked decode of `sequence` at `position` (attending to the new token only) and the
// one-item unit that runs it.
std::shared_ptr<TestDecode> NewDecode(const ModelShape& model, const std::string& sequence,
                                      int64_t position) {
  auto d = std::make_shared<TestDecode>();
  d->request = NewDecodeRequest(sequence, position);
  const absl::Status valid =
      ValidateDecode(*d->request, DecodeBytesOf(*d->request), model, &d->item);
  EXPECT_TRUE(valid.ok()) << valid;
  d->item.key = sequence;
  return d;
}
DecodeWork UnitOf(const std::shared_ptr<TestDecode>& d) {
  DecodeWork work;
  work.items.push_back(&d->item);
  work.sink = d.get();
  d->self = d;
  return work;
}

// A multi-item call as DecodeBatch and DecodeLayer make one: its items (sequence,
// position), one sink for all of them, each item's outcome and batch, and how many
// times Done ran.
struct TestCall final : DecodeSink {
  TestCall(const ModelShape& model, const std::vector<std::pair<std::string, int64_t>>& specs) {
    for (const auto& [sequence, position] : specs) {
      requests.push_back(NewDecodeRequest(sequence, position));
      items.emplace_back();
      const absl::Status valid =
          ValidateDecode(*requests.back(), DecodeBytesOf(*requests.back()), model, &items.back());
      EXPECT_TRUE(valid.ok()) << valid;
      items.back().index = static_cast<int32_t>(items.size()) - 1;
      items.back().key = sequence;
    }
    status.resize(items.size(), absl::UnknownError("not answered"));
    batch_id.resize(items.size(), 0);
    remaining = static_cast<int>(items.size());
  }
  absl::Status Write(int32_t index, const BatchInfo& batch, const uint16_t*,
                     const float*) override {
    batch_id[index] = batch.batch_id;
    return absl::OkStatus();
  }
  void Done(absl::Span<DecodeItem* const> done_items,
            absl::Span<const absl::Status> done_status) override {
    for (size_t i = 0; i < done_items.size(); ++i) status[done_items[i]->index] = done_status[i];
    ++completions;
    remaining -= static_cast<int>(done_items.size());
    if (remaining == 0) done.Notify();
  }
  // The items [first, last) as one unit.
  DecodeWork Unit(size_t first, size_t last) {
    DecodeWork work;
    for (size_t i = first; i < last; ++i) work.items.push_back(&items[i]);
    work.sink = this;
    return work;
  }

  std::vector<std::shared_ptr<v1::DecodeRequest>> requests;
  std::deque<DecodeItem> items;  // stable addresses
  std::vector<absl::Status> status;
  std::vector<uint64_t> batch_id;
  std::atomic<int> completions{0};
  std::atomic<int> remaining{0};
  absl::Notification done;
};

class BatcherTest : public ::testing::Test {
 protected:
  void Start(bool run_on_submitter, std::chrono::microseconds idle_spin = {},
             std::chrono::microseconds max_queue_delay = std::chrono::milliseconds(50)) {
    const absl::Status built = stack_.Init();
    ASSERT_TRUE(built.ok()) << built;
    BatcherOptions options;
    options.max_batch_size = stack_.config.max_batch_size;
    options.max_queue_delay = max_queue_delay;
    options.eager = true;
    options.run_on_submitter = run_on_submitter;
    options.idle_spin = idle_spin;
    options.max_concurrent_batches = max_concurrent_batches_;
    options.after_unit_release_for_test = after_unit_release_;
    batcher_ = std::make_unique<Batcher>(options, stack_.executor.get(), stack_.TakeStaging());
    batcher_->Start();
  }

  void TearDown() override {
    if (batcher_) batcher_->Stop();
  }

  // BatcherOptions::after_unit_release_for_test and max_concurrent_batches of the next
  // Start.
  std::function<void()> after_unit_release_;
  int32_t max_concurrent_batches_ = 1;

  // A decode of `sequence` at `position` held inside its run (the executor's "still
  // wanted?" check) until `release`; `entered` when it got there.
  std::shared_ptr<Record> SubmitHeldDecode(const std::string& sequence, int64_t position,
                                           const std::shared_ptr<absl::Notification>& entered,
                                           absl::Notification* release) {
    return SubmitDecodeAt(
        {.sequence = sequence, .position = position, .cancelled = [entered, release] {
           if (!entered->HasBeenNotified()) {
             entered->Notify();
             release->WaitForNotificationWithTimeout(kWait);
           }
           return false;
         }});
  }

  // A decode at position 0 of a fresh sequence (attending to itself); it finishes in
  // the returned record. `deadline_passed`: the queue answers it DEADLINE_EXCEEDED.
  // `claim`: see Batcher::SubmitDecode.
  std::shared_ptr<Record> SubmitDecode(const std::string& sequence, bool deadline_passed = false,
                                       Batcher::SubmitterRun* claim = nullptr) {
    return SubmitDecodeAt(
        {.sequence = sequence, .deadline_passed = deadline_passed, .claim = claim});
  }

  struct DecodeSpec {
    std::string sequence;
    int64_t position = 0;  // 0 creates the sequence
    bool deadline_passed = false;
    std::function<bool()> cancelled = nullptr;  // DecodeWork::cancelled
    Batcher::SubmitterRun* claim = nullptr;
    // When set, `done` notifies `entered`, then waits for `release` before it returns:
    // it holds the thread that answers it.
    absl::Notification* entered = nullptr;
    absl::Notification* release = nullptr;
  };

  // A decode at `position` of `sequence`, attending to the new token only.
  std::shared_ptr<Record> SubmitDecodeAt(const DecodeSpec& spec) {
    if (spec.position == 0) {
      EXPECT_TRUE(stack_.backend->cache().CreateSequence(spec.sequence, 0).ok());
    }
    std::shared_ptr<TestDecode> d = NewDecode(stack_.model, spec.sequence, spec.position);
    d->entered = spec.entered;
    d->release = spec.release;
    DecodeWork work = UnitOf(d);
    if (spec.deadline_passed) work.deadline = Clock::now() - std::chrono::seconds(1);
    work.cancelled = spec.cancelled;
    std::shared_ptr<Record> record = d->record;
    EXPECT_TRUE(batcher_->SubmitDecode(std::move(work), spec.claim).ok());
    return record;
  }

  // A prefill of two tokens into a fresh sequence (AppendWork's deadline and cancelled
  // as given).
  std::shared_ptr<Record> SubmitPrefill(const std::string& sequence,
                                        Clock::time_point deadline = Clock::time_point::max(),
                                        std::function<bool()> cancelled = {}) {
    EXPECT_TRUE(stack_.backend->cache().CreateSequence(sequence, 0).ok());
    auto request = std::make_shared<v1::AppendKVRequest>();
    request->set_sequence_id(sequence);
    SetZeros(request->mutable_k(), {2, 1, 64}, 2);
    SetZeros(request->mutable_v(), {2, 1, 64}, 2);
    auto record = std::make_shared<Record>();
    AppendWork work;
    work.key = sequence;
    work.sequence_id = request->sequence_id();
    work.num_tokens = 2;
    work.k = request->k().data().data();
    work.v = request->v().data().data();
    work.deadline = deadline;
    work.cancelled = std::move(cancelled);
    work.done = [record, request](const absl::StatusOr<int64_t>& length) {
      record->thread = ThreadName();
      record->status = length.status();
      record->done.Notify();
    };
    EXPECT_TRUE(batcher_->SubmitAppend(std::move(work)).ok());
    return record;
  }

  // Control work that records where it runs (`thread` stays empty when it does not
  // run), then waits for `release` (if any), and returns `result`.
  struct ControlSpec {
    absl::Notification* started = nullptr;
    absl::Notification* release = nullptr;
    bool deadline_passed = false;
    std::function<bool()> cancelled = nullptr;  // ControlWork::cancelled
    bool throws = false;                        // run throws instead of returning
  };
  std::shared_ptr<Record> SubmitControlAt(const ControlSpec& spec) {
    auto record = std::make_shared<Record>();
    ControlWork work;
    work.run = [record, spec]() -> absl::Status {
      record->thread = ThreadName();
      if (spec.started != nullptr) spec.started->Notify();
      if (spec.release != nullptr) spec.release->WaitForNotificationWithTimeout(kWait);
      if (spec.throws) throw std::runtime_error("injected");
      return absl::OkStatus();
    };
    if (spec.deadline_passed) work.deadline = Clock::now() - std::chrono::seconds(1);
    work.cancelled = spec.cancelled;
    work.done = [record](const absl::Status& s) {
      record->status = s;
      record->done.Notify();
    };
    EXPECT_TRUE(batcher_->SubmitControl(std::move(work)).ok());
    return record;
  }
  std::shared_ptr<Record> SubmitControl(absl::Notification* started = nullptr,
                                        absl::Notification* release = nullptr) {
    return SubmitControlAt({.started = started, .release = release});
  }

  static void Wait(const std::shared_ptr<Record>& r) {
    ASSERT_TRUE(r->done.WaitForNotificationWithTimeout(kWait));
  }

  // Leaves the executor thread running control work that waits for `release`, the
  // assembler idle and nothing queued or handed over.
  void OccupyExecutorThread(absl::Notification* release) {
    absl::Notification assembler_held, executor_held;
    absl::Notification let_assembler_go;
    std::shared_ptr<Record> hold = SubmitControl(&assembler_held, &let_assembler_go);
    ASSERT_TRUE(assembler_held.WaitForNotificationWithTimeout(kWait));
    ASSERT_EQ(hold->thread, "sds-assembler");
    // Queued behind the blocking unit: the executor unit, then a request whose deadline
    // passed, so that the first is handed over (the queue is not empty) and the second
    // leaves no unit behind.
    std::shared_ptr<Record> busy = SubmitControl(&executor_held, release);
    std::shared_ptr<Record> expired = SubmitDecode("expired", /*deadline_passed=*/true);
    let_assembler_go.Notify();
    ASSERT_TRUE(executor_held.WaitForNotificationWithTimeout(kWait));
    ASSERT_EQ(busy->thread, "sds-executor");
    Wait(expired);
    ASSERT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
    Wait(hold);
  }

  // A batcher of two concurrent batches (threads spinning 5 ms) with a decode of "a" at
  // position 0 held in flight until `release`; null when it did not get there.
  std::shared_ptr<Record> StartTwoLanesWithABatchHeld(absl::Notification* release) {
    max_concurrent_batches_ = 2;
    Start(/*run_on_submitter=*/false, std::chrono::milliseconds(5));
    auto entered = std::make_shared<absl::Notification>();
    std::shared_ptr<Record> held = SubmitHeldDecode("a", 0, entered, release);
    if (!entered->WaitForNotificationWithTimeout(kWait)) return nullptr;
    return held;
  }

  server_test::CpuStack stack_;
  std::unique_ptr<Batcher> batcher_;
};

TEST_F(BatcherTest, IdleBatcherRunsDecodeAndControlOnTheAssembler) {
  Start(/*run_on_submitter=*/false);
  std::shared_ptr<Record> decode = SubmitDecode("a");
  Wait(decode);
  EXPECT_TRUE(decode->status.ok()) << decode->status;
  EXPECT_EQ(decode->thread, "sds-assembler");
  std::shared_ptr<Record> control = SubmitControl();
  Wait(control);
  EXPECT_EQ(control->thread, "sds-assembler");
}

// --idle_spin_us: work that arrives while the threads spin, and after they have gone to
// sleep, runs on the usual threads; stopping does not wait for a spin to end.
TEST_F(BatcherTest, SpinningThreadsTakeWorkWhileSpinningAndAfterSleeping) {
  Start(false, std::chrono::milliseconds(5));
  for (int round = 0; round < 20; ++round) {
    // 0.2 ms: inside the 5 ms spin of both threads; 8 ms: asleep on their condition.
    std::this_thread::sleep_for(round % 2 ? std::chrono::microseconds(200)
                                          : std::chrono::milliseconds(8));
    const std::string id = "s" + std::to_string(round);
    std::shared_ptr<Record> decode = SubmitDecode(id);
    std::shared_ptr<Record> prefill = SubmitPrefill(id + "p");
    Wait(decode);
    Wait(prefill);
    EXPECT_TRUE(decode->status.ok()) << decode->status;
    EXPECT_TRUE(prefill->status.ok()) << prefill->status;
    EXPECT_EQ(prefill->thread, "sds-executor");
  }
  const auto stop_start = std::chrono::steady_clock::now();
  batcher_->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - stop_start, std::chrono::seconds(1));
}

// With a spin far longer than the test, work submitted to the spinning threads runs at
// once (the push and the hand-over end the spins) and Stop ends them: nothing waits for
// the 2 s to pass.
TEST_F(BatcherTest, LongSpinsEndOnWorkAndOnStop) {
  Start(false, std::chrono::seconds(2));
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // both threads spinning
    const auto start = std::chrono::steady_clock::now();
    const std::string id = "l" + std::to_string(round);
    std::shared_ptr<Record> decode = SubmitDecode(id);
    std::shared_ptr<Record> prefill = SubmitPrefill(id + "p");  // via the executor thread
    Wait(decode);
    Wait(prefill);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
    EXPECT_TRUE(decode->status.ok()) << decode->status;
    EXPECT_TRUE(prefill->status.ok()) << prefill->status;
  }
  const auto stop_start = std::chrono::steady_clock::now();
  batcher_->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - stop_start, std::chrono::milliseconds(500));
}

// An eager assembler waits for the batch in flight to end before it closes the next
// one; with idle_spin it polls for that end instead of sleeping, and must not miss it:
// here the spin (2 s) and the queue delay (10 s) are far longer than the test allows.
TEST_F(BatcherTest, SpinningAssemblerClosesTheNextBatchWhenTheOneInFlightEnds) {
  Start(/*run_on_submitter=*/true, std::chrono::seconds(2), std::chrono::seconds(10));
  absl::Notification entered, release;
  std::shared_ptr<Record> first;
  // Claimed by its submitter and held inside its run (the executor's "still wanted?"
  // check), so that it stays in flight.
  std::thread submitter([&] {
    pthread_setname_np(pthread_self(), "test-submitter");
    Batcher::SubmitterRun run;
    first = SubmitDecodeAt({.sequence = "f",
                            .cancelled =
                                [&] {
                                  if (!entered.HasBeenNotified()) {
                                    entered.Notify();
                                    release.WaitForNotificationWithTimeout(kWait);
                                  }
                                  return false;
                                },
                            .claim = &run});
    run.Run();
  });
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kWait)) << "the batch was not claimed";
  std::shared_ptr<Record> second = SubmitDecode("g");
  EXPECT_FALSE(second->done.WaitForNotificationWithTimeout(absl::Milliseconds(50)))
      << "the second batch closed while the first was in flight";
  const auto released = std::chrono::steady_clock::now();
  release.Notify();
  submitter.join();
  Wait(second);
  EXPECT_LT(std::chrono::steady_clock::now() - released, std::chrono::milliseconds(500));
  Wait(first);
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_TRUE(second->status.ok()) << second->status;
  EXPECT_EQ(second->thread, "sds-assembler");
}

// A batch gives its staging buffer and the executor back before its completions run
// (its answers are encoded by then): the next batch runs while a completion of the
// previous one still holds its thread.
TEST_F(BatcherTest, ABatchsCompletionsDoNotHoldTheNextBatch) {
  Start(/*run_on_submitter=*/true);
  absl::Notification entered, release;
  // Into an idle batcher without a claim: the assembler runs it, and its completion
  // holds the assembler's thread.
  std::shared_ptr<Record> first =
      SubmitDecodeAt({.sequence = "a", .entered = &entered, .release = &release});
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kWait));
  std::shared_ptr<Record> second;
  OnSubmitterThread([&] {
    Batcher::SubmitterRun run;
    second = SubmitDecode("b", false, &run);
    run.Run();
  });
  EXPECT_TRUE(second->done.HasBeenNotified())
      << "the next batch waited for the previous one's completions";
  release.Notify();
  Wait(first);
  Wait(second);
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_EQ(first->thread, "sds-assembler");
  EXPECT_TRUE(second->status.ok()) << second->status;
  EXPECT_EQ(second->thread, "test-submitter");
}

// max_concurrent_batches 2: a batch runs on a second executor thread while the first
// is still in flight; fork/release work waits for both (it runs alone).
TEST_F(BatcherTest, ConcurrentBatchesRunSideBySideAndControlWorkAlone) {
  absl::Notification release;
  std::shared_ptr<Record> held = StartTwoLanesWithABatchHeld(&release);
  ASSERT_NE(held, nullptr);
  std::shared_ptr<Record> other = SubmitDecode("b");
  Wait(other);
  EXPECT_TRUE(other->status.ok()) << other->status;
  EXPECT_EQ(other->thread, "sds-executor");
  std::shared_ptr<Record> control = SubmitControl();
  EXPECT_FALSE(control->done.WaitForNotificationWithTimeout(absl::Milliseconds(100)))
      << "fork/release work ran beside a batch";
  release.Notify();
  Wait(held);
  Wait(control);
  EXPECT_TRUE(held->status.ok()) << held->status;
  EXPECT_TRUE(control->status.ok()) << control->status;
}

// With concurrent batches, a decode of a sequence that a batch in flight holds waits for
// that batch (its position 0 is not written yet, and its page table may change), while
// a decode of another sequence queued after it runs.
TEST_F(BatcherTest, ConcurrentBatchesNeverHoldOneSequenceTwice) {
  absl::Notification release;
  std::shared_ptr<Record> held = StartTwoLanesWithABatchHeld(&release);
  ASSERT_NE(held, nullptr);
  std::shared_ptr<Record> next_of_held = SubmitDecodeAt({.sequence = "a", .position = 1});
  std::shared_ptr<Record> other = SubmitDecode("b");
  Wait(other);
  EXPECT_TRUE(other->status.ok()) << other->status;
  EXPECT_FALSE(next_of_held->done.WaitForNotificationWithTimeout(absl::Milliseconds(100)))
      << "a decode of a sequence in flight ran: " << next_of_held->status;
  release.Notify();
  Wait(held);
  Wait(next_of_held);
  EXPECT_TRUE(held->status.ok()) << held->status;
  EXPECT_TRUE(next_of_held->status.ok()) << next_of_held->status;
}

// Stop with several executor threads asleep (no spin): every one of them must wake and
// exit, or Stop would wait for ever on the one that was not told.
TEST_F(BatcherTest, StopEndsEveryExecutorThread) {
  max_concurrent_batches_ = 3;
  Start(/*run_on_submitter=*/false);
  std::shared_ptr<Record> decode = SubmitDecode("s");
  Wait(decode);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // all asleep on their cv
  absl::Notification stopped;
  std::thread stopper([&] {
    batcher_->Stop();
    stopped.Notify();
  });
  const bool ended = stopped.WaitForNotificationWithTimeout(absl::Seconds(5));
  EXPECT_TRUE(ended) << "Stop did not return: an executor thread was left asleep";
  if (!ended) std::_Exit(1);  // the stuck threads cannot be joined
  stopper.join();
}

// With one batch at a time (the default), the second decode waits for the first.
TEST_F(BatcherTest, OneBatchAtATimeByDefault) {
  Start(/*run_on_submitter=*/false, std::chrono::milliseconds(5));
  auto entered = std::make_shared<absl::Notification>();
  absl::Notification release;
  std::shared_ptr<Record> held = SubmitHeldDecode("a", 0, entered, &release);
  ASSERT_TRUE(entered->WaitForNotificationWithTimeout(kWait));
  std::shared_ptr<Record> other = SubmitDecode("b");
  EXPECT_FALSE(other->done.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  release.Notify();
  Wait(held);
  Wait(other);
  EXPECT_TRUE(other->status.ok()) << other->status;
}

// A decode unit the batcher cannot run (no sink, no items, more items than a batch) is
// refused INTERNAL at submission, nothing queued; the next one runs.
TEST_F(BatcherTest, MalformedDecodeUnitsAreRefusedInternal) {
  Start(false);
  std::shared_ptr<TestDecode> d = NewDecode(stack_.model, "n", 0);
  DecodeWork no_sink;
  no_sink.items.push_back(&d->item);
  EXPECT_EQ(batcher_->SubmitDecode(std::move(no_sink)).code(), absl::StatusCode::kInternal);
  DecodeWork empty;
  empty.sink = d.get();
  EXPECT_EQ(batcher_->SubmitDecode(std::move(empty)).code(), absl::StatusCode::kInternal);
  DecodeWork too_many;
  too_many.sink = d.get();
  for (int i = 0; i <= batcher_->max_batch_size(); ++i) too_many.items.push_back(&d->item);
  EXPECT_EQ(batcher_->SubmitDecode(std::move(too_many)).code(), absl::StatusCode::kInternal);
  std::shared_ptr<Record> good = SubmitDecode("m");
  Wait(good);
  EXPECT_TRUE(good->status.ok()) << good->status;
}

TEST_F(BatcherTest, PrefillAlwaysRunsOnTheExecutorThread) {
  Start(false);
  std::shared_ptr<Record> prefill = SubmitPrefill("p");
  Wait(prefill);
  EXPECT_TRUE(prefill->status.ok()) << prefill->status;
  EXPECT_EQ(prefill->thread, "sds-executor");
}

TEST_F(BatcherTest, WorkStillQueuedSendsTheUnitToTheExecutorThread) {
  Start(false);
  absl::Notification held, release;
  std::shared_ptr<Record> hold = SubmitControl(&held, &release);
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(kWait));
  // While the assembler is held: a decode, control work that ends its batch, another
  // decode. Taking the first decode leaves the other two queued.
  std::shared_ptr<Record> first = SubmitDecode("x");
  std::shared_ptr<Record> control = SubmitControl();
  std::shared_ptr<Record> last = SubmitDecode("y");
  release.Notify();
  Wait(first);
  Wait(control);
  Wait(last);
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_EQ(first->thread, "sds-executor");
  EXPECT_EQ(control->thread, "sds-executor");  // the last decode was still queued
  EXPECT_TRUE(last->status.ok()) << last->status;
}

TEST_F(BatcherTest, BusyExecutorThreadGetsTheUnit) {
  Start(false);
  absl::Notification release;
  OccupyExecutorThread(&release);
  // Nothing queued, nothing handed over, but a unit runs: the decode must wait for it
  // on the executor thread, not run beside it on the assembler.
  std::shared_ptr<Record> decode = SubmitDecode("z");
  EXPECT_FALSE(decode->done.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  release.Notify();
  Wait(decode);
  EXPECT_TRUE(decode->status.ok()) << decode->status;
  EXPECT_EQ(decode->thread, "sds-executor");
}

TEST_F(BatcherTest, RunOnSubmitterRunsAnIdleBatchOnTheCallingThread) {
  Start(/*run_on_submitter=*/true);
  std::shared_ptr<Record> decode;
  OnSubmitterThread([&] {
    Batcher::SubmitterRun run;
    decode = SubmitDecode("s", false, &run);
    // Claimed: it runs when the submitter runs it, and is answered then.
    EXPECT_FALSE(decode->done.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
    run.Run();
    EXPECT_TRUE(decode->done.HasBeenNotified());
  });
  Wait(decode);
  EXPECT_TRUE(decode->status.ok()) << decode->status;
  EXPECT_EQ(decode->thread, "test-submitter");
  // Without a claim, or for prefills and control work, the submitter never runs it.
  std::shared_ptr<Record> unclaimed = SubmitDecode("u");
  Wait(unclaimed);
  EXPECT_EQ(unclaimed->thread, "sds-assembler");
  std::shared_ptr<Record> prefill = SubmitPrefill("sp");
  Wait(prefill);
  EXPECT_EQ(prefill->thread, "sds-executor");
}

TEST_F(BatcherTest, RunOnSubmitterNeverRunsBesideAnotherUnit) {
  Start(true);
  absl::Notification release;
  OccupyExecutorThread(&release);
  std::shared_ptr<Record> decode;
  OnSubmitterThread([&] {
    Batcher::SubmitterRun run;
    decode = SubmitDecode("t", false, &run);
    run.Run();  // nothing was claimed
  });
  EXPECT_FALSE(decode->done.WaitForNotificationWithTimeout(absl::Milliseconds(200)));
  release.Notify();
  Wait(decode);
  EXPECT_TRUE(decode->status.ok()) << decode->status;
  EXPECT_EQ(decode->thread, "sds-executor");
}

// Stop waits until a claimed batch's submitting thread is done with the batcher, not
// only until its unit has given the executor back: the batcher may be destroyed as soon
// as Stop returns. The submitter is held at the very end of its unit's release.
TEST_F(BatcherTest, StopWaitsForAClaimedRunToLeaveTheBatcher) {
  absl::Notification in_release, leave_release;
  after_unit_release_ = [&] {
    if (ThreadName() != "test-submitter") return;
    in_release.Notify();
    leave_release.WaitForNotificationWithTimeout(kWait);
  };
  Start(/*run_on_submitter=*/true);
  std::shared_ptr<Record> decode;
  std::thread submitter([&] {
    pthread_setname_np(pthread_self(), "test-submitter");
    Batcher::SubmitterRun run;
    decode = SubmitDecode("s", false, &run);
    run.Run();
  });
  ASSERT_TRUE(in_release.WaitForNotificationWithTimeout(kWait)) << "the batch was not claimed";
  absl::Notification stopped;
  std::thread stopper([&] {
    batcher_->Stop();
    stopped.Notify();
  });
  EXPECT_FALSE(stopped.WaitForNotificationWithTimeout(absl::Milliseconds(300)))
      << "Stop returned while a claimed run was still inside the batcher";
  leave_release.Notify();
  EXPECT_TRUE(stopped.WaitForNotificationWithTimeout(kWait));
  stopper.join();
  submitter.join();
  Wait(decode);
  EXPECT_TRUE(decode->status.ok()) << decode->status;
  EXPECT_EQ(decode->thread, "test-submitter");
}

// Work submitted while a claimed batch waits for its submitter to run it waits too: it
// runs after the claimed unit, never beside it (one unit at a time, on any thread).
TEST_F(BatcherTest, WorkSubmittedAfterAClaimWaitsForTheClaimedUnit) {
  Start(true);
  absl::Notification claimed, go;
  std::shared_ptr<Record> first;
  std::thread submitter([&] {
    pthread_setname_np(pthread_self(), "test-submitter");
    Batcher::SubmitterRun run;
    first = SubmitDecode("c", false, &run);
    claimed.Notify();
    go.WaitForNotificationWithTimeout(kWait);
    run.Run();
  });
  ASSERT_TRUE(claimed.WaitForNotificationWithTimeout(kWait));
  // Control work first (the assembler hands it over at once), then a decode.
  std::shared_ptr<Record> control = SubmitControl();
  std::shared_ptr<Record> later = SubmitDecode("d");
  EXPECT_FALSE(control->done.WaitForNotificationWithTimeout(absl::Milliseconds(300)))
      << "control work ran on " << control->thread << " while a claimed batch was pending";
  EXPECT_FALSE(later->done.HasBeenNotified());
  EXPECT_FALSE(first->done.HasBeenNotified()) << "the batch was not claimed";
  go.Notify();
  submitter.join();
  Wait(first);
  Wait(control);
  Wait(later);
  EXPECT_TRUE(first->status.ok()) << first->status;
  EXPECT_EQ(first->thread, "test-submitter");
  EXPECT_EQ(control->thread, "sds-executor");
  EXPECT_TRUE(later->status.ok()) << later->status;
}

// While the assembler holds a batch it took (here: answering an expired request taken
// with it), a submitter may not claim: a later decode of the same (sequence, layer)
// would run before the one the assembler holds.
TEST_F(BatcherTest, NoClaimWhileTheAssemblerHoldsABatch) {
  Start(true);
  // Hold the assembler in a unit, so that the next two decodes are taken together.
  absl::Notification held, release_control;
  std::shared_ptr<Record> hold = SubmitControl(&held, &release_control);
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(kWait));
  absl::Notification answering_expired, release_expired;
  std::shared_ptr<Record> expired = SubmitDecodeAt({.sequence = "e",
                                                    .deadline_passed = true,
                                                    .entered = &answering_expired,
                                                    .release = &release_expired});
  std::shared_ptr<Record> at0 = SubmitDecodeAt({.sequence = "o"});
  release_control.Notify();
  ASSERT_TRUE(answering_expired.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(expired->thread, "sds-assembler");
  // The assembler now holds the batch with position 0 of "o".
  std::shared_ptr<Record> at1;
  OnSubmitterThread([&] {
    Batcher::SubmitterRun run;
    at1 = SubmitDecodeAt({.sequence = "o", .position = 1, .claim = &run});
    run.Run();
  });
  EXPECT_FALSE(at1->done.HasBeenNotified())
      << "position 1 ran on " << at1->thread << " (" << at1->status
      << ") while the assembler held position 0";
  release_expired.Notify();
  Wait(hold);
  Wait(expired);
  Wait(at0);
  Wait(at1);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(at0->status.ok()) << at0->status;
  EXPECT_TRUE(at1->status.ok()) << at1->status;
  EXPECT_NE(at1->thread, "test-submitter");
}

// A completion that throws while a claimed batch is answered (a bug elsewhere) is
// logged; the batch still runs and the batcher still takes work: the claimed unit
// always gives back its staging buffer and the "a unit runs" mark.
TEST_F(BatcherTest, ThrowingCompletionInAClaimedBatchDoesNotWedgeTheBatcher) {
  Start(true);
  ASSERT_TRUE(stack_.backend->cache().CreateSequence("g", 0).ok());
  std::shared_ptr<TestDecode> thrower = NewDecode(stack_.model, "expired", 0);
  thrower->throws = true;  // expired: answered first, and its Done throws
  std::shared_ptr<TestDecode> good_decode = NewDecode(stack_.model, "g", 0);
  std::shared_ptr<Record> good = good_decode->record;
  std::vector<DecodeWork> works;
  works.push_back(UnitOf(thrower));
  works[0].deadline = Clock::now() - std::chrono::seconds(1);
  works.push_back(UnitOf(good_decode));
  // One lock for both, then the claim: the submitting thread answers and runs them.
  std::vector<absl::Status> queued = batcher_->SubmitDecodes(&works);
  ASSERT_EQ(queued.size(), 2u);
  EXPECT_TRUE(queued[0].ok() && queued[1].ok());
  Wait(good);
  EXPECT_TRUE(good->status.ok()) << good->status;
  std::shared_ptr<Record> after = SubmitDecode("after");
  Wait(after);
  EXPECT_TRUE(after->status.ok()) << after->status;
  EXPECT_TRUE(batcher_->Drain(Clock::now() + std::chrono::seconds(5)));
}

// Fork and release (control work) run only while their caller still waits: one whose
// deadline passed or whose call was cancelled in the queue is answered DEADLINE_EXCEEDED
// or CANCELLED and not run (a fork that appeared after its caller's DEADLINE_EXCEEDED
// made the retry fail ALREADY_EXISTS).
TEST_F(BatcherTest, ControlWorkWhoseCallerGaveUpIsNotRun) {
  Start(false);
  std::shared_ptr<Record> expired = SubmitControlAt({.deadline_passed = true});
  Wait(expired);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded) << expired->status;
  EXPECT_EQ(expired->thread, "") << "ran after its deadline";
  std::shared_ptr<Record> cancelled = SubmitControlAt({.cancelled = [] { return true; }});
  Wait(cancelled);
  EXPECT_EQ(cancelled->status.code(), absl::StatusCode::kCancelled) << cancelled->status;
  EXPECT_EQ(cancelled->thread, "") << "ran after its call was cancelled";
  std::shared_ptr<Record> wanted = SubmitControlAt({.cancelled = [] { return false; }});
  Wait(wanted);
  EXPECT_TRUE(wanted->status.ok()) << wanted->status;
  EXPECT_NE(wanted->thread, "");
}

// A prefill whose call was cancelled (or whose deadline passed) in the queue writes
// nothing; the next one of the same sequence still starts at position 0.
TEST_F(BatcherTest, PrefillWhoseCallerGaveUpWritesNothing) {
  Start(false);
  std::shared_ptr<Record> cancelled =
      SubmitPrefill("c", Clock::time_point::max(), [] { return true; });
  Wait(cancelled);
  EXPECT_EQ(cancelled->status.code(), absl::StatusCode::kCancelled) << cancelled->status;
  std::shared_ptr<Record> expired = SubmitPrefill("e", Clock::now() - std::chrono::seconds(1));
  Wait(expired);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded) << expired->status;
  for (const char* id : {"c", "e"}) {
    absl::StatusOr<int64_t> length = stack_.backend->cache().Length(id, 0);
    ASSERT_TRUE(length.ok()) << length.status();
    EXPECT_EQ(*length, 0) << id << ": the refused prefill wrote tokens";
  }
  std::shared_ptr<Record> wanted =
      SubmitPrefill("w", Clock::time_point::max(), [] { return false; });
  Wait(wanted);
  EXPECT_TRUE(wanted->status.ok()) << wanted->status;
}

// An exception while a unit runs (only bad_alloc in the server; injected here through
// the work's own callbacks) is answered INTERNAL, once, for every kind of unit: no call
// waits for an answer that never comes, and the batcher goes on.
TEST_F(BatcherTest, ExceptionWhileAUnitRunsIsAnsweredInternal) {
  Start(false);
  auto injected = []() -> bool { throw std::runtime_error("injected"); };
  std::shared_ptr<Record> control = SubmitControlAt({.throws = true});
  Wait(control);
  EXPECT_EQ(control->status.code(), absl::StatusCode::kInternal) << control->status;
  std::shared_ptr<Record> prefill = SubmitPrefill("p", Clock::time_point::max(), injected);
  Wait(prefill);
  EXPECT_EQ(prefill->status.code(), absl::StatusCode::kInternal) << prefill->status;
  std::shared_ptr<Record> decode = SubmitDecodeAt({.sequence = "d", .cancelled = injected});
  Wait(decode);
  EXPECT_EQ(decode->status.code(), absl::StatusCode::kInternal) << decode->status;
  std::shared_ptr<Record> after = SubmitDecode("after");
  Wait(after);
  EXPECT_TRUE(after->status.ok()) << after->status;
  EXPECT_TRUE(batcher_->Drain(Clock::now() + std::chrono::seconds(5)));
}

// A completion that throws while the assembler answers expired requests (a bug
// elsewhere) is logged; the assembler thread lives on (an exception leaving it would
// end the process) and answers the other expired request too.
TEST_F(BatcherTest, ThrowingCompletionOfAnExpiredRequestDoesNotStopTheAssembler) {
  Start(false);
  absl::Notification held, release;
  std::shared_ptr<Record> hold = SubmitControl(&held, &release);
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(kWait));
  // Both expired, taken together while the assembler is held; the first one throws.
  std::shared_ptr<TestDecode> thrower = NewDecode(stack_.model, "x", 0);
  thrower->throws = true;
  DecodeWork unit = UnitOf(thrower);
  unit.deadline = Clock::now() - std::chrono::seconds(1);
  ASSERT_TRUE(batcher_->SubmitDecode(std::move(unit)).ok());
  std::shared_ptr<Record> expired = SubmitDecode("y", /*deadline_passed=*/true);
  release.Notify();
  Wait(hold);
  Wait(expired);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
  std::shared_ptr<Record> after = SubmitDecode("after");
  Wait(after);
  EXPECT_TRUE(after->status.ok()) << after->status;
}

// A unit of several items runs in one batch and is completed once, with every item's
// outcome.
TEST_F(BatcherTest, AMultiItemUnitRunsInOneBatchAndCompletesOnce) {
  Start(false);
  for (const char* id : {"u0", "u1", "u2", "u3", "u4"})
    ASSERT_TRUE(stack_.backend->cache().CreateSequence(id, 0).ok());
  TestCall call(stack_.model, {{"u0", 0}, {"u1", 0}, {"u2", 0}, {"u3", 0}, {"u4", 0}});
  ASSERT_TRUE(batcher_->SubmitDecode(call.Unit(0, 5)).ok());
  ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(call.completions.load(), 1);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_TRUE(call.status[i].ok()) << i << ": " << call.status[i];
    EXPECT_EQ(call.batch_id[i], call.batch_id[0]) << i;
  }
  EXPECT_NE(call.batch_id[0], 0u);
}

// A unit that holds a (sequence, layer) the batch already holds waits for a later batch,
// and a later unit holding any of its pairs stays behind it: positions of one sequence
// still run in order. Here B's position 1 would fail (a gap) had the third unit
// overtaken the second.
TEST_F(BatcherTest, AUnitWithAPairOfTheBatchWaitsAndLaterUnitsOfItsPairsStayBehind) {
  Start(false);
  for (const char* id : {"A", "B"}) ASSERT_TRUE(stack_.backend->cache().CreateSequence(id, 0).ok());
  TestCall call(stack_.model, {{"A", 0}, {"A", 1}, {"B", 0}, {"B", 1}});
  std::vector<DecodeWork> units;
  units.push_back(call.Unit(0, 1));  // A0
  units.push_back(call.Unit(1, 3));  // A1 B0: A is in the first batch
  units.push_back(call.Unit(3, 4));  // B1: B is in the kept unit
  std::vector<absl::Status> queued = batcher_->SubmitDecodes(&units);
  for (const absl::Status& q : queued) ASSERT_TRUE(q.ok()) << q;
  ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(kWait));
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(call.status[i].ok()) << i << ": " << call.status[i];
  EXPECT_LT(call.batch_id[0], call.batch_id[1]);
  EXPECT_EQ(call.batch_id[1], call.batch_id[2]);
  EXPECT_LT(call.batch_id[2], call.batch_id[3]);
  EXPECT_EQ(call.completions.load(), 3);
}

// Admission splits a call into units of distinct (sequence, layer) pairs and at most a
// batch each, in order: a call that carries two positions of one sequence, and more
// items than a batch holds, runs whole and in order.
TEST_F(BatcherTest, AdmissionSplitsACallIntoUnitsInOrder) {
  Start(false);
  PendingWrites pending;
  DecodeAdmission admission(batcher_.get(), &stack_.backend->cache(), &pending);
  std::vector<std::pair<std::string, int64_t>> specs = {{"s", 0}, {"s", 1}};
  for (int i = 0; i < 10; ++i) specs.emplace_back("t" + std::to_string(i), 0);
  specs.emplace_back("s", 2);
  for (const auto& [id, position] : specs) {
    if (position == 0) {
      ASSERT_TRUE(stack_.backend->cache().CreateSequence(id, 0).ok());
    }
  }
  TestCall call(stack_.model, specs);
  std::vector<DecodeItem*> items;
  for (DecodeItem& item : call.items) items.push_back(&item);
  admission.Submit(items, &call, Clock::time_point::max(), nullptr, /*whole_batch=*/true);
  ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(kWait));
  for (size_t i = 0; i < specs.size(); ++i)
    EXPECT_TRUE(call.status[i].ok()) << i << ": " << call.status[i];
  EXPECT_LT(call.batch_id[0], call.batch_id[1]);      // s0 before s1
  EXPECT_LT(call.batch_id[1], call.batch_id.back());  // s1 before s2
  // Units of at most max_batch_size (8): the 13 items took at least 3 batches.
  EXPECT_GE(call.completions.load(), 3);
  auto length = stack_.backend->cache().Length("s", 0);
  ASSERT_TRUE(length.ok()) << length.status();
  EXPECT_EQ(*length, 3);
}

// Single-item calls (Decode, DecodeStream) do not close their batch under eager
// batching: submitted while a batch runs on the executor thread, two of them wait for it
// and then run together (each closing its own batch at once was the bug).
TEST_F(BatcherTest, SingleItemCallsWaitToBeBatchedTogether) {
  Start(false, {}, std::chrono::seconds(5));  // only the batch in flight's end closes theirs
  PendingWrites pending;
  DecodeAdmission admission(batcher_.get(), &stack_.backend->cache(), &pending);
  absl::Notification held, release;
  std::shared_ptr<Record> hold = SubmitControl(&held, &release);  // holds the assembler
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(kWait));
  auto entered = std::make_shared<absl::Notification>();
  absl::Notification release_decode;
  // Behind it: a decode held inside its run, then control work that makes the assembler
  // hand that decode to the executor thread.
  std::shared_ptr<Record> running = SubmitHeldDecode("held", 0, entered, &release_decode);
  std::shared_ptr<Record> control = SubmitControl();
  release.Notify();
  Wait(hold);
  ASSERT_TRUE(entered->WaitForNotificationWithTimeout(kWait));
  for (const char* id : {"p", "q"}) ASSERT_TRUE(stack_.backend->cache().CreateSequence(id, 0).ok());
  TestCall call(stack_.model, {{"p", 0}, {"q", 0}});
  for (DecodeItem& item : call.items) {
    DecodeItem* one = &item;
    admission.Submit({&one, 1}, &call, Clock::time_point::max(), nullptr, /*whole_batch=*/false);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // time to close it alone
  }
  release_decode.Notify();
  Wait(running);
  Wait(control);
  ASSERT_TRUE(call.done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(running->thread, "sds-executor");
  EXPECT_TRUE(call.status[0].ok() && call.status[1].ok()) << call.status[0] << call.status[1];
  EXPECT_EQ(call.batch_id[0], call.batch_id[1]) << "each call closed a batch of its own";
}

}  // namespace
}  // namespace sds::server
