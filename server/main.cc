// decode_server: the Sparse Decode Server binary. Parses flags, creates the backend,
// starts the batcher, runs the self-test, then serves gRPC (with health and
// reflection) and /metrics until SIGTERM or SIGINT, when it drains and exits 0; after a
// lost backend (a sticky CUDA fault) it drains the same way and exits 1.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/usable_cpus.h"
#include "server/backend_select.h"
#include "server/batcher.h"
#include "server/executor.h"
#include "server/heap_tuning.h"
#include "server/log_throttle.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/mutex_tuning.h"
#include "server/options.h"
#include "server/self_test.h"
#include "server/service.h"
#include "server/sigbus_guard.h"
#include "server/staging.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, log_level, "info", "trace | debug | info | warn | error");
ABSL_FLAG(bool, check_flags, false,
          "validate the other flags as a start would, print the result and exit (0: they are "
          "good, 2: they are not) without allocating the cache or listening; the backend's "
          "availability (a GPU for --backend=cuda) and the memory are not checked. For "
          "deployment manifests and config reviews");
ABSL_FLAG(int32_t, drain_linger_ms, 0,
          "on SIGTERM/SIGINT, once queued work and open streams are done, keep the port open "
          "this long (within --drain_timeout_s), answering new RPCs UNAVAILABLE, before "
          "closing it; for callers that have not seen NOT_SERVING yet (0 = close at once)");

namespace sds::server {
namespace {

constexpr char kVersion[] = "0.1.0";
constexpr char kServiceName[] = "sparse_decode.v1.DecodeService";

// After the drain, how long gRPC's Shutdown may wait for its connections to close
// before it cancels what is left (at most the rest of the drain budget).
constexpr std::chrono::seconds kShutdownGrace{1};

// Polls `done` until it holds (true) or `deadline` passes (false).
template <typename Done>
bool WaitUntil(Clock::time_point deadline, Done done) {
  while (!done()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int Fail(const std::string& line, int code = 1) {
  std::fprintf(stderr, "decode_server: %s\n", line.c_str());
  return code;
}

ServiceConfig MakeServiceConfig(const ServerOptions& opt, const ModelShape& model,
                                const std::string& backend_name) {
  ServiceConfig config;
  config.model = model;
  config.auth = opt.auth;
  config.max_unanswered_per_stream = opt.max_unanswered_per_stream;
  config.answer_threads = opt.answer_threads;
  config.max_decode_batch_items = opt.max_decode_batch_items;
  config.allow_client_shm = opt.allow_client_shm;
  config.region_limits = opt.region_limits;
  const CacheConfig& cache = opt.backend_config.cache;
  sparse_decode::v1::ModelInfo& info = config.info;
  info.set_num_layers(cache.num_layers);
  info.set_num_q_heads(model.num_q_heads);
  info.set_num_kv_heads(cache.num_kv_heads);
  info.set_head_dim(cache.head_dim);
  info.set_page_size(cache.page_size);
  info.set_kv_dtype("fp8_e4m3");
  info.set_scale_mode(ScaleModeName(cache.scale_mode));
  info.set_max_batch_size(opt.backend_config.max_batch_size);
  info.set_backend(backend_name);
  for (float s : cache.layer_k_scales) info.add_k_scales(s);
  for (float s : cache.layer_v_scales) info.add_v_scales(s);
  info.set_scales_are_default(opt.scales_are_default);
  info.set_max_topk(model.max_topk);
  info.set_server_version(kVersion);
  return config;
}

// TLS from the PEM files (mutual when a client CA is given), or plaintext.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsOf(const TlsFiles& tls) {
  if (tls.cert_file.empty()) return grpc::InsecureServerCredentials();
  auto read = [](const std::string& path, const char* flag) -> absl::StatusOr<std::string> {
    std::ifstream in(path);
    if (!in)
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read '", path, "'"));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  grpc::SslServerCredentialsOptions options;
  absl::StatusOr<std::string> cert = read(tls.cert_file, "tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = read(tls.key_file, "tls_key_file");
  if (!key.ok()) return key.status();
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!tls.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = read(tls.client_ca_file, "tls_client_ca_file");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

// True for an address only this host reaches (loopback or a Unix socket).
bool LoopbackOnly(const std::string& address) {
  return absl::StartsWith(address, "127.") || absl::StartsWith(address, "localhost:") ||
         absl::StartsWith(address, "[::1]:") || absl::StartsWith(address, "unix:");
}

// Loud lines for a server that anyone on the network may call or read.
void WarnAboutExposure(const ServerOptions& opt) {
  if (!LoopbackOnly(opt.listen) && opt.tls.cert_file.empty() && !opt.auth.required()) {
    spdlog::warn(
        "*** gRPC listens on {} beyond loopback without TLS and without tokens: anyone who "
        "reaches the port can read and write every sequence (--tls_cert_file, "
        "--auth_tokens_file) ***",
        opt.listen);
  } else if (!LoopbackOnly(opt.listen) && opt.tls.cert_file.empty()) {
    spdlog::warn("gRPC listens on {} beyond loopback without TLS: tokens travel in the clear",
                 opt.listen);
  }
  if (!opt.metrics_listen.empty() && !LoopbackOnly(opt.metrics_listen)) {
    // Plain HTTP only: civetweb's HTTPS is not usable with the packaged OpenSSL 3
    // (server/README.md), so TLS for /metrics belongs in front of it.
    spdlog::warn(
        "/metrics listens on {} beyond loopback over plain HTTP, without a token: bind it to a "
        "pod-internal address or put TLS in front of it",
        opt.metrics_listen);
  }
  if (opt.tokens_file_readable_by_others) {
    spdlog::warn("--auth_tokens_file is readable by group or others: chmod 600 it");
  }
  if (opt.single_token_bytes > 0) {
    spdlog::warn("--auth_token is visible in ps and /proc: prefer --auth_tokens_file{}",
                 opt.single_token_bytes < kMinTokenBytes
                     ? absl::StrCat(" (and a token of at least ", kMinTokenBytes, " bytes)")
                     : "");
  }
}

// The connection limits as channel arguments.
void ApplyLimits(const GrpcLimits& limits, grpc::ServerBuilder* builder) {
  builder->SetMaxReceiveMessageSize(static_cast<int>(
      std::min<int64_t>(limits.max_receive_message_bytes, std::numeric_limits<int>::max())));
  builder->SetMaxSendMessageSize(256 << 20);
  builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams);
  builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, limits.max_connection_idle_ms);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, limits.keepalive_time_ms);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, limits.keepalive_timeout_ms);
  // Clients may ping as often as the server does without being told to go away.
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              std::min(limits.keepalive_time_ms, 10000));
}

int Run(const ServerOptions& opt, std::chrono::milliseconds drain_linger) {
  // Signals are taken synchronously by this thread (sigwait); every other thread,
  // including gRPC's and civetweb's, inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  const CacheConfig& cache_config = opt.backend_config.cache;
  if (opt.scales_are_default) {
    spdlog::warn(
        "--scale_mode=per_tensor without --k_scales/--v_scales/--scales_file: all "
        "scales default to 1.0 (values beyond +-448 saturate); visible in "
        "GetModelInfo.scales_are_default and sds_build_info");
  }
  auto backend_or = CreateBackend(opt.backend, opt.backend_config);
  if (!backend_or.ok()) return Fail(absl::StrCat("backend: ", backend_or.status().ToString()));
  std::unique_ptr<Backend> backend = *std::move(backend_or);
  if (opt.inline_idle_batches && backend->name() != "cpu") {
    // Accepted, for experiments: but a gRPC thread then waits on the device for the
    // whole batch, and on the H200 one stream showed no gain (bench/RESULTS.md).
    spdlog::warn(
        "--inline_idle_batches with the {} backend: idle batches run on gRPC threads, "
        "which then wait on the device; it is meant for --backend=cpu (no gain measured on "
        "the H200 at one stream)",
        backend->name());
  }

  ModelShape model;
  model.num_layers = cache_config.num_layers;
  model.num_q_heads = opt.backend_config.num_q_heads;
  model.num_kv_heads = cache_config.num_kv_heads;
  model.head_dim = cache_config.head_dim;
  model.max_topk = opt.backend_config.max_topk;

  BuildInfo build;
  build.backend = backend->name();
  build.num_q_heads = model.num_q_heads;
  build.num_kv_heads = model.num_kv_heads;
  build.head_dim = model.head_dim;
  build.scale_mode = ScaleModeName(cache_config.scale_mode);
  build.scales_default = opt.scales_are_default;
  build.version = kVersion;
  Metrics metrics(build);

  auto executor = Executor::Create(backend.get(), &metrics, model);
  if (!executor.ok()) return Fail(executor.status().ToString());
  // A lost backend (a sticky CUDA fault) fails every later batch: drain as on SIGTERM
  // (health NOT_SERVING at once, queued work answered UNAVAILABLE) and exit 1, so that
  // the supervisor restarts the process instead of routing traffic to it.
  std::atomic<bool> backend_lost{false};
  (*executor)->OnBackendLost([&backend_lost](const absl::Status&) {
    backend_lost = true;
    kill(getpid(), SIGTERM);
  });
  // Decode batches side by side: as many as the backend runs to advantage (CUDA lanes),
  // or the flag's number; not with inline runs (a claimed batch runs alone).
  const int concurrent_batches = opt.inline_idle_batches      ? 1
                                 : opt.concurrent_batches > 0 ? opt.concurrent_batches
                                                              : backend->max_concurrent_runs();
  if (concurrent_batches > backend->max_concurrent_runs()) {
    // Accepted (the extra batches wait for the backend inside Run), but they hold staging
    // buffers and keep their sequences out of other batches meanwhile.
    spdlog::warn(
        "--concurrent_batches={} exceeds the {} batches the {} backend runs side by "
        "side; the extra ones wait for it",
        concurrent_batches, backend->max_concurrent_runs(), backend->name());
  }
  std::vector<std::unique_ptr<StagingBuffer>> staging;
  for (int i = 0; i < std::max(2, concurrent_batches + 1); ++i) {
    auto buffer = StagingBuffer::Create(backend.get(), model, opt.backend_config.max_batch_size);
    if (!buffer.ok()) return Fail(buffer.status().ToString());
    staging.push_back(*std::move(buffer));
  }
  BatcherOptions batcher_options;
  batcher_options.max_batch_size = opt.backend_config.max_batch_size;
  batcher_options.max_queue_delay = std::chrono::microseconds(opt.max_queue_delay_us);
  batcher_options.max_queue_depth = opt.max_queue_depth;
  batcher_options.eager = opt.eager_batching;
  batcher_options.run_on_submitter = opt.inline_idle_batches;
  batcher_options.staging_threads = opt.staging_threads;
  batcher_options.idle_spin = std::chrono::microseconds(opt.idle_spin_us);
  batcher_options.max_concurrent_batches = concurrent_batches;
  Batcher batcher(batcher_options, executor->get(), std::move(staging));
  batcher.Start();
  spdlog::info(
      "batcher: max_batch_size {}, max_queue_delay {} us, eager {}, inline {}, "
      "staging threads {}, idle spin {} us, concurrent batches {}; stream answer threads {} ({} "
      "usable CPUs)",
      batcher_options.max_batch_size, opt.max_queue_delay_us, batcher_options.eager,
      batcher_options.run_on_submitter, batcher_options.staging_threads, opt.idle_spin_us,
      concurrent_batches,
      opt.answer_threads > 0 ? absl::StrCat(opt.answer_threads) : std::string("none"),
      UsableCpus());

  if (absl::Status s = RunSelfTest(batcher, backend->cache(), model); !s.ok()) {
    return Fail(
        absl::StrCat("self-test failed on the ", backend->name(), " backend: ", s.ToString()));
  }

  DecodeServiceImpl service(MakeServiceConfig(opt, model, backend->name()), backend.get(), &batcher,
                            &metrics);
  metrics.SetGaugeSource([&] {
    GaugeValues g;
    const CacheStats stats = backend->cache().Stats();
    g.queue_depth = batcher.queue_depth();
    g.pages_total = stats.pages_total;
    g.pages_used = stats.pages_used;
    g.pages_free = stats.pages_free;
    g.sequences = stats.sequences;
    g.active_streams = service.active_streams();
    const RegionTotals regions = service.region_totals();
    g.system_regions = regions.system_regions;
    g.system_region_bytes = regions.system_bytes;
    g.cuda_regions = regions.cuda_regions;
    g.cuda_region_bytes = regions.cuda_bytes;
    return g;
  });

  std::unique_ptr<MetricsHttpServer> http;
  if (!opt.metrics_listen.empty()) {
    auto started = MetricsHttpServer::Start(
        opt.metrics_listen, [&] { return metrics.Render(); }, opt.metrics_http);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    http = *std::move(started);
  }

  grpc::EnableDefaultHealthCheckService(true);
  if (opt.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsOf(opt.tls);
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  WarnAboutExposure(opt);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(opt.listen, *credentials, &port);
  builder.RegisterService(&service);
  ApplyLimits(opt.grpc_limits, &builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return Fail(absl::StrCat("cannot listen on '", opt.listen, "'"));
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(true);
  // Tests and scripts read the two bound ports from this line (listen on port 0).
  spdlog::info(
      "decode_server {} serving on {} (port {}), backend {}, metrics {} (port {}), model "
      "Hq={} Hkv={} D={} layers={} pages={} scale_mode={}",
      kVersion, opt.listen, port, backend->name(),
      opt.metrics_listen.empty() ? "off" : opt.metrics_listen, http ? http->port() : 0,
      model.num_q_heads, model.num_kv_heads, model.head_dim, model.num_layers,
      cache_config.num_pages, ScaleModeName(cache_config.scale_mode));

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  const Clock::time_point signalled = Clock::now();
  const Clock::time_point deadline = signalled + std::chrono::seconds(opt.drain_timeout_s);
  spdlog::info("signal {}: draining (up to {} s)", signal_number, opt.drain_timeout_s);
  // 1. Stop admitting: health NOT_SERVING; new RPCs and stream messages are answered
  //    UNAVAILABLE by the service itself, so the port stays open until step 5.
  health->SetServingStatus(false);
  service.StartDraining();
  // 2. Queued work runs at once (no queue delay) and is answered.
  const bool drained = batcher.Drain(deadline);
  if (!drained) spdlog::warn("drain timeout: queued work did not finish in time");
  // 3. Open streams finish (UNAVAILABLE) once their answers are written; a slow reader
  //    may still be taking them.
  const bool streams_closed =
      WaitUntil(deadline, [&service] { return service.active_streams() == 0; });
  if (!streams_closed) {
    spdlog::warn("drain timeout: {} streams still open", service.active_streams());
  }
  // 4. Optional lame-duck time for callers that have not yet seen NOT_SERVING.
  if (drain_linger.count() > 0) {
    std::this_thread::sleep_until(
        std::min<Clock::time_point>(deadline, Clock::now() + drain_linger));
  }
  // 5. Close the port. Every call of ours has been answered; what gRPC may still wait
  //    for is answers being flushed and, on each connected client, the GOAWAY handshake
  //    (a PING that an idle client that is not polling its channel answers late), so
  //    the grace is short, and within the budget. A call that arrives while gRPC closes
  //    the port is answered CANCELLED by gRPC itself (grpc/grpc#41785).
  const Clock::duration grace =
      std::clamp<Clock::duration>(deadline - Clock::now(), Clock::duration::zero(), kShutdownGrace);
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::duration_cast<std::chrono::system_clock::duration>(grace));
  // 6. Nothing can submit any more: join the batcher (anything left fails UNAVAILABLE),
  //    stop /metrics.
  batcher.Stop();
  http.reset();
  spdlog::info(
      "drained{} in {} ms; exiting{}", drained && streams_closed ? "" : " (with timeouts)",
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - signalled).count(),
      backend_lost ? " with status 1: the backend was lost" : "");
  return backend_lost ? 1 : 0;
}

}  // namespace
}  // namespace sds::server

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Sparse Decode Server: paged FP8 KV cache + batched sparse top-K GQA decode over gRPC.\n"
      "Usage: decode_server --listen=0.0.0.0:50051 --backend=auto --num_layers=... ");
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "server/");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  sds::DisableMutexDeadlockDetection();
  const auto level = spdlog::level::from_str(absl::GetFlag(FLAGS_log_level));
  spdlog::set_level(level);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%t] %v");
  sds::server::InstallThrottledProtobufLog();
  auto options = sds::server::OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "decode_server: invalid flags: %s\n",
                 std::string(options.status().message()).c_str());
    return 2;
  }
  const int32_t drain_linger_ms = absl::GetFlag(FLAGS_drain_linger_ms);
  if (drain_linger_ms < 0) {
    std::fprintf(stderr, "decode_server: invalid flags: --drain_linger_ms must be >= 0 (got %d)\n",
                 drain_linger_ms);
    return 2;
  }
  if (absl::GetFlag(FLAGS_check_flags)) {
    std::printf("decode_server: flags ok (backend availability and memory not checked)\n");
    return 0;
  }
  // Once the flags are known good (a run with bad flags prints one line, nothing else)
  // and before the server allocates its buffers. Refused under AddressSanitizer.
  if (!sds::KeepFreedHeapMemory())
    spdlog::warn("mallopt refused the heap settings of server/heap_tuning.h");
  // Client shared memory may lose its pages under the server (sigbus_guard.h).
  if (options->allow_client_shm) sds::server::InstallSigbusGuard();
  return sds::server::Run(*options, std::chrono::milliseconds(drain_linger_ms));
}
