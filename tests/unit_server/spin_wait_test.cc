// SpinThenWait (server/spin_wait.h): a state change made during the spin, or after the
// waiter went to sleep, ends the wait; a change that does not bump the event counter is
// still seen once the spin ends; and a notification that came during the spin is not
// needed again (the predicate is checked under the lock before sleeping).
#include "server/spin_wait.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"

namespace sds::server {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<uint64_t> events{0};
  bool ready = false;  // guarded by mu

  // Sets `ready` under the lock, bumps the counter when asked, notifies once.
  void Set(bool bump) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ready = true;
    }
    if (bump) events.fetch_add(1, std::memory_order_release);
    cv.notify_one();
  }
};

// Runs SpinThenWait on a thread; the returned future is ready when the wait returned.
std::future<void> StartWaiter(State* state, microseconds spin) {
  return std::async(std::launch::async, [state, spin] {
    std::unique_lock<std::mutex> lock(state->mu);
    SpinThenWait(lock, state->cv, state->events, spin, [state] { return state->ready; });
    EXPECT_TRUE(state->ready);
  });
}

// Makes sure a stuck waiter (a failed test) can still be joined.
void Unstick(State* state, std::future<void>* waiter) {
  while (waiter->wait_for(milliseconds(10)) != std::future_status::ready) {
    state->cv.notify_all();
  }
}

// Starts a waiter spinning for `spin`, sets the state `set_after` later (bumping the
// counter or not) and says whether the wait then ended within `within`.
bool EndsAfterSet(std::chrono::microseconds spin, milliseconds set_after, bool bump,
                  milliseconds within) {
  State state;
  std::future<void> waiter = StartWaiter(&state, spin);
  std::this_thread::sleep_for(set_after);
  state.Set(bump);  // its one notification comes now
  const bool ended = waiter.wait_for(within) == std::future_status::ready;
  Unstick(&state, &waiter);
  return ended;
}

TEST(SpinThenWait, ChangeDuringTheSpinEndsTheWait) {
  // Set while the waiter spins (2 s).
  EXPECT_TRUE(
      EndsAfterSet(std::chrono::seconds(2), milliseconds(20), /*bump=*/true, milliseconds(500)))
      << "a change made during the spin was missed";
}

TEST(SpinThenWait, ChangeAfterTheSpinWakesTheSleeper) {
  // Spin over after 0.5 ms, asleep when the state is set.
  EXPECT_TRUE(
      EndsAfterSet(microseconds(500), milliseconds(50), /*bump=*/true, std::chrono::seconds(2)));
}

TEST(SpinThenWait, ChangeWithoutABumpIsSeenWhenTheSpinEnds) {
  // Notified while spinning, counter unchanged.
  EXPECT_TRUE(
      EndsAfterSet(milliseconds(100), milliseconds(10), /*bump=*/false, std::chrono::seconds(2)));
}

// A bump whose change leaves the predicate false ends the spin, but not the wait.
TEST(SpinThenWait, ABumpWithoutTheStateKeepsWaiting) {
  State state;
  std::future<void> waiter = StartWaiter(&state, std::chrono::seconds(2));
  std::this_thread::sleep_for(milliseconds(10));
  state.events.fetch_add(1);  // as a change of other state under the mutex would
  state.cv.notify_one();
  const bool early = waiter.wait_for(milliseconds(100)) == std::future_status::ready;
  EXPECT_FALSE(early) << "the wait returned with its predicate false";
  state.Set(/*bump=*/true);
  const bool ended = waiter.wait_for(std::chrono::seconds(2)) == std::future_status::ready;
  Unstick(&state, &waiter);
  EXPECT_TRUE(ended);
}

TEST(SpinThenWait, NoSpinIsAPlainWait) {
  EXPECT_TRUE(
      EndsAfterSet(microseconds(0), milliseconds(10), /*bump=*/false, std::chrono::seconds(2)));
}

}  // namespace
}  // namespace sds::server
