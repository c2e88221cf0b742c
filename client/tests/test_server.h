// Helpers shared by the client and load generator tests: a model shape as the
// GetModelInfo answer, and an in-process gRPC server on a free loopback port.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "client/decode_client.h"
#include "sparse_decode/v1/decode.pb.h"

namespace sds::client_test {

inline ::sparse_decode::v1::ModelInfo ModelInfoOf(const client::Shape& shape, int32_t num_layers) {
  ::sparse_decode::v1::ModelInfo info;
  info.set_num_layers(num_layers);
  info.set_num_q_heads(shape.num_q_heads);
  info.set_num_kv_heads(shape.num_kv_heads);
  info.set_head_dim(shape.head_dim);
  return info;
}

// For StartTestServer's `configure`: HTTP/2's 64 KiB windows instead of the several MB
// of gRPC's BDP probing (a server short of memory does the same through gRPC's resource
// quota), so that a client's Write to a server that does not read blocks soon.
inline void SmallFlowControlWindows(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16384);
}

// Serves `service` on 127.0.0.1 at a free port; `target` receives "127.0.0.1:<port>".
// `configure` may add to the builder (channel arguments). nullptr when it cannot listen.
inline std::unique_ptr<grpc::Server> StartTestServer(
    grpc::Service* service, std::string* target,
    const std::function<void(grpc::ServerBuilder&)>& configure = {}) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  if (configure) configure(builder);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (port == 0) return nullptr;
  *target = "127.0.0.1:" + std::to_string(port);
  return server;
}

}  // namespace sds::client_test
