#include "server/log_throttle.h"

#include <algorithm>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "spdlog/spdlog.h"

namespace sds::server {

LogThrottle::LogThrottle(int32_t burst, double per_second)
    : burst_(burst), per_second_(per_second), tokens_(burst) {}

bool LogThrottle::Allow(Clock::time_point now, int64_t* suppressed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (last_ != Clock::time_point{}) {
    const double elapsed = std::chrono::duration<double>(now - last_).count();
    tokens_ = std::min(burst_, tokens_ + std::max(0.0, elapsed) * per_second_);
  }
  last_ = now;
  if (tokens_ < 1.0) {
    ++suppressed_;
    return false;
  }
  tokens_ -= 1.0;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

namespace {

LogThrottle& ProtobufThrottle() {
  static LogThrottle* const throttle = new LogThrottle(10, 1.0);  // never destroyed
  return *throttle;
}

void ThrottledProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                          const std::string& message) {
  int64_t suppressed = 0;
  if (!ProtobufThrottle().Allow(LogThrottle::Clock::now(), &suppressed)) return;
  const spdlog::level::level_enum spd =
      level >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
      : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                    : spdlog::level::info;
  if (suppressed > 0) {
    spdlog::log(spd, "protobuf {}:{}: {} ({} similar lines suppressed)", filename, line, message,
                suppressed);
  } else {
    spdlog::log(spd, "protobuf {}:{}: {}", filename, line, message);
  }
}

}  // namespace

void InstallThrottledProtobufLog() { google::protobuf::SetLogHandler(&ThrottledProtobufLog); }

}  // namespace sds::server
