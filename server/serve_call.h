// The shape every unary handler of DecodeServiceImpl shares: admission (draining,
// authentication), a completion that counts and logs once, and for the methods parsed
// whole by protobuf the parse (TypedCall, raw_call.h) and the serialized reply.
#pragma once

#include <grpcpp/grpcpp.h>

#include <exception>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "server/metrics.h"
#include "server/raw_call.h"
#include "server/rpc_util.h"
#include "server/work.h"
#include "spdlog/spdlog.h"

namespace sds::server {

// Completes a unary call once: metrics, a log line for bugs, then Finish.
struct Finisher {
  grpc::ServerUnaryReactor* reactor;
  Metrics* metrics;
  const char* rpc;
  Clock::time_point start;
  bool count_rpc;  // false where the items inside the call are counted instead

  void operator()(const absl::Status& status) const {
    if (count_rpc) metrics->CountRequest(rpc, status.code());
    metrics->ObserveLatency(rpc, SecondsSince(start));
    if (status.code() == absl::StatusCode::kInternal) {
      spdlog::error("{}: {}", rpc, status.ToString());
    } else if (!status.ok()) {
      spdlog::debug("{}: {}", rpc, status.ToString());
    }
    reactor->Finish(ToGrpc(status));
  }
};

// Runs `body(tenant, finish)`; `body` calls `finish` exactly once, now or later.
template <typename Body>
grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, Metrics* metrics,
                                const char* rpc, const absl::StatusOr<std::string>& tenant,
                                Body&& body, bool count_rpc = true) {
  Finisher finish{context->DefaultReactor(), metrics, rpc, Clock::now(), count_rpc};
  if (!tenant.ok()) {
    if (!count_rpc) metrics->CountRequest(rpc, tenant.status().code());
    finish(tenant.status());
    return finish.reactor;
  }
  try {
    body(*tenant, finish);
  } catch (const std::exception& e) {
    finish(absl::InternalError(absl::StrCat("internal error: ", e.what())));
  }
  return finish.reactor;
}

// A unary method parsed whole by protobuf (TypedCall, raw_call.h): Serve, then the
// request is parsed (a malformed one is answered INVALID_ARGUMENT and counted) and the
// received bytes freed (the parsed request is a copy), then
// `body(tenant, request, response, finish)`; `finish(OK)` sends the serialized response.
// Request and response live until the last copy of `finish` is gone.
template <typename Request, typename Response, typename Body>
grpc::ServerUnaryReactor* ServeTyped(grpc::CallbackServerContext* context, Metrics* metrics,
                                     const char* rpc, const absl::StatusOr<std::string>& tenant,
                                     const grpc::ByteBuffer* wire, grpc::ByteBuffer* reply,
                                     Body&& body, bool count_rpc = true) {
  return Serve(
      context, metrics, rpc, tenant,
      [&](const std::string& tenant_id, const Finisher& finished) {
        auto call = std::make_shared<TypedCall<Request, Response>>();
        const absl::Status parsed = call->Parse(*wire);
        // Not read again: the request may wait in the queue for long.
        ReleaseReceived(context, wire);
        if (!parsed.ok()) {
          // A method that counts its items has none to count here.
          if (!count_rpc) metrics->CountRequest(rpc, parsed.code());
          return finished(parsed);
        }
        auto finish = [finished, call, reply](const absl::Status& s) {
          finished(s.ok() ? call->Reply(reply) : s);
        };
        body(tenant_id, call->request, &call->response, finish);
      },
      count_rpc);
}
}  // namespace sds::server
