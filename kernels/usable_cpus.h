// How many CPUs this process may use: the smaller of its CPU affinity mask and its
// cgroup's CPU quota (rounded up), at least 1. std::thread::hardware_concurrency()
// counts the node's CPUs, so a 2-CPU Kubernetes pod on a 64-core node would size its
// pools for 64; the "0 = all cores" and "auto" thread counts use this instead.
#pragma once

#include <optional>
#include <string>

namespace sds {

int UsableCpus();

// The CPU count that a cgroup quota allows (ceil(quota / period)), from the contents of
// cgroup v2's cpu.max ("200000 100000"; "max 100000" is no limit) or of cgroup v1's
// cpu.cfs_quota_us and cpu.cfs_period_us (quota -1 is no limit). nullopt when there is
// no limit or the text does not parse.
std::optional<int> CpusFromCgroupV2Max(const std::string& cpu_max);
std::optional<int> CpusFromCgroupV1(const std::string& quota_us, const std::string& period_us);

}  // namespace sds
