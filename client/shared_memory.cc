#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace sds::client {
namespace {

void SetPacked(v1::PackedTensor* t, v1::DType dtype, std::initializer_list<int64_t> shape,
               const RegionSlice& slice) {
  t->set_dtype(dtype);
  for (int64_t dim : shape) t->add_shape(dim);
  v1::RegionRef* ref = t->mutable_ref();
  ref->set_region(slice.region);
  ref->set_offset(slice.offset);
  ref->set_byte_size(slice.bytes);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(size_t bytes) {
  static std::atomic<int> next{0};
  const std::string name = absl::StrCat("/sds-", getpid(), "-", next.fetch_add(1));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("shm_open ", name, ": ", strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate ", name, ": ", strerror(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", name, ": ", strerror(err)));
  }
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, static_cast<char*>(p), bytes));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(data_, bytes_);
  shm_unlink(shm_name_.c_str());
}

absl::Status RegisterSystemRegion(DecodeClient& client, const std::string& name,
                                  const SharedMemoryRegion& region, const CallOptions& call) {
  grpc::ClientContext ctx;
  client.PrepareContext(&ctx, call);
  v1::RegisterRegionRequest req;
  req.set_name(name);
  v1::SystemRegion* system = req.mutable_system();
  system->set_shm_name(region.shm_name());
  system->set_byte_size(region.size());
  v1::RegisterRegionResponse resp;
  return FromGrpc(client.stub()->RegisterRegion(&ctx, req, &resp));
}

absl::Status UnregisterRegion(DecodeClient& client, const std::string& name,
                              const CallOptions& call) {
  grpc::ClientContext ctx;
  client.PrepareContext(&ctx, call);
  v1::UnregisterRegionRequest req;
  req.set_name(name);
  v1::UnregisterRegionResponse resp;
  return FromGrpc(client.stub()->UnregisterRegion(&ctx, req, &resp));
}

absl::StatusOr<LayerResult> DecodeLayer(DecodeClient& client, const LayerBatch& batch,
                                        const CallOptions& call) {
  absl::StatusOr<Shape> shape = client.GetShape();
  if (!shape.ok()) return shape.status();
  const int64_t b = static_cast<int64_t>(batch.sequence_ids.size());
  if (static_cast<int64_t>(batch.positions.size()) != b) {
    return absl::InvalidArgumentError(
        absl::StrCat("positions has ", batch.positions.size(), " values for ", b, " sequences"));
  }
  v1::DecodeLayerRequest req;
  req.set_layer(batch.layer);
  for (const std::string& id : batch.sequence_ids) req.add_sequence_ids(id);
  for (int64_t p : batch.positions) req.add_positions(p);
  req.set_request_id(batch.request_id);
  const int64_t hq = shape->num_q_heads, hkv = shape->num_kv_heads, d = shape->head_dim;
  SetPacked(req.mutable_q(), v1::BF16, {b, hq, d}, batch.q);
  SetPacked(req.mutable_gate(), v1::BF16, {b, hq, d}, batch.gate);
  SetPacked(req.mutable_k(), v1::BF16, {b, hkv, d}, batch.k);
  SetPacked(req.mutable_v(), v1::BF16, {b, hkv, d}, batch.v);
  if (batch.per_kv_head_indices) {
    SetPacked(req.mutable_indices(), v1::INT32, {b, hkv, batch.topk}, batch.indices);
  } else {
    SetPacked(req.mutable_indices(), v1::INT32, {b, batch.topk}, batch.indices);
  }
  SetPacked(req.mutable_out(), v1::BF16, {b, hq, d}, batch.out);
  grpc::ClientContext ctx;
  client.PrepareContext(&ctx, call);
  v1::DecodeLayerResponse resp;
  if (absl::Status s = FromGrpc(client.stub()->DecodeLayer(&ctx, req, &resp)); !s.ok()) return s;
  if (resp.error_codes_size() != b || resp.error_messages_size() != b) {
    return absl::InternalError(
        absl::StrCat("the server answered ", resp.error_codes_size(), " items for ", b));
  }
  LayerResult result;
  result.items.reserve(b);
  for (int64_t i = 0; i < b; ++i) {
    result.items.emplace_back(static_cast<absl::StatusCode>(resp.error_codes(i)),
                              resp.error_messages(i));
  }
  result.batch = {resp.batch().batch_id(), resp.batch().batch_size(), resp.batch().queue_us(),
                  resp.batch().compute_us()};
  return result;
}

}  // namespace sds::client
