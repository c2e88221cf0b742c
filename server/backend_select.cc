#include "server/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace sds::server {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const std::string& which,
                                                       const BackendConfig& config) {
  if (which == "cpu") return CreateCpuBackend(config);
  const absl::Status gpu = CudaDeviceStatus();
  if (which == "cuda") {
    if (!gpu.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--backend=cuda but no usable GPU: ", gpu.message(), "; use --backend=cpu or auto"));
    }
    return CreateCudaBackend(config);
  }
  if (gpu.ok()) {
    auto backend = CreateCudaBackend(config);
    if (backend.ok()) return backend;
    spdlog::warn("--backend=auto: the CUDA backend failed ({}); falling back to cpu",
                 backend.status().ToString());
  } else if (absl::IsNotFound(gpu)) {
    spdlog::info("--backend=auto: {}; using the cpu backend", std::string(gpu.message()));
  } else {
    // A GPU is there but cannot be used: say why, loudly (a silent CPU fallback on a
    // GPU host would look like a slow server).
    spdlog::warn("--backend=auto: a GPU is present but unusable ({}); falling back to cpu",
                 gpu.ToString());
  }
  return CreateCpuBackend(config);
}

}  // namespace sds::server
