// Host-to-device upload of one batch's inputs for the CUDA backend. Small inputs are
// gathered into one pinned buffer and sent with one cudaMemcpyAsync: at one request a
// batch has 13 inputs of a few KB, and each copy of its own costs microseconds of
// copy-engine latency, which was most of one request's device time (compute p99 96-106
// us before, 51 us with every input of a small batch packed: bench/RESULTS.md). Inputs
// above kPackPieceBytes are copied straight from the pinned staging memory into their
// own buffers: gathering them would cost a host memcpy that grows with the batch (with
// every input of batches up to 1 MB packed, 16 streams measured slower).
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
    const void* host;   // pinned staging memory
    size_t bytes;       // may be 0
    const char* what;   // for error messages
  };

  InputUpload() = default;
  InputUpload(const InputUpload&) = delete;
  InputUpload& operator=(const InputUpload&) = delete;
  ~InputUpload();

  // Enqueues the copies of `inputs` on `stream` and sets device[i] to where input i will
  // be (256-byte aligned). The host memory must stay untouched until the stream has
  // passed the copies; the caller synchronises before the next Upload.
  absl::Status Upload(const std::vector<Input>& inputs, cudaStream_t stream,
                      std::vector<void*>* device);

 private:
  void* pinned_ = nullptr;  // [kPackBytes] host, allocated on first use
  DeviceBuffer packed_;     // [kPackBytes] device
};

}  // namespace sds::cudabackend
