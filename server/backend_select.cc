#include "server/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace sds::server {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& which,
                                                       const BackendConfig& config) {
  if (which == "cpu") return CreateCpuBackend(config);
  const bool gpu = CudaDeviceAvailable();
  if (which == "cuda") {
    if (!gpu) {
      return absl::FailedPreconditionError(
          "--backend=cuda but no usable GPU (or a build without CUDA); use --backend=cpu or auto");
    }
    return CreateCudaBackend(config);
  }
  if (gpu) {
    auto backend = CreateCudaBackend(config);
    if (backend.ok()) return backend;
    spdlog::warn("--backend=auto: the CUDA backend failed ({}); falling back to cpu",
                 backend.status().ToString());
  } else {
    spdlog::info("--backend=auto: no usable GPU, using the cpu backend");
  }
  return CreateCpuBackend(config);
}

}  // namespace sds::server
