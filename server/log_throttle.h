// Rate-limited logging of what a caller controls. A malformed request (a non-UTF-8
// string in a typed message) makes protobuf write one error line per string, so a
// hostile client could fill the disk at the speed of its uplink; the server's protobuf
// log handler lets a burst through and then one line a second, counting what it drops.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace sds::server {

// A token bucket: `burst` lines at once, refilled at `per_second`. Thread-safe.
class LogThrottle {
 public:
  using Clock = std::chrono::steady_clock;
  LogThrottle(int32_t burst, double per_second);

  // True when a line may be written at `now`. `*suppressed` is set to the number of
  // lines refused since the last one allowed (for the allowed line to say so).
  bool Allow(Clock::time_point now, int64_t* suppressed);

 private:
  std::mutex mu_;
  const double burst_;
  const double per_second_;
  double tokens_;
  Clock::time_point last_{};
  int64_t suppressed_ = 0;
};

// Routes protobuf's log lines to spdlog through a LogThrottle (10 lines, then 1 a
// second). Call once at start-up, before serving (protobuf's SetLogHandler is not
// thread-safe).
void InstallThrottledProtobufLog();

}  // namespace sds::server
