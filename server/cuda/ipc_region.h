// A runner's device allocation opened in this process through CUDA IPC
// (cudaIpcOpenMemHandle), bounds-checked against the allocation's real size, closed on
// destruction.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/backend.h"

namespace sds::cudabackend {

// Opens `ipc_handle` (the 64 bytes of a cudaIpcMemHandle_t) on the current device, which
// must be `device_id`, and maps [offset, offset + byte_size) of its allocation.
// INVALID_ARGUMENT for a malformed handle, another device or a range past the
// allocation; UNAVAILABLE with the driver's error when it refuses the handle.
absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenIpcRegion(absl::string_view ipc_handle,
                                                             int32_t device_id, uint64_t offset,
                                                             uint64_t byte_size);

}  // namespace sds::cudabackend
