// A DecodeLayer call (one layer's packed batch, DESIGN.md "Shared-memory regions")
// turned into the per-item work the batcher runs. Checked once here, at the entry: the
// packed tensors' dtypes and exact shapes, every region reference (registered by the
// caller's tenant, inside the region, the size the shape needs, outputs in host memory
// and overlapping nothing else). Then each item becomes one DecodeItem (work.h) whose
// tensor bytes are views into the packed tensors (inline bytes or mapped shared memory),
// checked (NaN/Inf, index range) and admitted as an item of a DecodeBatch is, each with
// its own outcome; the call is the items' DecodeSink: the executor writes each answer
// through it, into the caller's region or the response.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model_shape.h"
#include "server/shm_region.h"
#include "server/tensor_bytes.h"
#include "server/work.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::server {

struct LayerCallLimits {
  int32_t max_items = 1024;    // --max_decode_batch_items
  bool allow_regions = false;  // --allow_client_shm
  bool device_rows = false;    // the backend reads CUDA regions (Backend::reads_device_rows)
};

class LayerCall final : public DecodeSink {
 public:
  // Checks `request` (which, with `response`, must outlive the call) and resolves its
  // references in `registry` (may be null when regions are off). INVALID_ARGUMENT for a
  // bad shape, dtype or reference, NOT_FOUND for a region the tenant has not registered,
  // FAILED_PRECONDITION for references while the server has regions off.
  static absl::StatusOr<std::unique_ptr<LayerCall>> Plan(
      const std::string& tenant, const sparse_decode::v1::DecodeLayerRequest* request,
      sparse_decode::v1::DecodeLayerResponse* response, const ModelShape& model,
      const RegionRegistry* registry, const LayerCallLimits& limits);
  ~LayerCall() override;

  int32_t size() const { return static_cast<int32_t>(items_.size()); }
  // Item b (index b, key set): its fields and views of its bytes; checked by Check(b).
  DecodeItem* item(int32_t b) { return &items_[b]; }
  // The checks of item b beyond the call's: its sequence id, position, and on the host
  // its values (NaN/Inf, index range).
  absl::Status Check(int32_t b) const;
  // Called with the call's outcome once every item is done; `self` keeps the call alive
  // until then (the batcher holds only pointers into it).
  void FinishWith(std::function<void(const absl::Status&)> finish,
                  std::shared_ptr<LayerCall> self) {
    finish_ = std::move(finish);
    self_ = std::move(self);
  }
  // After every item is done: fn(code, items) for every code the items ended with.
  template <typename Fn>
  void ForEachCode(Fn&& fn) const {
    std::array<int32_t, 17> counts{};  // OK .. UNAUTHENTICATED; others as UNKNOWN
    for (const absl::Status& s : status_) {
      const int code = static_cast<int>(s.code());
      ++counts[code >= 0 && code < 17 ? code : static_cast<int>(absl::StatusCode::kUnknown)];
    }
    for (int code = 0; code < 17; ++code)
      if (counts[code] > 0) fn(static_cast<absl::StatusCode>(code), counts[code]);
  }

  // DecodeSink. BeforeRun fails a unit whose regions were unregistered while it was
  // queued and pins the CUDA regions the device writes its answers into during the run;
  // AfterRun unpins them. Write delivers an answer into the caller's region or the
  // response; Done records outcomes, and the last one completes the response (codes,
  // messages, the last batch's BatchInfo) and calls `finish`.
  absl::Status BeforeRun() override;
  void AfterRun() override;
  absl::Status Write(int32_t index, const BatchInfo& batch, const uint16_t* out,
                     const float* lse) override;
  void Done(absl::Span<DecodeItem* const> items, absl::Span<const absl::Status> status) override;

 private:
  LayerCall() = default;
  // An input's bytes: a pointer and its byte size.
  struct Span {
    const char* data = nullptr;  // host address, or device address in a CUDA region
    uint64_t bytes = 0;
    const Region* region = nullptr;  // null for inline bytes
    bool on_device() const { return region != nullptr && region->kind() == RegionKind::kCuda; }
  };
  // The host address of `t`'s bytes (inline or in its region), after the checks.
  // `align`: the byte alignment the device needs of a tensor in a CUDA region.
  absl::StatusOr<Span> Resolve(const char* name, const sparse_decode::v1::PackedTensor& t,
                               uint64_t want_bytes, bool output, uint64_t align);

  const std::string* tenant_ = nullptr;
  const RegionRegistry* registry_ = nullptr;
  LayerCallLimits limits_;
  const sparse_decode::v1::DecodeLayerRequest* request_ = nullptr;
  sparse_decode::v1::DecodeLayerResponse* response_ = nullptr;
  ModelShape model_;
  std::vector<DecodeItem> items_;  // [B]
  std::vector<BatchInfo> batch_;   // [B]: the batch that answered each item
  // The regions the call references, each held (and counted in flight) until the call
  // is destroyed; a revoked one fails the items not yet written.
  std::vector<std::shared_ptr<Region>> regions_;
  struct Ref {
    const Region* region;
    uint64_t begin, end;
    bool output;
    const char* name;
  };
  std::vector<Ref> refs_;
  const Region* out_region_ = nullptr;  // null: inline out
  const Region* lse_region_ = nullptr;  // null: inline lse (or none)
  char* out_ = nullptr;                 // [B, Hq, D] bf16 on the host; null when on the device
  char* lse_ = nullptr;  // [B, Hq] f32 on the host; null when not asked for or on the device
  // Inputs in CUDA regions: item b's device addresses (DeviceRowSource), which its
  // DecodeTensorBytes points to.
  std::vector<DeviceRowSource> sources_;  // [B] or empty
  std::vector<const Region*> pinned_;     // CUDA regions written by the device
  std::vector<absl::Status> status_;      // [B]
  std::atomic<int32_t> remaining_{0};
  std::function<void(const absl::Status&)> finish_;
  std::shared_ptr<LayerCall> self_;
};

}  // namespace sds::server
