// Host-to-device upload of one batch's inputs for the CUDA backend. Small inputs are
// gathered into one pinned buffer and sent with one cudaMemcpyAsync: at one request a
// batch has 13 inputs of a few KB, and each copy of its own costs microseconds of
// copy-engine latency, which was most of one request's device time (compute p99 96-106
// us before, 51 us with every input of a small batch packed: bench/RESULTS.md). Inputs
// above kPackPieceBytes are copied straight from the pinned staging memory into their
// own buffers, or read there by the kernels (Input::in_place, cuda_backend.h):
// gathering them would cost a host memcpy that grows with the batch (with every input
// of batches up to 1 MB packed, 16 streams measured slower).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "server/cuda/device_buffer.h"

namespace sds::cudabackend {

class InputUpload {
 public:
  // Inputs of at most kPackPieceBytes go into the pack while it has room.
  static constexpr size_t kPackPieceBytes = size_t{16} << 10;
  static constexpr size_t kPackBytes = size_t{256} << 10;

  struct Input {
    DeviceBuffer* own;  // the input's own device buffer (used when not packed)
    // Pinned staging memory; nullptr: nothing to send, the device fills the input's own
    // buffer (a batch whose rows are all gathered from CUDA regions).
    const void* host;
    size_t bytes;      // may be 0
    const char* what;  // for error messages
    // The device address of `host` in mapped staging when the kernels are to read the
    // input there, over PCIe (nothing copied); nullptr: upload it.
    const void* in_place = nullptr;
  };

  InputUpload() = default;
  InputUpload(const InputUpload&) = delete;
  InputUpload& operator=(const InputUpload&) = delete;
  ~InputUpload();

  // Allocates the pinned and device packs. RESOURCE_EXHAUSTED when either fails.
  absl::Status Init();
  // Host side of an upload: copies the small inputs into the pinned pack, makes room in
  // the large inputs' own buffers and sets device[i] to where input i will be (256-byte
  // aligned; an in-place input's own address). Enqueues nothing, so the host copying
  // stays out of the device timing.
  absl::Status Stage(const std::vector<Input>& inputs, std::vector<void*>* device);
  // Enqueues the staged copies on `stream`: the pack (one copy), then each large input.
  // The host memory must stay untouched until the stream has passed them; the caller
  // synchronises the stream before the next Stage.
  absl::Status Send(cudaStream_t stream);

 private:
  struct Copy {
    void* device;
    const void* host;
    size_t bytes;
    const char* what;
  };
  void* pinned_ = nullptr;    // [kPackBytes] host
  DeviceBuffer packed_;       // [kPackBytes] device
  size_t packed_bytes_ = 0;   // staged bytes of the pack
  std::vector<Copy> direct_;  // staged copies of the large inputs
};

}  // namespace sds::cudabackend
