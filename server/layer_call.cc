#include "server/layer_call.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/sigbus_guard.h"
#include "server/validate.h"

namespace sds::server {
namespace {

namespace v1 = sparse_decode::v1;

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

using ::sds::server::ShapeText;  // the span form, beside this one
std::string ShapeText(const v1::PackedTensor& t) { return ShapeText(t.shape()); }

// `t` is `dtype` with exactly the dims `want` (named by `layout`, e.g. "[B, Hq, D]").
absl::Status CheckShape(const char* name, const v1::PackedTensor& t, v1::DType dtype,
                        std::initializer_list<int64_t> want, const char* layout) {
  if (t.dtype() != dtype) {
    return Bad(absl::StrCat(name, ": dtype must be ", v1::DType_Name(dtype), ", got ",
                            DTypeText(t.dtype())));
  }
  if (!std::equal(t.shape().begin(), t.shape().end(), want.begin(), want.end())) {
    std::string hint;
    if (t.shape_size() == 4) {
      hint =
          " (a [batch, heads, seq, head_dim] layout such as transformers' is not accepted: "
          "pass the one decode token's [batch, heads, head_dim])";
    }
    return Bad(absl::StrCat(name, ": shape must be ", layout, " = ",
                            ShapeText(absl::Span<const int64_t>(want.begin(), want.size())),
                            ", got ", ShapeText(t), hint));
  }
  return absl::OkStatus();
}

bool Overlap(uint64_t a0, uint64_t a1, uint64_t b0, uint64_t b1) { return a0 < b1 && b0 < a1; }

}  // namespace

LayerCall::~LayerCall() {
  for (const std::shared_ptr<Region>& region : regions_) region->calls_in_flight.fetch_sub(1);
}

absl::StatusOr<LayerCall::Span> LayerCall::Resolve(const char* name, const v1::PackedTensor& t,
                                                   uint64_t want_bytes, bool output,
                                                   uint64_t align) {
  switch (t.where_case()) {
    case v1::PackedTensor::kData:
      if (output) {
        return Bad(absl::StrCat(name,
                                ": an output is a region ref, or left unset to come back "
                                "inline; it cannot carry data"));
      }
      if (t.data().size() != want_bytes) {
        return Bad(absl::StrCat(name, ": data has ", t.data().size(), " bytes, shape ",
                                ShapeText(t), " needs ", want_bytes));
      }
      return Span{t.data().data(), want_bytes};
    case v1::PackedTensor::kRef: {
      if (!limits_.allow_regions || registry_ == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat(name,
                         ": region refs need a server started with --allow_client_shm; send the "
                         "bytes inline (or use DecodeBatch)"));
      }
      const v1::RegionRef& ref = t.ref();
      absl::StatusOr<std::shared_ptr<Region>> found = registry_->Find(*tenant_, ref.region());
      if (!found.ok())
        return absl::NotFoundError(absl::StrCat(name, ": ", found.status().message()));
      const Region& region = **found;
      if (ref.byte_size() != want_bytes) {
        return Bad(absl::StrCat(name, ": ref has byte_size ", ref.byte_size(), ", shape ",
                                ShapeText(t), " needs ", want_bytes));
      }
      if (ref.offset() > region.byte_size() || want_bytes > region.byte_size() - ref.offset()) {
        return Bad(absl::StrCat(name, ": bytes [", ref.offset(), ", ", ref.offset(), " + ",
                                want_bytes, ") are past the end of region '", ref.region(), "' (",
                                region.byte_size(), " bytes)"));
      }
      if (region.kind() == RegionKind::kCuda) {
        if (!limits_.device_rows) {
          return absl::UnimplementedError(absl::StrCat(
              name, ": region '", ref.region(),
              "' is a CUDA region, which this backend does not read or write; use a system "
              "region"));
        }
        const uint64_t address = reinterpret_cast<uintptr_t>(region.base()) + ref.offset();
        if (address % align != 0) {
          return Bad(absl::StrCat(name, ": a tensor in a CUDA region must start on a ", align,
                                  "-byte boundary (offset ", ref.offset(), ")"));
        }
      }
      if (std::none_of(regions_.begin(), regions_.end(),
                       [&](const std::shared_ptr<Region>& r) { return r.get() == &region; })) {
        regions_.push_back(*found);
        region.calls_in_flight.fetch_add(1);  // LayerCall's destructor takes it back
      }
      refs_.push_back({&region, ref.offset(), ref.offset() + want_bytes, output, name});
      return Span{region.base() + ref.offset(), want_bytes, &region};
    }
    case v1::PackedTensor::WHERE_NOT_SET:
      if (output) return Span{};
      return Bad(absl::StrCat(name, ": neither data nor a region ref"));
  }
  return Bad(absl::StrCat(name, ": unknown kind of tensor"));
}

absl::StatusOr<std::unique_ptr<LayerCall>> LayerCall::Plan(const std::string& tenant,
                                                           const v1::DecodeLayerRequest* request,
                                                           v1::DecodeLayerResponse* response,
                                                           const ModelShape& model,
                                                           const RegionRegistry* registry,
                                                           const LayerCallLimits& limits) {
  std::unique_ptr<LayerCall> call(new LayerCall());
  call->tenant_ = &tenant;
  call->registry_ = registry;
  call->limits_ = limits;
  call->request_ = request;
  call->response_ = response;
  call->model_ = model;
  const v1::DecodeLayerRequest& r = *request;
  const int64_t b = r.sequence_ids_size();
  if (b == 0) return Bad("sequence_ids: the batch is empty");
  if (b > limits.max_items) {
    return Bad(absl::StrCat("the batch holds ", b, " items, more than ", limits.max_items,
                            " (the server's --max_decode_batch_items); split it"));
  }
  if (r.positions_size() != b) {
    return Bad(
        absl::StrCat("positions has ", r.positions_size(), " values for ", b, " sequence_ids"));
  }
  if (r.topk_size() != 0 && r.topk_size() != b) {
    return Bad(absl::StrCat("topk has ", r.topk_size(), " values for ", b,
                            " sequence_ids (give one per item, or none)"));
  }
  const int64_t hq = model.num_q_heads, hkv = model.num_kv_heads, d = model.head_dim;
  if (absl::Status s = CheckShape("q", r.q(), v1::BF16, {b, hq, d}, "[B, Hq, D]"); !s.ok())
    return s;
  if (absl::Status s = CheckShape("gate", r.gate(), v1::BF16, {b, hq, d}, "[B, Hq, D]"); !s.ok())
    return s;
  if (absl::Status s = CheckShape("k", r.k(), v1::BF16, {b, hkv, d}, "[B, Hkv, D]"); !s.ok())
    return s;
  if (absl::Status s = CheckShape("v", r.v(), v1::BF16, {b, hkv, d}, "[B, Hkv, D]"); !s.ok())
    return s;
  const v1::PackedTensor& idx = r.indices();
  const bool per_kv_head = idx.shape_size() == 3;
  const int64_t k = idx.shape_size() > 0 ? idx.shape(idx.shape_size() - 1) : -1;
  if (k < 0 || k > model.max_topk) {
    return Bad(absl::StrCat("indices: shape must be [B, K] or [B, Hkv, K] with 0 <= K <= ",
                            model.max_topk, " (max_topk), got ", ShapeText(idx)));
  }
  if (absl::Status s = per_kv_head
                           ? CheckShape("indices", idx, v1::INT32, {b, hkv, k}, "[B, Hkv, K]")
                           : CheckShape("indices", idx, v1::INT32, {b, k}, "[B, K]");
      !s.ok()) {
    return s;
  }
  for (int64_t i = 0; i < r.topk_size(); ++i) {
    if (r.topk(i) < 0 || r.topk(i) > k) {
      return Bad(absl::StrCat("topk[", i, "] = ", r.topk(i), " is outside [0, K = ", k, "]"));
    }
  }
  const bool lse_wanted = r.return_lse() || r.has_lse();
  if (r.has_out() && r.out().where_case() != v1::PackedTensor::WHERE_NOT_SET) {
    if (absl::Status s = CheckShape("out", r.out(), v1::BF16, {b, hq, d}, "[B, Hq, D]"); !s.ok())
      return s;
  }
  if (r.has_lse() && r.lse().where_case() != v1::PackedTensor::WHERE_NOT_SET) {
    if (absl::Status s = CheckShape("lse", r.lse(), v1::FP32, {b, hq}, "[B, Hq]"); !s.ok())
      return s;
  }

  const uint64_t q_row = hq * d * 2, kv_row = hkv * d * 2;
  const uint64_t idx_row = (per_kv_head ? hkv : 1) * k * 4;
  // The device reads bf16 rows 16 bytes at a time (q_row and kv_row are multiples of 16).
  absl::StatusOr<Span> q = call->Resolve("q", r.q(), b * q_row, false, 16);
  if (!q.ok()) return q.status();
  absl::StatusOr<Span> gate = call->Resolve("gate", r.gate(), b * q_row, false, 16);
  if (!gate.ok()) return gate.status();
  absl::StatusOr<Span> kn = call->Resolve("k", r.k(), b * kv_row, false, 16);
  if (!kn.ok()) return kn.status();
  absl::StatusOr<Span> vn = call->Resolve("v", r.v(), b * kv_row, false, 16);
  if (!vn.ok()) return vn.status();
  absl::StatusOr<Span> indices = call->Resolve("indices", idx, b * idx_row, false, 4);
  if (!indices.ok()) return indices.status();
  absl::StatusOr<Span> out = call->Resolve("out", r.out(), b * q_row, true, 16);
  if (!out.ok()) return out.status();
  absl::StatusOr<Span> lse = call->Resolve("lse", r.lse(), b * hq * 4, true, 4);
  if (!lse.ok()) return lse.status();
  // Inputs all on the host or all on the device; answers on the device only from there,
  // and lse where out is (the device answers a row wholly, or the host does).
  const bool on_device = q->on_device();
  for (const Span* s : {&*gate, &*kn, &*vn, &*indices}) {
    if (s->on_device() != on_device) {
      return Bad("q, gate, k, v and indices are all in CUDA regions, or none of them is");
    }
  }
  if (out->on_device() && !on_device) {
    return Bad("out: a CUDA region receives answers only when the inputs are in CUDA regions");
  }
  if (lse_wanted && lse->on_device() != out->on_device()) {
    return Bad("lse: in a CUDA region exactly when out is");
  }
  // An output must overlap no input and not the other output: the kernels read inputs
  // after earlier items' answers are written.
  for (const Ref& o : call->refs_) {
    if (!o.output) continue;
    for (const Ref& other : call->refs_) {
      if (&other == &o || other.region != o.region) continue;
      if (Overlap(o.begin, o.end, other.begin, other.end)) {
        return Bad(absl::StrCat(o.name, ": its bytes in region '", o.region->name(),
                                "' overlap those of ", other.name));
      }
    }
  }
  if (out->on_device()) {
    call->pinned_.push_back(out->region);
    if (lse->on_device() && lse->region != out->region) call->pinned_.push_back(lse->region);
  } else if (out->data != nullptr) {
    call->out_ = const_cast<char*>(out->data);  // a region the server maps read-write
    call->out_region_ = out->region;
  } else {
    v1::Tensor* inline_out = response->mutable_out();
    inline_out->set_dtype(v1::BF16);
    for (int64_t dim : {b, hq, d}) inline_out->add_shape(dim);
    inline_out->mutable_data()->assign(b * q_row, '\0');
    call->out_ = inline_out->mutable_data()->data();
  }
  if (lse->on_device()) {
    // Written by the device (pinned with out).
  } else if (lse->data != nullptr) {
    call->lse_ = const_cast<char*>(lse->data);
    call->lse_region_ = lse->region;
  } else if (lse_wanted) {
    v1::Tensor* inline_lse = response->mutable_lse();
    inline_lse->set_dtype(v1::FP32);
    for (int64_t dim : {b, hq}) inline_lse->add_shape(dim);
    inline_lse->mutable_data()->assign(b * hq * 4, '\0');
    call->lse_ = inline_lse->mutable_data()->data();
  }

  call->items_.resize(b);
  call->batch_.resize(b);
  if (on_device) call->sources_.resize(b);
  call->status_.resize(b);
  const uint64_t idx_list = static_cast<uint64_t>(k) * 4;  // one list's bytes at K
  for (int64_t i = 0; i < b; ++i) {
    DecodeItem& item = call->items_[i];
    item.index = static_cast<int32_t>(i);
    item.sequence_id = r.sequence_ids(i);
    item.key = SequenceKey(tenant, item.sequence_id);
    item.layer = r.layer();
    item.position = r.positions(i);
    item.return_lse = lse_wanted;
    const int64_t topk = r.topk_size() != 0 ? r.topk(i) : k;
    item.topk = static_cast<int32_t>(topk);
    item.indices_per_kv_head = per_kv_head;
    DecodeTensorBytes& bytes = item.bytes;
    if (on_device) {
      DeviceRowSource& src = call->sources_[i];
      src.q = reinterpret_cast<const uint16_t*>(q->data + i * q_row);
      src.gate = reinterpret_cast<const uint16_t*>(gate->data + i * q_row);
      src.k = reinterpret_cast<const uint16_t*>(kn->data + i * kv_row);
      src.v = reinterpret_cast<const uint16_t*>(vn->data + i * kv_row);
      src.indices = reinterpret_cast<const int32_t*>(indices->data + i * idx_row);
      src.index_stride = per_kv_head ? k : 0;
      src.position = r.positions(i);
      if (out->on_device()) {
        src.out = reinterpret_cast<uint16_t*>(const_cast<char*>(out->data) + i * q_row);
      }
      if (lse_wanted && lse->on_device()) {
        src.lse = reinterpret_cast<float*>(const_cast<char*>(lse->data) + i * hq * 4);
      }
      bytes.device = &src;
      bytes.device_index_count = (per_kv_head ? hkv : 1) * topk;
    } else {
      bytes.q.Append(q->data + i * q_row, q_row);
      bytes.gate.Append(gate->data + i * q_row, q_row);
      bytes.k.Append(kn->data + i * kv_row, kv_row);
      bytes.v.Append(vn->data + i * kv_row, kv_row);
      const char* list = indices->data + i * idx_row;
      if (topk == k) {
        bytes.indices.Append(list, idx_row);  // the lists back to back: one piece
      } else {
        for (int64_t h = 0; h < (per_kv_head ? hkv : 1); ++h)
          bytes.indices.Append(list + h * idx_list, static_cast<size_t>(topk) * 4);
      }
    }
  }
  call->remaining_.store(static_cast<int32_t>(b));
  return call;
}

absl::Status LayerCall::Check(int32_t b) const {
  const DecodeItem& item = items_[b];
  if (absl::Status s = CheckItemFields(item.sequence_id, item.layer, item.position, model_);
      !s.ok()) {
    return s;
  }
  return CheckDecodeValues(item);
}

absl::Status LayerCall::Write(int32_t b, const BatchInfo& batch, const uint16_t* out,
                              const float* lse) {
  // Inputs read from a region unregistered since may not be what the caller sent: the
  // answer is not delivered and the token not committed.
  for (const std::shared_ptr<Region>& region : regions_) {
    if (region->revoked()) {
      return absl::FailedPreconditionError(
          absl::StrCat("region '", region->name(),
                       "' was unregistered while the request ran; its answer is not valid "
                       "and nothing was stored"));
    }
  }
  batch_[b] = batch;
  const size_t out_row = static_cast<size_t>(model_.num_q_heads) * model_.head_dim * 2;
  const size_t lse_row = static_cast<size_t>(model_.num_q_heads) * 4;
  if (out_ == nullptr) return absl::OkStatus();  // answered on the device (pinned)
  // A region's pages may be gone (its object shrunk by its owner): sigbus_guard.h.
  auto gone = [] {
    return absl::FailedPreconditionError(
        "the answer could not be written: the shared-memory object was shrunk under its "
        "region (nothing was stored)");
  };
  bool lse_written = true;
  auto write_lse = [&] {
    if (lse_ != nullptr && lse != nullptr) {
      lse_written = RunGuarded([&] { std::memcpy(lse_ + b * lse_row, lse, lse_row); });
    }
  };
  auto write = [&] {
    if (!RunGuarded([&] { std::memcpy(out_ + b * out_row, out, out_row); })) return gone();
    absl::Status s;
    if (lse_region_ != nullptr && lse_region_ != out_region_) {
      s = lse_region_->WriteIfLive(write_lse);
    } else {
      write_lse();
    }
    if (s.ok() && !lse_written) return gone();
    return s;
  };
  if (out_region_ == nullptr) return write();
  absl::Status inner;
  absl::Status outer = out_region_->WriteIfLive([&] { inner = write(); });
  return outer.ok() ? inner : outer;
}

absl::Status LayerCall::BeforeRun() {
  for (const std::shared_ptr<Region>& region : regions_) {
    if (region->revoked()) {
      return absl::FailedPreconditionError(
          absl::StrCat("region '", region->name(),
                       "' was unregistered while the request was queued; "
                       "nothing was written or stored"));
    }
  }
  for (size_t i = 0; i < pinned_.size(); ++i) {
    if (absl::Status s = pinned_[i]->Pin(); !s.ok()) {
      for (size_t j = 0; j < i; ++j) pinned_[j]->Unpin();
      return s;
    }
  }
  return absl::OkStatus();
}

void LayerCall::AfterRun() {
  for (const Region* region : pinned_) region->Unpin();
}

void LayerCall::Done(absl::Span<DecodeItem* const> items, absl::Span<const absl::Status> status) {
  for (size_t i = 0; i < items.size(); ++i) status_[items[i]->index] = status[i];
  const auto n = static_cast<int32_t>(items.size());
  if (remaining_.fetch_sub(n, std::memory_order_acq_rel) != n) return;
  const BatchInfo* last = nullptr;
  for (int32_t i = 0; i < size(); ++i) {
    response_->add_error_codes(static_cast<int32_t>(status_[i].code()));
    response_->add_error_messages(std::string(status_[i].message()));
    if (status_[i].ok() && (last == nullptr || batch_[i].batch_id > last->batch_id)) {
      last = &batch_[i];
    }
  }
  response_->set_request_id(request_->request_id());
  if (last != nullptr) {
    v1::BatchInfo* info = response_->mutable_batch();
    info->set_batch_id(last->batch_id);
    info->set_batch_size(last->batch_size);
    info->set_queue_us(last->queue_us);
    info->set_compute_us(last->compute_us);
  }
  std::shared_ptr<LayerCall> self = std::move(self_);  // freed on return
  std::function<void(const absl::Status&)> finish = std::move(finish_);
  finish(absl::OkStatus());
}

}  // namespace sds::server
