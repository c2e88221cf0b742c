// A few threads that run posted tasks in posting order (each task on whichever thread
// takes it). The batcher's executor posts stream answers here: writing an answer
// (StartWrite) runs gRPC's transport write inline on the calling thread, so answering a
// batch of 256 streams one after another kept the executor from the next batch (on the
// 2-core VM, 90 % of the executor thread's samples at 256 streams; bench/RESULTS.md).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sds::server {

class TaskPool {
 public:
  // Starts `num_threads` threads named `name` (at most 15 characters, for top -H).
  TaskPool(int num_threads, const char* name);
  // Runs every task still queued, then joins the threads.
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // Queues `task`. A task must not throw (one that does is logged and dropped).
  void Post(std::function<void()> task);

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int idle_ = 0;  // threads waiting on cv_: Post notifies only when one is
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace sds::server
