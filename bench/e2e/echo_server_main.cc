// echo_server: the gRPC-only ceiling for the end-to-end benchmark.
#include <csignal>
#include <cstdio>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/e2e/echo_service.h"
#include "server/heap_tuning.h"
#include "server/mutex_tuning.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50061", "host:port to serve on (port 0 picks one)");
ABSL_FLAG(int32_t, num_layers, 4, "layers reported by GetModelInfo");
ABSL_FLAG(int32_t, num_q_heads, 32, "query heads");
ABSL_FLAG(int32_t, num_kv_heads, 8, "KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension");
ABSL_FLAG(int32_t, page_size, 64, "tokens per page (reported only)");
ABSL_FLAG(int32_t, max_batch_size, 256, "reported only");
ABSL_FLAG(int32_t, max_topk, 2048, "reported only");
ABSL_FLAG(double, work_us, 0,
          "CPU microseconds spent per decode request before answering (a calibrated loop; a "
          "DecodeBatch's requests one after another on its gRPC thread): the ceiling of a "
          "server whose only cost beyond gRPC's is that computing; 0 = none");

namespace {
std::unique_ptr<grpc::Server> g_server;
void OnSignal(int) {
  // Shutdown from a signal handler is not safe; a short exit is.
  std::_Exit(0);
}
}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Echo DecodeService: same-size answers, no compute.");
  absl::ParseCommandLine(argc, argv);
  if (!sds::KeepFreedHeapMemory()) std::fprintf(stderr, "echo_server: mallopt refused\n");
  sds::DisableMutexDeadlockDetection();
  sparse_decode::v1::ModelInfo info;
  info.set_num_layers(absl::GetFlag(FLAGS_num_layers));
  info.set_num_q_heads(absl::GetFlag(FLAGS_num_q_heads));
  info.set_num_kv_heads(absl::GetFlag(FLAGS_num_kv_heads));
  info.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  info.set_page_size(absl::GetFlag(FLAGS_page_size));
  info.set_max_batch_size(absl::GetFlag(FLAGS_max_batch_size));
  info.set_max_topk(absl::GetFlag(FLAGS_max_topk));
  info.set_kv_dtype("fp8_e4m3");
  info.set_scale_mode("per_tensor");
  info.set_backend("echo");
  info.set_server_version("echo");
  for (int i = 0; i < info.num_layers(); ++i) {
    info.add_k_scales(1.0f);
    info.add_v_scales(1.0f);
  }
  const double work_us = absl::GetFlag(FLAGS_work_us);
  if (work_us < 0 || work_us > 1e6) {
    std::fprintf(stderr, "echo_server: --work_us must be in [0, 1e6]\n");
    return 2;
  }
  sds::bench::EchoService service(info, work_us);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(-1);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&service);
  g_server = builder.BuildAndStart();
  if (!g_server || port == 0) {
    std::fprintf(stderr, "echo_server: cannot listen on %s\n", absl::GetFlag(FLAGS_listen).c_str());
    return 1;
  }
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  std::printf("echo_server listening on port %d\n", port);
  std::fflush(stdout);
  g_server->Wait();
  return 0;
}
