// Helpers of the GPU tests: device buffers, a paged FP8 cache built on the host with
// CpuAppend and mirrored on the device, and random decode batches (host + device).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/decode_params.h"

namespace sds::gputest {

// True when a CUDA device of compute capability 9.0 (the sm_90a build) is present.
bool HaveGpu();

// Aborts the test binary with the CUDA error text (setup failures only).
void Check(cudaError_t err, const char* what);

// Streaming multiprocessors of the current device (a GPU must be present).
int SmCount();

// Owning device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
DeviceBuffer Upload(const std::vector<T>& host) {
  DeviceBuffer buf(host.size() * sizeof(T) + 16);
  if (!host.empty())
    Check(cudaMemcpy(buf.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
          "upload");
  return buf;
}
template <typename T>
std::vector<T> Download(const DeviceBuffer& buf, size_t count) {
  std::vector<T> host(count);
  if (count)
    Check(cudaMemcpy(host.data(), buf.get(), count * sizeof(T), cudaMemcpyDeviceToHost),
          "download");
  return host;
}

uint16_t RandomBf16(std::mt19937& rng, float stddev);

// A cache of `num_seqs` sequences, every layer filled to its length through CpuAppend.
struct TestCache {
  CacheGeometry geo;
  // Host mirror. k, v: [L, P, page_size, Hkv, D]; token scales [L, P, page_size, Hkv].
  std::vector<uint8_t> k, v;
  std::vector<float> k_ts, v_ts, layer_k, layer_v;  // layer_*: [L]
  std::vector<std::vector<int32_t>> pages;          // per sequence, logical page order
  std::vector<int32_t> lengths;                     // tokens per sequence
  DeviceBuffer dk, dv, dk_ts, dv_ts, dlayer_k, dlayer_v;

  CacheView HostView();
  CacheView DeviceView() const;
  void UploadAll();
};

// lengths: tokens of each sequence. Pages are handed out in a shuffled order.
TestCache BuildCache(int layers, int hkv, int head_dim, int page_size, ScaleMode mode,
                     const std::vector<int32_t>& lengths, uint32_t seed);

struct RequestSpec {
  int seq = 0;
  int layer = 0;
  int topk = 0;
  bool per_kv_head = false;
  uint32_t seed = 0;  // indices, q and gate come from this seed alone
};

// A batch on the host and its device copy (out/lse poisoned before each launch).
struct TestBatch {
  int hq = 0, hkv = 0, d = 0;
  std::vector<uint16_t> q, gate;  // [B, Hq, D]
  std::vector<int32_t> layer, page_table, indices, topk;
  std::vector<int64_t> page_table_offset, index_offset;
  std::vector<uint8_t> per_kv;
  DeviceBuffer dq, dgate, dlayer, dpt, dpto, didx, didxo, dtopk, dperkv, dout, dlse;
  int32_t max_topk = 0;

  int size() const { return static_cast<int>(topk.size()); }
  DecodeBatch HostBatch(uint16_t* out, float* lse) const;
  DecodeBatch DeviceBatch(bool with_lse) const;
  void Poison();  // fills device out/lse with NaN bit patterns
};

TestBatch BuildBatch(const TestCache& cache, int hq, const std::vector<RequestSpec>& specs);

// Runs LaunchDecode with `kernel` on the batch (workspace allocated here) and downloads
// out/lse. host_scalars: pass the host copies of the per-request arrays too (as the
// backend does), so batches of at most cuda::DecodeInlineRequests() requests take their
// scalars from the launch parameters; `host` (optional) replaces those copies (a test
// that makes them disagree with the device arrays sees which ones the kernel read).
// append_first (device pointers, optional): launched with LaunchAppend on the decode's
// stream right before it, the decode then launched as the backend launches it after an
// append (LaunchDecode's after_append: programmatic dependent launch).
void RunGpuDecode(const TestCache& cache, TestBatch& batch, bool with_lse,
                  std::vector<uint16_t>* out, std::vector<float>* lse,
                  cuda::DecodeKernel kernel = cuda::DecodeKernel::kV1, bool host_scalars = true,
                  const DecodeBatch* host = nullptr, const AppendBatch* append_first = nullptr);

// "v1", "v2", "v2coarse", "v2fine" (test names).
std::string KernelName(cuda::DecodeKernel kernel);

// Compares request b's output rows with ReferenceDecode: every element within `ulps`
// bf16 ulps (at max(|want|, row max / 64)); rows without a valid index must be +0.
// Returns "" or the first failures.
std::string CompareWithReference(TestCache& cache, const TestBatch& batch, int b,
                                 const std::vector<uint16_t>& out, const std::vector<float>& lse,
                                 double ulps);

}  // namespace sds::gputest
