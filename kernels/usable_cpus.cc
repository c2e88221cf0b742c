#include "kernels/usable_cpus.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace sds {
namespace {

std::optional<int> CpusFromQuota(int64_t quota, int64_t period) {
  if (quota <= 0 || period <= 0) return std::nullopt;
  return static_cast<int>(std::max<int64_t>(1, (quota + period - 1) / period));
}

std::optional<int64_t> ParseInt(const std::string& text) {
  std::istringstream in(text);
  int64_t value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

std::string ReadFile(const char* path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

}  // namespace

std::optional<int> CpusFromCgroupV2Max(const std::string& cpu_max) {
  std::istringstream in(cpu_max);
  std::string quota, period;
  if (!(in >> quota >> period) || quota == "max") return std::nullopt;
  const std::optional<int64_t> q = ParseInt(quota), p = ParseInt(period);
  if (!q || !p) return std::nullopt;
  return CpusFromQuota(*q, *p);
}

std::optional<int> CpusFromCgroupV1(const std::string& quota_us, const std::string& period_us) {
  const std::optional<int64_t> q = ParseInt(quota_us), p = ParseInt(period_us);
  if (!q || !p) return std::nullopt;
  return CpusFromQuota(*q, *p);
}

int UsableCpus() {
  int cpus = static_cast<int>(std::thread::hardware_concurrency());
#if defined(__linux__)
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) == 0) {
    const int allowed = CPU_COUNT(&mask);
    if (allowed > 0) cpus = cpus > 0 ? std::min(cpus, allowed) : allowed;
  }
  // The process's own cgroup is mounted at /sys/fs/cgroup in a container (v2), or its
  // cpu controller at /sys/fs/cgroup/cpu (v1). A limit set further up the hierarchy on
  // a host is not seen: containers are the case that matters.
  std::optional<int> quota = CpusFromCgroupV2Max(ReadFile("/sys/fs/cgroup/cpu.max"));
  if (!quota) {
    quota = CpusFromCgroupV1(ReadFile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                             ReadFile("/sys/fs/cgroup/cpu/cpu.cfs_period_us"));
  }
  if (quota) cpus = cpus > 0 ? std::min(cpus, *quota) : *quota;
#endif
  return std::max(cpus, 1);
}

}  // namespace sds
