// Built when the CUDA backend is not: there is never a usable GPU.
#include "absl/status/status.h"
#include "server/backend.h"

namespace sds {

absl::Status CudaDeviceStatus() {
  return absl::NotFoundError("this decode_server was built without the CUDA backend");
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendConfig&) {
  return absl::UnavailableError("this decode_server was built without the CUDA backend");
}

}  // namespace sds
