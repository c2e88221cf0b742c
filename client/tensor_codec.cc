// Building wire requests from plain vectors and parsing responses back.
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/decode_client.h"

namespace sds::client {
namespace {

template <typename T>
void FillTensor(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> shape,
                const std::vector<T>& data) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
  t->set_data(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(T));
}

absl::Status CheckSize(const char* name, size_t got, int64_t want) {
  if (static_cast<int64_t>(got) == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " has ", got, " elements, the model shape needs ", want));
}

template <typename T>
absl::StatusOr<std::vector<T>> ReadTensor(const v1::Tensor& t, v1::DType dtype, const char* name) {
  if (t.dtype() != dtype) {
    return absl::InternalError(absl::StrCat("response ", name, " has dtype ",
                                            v1::DType_Name(t.dtype()), ", expected ",
                                            v1::DType_Name(dtype)));
  }
  if (t.data().size() % sizeof(T) != 0) {
    return absl::InternalError(absl::StrCat("response ", name, " has ", t.data().size(),
                                            " bytes, not a multiple of ", sizeof(T)));
  }
  std::vector<T> out(t.data().size() / sizeof(T));
  std::memcpy(out.data(), t.data().data(), t.data().size());
  return out;
}

}  // namespace

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::StatusOr<v1::DecodeRequest> BuildDecodeRequest(const DecodeInput& in, const Shape& shape) {
  const int64_t hq = shape.num_q_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  absl::Status st = CheckSize("q", in.q.size(), hq * d);
  if (st.ok()) st = CheckSize("gate", in.gate.size(), hq * d);
  if (st.ok()) st = CheckSize("k", in.k.size(), hkv * d);
  if (st.ok()) st = CheckSize("v", in.v.size(), hkv * d);
  if (st.ok() && in.per_kv_head_indices && in.indices.size() % hkv != 0) {
    st = absl::InvalidArgumentError(
        absl::StrCat("indices has ", in.indices.size(), " elements, not a multiple of Hkv=", hkv));
  }
  if (!st.ok()) return st;
  v1::DecodeRequest req;
  req.set_sequence_id(in.sequence_id);
  req.set_layer(in.layer);
  req.set_position(in.position);
  req.set_return_lse(in.return_lse);
  req.set_request_id(in.request_id);
  FillTensor(req.mutable_q(), v1::BF16, {hq, d}, in.q);
  FillTensor(req.mutable_k(), v1::BF16, {hkv, d}, in.k);
  FillTensor(req.mutable_v(), v1::BF16, {hkv, d}, in.v);
  FillTensor(req.mutable_gate(), v1::BF16, {hq, d}, in.gate);
  const int64_t n = static_cast<int64_t>(in.indices.size());
  if (in.per_kv_head_indices) {
    FillTensor(req.mutable_indices(), v1::INT32, {hkv, n / hkv}, in.indices);
  } else {
    FillTensor(req.mutable_indices(), v1::INT32, {n}, in.indices);
  }
  return req;
}

absl::StatusOr<DecodeOutput> ParseDecodeResponse(const v1::DecodeResponse& resp) {
  if (resp.error_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(resp.error_code()), resp.error_message());
  }
  DecodeOutput out;
  out.request_id = resp.request_id();
  auto o = ReadTensor<uint16_t>(resp.out(), v1::BF16, "out");
  if (!o.ok()) return o.status();
  out.out = *std::move(o);
  if (resp.has_lse() && !resp.lse().data().empty()) {
    auto l = ReadTensor<float>(resp.lse(), v1::FP32, "lse");
    if (!l.ok()) return l.status();
    out.lse = *std::move(l);
  }
  out.batch.batch_id = resp.batch().batch_id();
  out.batch.batch_size = resp.batch().batch_size();
  out.batch.queue_us = resp.batch().queue_us();
  out.batch.compute_us = resp.batch().compute_us();
  return out;
}

}  // namespace sds::client
