#include "server/cuda/input_upload.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_kernels.h"
#include "server/cuda/cuda_cleanup.h"

namespace sds::cudabackend {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

InputUpload::~InputUpload() {
  if (pinned_ != nullptr)
    LogIfCudaCleanupFailed(cudaFreeHost(pinned_), "cudaFreeHost of the input pack");
}

absl::Status InputUpload::Init() {
  if (pinned_ == nullptr) {
    const cudaError_t err = cudaHostAlloc(&pinned_, kPackBytes, cudaHostAllocDefault);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky: later launches must not see it
      pinned_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrCat("pinned allocation of ", kPackBytes,
                       " bytes for the input pack failed: ", cudaGetErrorString(err)));
    }
  }
  return packed_.Reserve(kPackBytes, "input pack");
}

absl::Status InputUpload::Stage(const std::vector<Input>& inputs, std::vector<void*>* device) {
  if (pinned_ == nullptr || packed_.get() == nullptr)
    return absl::FailedPreconditionError("InputUpload::Stage before a successful Init");
  device->assign(inputs.size(), nullptr);
  direct_.clear();
  auto* host = static_cast<unsigned char*>(pinned_);
  auto* dev = static_cast<unsigned char*>(packed_.get());
  size_t at = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    if (in.in_place != nullptr) {
      (*device)[i] = const_cast<void*>(in.in_place);
      continue;
    }
    if (in.host == nullptr) {  // filled on the device: room only
      if (absl::Status s = in.own->Reserve(in.bytes, in.what); !s.ok()) return s;
      (*device)[i] = in.own->get();
      continue;
    }
    if (in.bytes <= kPackPieceBytes && at + AlignUp(in.bytes) <= kPackBytes) {
      if (in.bytes > 0) std::memcpy(host + at, in.host, in.bytes);
      (*device)[i] = dev + at;
      at += AlignUp(in.bytes);
      continue;
    }
    if (absl::Status s = in.own->Reserve(in.bytes, in.what); !s.ok()) return s;
    (*device)[i] = in.own->get();
    direct_.push_back({in.own->get(), in.host, in.bytes, in.what});
  }
  packed_bytes_ = at;
  return absl::OkStatus();
}

absl::Status InputUpload::Send(cudaStream_t stream) {
  if (packed_bytes_ > 0) {
    if (absl::Status s = cuda::CudaCall(
            cudaMemcpyAsync(packed_.get(), pinned_, packed_bytes_, cudaMemcpyHostToDevice, stream),
            "copy of the packed batch inputs to the device");
        !s.ok())
      return s;
  }
  for (const Copy& c : direct_) {
    if (absl::Status s = cuda::CudaCall(
            cudaMemcpyAsync(c.device, c.host, c.bytes, cudaMemcpyHostToDevice, stream),
            absl::StrCat("copy of ", c.what, " to the device"));
        !s.ok())
      return s;
  }
  return absl::OkStatus();
}

}  // namespace sds::cudabackend
