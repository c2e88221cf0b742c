#include "client/loadgen/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

namespace sds::loadgen {

absl::Status ParallelFor(int n, int threads, const std::function<absl::Status(int)>& fn,
                         bool stop_on_error) {
  std::atomic<int> next{0};
  std::mutex mu;
  absl::Status first;
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min(n, threads); ++t) {
    pool.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < n;) {
        absl::Status st = fn(i);
        if (!st.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (first.ok()) first = st;
          if (stop_on_error) next = n;  // stop handing out work
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  return first;
}

}  // namespace sds::loadgen
