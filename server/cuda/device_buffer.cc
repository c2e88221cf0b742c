#include "server/cuda/device_buffer.h"

#include "absl/strings/str_cat.h"
#include "server/cuda/cuda_cleanup.h"

namespace sds::cudabackend {

absl::Status DeviceBuffer::Reserve(size_t bytes, const char* what) {
  if (bytes <= capacity_) return absl::OkStatus();
  Release();
  const size_t grown = bytes + bytes / 4;  // headroom against repeated growth
  const cudaError_t err = cudaMalloc(&ptr_, grown);
  if (err != cudaSuccess) {
    cudaGetLastError();
    ptr_ = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("device allocation of ", grown, " bytes for ",
                                                     what, " failed: ", cudaGetErrorString(err)));
  }
  capacity_ = grown;
  return absl::OkStatus();
}

void DeviceBuffer::Release() {
  if (ptr_ != nullptr) LogIfCudaCleanupFailed(cudaFree(ptr_), "cudaFree of a device buffer");
  ptr_ = nullptr;
  capacity_ = 0;
}

}  // namespace sds::cudabackend
