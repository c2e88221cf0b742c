// Checks of the CUDA calls that release resources (frees, destroys, the destructor's
// final synchronisation). They cannot fail the caller, which is tearing down, but a
// failure must not pass silently: it is logged with what was being released, and the
// thread's last error is cleared so that a later launch check does not report it again.
#pragma once

#include <cuda_runtime_api.h>

#include "spdlog/spdlog.h"

namespace sds::cudabackend {

inline void LogIfCudaCleanupFailed(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  spdlog::error("CUDA backend: {} failed: {}: {}", what, cudaGetErrorName(err),
                cudaGetErrorString(err));
}

}  // namespace sds::cudabackend
