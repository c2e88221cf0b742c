// Growable device allocation of the CUDA backend (capacity only grows; contents are
// not preserved across growth).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"

namespace sds::cudabackend {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Release(); }

  // Makes room for `bytes` bytes. RESOURCE_EXHAUSTED when the device is full.
  absl::Status Reserve(size_t bytes, const char* what);
  void Release();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t capacity() const { return capacity_; }

 private:
  void* ptr_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace sds::cudabackend
