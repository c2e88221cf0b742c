// A failed property aborts the process: libFuzzer then saves the input as a crash
// (crash-<sha1>) and the sanitizer prints the stack.
#pragma once

#include <cstdio>
#include <cstdlib>

#define SDS_FUZZ_CHECK(cond, ...)                                                   \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                            \
      std::fprintf(stderr, "\n");                                                   \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)
