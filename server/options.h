// Everything the server needs to start, resolved and validated from the command line.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend.h"
#include "server/credentials.h"
#include "server/metrics_http.h"
#include "server/shm_region.h"

namespace sds::server {

// PEM files of the gRPC listener's TLS.
struct TlsFiles {
  std::string cert_file, key_file;
  std::string client_ca_file;  // mutual TLS: clients must present a certificate it signed
};

// Connection-level limits of the gRPC server (channel arguments).
struct GrpcLimits {
  int32_t max_concurrent_streams = 1024;
  int32_t max_connection_idle_ms = 300000;
  int32_t keepalive_time_ms = 60000;
  int32_t keepalive_timeout_ms = 20000;
  int64_t max_receive_message_bytes = int64_t{256} << 20;
};

struct ServerOptions {
  std::string listen;          // gRPC address, host:port
  std::string metrics_listen;  // civetweb address for /metrics; empty = off
  std::string backend;         // "auto" | "cpu" | "cuda"
  BackendConfig backend_config;
  bool scales_are_default = false;  // per_tensor mode without configured scales
  int64_t max_queue_delay_us = 0;
  int32_t max_queue_depth = 0;
  bool eager_batching = false;
  bool inline_idle_batches = false;
  int32_t staging_threads = 1;
  int32_t answer_threads = 0;      // resolved (never -1 after OptionsFromFlags); 0: no answer pool
  int32_t idle_spin_us = 0;        // 0: the batcher threads sleep at once
  int32_t concurrent_batches = 0;  // 0: Backend::max_concurrent_runs()
  int32_t drain_timeout_s = 0;
  CallerAuth auth;                              // tokens, certificate tenancy (credentials.h)
  bool tokens_file_readable_by_others = false;  // warned about at start
  size_t single_token_bytes = 0;                // --auth_token's length (warned about)
  bool reflection = true;
  TlsFiles tls;  // empty: plaintext gRPC
  GrpcLimits grpc_limits;
  int32_t max_unanswered_per_stream = 4096;
  int32_t max_decode_batch_items = 1024;  // requests per DecodeBatch call
  MetricsHttpOptions metrics_http;
  bool allow_client_shm = false;  // shared-memory regions (shm_region.h)
  RegionLimits region_limits;
};

// Reads the absl flags (after absl::ParseCommandLine) and checks their combination.
// INVALID_ARGUMENT with one line naming the flag on a bad combination.
absl::StatusOr<ServerOptions> OptionsFromFlags();

// --answer_threads: -1 (auto) is 4 answer threads where the process may use at least 8
// CPUs (`usable_cpus`: UsableCpus(), affinity and cgroup quota) and none below (where
// they would take cores from the batch); other values are kept.
int32_t AnswerThreadsFor(int32_t flag, int usable_cpus);

// "per_tensor" | "per_token_head".
const char* ScaleModeName(ScaleMode mode);

}  // namespace sds::server
