// DecodeServiceImpl's shared-memory data plane: RegisterRegion, UnregisterRegion,
// ListRegions, DecodeLayer and DecodeLayerStream (shm_region.h, layer_call.h).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/layer_call.h"
#include "server/layer_stream.h"
#include "server/serve_call.h"
#include "server/service.h"

namespace sds::server {

namespace v1 = sparse_decode::v1;

namespace {

constexpr char kDecodeLayerRpc[] = "DecodeLayer";

absl::Status ShmOff() {
  return absl::FailedPreconditionError(
      "shared-memory regions are off: start the server with --allow_client_shm (the runner "
      "must share its host)");
}

}  // namespace

absl::StatusOr<std::shared_ptr<Region>> DecodeServiceImpl::MapRegion(
    const v1::RegisterRegionRequest& request) {
  switch (request.kind_case()) {
    case v1::RegisterRegionRequest::kSystem: {
      const v1::SystemRegion& system = request.system();
      return MapSystemRegion(request.name(), system.shm_name(), system.offset(),
                             system.byte_size());
    }
    case v1::RegisterRegionRequest::kCuda: {
      const v1::CudaRegion& cuda = request.cuda();
      absl::StatusOr<std::unique_ptr<DeviceMapping>> opened = backend_->OpenCudaIpcRegion(
          cuda.ipc_handle(), cuda.device_id(), cuda.offset(), cuda.byte_size());
      if (!opened.ok()) return opened.status();
      std::shared_ptr<DeviceMapping> mapping = *std::move(opened);
      char* base = static_cast<char*>(mapping->device_address());
      return std::make_shared<Region>(request.name(), RegionKind::kCuda, base, cuda.byte_size(),
                                      [mapping]() mutable { mapping.reset(); });
    }
    case v1::RegisterRegionRequest::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("a region is `system` or `cuda`; neither was given");
}

grpc::ServerUnaryReactor* DecodeServiceImpl::RegisterRegion(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* wire,
                                                            grpc::ByteBuffer* reply) {
  return ServeTyped<v1::RegisterRegionRequest, v1::RegisterRegionResponse>(
      context, metrics_, "RegisterRegion", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::RegisterRegionRequest& request,
          v1::RegisterRegionResponse*, const auto& finish) {
        if (!config_.allow_client_shm) return finish(ShmOff());
        const uint64_t bytes =
            request.has_system() ? request.system().byte_size() : request.cuda().byte_size();
        finish(
            regions_.Register(tenant, request.name(), bytes, [&] { return MapRegion(request); }));
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::UnregisterRegion(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* wire,
                                                              grpc::ByteBuffer* reply) {
  return ServeTyped<v1::UnregisterRegionRequest, v1::UnregisterRegionResponse>(
      context, metrics_, "UnregisterRegion", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::UnregisterRegionRequest& request,
          v1::UnregisterRegionResponse* response, const auto& finish) {
        if (!config_.allow_client_shm) return finish(ShmOff());
        absl::StatusOr<int> dropped = regions_.Unregister(tenant, request.name());
        if (dropped.ok()) response->set_unregistered(*dropped);
        finish(dropped.status());
      });
}

grpc::ServerUnaryReactor* DecodeServiceImpl::ListRegions(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* wire,
                                                         grpc::ByteBuffer* reply) {
  return ServeTyped<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      context, metrics_, "ListRegions", Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::ListRegionsRequest&,
          v1::ListRegionsResponse* response, const auto& finish) {
        if (!config_.allow_client_shm) return finish(ShmOff());
        for (const std::shared_ptr<Region>& region : regions_.List(tenant)) {
          v1::RegionStatus* status = response->add_regions();
          status->set_name(region->name());
          status->set_kind(RegionKindName(region->kind()));
          status->set_byte_size(region->byte_size());
          status->set_calls_in_flight(region->calls_in_flight.load());
        }
        finish(absl::OkStatus());
      });
}

void DecodeServiceImpl::RunLayerCall(const std::string& tenant,
                                     const v1::DecodeLayerRequest* request,
                                     v1::DecodeLayerResponse* response, Clock::time_point deadline,
                                     const std::function<bool()>& cancelled,
                                     const std::function<void(const absl::Status&)>& finish) {
  const LayerCallLimits limits{config_.max_decode_batch_items, config_.allow_client_shm,
                               backend_->reads_device_rows()};
  absl::StatusOr<std::unique_ptr<LayerCall>> planned =
      LayerCall::Plan(tenant, request, response, config_.model, &regions_, limits);
  if (!planned.ok()) {
    metrics_->CountRequest(kDecodeLayerRpc, planned.status().code());  // no item to count it
    return finish(planned.status());
  }
  std::shared_ptr<LayerCall> call = *std::move(planned);
  LayerCall* sink = call.get();
  sink->FinishWith(
      [this, sink, finish](const absl::Status& s) {
        // The call's items, counted once per code: a lock per call, not per item.
        sink->ForEachCode([this](absl::StatusCode code, int32_t count) {
          metrics_->CountRequests(kDecodeLayerRpc, code, static_cast<uint64_t>(count));
        });
        finish(s);
      },
      call);
  call.reset();  // the call keeps itself until its last item is done
  const int32_t n = sink->size();
  std::vector<DecodeItem*> valid;
  std::vector<DecodeItem*> invalid;
  std::vector<absl::Status> invalid_status;
  valid.reserve(n);
  for (int32_t b = 0; b < n; ++b) {
    absl::Status s = sink->Check(b);
    if (s.ok()) {
      valid.push_back(sink->item(b));
    } else {
      invalid.push_back(sink->item(b));
      invalid_status.push_back(std::move(s));
    }
  }
  // Every item is answered through the call's Done (those that failed their checks here
  // at once); the valid ones are queued in one step.
  if (!invalid.empty()) sink->Done(invalid, invalid_status);
  admission_.Submit(valid, sink, deadline, cancelled, /*whole_batch=*/true);
}

grpc::ServerUnaryReactor* DecodeServiceImpl::DecodeLayer(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* wire,
                                                         grpc::ByteBuffer* reply) {
  return ServeTyped<v1::DecodeLayerRequest, v1::DecodeLayerResponse>(
      context, metrics_, kDecodeLayerRpc, Admit(*context), wire, reply,
      [&](const std::string& tenant, const v1::DecodeLayerRequest& request,
          v1::DecodeLayerResponse* response, const auto& finish) {
        RunLayerCall(
            tenant, &request, response, DeadlineOf(*context),
            [context] { return context->IsCancelled(); }, finish);
      },
      /*count_rpc=*/false);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* DecodeServiceImpl::DecodeLayerStream(
    grpc::CallbackServerContext* context) {
  LayerStreamReactor::Env env;
  env.metrics = metrics_;
  env.draining = &draining_;
  env.run = [this](const std::string& tenant, const v1::DecodeLayerRequest* request,
                   v1::DecodeLayerResponse* response, Clock::time_point deadline,
                   const std::function<bool()>& cancelled,
                   const std::function<void(const absl::Status&)>& done) {
    RunLayerCall(tenant, request, response, deadline, cancelled, done);
  };
  return new LayerStreamReactor(context, std::move(env), Admit(*context));
}

}  // namespace sds::server
