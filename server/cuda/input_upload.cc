#include "server/cuda/input_upload.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_kernels.h"

namespace sds::cudabackend {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

InputUpload::~InputUpload() {
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
}

absl::Status InputUpload::Upload(const std::vector<Input>& inputs, cudaStream_t stream,
                                 std::vector<void*>* device) {
  device->assign(inputs.size(), nullptr);
  if (pinned_ == nullptr) {
    if (absl::Status s = cuda::CudaCall(cudaHostAlloc(&pinned_, kPackBytes, cudaHostAllocDefault),
                                        "pinned input pack allocation");
        !s.ok()) {
      pinned_ = nullptr;
      return s;
    }
  }
  if (absl::Status s = packed_.Reserve(kPackBytes, "input pack"); !s.ok()) return s;
  auto* host = static_cast<unsigned char*>(pinned_);
  auto* dev = static_cast<unsigned char*>(packed_.get());
  size_t at = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Input& in = inputs[i];
    if (in.bytes <= kPackPieceBytes && at + AlignUp(in.bytes) <= kPackBytes) {
      if (in.bytes > 0) std::memcpy(host + at, in.host, in.bytes);
      (*device)[i] = dev + at;
      at += AlignUp(in.bytes);
      continue;
    }
    // Large: straight from the pinned staging memory into the input's own buffer.
    if (absl::Status s = in.own->Reserve(in.bytes, in.what); !s.ok()) return s;
    if (absl::Status s = cuda::CudaCall(
            cudaMemcpyAsync(in.own->get(), in.host, in.bytes, cudaMemcpyHostToDevice, stream),
            absl::StrCat("copy of ", in.what, " to the device"));
        !s.ok())
      return s;
    (*device)[i] = in.own->get();
  }
  if (at == 0) return absl::OkStatus();
  return cuda::CudaCall(cudaMemcpyAsync(dev, host, at, cudaMemcpyHostToDevice, stream),
                        "copy of the packed batch inputs to the device");
}

}  // namespace sds::cudabackend
