// Where the cache's bytes live. The CPU backend uses host memory; the CUDA backend
// supplies device memory whose Copy is ordered on its compute stream.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace sds {

class PageMemory {
 public:
  virtual ~PageMemory() = default;
  // Allocates `bytes` bytes (RESOURCE_EXHAUSTED on failure). Contents are unspecified.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Copies within this memory, ordered after all earlier work that writes or reads
  // `src`/`dst`; done before any later work once WaitForCopies has returned (the CUDA
  // version enqueues on a stream of its own; the host version is a plain memmove).
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  // Sets `bytes` bytes to zero, with the same ordering as Copy.
  virtual absl::Status Zero(void* dst, size_t bytes) = 0;
  // Returns once every Copy and Zero issued so far is done (the cache calls it before it
  // returns from a call that issued any, so no later work can see them unfinished).
  virtual absl::Status WaitForCopies() = 0;
  // True when the CPU may dereference the pointers this memory hands out.
  virtual bool host_accessible() const = 0;
};

// Plain 64-byte-aligned host memory.
std::unique_ptr<PageMemory> MakeHostPageMemory();

}  // namespace sds
