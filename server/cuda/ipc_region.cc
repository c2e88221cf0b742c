#include "server/cuda/ipc_region.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/cuda/cuda_cleanup.h"

namespace sds::cudabackend {
namespace {

class IpcMapping final : public DeviceMapping {
 public:
  IpcMapping(void* allocation, char* region) : allocation_(allocation), region_(region) {}
  ~IpcMapping() override {
    LogIfCudaCleanupFailed(cudaIpcCloseMemHandle(allocation_), "cudaIpcCloseMemHandle");
  }
  void* device_address() const override { return region_; }

 private:
  void* allocation_;
  char* region_;
};

std::string CudaText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// The size of the allocation that starts at `base`, from the driver (the runtime has no
// call for it): cuMemGetAddressRange through the runtime's driver entry point, so that
// the backend needs no link against libcuda.
absl::StatusOr<uint64_t> AllocationBytes(void* base) {
  static PFN_cuMemGetAddressRange_v3020 range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn);
  }();
  if (range == nullptr) {
    return absl::UnavailableError("the CUDA driver has no cuMemGetAddressRange entry point");
  }
  CUdeviceptr start = 0;
  size_t bytes = 0;
  if (const CUresult r = range(&start, &bytes, reinterpret_cast<CUdeviceptr>(base));
      r != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("cuMemGetAddressRange failed with CUresult ", r));
  }
  // An IPC handle names a whole allocation, opened at its start.
  return static_cast<uint64_t>(bytes) - (reinterpret_cast<CUdeviceptr>(base) - start);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenIpcRegion(absl::string_view ipc_handle,
                                                             int32_t device_id, uint64_t offset,
                                                             uint64_t byte_size) {
  if (ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("ipc_handle has ", ipc_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ",
                                                   sizeof(cudaIpcMemHandle_t)));
  }
  int current = -1;
  if (const cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cudaGetDevice: ", CudaText(e)));
  }
  if (device_id != current) {
    return absl::InvalidArgumentError(absl::StrCat("the region is on device ", device_id,
                                                   "; this server runs on device ", current));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof handle);
  void* base = nullptr;
  if (const cudaError_t e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("cudaIpcOpenMemHandle refused the handle: ", CudaText(e)));
  }
  auto mapping = std::make_unique<IpcMapping>(base, static_cast<char*>(base) + offset);
  absl::StatusOr<uint64_t> allocation = AllocationBytes(base);
  if (!allocation.ok()) return allocation.status();  // closes the handle
  if (offset > *allocation || byte_size > *allocation - offset) {
    return absl::InvalidArgumentError(absl::StrCat("offset ", offset, " + byte_size ", byte_size,
                                                   " is past the end of the shared allocation (",
                                                   *allocation, " bytes)"));
  }
  return mapping;
}

}  // namespace sds::cudabackend
