// Small helpers shared by the RPC handlers.
#pragma once

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "server/caller_status.h"
#include "server/work.h"

namespace grpc {
class CallbackServerContext;
}

namespace sds::server {

// absl and gRPC status codes share their numbering.
grpc::Status ToGrpc(const absl::Status& status);

// The call's deadline on the steady clock (max() when the client set none).
Clock::time_point DeadlineOf(const grpc::CallbackServerContext& context);

double SecondsSince(Clock::time_point start);

}  // namespace sds::server
