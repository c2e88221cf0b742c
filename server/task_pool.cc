#include "server/task_pool.h"

#include <pthread.h>

#include <exception>
#include <string>

#include "spdlog/spdlog.h"

namespace sds::server {

TaskPool::TaskPool(int num_threads, const char* name) {
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, name = std::string(name)] {
      pthread_setname_np(pthread_self(), name.c_str());
      Loop();
    });
  }
}

TaskPool::~TaskPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void TaskPool::Post(std::function<void()> task) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    wake = idle_ > 0;
  }
  if (wake) cv_.notify_one();
}

void TaskPool::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (tasks_.empty()) {
      if (stopping_) return;  // every queued task has run
      ++idle_;
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      --idle_;
      continue;
    }
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    try {
      task();
    } catch (const std::exception& e) {
      spdlog::critical("task pool: a task threw: {}", e.what());
    }
    lock.lock();
  }
}

}  // namespace sds::server
