// The CUDA backend: the paged FP8 cache in device memory (copy-on-write and zeroing
// ordered on the backend's stream), pinned staging mapped into the device address
// space, asynchronous input copies (or, for the bulk tensors too large for the pack,
// reads in place from the staging: cuda_backend.h), one append launch and one decode
// launch per batch (the decode overlapping the append's end through programmatic
// dependent launch), the outputs copied back or, for small batches, written by the
// decode straight into the staging (cuda_backend.h), CUDA-event timing.
#include "server/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/device_rows.h"
#include "server/backend.h"
#include "server/cuda/cuda_cleanup.h"
#include "server/cuda/device_buffer.h"
#include "server/cuda/input_upload.h"
#include "server/cuda/ipc_region.h"
#include "spdlog/spdlog.h"

namespace sds {
namespace {

using cuda::CudaCall;
using cudabackend::DeviceBuffer;
using cudabackend::InputUpload;
using cudabackend::LogIfCudaCleanupFailed;

// Device memory for the cache pool. Copy and Zero enqueue on a stream of their own and
// WaitForCopies waits for it, so they are done before the batch that needed them (on
// any lane) enqueues a kernel. They are rare (copy-on-write after a fork; zeroing at
// start-up).
class CudaPageMemory : public PageMemory {
 public:
  explicit CudaPageMemory(cudaStream_t stream) : stream_(stream) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* ptr = nullptr;
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(absl::StrCat(
          "cudaMalloc of ", bytes, " bytes for the KV cache failed: ", cudaGetErrorString(err)));
    }
    return ptr;
  }
  void Free(void* ptr) override {
    if (ptr != nullptr) LogIfCudaCleanupFailed(cudaFree(ptr), "cudaFree of the KV cache pool");
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    return CudaCall(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
                    "cache page copy (copy-on-write)");
  }
  absl::Status Zero(void* dst, size_t bytes) override {
    return CudaCall(cudaMemsetAsync(dst, 0, bytes, stream_), "cache page zero");
  }
  absl::Status WaitForCopies() override {
    return CudaCall(cudaStreamSynchronize(stream_), "cache page copies and zeroing");
  }
  bool host_accessible() const override { return false; }

 private:
  cudaStream_t stream_;
};

template <typename T>
absl::Status CopyIn(DeviceBuffer& buf, const T* host, int64_t count, const char* what,
                    cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  if (absl::Status s = buf.Reserve(sizeof(T) * count, what); !s.ok()) return s;
  return CudaCall(
      cudaMemcpyAsync(buf.get(), host, sizeof(T) * count, cudaMemcpyHostToDevice, stream),
      absl::StrCat("copy of ", what, " to the device"));
}

// One upload input of `count` elements of T (bytes from the element type).
template <typename T>
InputUpload::Input Input(DeviceBuffer* own, const T* host, size_t count, const char* what) {
  return {own, host, sizeof(T) * count, what, nullptr};
}

// Staging allocations, pinned and mapped into the device address space, by host
// address; AllocateStaging may run on other threads than Run.
class MappedStaging {
 public:
  MappedStaging() = default;
  MappedStaging(const MappedStaging&) = delete;
  MappedStaging& operator=(const MappedStaging&) = delete;

  // nullptr when either CUDA call fails (the error is cleared: not sticky).
  void* Allocate(size_t bytes) {
    void* host = nullptr;
    if (const cudaError_t e = cudaHostAlloc(&host, bytes == 0 ? 1 : bytes, cudaHostAllocMapped);
        e != cudaSuccess) {
      cudaGetLastError();
      spdlog::warn("CUDA backend: mapped staging of {} bytes: cudaHostAlloc: {}: {}", bytes,
                   cudaGetErrorName(e), cudaGetErrorString(e));
      return nullptr;
    }
    // The device address of mapped memory need not equal the host one (the CUDA docs
    // promise that only under unified addressing), so ask for it.
    void* device = nullptr;
    if (const cudaError_t e = cudaHostGetDevicePointer(&device, host, 0); e != cudaSuccess) {
      cudaGetLastError();
      spdlog::warn("CUDA backend: mapped staging of {} bytes: cudaHostGetDevicePointer: {}: {}",
                   bytes, cudaGetErrorName(e), cudaGetErrorString(e));
      LogIfCudaCleanupFailed(cudaFreeHost(host), "cudaFreeHost of unmappable staging");
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    regions_[reinterpret_cast<uintptr_t>(host)] = {bytes, static_cast<char*>(device)};
    return host;
  }
  void Free(void* host) {
    if (host == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      regions_.erase(reinterpret_cast<uintptr_t>(host));
    }
    LogIfCudaCleanupFailed(cudaFreeHost(host), "cudaFreeHost of mapped staging");
  }
  // Device address of host[0 .. bytes) when it lies inside one allocation and is
  // 16-byte aligned (what the kernels assume of their device buffers; a copy takes any
  // alignment), else nullptr.
  void* DeviceAddress(const void* host, size_t bytes) const {
    const uintptr_t h = reinterpret_cast<uintptr_t>(host);
    if (host == nullptr || h % 16 != 0) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.upper_bound(h);
    if (it == regions_.begin()) return nullptr;
    --it;
    const uintptr_t offset = h - it->first;
    if (offset > it->second.bytes || bytes > it->second.bytes - offset) return nullptr;
    char* device = it->second.device + offset;
    return reinterpret_cast<uintptr_t>(device) % 16 == 0 ? device : nullptr;
  }

 private:
  struct Region {
    size_t bytes;
    char* device;  // the allocation's device address
  };
  mutable std::mutex mu_;
  std::map<uintptr_t, Region> regions_;  // by host start
};

// Errors after which the CUDA context is unusable until the process exits (the CUDA
// runtime documentation's "sticky" errors: a kernel fault or an uncorrectable memory
// error); every later call in the process returns them.
bool IsStickyCudaError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

class CudaBackend : public Backend {
 private:
  // A batch's stream, events and buffers: concurrent Runs use different lanes, so their
  // copies and kernels overlap on the device (the batcher gives concurrent batches
  // disjoint sequences; the cache's page copies are synchronous on cache_stream_).
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    cudaEvent_t uploaded = nullptr, appended = nullptr;  // options_.log_phases only
    cuda::DecodeWorkspace workspace;
    // partial: split-K floats; counters: [B_max * Hkv].
    DeviceBuffer partial, counters;
    // q, gate, out: [B_max, Hq, D] bf16; lse: [B_max, Hq] float.
    DeviceBuffer q, gate, out, lse;
    // Append inputs: k_new, v_new: [N, Hkv, D] bf16; a_layer: [N]; a_slot: [N] int64.
    DeviceBuffer k_new, v_new, a_layer, a_slot;
    // Decode metadata: [B] each; d_index: flat indices; d_pages: flat page tables.
    DeviceBuffer d_layer, d_pto, d_io, d_topk, d_perkv, d_index, d_pages;
    // Rows on the device (DeviceRowSource): d_rows [B] sources, d_row_error [B] verdicts.
    DeviceBuffer d_rows, d_row_error;
    // Inputs of at most 16 KB go in one packed copy; larger ones into their buffers
    // above, or are read in place from the staging.
    InputUpload upload;
    CudaBatchPath path;  // of the last Enqueue on this lane

    std::vector<DeviceBuffer*> Buffers() {
      return {&partial, &counters, &q,       &gate,    &out,        &lse,  &k_new,
              &v_new,   &a_layer,  &a_slot,  &d_layer, &d_pto,      &d_io, &d_topk,
              &d_perkv, &d_index,  &d_pages, &d_rows,  &d_row_error};
    }
  };

 public:
  CudaBackend(const BackendConfig& config, const CudaBackendOptions& options)
      : config_(config), options_(options) {}
  ~CudaBackend() override {
    for (const std::unique_ptr<Lane>& lane : lanes_)
      if (lane->stream != nullptr)
        LogIfCudaCleanupFailed(cudaStreamSynchronize(lane->stream), "final stream synchronisation");
    cache_.reset();  // frees the pool through CudaPageMemory
    layer_k_.Release();
    layer_v_.Release();
    for (const std::unique_ptr<Lane>& lane : lanes_) {
      for (DeviceBuffer* b : lane->Buffers()) b->Release();
      for (cudaEvent_t e : {lane->start, lane->stop, lane->uploaded, lane->appended})
        if (e != nullptr) LogIfCudaCleanupFailed(cudaEventDestroy(e), "cudaEventDestroy");
      if (lane->stream != nullptr)
        LogIfCudaCleanupFailed(cudaStreamDestroy(lane->stream), "cudaStreamDestroy");
    }
    if (cache_stream_ != nullptr)
      LogIfCudaCleanupFailed(cudaStreamDestroy(cache_stream_), "cudaStreamDestroy");
  }

  absl::Status Init() {
    if (absl::Status s = CudaCall(cudaStreamCreateWithFlags(&cache_stream_, cudaStreamNonBlocking),
                                  "cudaStreamCreate");
        !s.ok())
      return s;
    absl::StatusOr<std::unique_ptr<PagedKvCache>> cache =
        PagedKvCache::Create(config_.cache, std::make_unique<CudaPageMemory>(cache_stream_));
    if (!cache.ok()) return cache.status();
    cache_ = *std::move(cache);
    // Per-layer scales: the cache keeps host copies; the kernels need device ones.
    const CacheView view = cache_->view();
    const int32_t layers = config_.cache.num_layers;
    if (view.layer_k_scale != nullptr && view.layer_v_scale != nullptr) {
      if (absl::Status s =
              CopyIn(layer_k_, view.layer_k_scale, layers, "layer k scales", cache_stream_);
          !s.ok())
        return s;
      if (absl::Status s =
              CopyIn(layer_v_, view.layer_v_scale, layers, "layer v scales", cache_stream_);
          !s.ok())
        return s;
    }
    if (config_.max_topk > cuda::DecodeMaxTopK())
      return absl::InvalidArgumentError(absl::StrCat("CUDA backend: max_topk ", config_.max_topk,
                                                     " exceeds ", cuda::DecodeMaxTopK()));
    if (options_.lanes < 1 || options_.lanes > 8)
      return absl::InvalidArgumentError(
          absl::StrCat("CUDA backend: lanes must be in [1, 8], got ", options_.lanes));
    for (int i = 0; i < options_.lanes; ++i) {
      lanes_.push_back(std::make_unique<Lane>());
      if (absl::Status s = InitLane(*lanes_.back()); !s.ok()) return s;
      free_lanes_.push_back(lanes_.back().get());
    }
    return CudaCall(cudaStreamSynchronize(cache_stream_), "CUDA backend initialisation");
  }

  std::string name() const override { return "cuda"; }
  PagedKvCache& cache() override { return *cache_; }

  void* AllocateStaging(size_t bytes) override { return staging_.Allocate(bytes); }
  void FreeStaging(void* ptr) override { staging_.Free(ptr); }
  CudaBatchPath last_path() const {
    std::lock_guard<std::mutex> lock(lanes_mu_);
    return last_path_;
  }
  int max_concurrent_runs() const override { return static_cast<int>(lanes_.size()); }

  bool reads_device_rows() const override { return true; }
  absl::StatusOr<std::unique_ptr<DeviceMapping>> OpenCudaIpcRegion(absl::string_view ipc_handle,
                                                                   int32_t device_id,
                                                                   uint64_t offset,
                                                                   uint64_t byte_size) override {
    return cudabackend::OpenIpcRegion(ipc_handle, device_id, offset, byte_size);
  }

  // Runs on a free lane (waiting for one when every lane is busy).
  absl::Status Run(const BatchWork& work, BatchTiming* timing) override {
    Lane* lane;
    {
      std::unique_lock<std::mutex> lock(lanes_mu_);
      lane_cv_.wait(lock, [&] { return !free_lanes_.empty(); });
      lane = free_lanes_.back();
      free_lanes_.pop_back();
    }
    absl::Status status;
    try {
      status = RunOnLane(*lane, work, timing);
    } catch (const std::exception& e) {
      // bad_alloc while enqueuing: drain what was enqueued (it may read staging that the
      // caller frees next) and give the lane back, or the next Run would wait forever.
      LogIfCudaCleanupFailed(cudaStreamSynchronize(lane->stream),
                             "stream synchronisation after an exception");
      status = absl::InternalError(absl::StrCat("CUDA batch: ", e.what()));
    }
    {
      std::lock_guard<std::mutex> lock(lanes_mu_);
      last_path_ = lane->path;
      free_lanes_.push_back(lane);
    }
    lane_cv_.notify_one();
    return status;
  }

 private:
  // One lane's stream, events, split-K workspace, input pack and fixed-size buffers.
  absl::Status InitLane(Lane& lane) {
    if (absl::Status s = CudaCall(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking),
                                  "cudaStreamCreate");
        !s.ok())
      return s;
    if (absl::Status s = CudaCall(cudaEventCreate(&lane.start), "cudaEventCreate"); !s.ok())
      return s;
    if (absl::Status s = CudaCall(cudaEventCreate(&lane.stop), "cudaEventCreate"); !s.ok())
      return s;
    if (options_.log_phases) {
      for (cudaEvent_t* e : {&lane.uploaded, &lane.appended})
        if (absl::Status s = CudaCall(cudaEventCreate(e), "cudaEventCreate"); !s.ok()) return s;
    }
    // Split-K workspace for the largest batch.
    const int32_t hkv = config_.cache.num_kv_heads;
    lane.workspace.capacity_floats = cuda::DecodeWorkspaceFloats(
        config_.max_batch_size, config_.num_q_heads, config_.cache.head_dim, config_.max_topk);
    lane.workspace.capacity_counters = cuda::DecodeWorkspaceCounters(config_.max_batch_size, hkv);
    if (absl::Status s = lane.partial.Reserve(sizeof(float) * (lane.workspace.capacity_floats + 4),
                                              "decode split-K workspace");
        !s.ok())
      return s;
    if (absl::Status s = lane.counters.Reserve(
            sizeof(int32_t) * (lane.workspace.capacity_counters + 1), "decode split-K counters");
        !s.ok())
      return s;
    lane.workspace.partial = lane.partial.as<float>();
    lane.workspace.counters = lane.counters.as<int32_t>();
    if (absl::Status s =
            CudaCall(cudaMemsetAsync(lane.counters.get(), 0, lane.counters.capacity(), lane.stream),
                     "zeroing split-K counters");
        !s.ok())
      return s;
    if (absl::Status s = lane.upload.Init(); !s.ok()) return s;
    // Fixed-size decode buffers sized by the config.
    const size_t rows = static_cast<size_t>(config_.max_batch_size) * config_.num_q_heads;
    const size_t elems = rows * config_.cache.head_dim;
    for (auto [buf, bytes, what] :
         {std::tuple{&lane.q, elems * 2, "q"}, std::tuple{&lane.gate, elems * 2, "gate"},
          std::tuple{&lane.out, elems * 2, "out"}, std::tuple{&lane.lse, rows * 4, "lse"}}) {
      if (absl::Status s = buf->Reserve(bytes, what); !s.ok()) return s;
    }
    return CudaCall(cudaStreamSynchronize(lane.stream), "CUDA backend lane initialisation");
  }

  absl::Status RunOnLane(Lane& lane, const BatchWork& work, BatchTiming* timing) {
    absl::Status status = Enqueue(lane, work);
    // Always drain the stream so that no copy or kernel still reads staging memory on
    // return.
    const cudaError_t sync_error = cudaStreamSynchronize(lane.stream);
    absl::Status sync = CudaCall(sync_error, "CUDA batch");
    if (status.ok()) status = sync;
    if (!status.ok()) {
      // A sticky fault leaves the context unusable: every later call returns it.
      const cudaError_t sticky = IsStickyCudaError(sync_error) ? sync_error : cudaPeekAtLastError();
      if (IsStickyCudaError(sticky)) {
        return BackendLostError(
            absl::StrCat("CUDA context lost (", cudaGetErrorName(sticky), "): ", status.message()));
      }
      return status;
    }
    if (timing != nullptr) {
      float ms = 0.0f;
      if (absl::Status s =
              CudaCall(cudaEventElapsedTime(&ms, lane.start, lane.stop), "batch timing");
          !s.ok())
        return s;
      timing->compute_us = std::llround(ms * 1000.0);
    }
    if (options_.log_phases) LogPhases(lane, work);
    return absl::OkStatus();
  }

  // Marks the last two inputs (a pair of equal size: q and gate, or new K and V) of a
  // batch of `rows` requests or tokens to be read in place when rows is within
  // options_.in_place_inputs_max_requests, they are too large for the pack (so each would
  // be a copy of its own) and both lie in mapped staging (device addresses 16-byte
  // aligned); returns whether they were. Packed, they cost no copy of their own, and read
  // in place they measured slower (1 request, bench/RESULTS.md).
  bool InPlace(int32_t rows, std::vector<InputUpload::Input>* inputs) const {
    InputUpload::Input* x = &(*inputs)[inputs->size() - 2];
    InputUpload::Input* y = &(*inputs)[inputs->size() - 1];
    if (rows > options_.in_place_inputs_max_requests || x->bytes <= InputUpload::kPackPieceBytes ||
        y->bytes <= InputUpload::kPackPieceBytes)
      return false;
    const void* dx = staging_.DeviceAddress(x->host, x->bytes);
    const void* dy = staging_.DeviceAddress(y->host, y->bytes);
    if (dx == nullptr || dy == nullptr) return false;
    x->in_place = dx;
    y->in_place = dy;
    return true;
  }

  // options_.log_phases: the last batch's device time between its events.
  void LogPhases(const Lane& lane, const BatchWork& work) const {
    float upload = 0, append = 0, rest = 0;
    if (cudaEventElapsedTime(&upload, lane.start, lane.uploaded) != cudaSuccess ||
        cudaEventElapsedTime(&append, lane.uploaded, lane.appended) != cudaSuccess ||
        cudaEventElapsedTime(&rest, lane.appended, lane.stop) != cudaSuccess) {
      cudaGetLastError();
      spdlog::warn("CUDA batch phases: event times unavailable");
      return;
    }
    spdlog::info(
        "CUDA batch: {} requests, {} appended tokens: input copies {:.1f} us, append {:.1f} us, "
        "decode and output copies {:.1f} us",
        work.decode.num_requests, work.append.num_tokens, upload * 1e3, append * 1e3, rest * 1e3);
  }

  CacheView DeviceView() const {
    CacheView view = cache_->view();  // k, v and token scales already live on the device
    if (view.layer_k_scale != nullptr) view.layer_k_scale = layer_k_.as<float>();
    if (view.layer_v_scale != nullptr) view.layer_v_scale = layer_v_.as<float>();
    return view;
  }

  // Input copies, kernels and output copies of one batch (none for a small batch's
  // outputs in mapped staging), bracketed by the events.
  absl::Status Enqueue(Lane& lane, const BatchWork& work) {
    const CacheView view = DeviceView();
    const CacheGeometry& geo = view.geo;
    const AppendBatch& a = work.append;
    const DecodeBatch& d = work.decode;
    // Rows whose tensors are on the device are gathered into the batch's device arrays
    // (so none of those arrays is read in place from staging), new K/V into append row b.
    const bool device_rows = d.num_requests > 0 && d.device_rows != nullptr;
    if (device_rows && a.num_tokens != d.num_requests)
      return absl::InternalError("CUDA backend: device rows need one appended token per request");
    // Every row on the device: its q, gate, new K/V and indices are the gather's alone, so
    // their staging rows (never filled) are not sent, only given room on the device.
    bool all_device_rows = device_rows;
    for (int32_t r = 0; r < d.num_requests && all_device_rows; ++r)
      all_device_rows = d.device_rows[r].q != nullptr;
    // Inputs in upload order: append k, v, layers, slots; then the decode inputs.
    std::vector<InputUpload::Input> inputs;
    lane.path = CudaBatchPath{};
    if (a.num_tokens > 0) {
      const size_t n = a.num_tokens;
      const size_t row = static_cast<size_t>(geo.num_kv_heads) * geo.head_dim;
      inputs.push_back(
          Input(&lane.k_new, all_device_rows ? nullptr : a.k_new, n * row, "appended k"));
      inputs.push_back(
          Input(&lane.v_new, all_device_rows ? nullptr : a.v_new, n * row, "appended v"));
      // Only a decode batch's own new tokens: a prefill (append only, up to thousands of
      // tokens) keeps its copy (not measured in place).
      if (d.num_requests > 0 && !device_rows)
        lane.path.in_place_new_kv = InPlace(a.num_tokens, &inputs);
      inputs.push_back(Input(&lane.a_layer, a.layer, n, "append layers"));
      inputs.push_back(Input(&lane.a_slot, a.slot, n, "append slots"));
    }
    int32_t max_topk = 0;
    if (d.num_requests > 0) {
      if (absl::Status s = AddDecodeInputs(lane, geo, d, all_device_rows, &inputs, &max_topk);
          !s.ok())
        return s;
    }
    std::vector<void*> dev;
    if (absl::Status s = lane.upload.Stage(inputs, &dev); !s.ok()) return s;
    if (absl::Status s = CudaCall(cudaEventRecord(lane.start, lane.stream), "event record");
        !s.ok())
      return s;
    if (absl::Status s = lane.upload.Send(lane.stream); !s.ok()) return s;
    if (device_rows) {
      if (absl::Status s = GatherDeviceRows(lane, geo, d, dev); !s.ok()) return s;
    }
    if (options_.log_phases) {
      if (absl::Status s = CudaCall(cudaEventRecord(lane.uploaded, lane.stream), "event record");
          !s.ok())
        return s;
    }
    size_t next = 0;
    if (a.num_tokens > 0) {
      const AppendBatch append{
          a.num_tokens, static_cast<const uint16_t*>(dev[0]), static_cast<const uint16_t*>(dev[1]),
          static_cast<const int32_t*>(dev[2]), static_cast<const int64_t*>(dev[3])};
      next = 4;
      if (absl::Status s = cuda::LaunchAppend(view, append, lane.stream); !s.ok()) return s;
    }
    if (options_.log_phases) {
      if (absl::Status s = CudaCall(cudaEventRecord(lane.appended, lane.stream), "event record");
          !s.ok())
        return s;
    }
    if (d.num_requests > 0) {
      if (absl::Status s = EnqueueDecode(lane, view, d, max_topk, &dev[next], a.num_tokens > 0);
          !s.ok())
        return s;
    }
    return CudaCall(cudaEventRecord(lane.stop, lane.stream), "event record");
  }

  // Checks a decode batch against the configuration and appends its inputs: q, gate,
  // layers, page table offsets, index offsets, top-K sizes, index forms, indices, page
  // tables (the last two sized from the host copies).
  // `gathered`: every row is on the device (q, gate and indices get room, no copy).
  absl::Status AddDecodeInputs(Lane& lane, const CacheGeometry& geo, const DecodeBatch& d,
                               bool gathered, std::vector<InputUpload::Input>* inputs,
                               int32_t* max_topk_out) {
    const int32_t b = d.num_requests;
    if (b > config_.max_batch_size)
      return absl::InternalError(absl::StrCat("CUDA backend: batch of ", b,
                                              " requests exceeds max_batch_size ",
                                              config_.max_batch_size));
    if (d.num_q_heads != config_.num_q_heads)
      return absl::InternalError(absl::StrCat("CUDA backend: batch has ", d.num_q_heads,
                                              " query heads, configured for ",
                                              config_.num_q_heads));
    int32_t max_topk = 0;
    int64_t index_total = 0, pages_total = 0;
    for (int32_t r = 0; r < b; ++r) {
      const int32_t k = d.topk[r];
      const int lists = d.indices_per_kv_head[r] ? geo.num_kv_heads : 1;
      max_topk = std::max(max_topk, k);
      index_total = std::max(index_total, d.index_offset[r] + static_cast<int64_t>(k) * lists);
      if (d.device_rows != nullptr && d.device_rows[r].q != nullptr) {
        // Its indices are on the device, checked there against its position: its whole
        // page table (the pages up to its position) goes up.
        pages_total = std::max(
            pages_total, d.page_table_offset[r] + d.device_rows[r].position / geo.page_size + 1);
        continue;
      }
      int32_t max_index = -1;
      const int32_t* list = d.indices + d.index_offset[r];
      for (int64_t i = 0; i < static_cast<int64_t>(k) * lists; ++i)
        max_index = std::max(max_index, list[i]);
      if (max_index >= 0)
        pages_total = std::max(pages_total, d.page_table_offset[r] + max_index / geo.page_size + 1);
    }
    if (max_topk > config_.max_topk)
      return absl::InternalError(
          absl::StrCat("CUDA backend: top-K ", max_topk, " exceeds max_topk ", config_.max_topk));
    const size_t elems = static_cast<size_t>(b) * d.num_q_heads * geo.head_dim;
    const size_t rows = b;
    inputs->push_back(Input(&lane.q, gathered ? nullptr : d.q, elems, "q"));
    inputs->push_back(Input(&lane.gate, gathered ? nullptr : d.gate, elems, "gate"));
    lane.path.in_place_q = d.device_rows == nullptr && InPlace(b, inputs);
    inputs->push_back(Input(&lane.d_layer, d.layer, rows, "layers"));
    inputs->push_back(Input(&lane.d_pto, d.page_table_offset, rows, "page table offsets"));
    inputs->push_back(Input(&lane.d_io, d.index_offset, rows, "index offsets"));
    inputs->push_back(Input(&lane.d_topk, d.topk, rows, "top-K sizes"));
    inputs->push_back(Input(&lane.d_perkv, d.indices_per_kv_head, rows, "index forms"));
    inputs->push_back(Input(&lane.d_index, gathered ? nullptr : d.indices,
                            static_cast<size_t>(index_total), "indices"));
    inputs->push_back(
        Input(&lane.d_pages, d.page_table, static_cast<size_t>(pages_total), "page tables"));
    if (d.device_rows != nullptr)
      inputs->push_back(Input(&lane.d_rows, d.device_rows, rows, "device row sources"));
    *max_topk_out = max_topk;
    return absl::OkStatus();
  }

  // Launches the decode on the staged inputs (dev: the nine device addresses in
  // AddDecodeInputs' order) and copies the outputs back, or, for a batch of at most
  // direct_out_max_requests requests, has the decode write them into the mapped staging
  // (cuda_backend.h). after_append: the append kernel was the last work enqueued, so the
  // decode may overlap it (programmatic dependent launch: its prologue runs during the
  // append, its cache reads wait for it).
  absl::Status EnqueueDecode(Lane& lane, const CacheView& view, const DecodeBatch& d,
                             int32_t max_topk, void* const* dev, bool after_append) {
    const int32_t b = d.num_requests;
    DecodeBatch batch;
    batch.num_requests = b;
    batch.num_q_heads = d.num_q_heads;
    batch.q = static_cast<const uint16_t*>(dev[0]);
    batch.gate = static_cast<const uint16_t*>(dev[1]);
    batch.layer = static_cast<const int32_t*>(dev[2]);
    batch.page_table_offset = static_cast<const int64_t*>(dev[3]);
    batch.index_offset = static_cast<const int64_t*>(dev[4]);
    batch.topk = static_cast<const int32_t*>(dev[5]);
    batch.indices_per_kv_head = static_cast<const uint8_t*>(dev[6]);
    batch.indices = static_cast<const int32_t*>(dev[7]);
    batch.page_table = static_cast<const int32_t*>(dev[8]);
    const int64_t elems = static_cast<int64_t>(b) * d.num_q_heads * view.geo.head_dim;
    const int64_t rows = static_cast<int64_t>(b) * d.num_q_heads;
    // out: [B, Hq, D] bf16, lse: [B, Hq] float, each in staging (direct) or device memory.
    // Device rows are answered from the device buffers (ScatterDeviceOutputs).
    const bool small = b <= options_.direct_out_max_requests && d.device_rows == nullptr;
    void* direct_out = small ? staging_.DeviceAddress(d.out, elems * 2) : nullptr;
    void* direct_lse = small ? staging_.DeviceAddress(d.lse, sizeof(float) * rows) : nullptr;
    lane.path.direct_out = direct_out != nullptr;
    lane.path.direct_lse = direct_lse != nullptr;
    batch.out =
        direct_out != nullptr ? static_cast<uint16_t*>(direct_out) : lane.out.as<uint16_t>();
    batch.lse = d.lse == nullptr        ? nullptr
                : direct_lse != nullptr ? static_cast<float*>(direct_lse)
                                        : lane.lse.as<float>();
    // d's [B] arrays are the host copies of what was uploaded: small batches carry them in
    // the kernel's parameters.
    if (absl::Status s = cuda::LaunchDecode(view, batch, max_topk, lane.workspace, lane.stream,
                                            cuda::DecodeKernel::kDefault, &d, after_append);
        !s.ok())
      return s;
    // Every row answered on the device needs no host copy of the outputs.
    bool host_answers = true;
    if (d.device_rows != nullptr) {
      if (absl::Status s = ScatterDeviceOutputs(lane, view.geo, d, batch, dev[9]); !s.ok())
        return s;
      host_answers = false;
      for (int32_t r = 0; r < b && !host_answers; ++r)
        host_answers = d.device_rows[r].q == nullptr || d.device_rows[r].out == nullptr;
    }
    if (!host_answers) return absl::OkStatus();
    if (direct_out == nullptr) {
      if (absl::Status s = CudaCall(cudaMemcpyAsync(d.out, lane.out.get(), elems * 2,
                                                    cudaMemcpyDeviceToHost, lane.stream),
                                    "copy of the outputs to the host");
          !s.ok())
        return s;
    }
    if (d.lse != nullptr && direct_lse == nullptr)
      return CudaCall(cudaMemcpyAsync(d.lse, lane.lse.get(), sizeof(float) * rows,
                                      cudaMemcpyDeviceToHost, lane.stream),
                      "copy of lse to the host");
    return absl::OkStatus();
  }

  // The device stage before the append of a batch with device rows: their q, gate, new
  // K/V and indices gathered into the uploaded arrays (dev: the device addresses in
  // Enqueue's upload order) and checked; verdicts start at kRowOk for every row.
  absl::Status GatherDeviceRows(Lane& lane, const CacheGeometry& geo, const DecodeBatch& d,
                                const std::vector<void*>& dev) {
    const int32_t b = d.num_requests;
    if (absl::Status s = lane.d_row_error.Reserve(b, "device row verdicts"); !s.ok()) return s;
    if (absl::Status s = CudaCall(cudaMemsetAsync(lane.d_row_error.get(), kRowOk, b, lane.stream),
                                  "clearing device row verdicts");
        !s.ok())
      return s;
    cuda::GatherRowsParams p;
    p.num_rows = b;
    p.num_q_heads = d.num_q_heads;
    p.num_kv_heads = geo.num_kv_heads;
    p.head_dim = geo.head_dim;
    // Upload order: append k_new, v_new, layers, slots; q, gate, layers, page table
    // offsets, index offsets, top-K, index forms, indices, page tables, device rows.
    p.k_new = static_cast<uint16_t*>(dev[0]);
    p.v_new = static_cast<uint16_t*>(dev[1]);
    p.slot = static_cast<int64_t*>(dev[3]);
    p.q = static_cast<uint16_t*>(dev[4]);
    p.gate = static_cast<uint16_t*>(dev[5]);
    p.index_offset = static_cast<const int64_t*>(dev[8]);
    p.topk = static_cast<const int32_t*>(dev[9]);
    p.indices_per_kv_head = static_cast<const uint8_t*>(dev[10]);
    p.indices = static_cast<int32_t*>(dev[11]);
    p.rows = static_cast<const DeviceRowSource*>(dev[13]);
    p.row_error = lane.d_row_error.as<uint8_t>();
    return CudaCall(cuda::EnqueueGatherDeviceRows(p, lane.stream), "device row gather launch");
  }

  // The device stage after the decode of a batch with device rows: their answers written
  // to their destinations, the verdicts copied back to d.row_error. `rows_dev`: the
  // device copy of d.device_rows (dev[9] of EnqueueDecode's decode inputs).
  absl::Status ScatterDeviceOutputs(Lane& lane, const CacheGeometry& geo, const DecodeBatch& d,
                                    const DecodeBatch& batch, void* rows_dev) {
    cuda::ScatterRowsParams p;
    p.num_rows = d.num_requests;
    p.num_q_heads = d.num_q_heads;
    p.head_dim = geo.head_dim;
    p.rows = static_cast<const DeviceRowSource*>(rows_dev);
    p.out = batch.out;
    p.lse = batch.lse;
    p.row_error = lane.d_row_error.as<uint8_t>();
    if (absl::Status s = CudaCall(cuda::EnqueueScatterDeviceOutputs(p, lane.stream),
                                  "device row scatter launch");
        !s.ok())
      return s;
    return CudaCall(cudaMemcpyAsync(d.row_error, lane.d_row_error.get(), d.num_requests,
                                    cudaMemcpyDeviceToHost, lane.stream),
                    "copy of the device row verdicts to the host");
  }

  BackendConfig config_;
  CudaBackendOptions options_;
  MappedStaging staging_;
  // The cache's page copies and zeroing (synchronous: ordered before any lane's next
  // kernels) and the layer scales' upload.
  cudaStream_t cache_stream_ = nullptr;
  std::unique_ptr<PagedKvCache> cache_;
  // layer_k_, layer_v_: [L] float.
  DeviceBuffer layer_k_, layer_v_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  mutable std::mutex lanes_mu_;
  std::condition_variable lane_cv_;
  std::vector<Lane*> free_lanes_;  // guarded by lanes_mu_
  CudaBatchPath last_path_;        // of the last Run to finish; guarded by lanes_mu_
};

}  // namespace

absl::Status CudaDeviceStatus() {
  int count = 0;
  const cudaError_t counted = cudaGetDeviceCount(&count);
  // No device, or no NVIDIA driver at all (a CPU host with the CUDA runtime: the runtime
  // reports it as an insufficient driver); a loaded driver that is too old is a problem.
  const bool driver_loaded = std::filesystem::exists("/proc/driver/nvidia/version");
  if (counted == cudaErrorNoDevice || (counted == cudaSuccess && count == 0) ||
      (counted == cudaErrorInsufficientDriver && !driver_loaded)) {
    cudaGetLastError();
    return absl::NotFoundError("no CUDA device");
  }
  if (counted != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("cannot use the CUDA devices: cudaGetDeviceCount: ", cudaGetErrorName(counted),
                     " (", cudaGetErrorString(counted), ")"));
  }
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, 0); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cannot read CUDA device 0: ", cudaGetErrorName(e),
                                               " (", cudaGetErrorString(e), ")"));
  }
  if (prop.major != 9 || prop.minor != 0) {  // the kernels are built for sm_90a only
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device 0 (", prop.name, ") has compute capability ", prop.major, ".",
                     prop.minor, "; the CUDA backend is built for 9.0 (H100/H200)"));
  }
  return absl::OkStatus();
}

CudaBackendOptions CudaBackendOptionsFromEnv() {
  CudaBackendOptions options;
  if (const char* v = std::getenv("SDS_CUDA_DIRECT_OUT_MAX_REQUESTS"); v != nullptr && *v != 0)
    options.direct_out_max_requests = std::atoi(v);
  if (const char* v = std::getenv("SDS_CUDA_LOG_PHASES"); v != nullptr && *v != 0)
    options.log_phases = std::atoi(v) != 0;
  if (const char* v = std::getenv("SDS_CUDA_IN_PLACE_INPUTS_MAX_REQUESTS"); v != nullptr && *v != 0)
    options.in_place_inputs_max_requests = std::atoi(v);
  if (const char* v = std::getenv("SDS_CUDA_LANES"); v != nullptr && *v != 0)
    options.lanes = std::atoi(v);
  return options;
}

CudaBatchPath LastCudaBatchPath(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->last_path() : CudaBatchPath{};
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendConfig& config) {
  return CreateCudaBackend(config, CudaBackendOptionsFromEnv());
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendConfig& config,
                                                           const CudaBackendOptions& options) {
  if (absl::Status device = CudaDeviceStatus(); !device.ok())
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: ", device.message()));
  CacheGeometry geo;
  geo.num_layers = config.cache.num_layers;
  geo.num_kv_heads = config.cache.num_kv_heads;
  geo.head_dim = config.cache.head_dim;
  geo.page_size = config.cache.page_size;
  geo.num_pages = config.cache.num_pages;
  if (absl::Status s = cuda::CheckDecodeShape(config.num_q_heads, geo); !s.ok()) return s;
  if (config.max_batch_size <= 0 || config.max_topk <= 0)
    return absl::InvalidArgumentError(absl::StrCat("max_batch_size (", config.max_batch_size,
                                                   ") and max_topk (", config.max_topk,
                                                   ") must be positive"));
  auto backend = std::make_unique<CudaBackend>(config, options);
  if (absl::Status s = backend->Init(); !s.ok()) return s;
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace sds
