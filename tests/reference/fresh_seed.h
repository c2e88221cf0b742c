// Seeds of the randomised tests: fresh on every run (std::random_device), so that runs
// keep drawing new inputs; SDS_TEST_SEED=<seed> replays a failure from the seed that its
// message printed.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>

namespace sds::test {

inline uint32_t FreshSeed() {
  if (const char* fixed = std::getenv("SDS_TEST_SEED"))
    return static_cast<uint32_t>(std::stoul(fixed));
  return std::random_device{}();
}

}  // namespace sds::test
