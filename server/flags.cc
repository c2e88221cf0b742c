// Command-line flags of decode_server and their validation.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/usable_cpus.h"
#include "server/options.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "gRPC listen address (host:port)");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "HTTP address for Prometheus /metrics (host:port); empty disables it");
ABSL_FLAG(std::string, backend, "auto", "auto | cpu | cuda (auto = cuda when a GPU is usable)");
ABSL_FLAG(int32_t, num_layers, 2, "number of transformer layers in the cache");
ABSL_FLAG(int32_t, num_q_heads, 32, "query heads Hq (a multiple of --num_kv_heads)");
ABSL_FLAG(int32_t, num_kv_heads, 8, "KV heads Hkv");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension D");
ABSL_FLAG(int32_t, page_size, 16, "tokens per cache page (a power of two)");
ABSL_FLAG(int64_t, cache_bytes, 0,
          "cache size in bytes (K, V and scales of all layers); default 256 MiB when "
          "--cache_pages is not given either");
ABSL_FLAG(int64_t, cache_pages, 0, "cache size in pages (alternative to --cache_bytes)");
ABSL_FLAG(std::string, scale_mode, "per_tensor", "per_tensor | per_token_head");
ABSL_FLAG(std::string, k_scales, "",
          "per_tensor K scales: one float for all layers or a comma list, one per layer");
ABSL_FLAG(std::string, v_scales, "",
          "per_tensor V scales: one float for all layers or a comma list, one per layer");
ABSL_FLAG(std::string, scales_file, "",
          "per_tensor scales file: one line per layer, 'k_scale v_scale'; '#' starts a "
          "comment (alternative to --k_scales/--v_scales)");
ABSL_FLAG(int32_t, max_batch_size, 64, "largest decode batch");
ABSL_FLAG(int64_t, max_queue_delay_us, 500,
          "a batch closes when its oldest request has waited this long");
ABSL_FLAG(int32_t, max_queue_depth, 4096, "requests waiting before RESOURCE_EXHAUSTED");
ABSL_FLAG(bool, eager_batching, false,
          "launch a batch without waiting up to --max_queue_delay_us when the backend is "
          "idle or when a DecodeBatch call's items are all queued (lower latency)");
ABSL_FLAG(bool, inline_idle_batches, false,
          "with --eager_batching: the RPC thread that queues work into an idle batcher runs "
          "that batch itself (no hand-off to the batcher's threads; CPU backend)");
ABSL_FLAG(int32_t, staging_threads, 1,
          "threads copying a batch's request tensors into staging (batches of 16 or more); "
          "1 = the batcher's thread alone (on the H200 host 4 measured within the run-to-run "
          "spread, bench/RESULTS.md)");
ABSL_FLAG(int32_t, answer_threads, -1,
          "threads writing DecodeStream answers of batches of two or more requests, so that the "
          "batch's thread goes on (gRPC writes inline on the calling thread); 0 = the batch's "
          "thread writes them; -1 (auto) = 4 where the process may use 8 or more CPUs "
          "(affinity, cgroup quota), else 0 (on the H200 host at 256 streams over 4 "
          "connections the batch's thread writing alone capped the server at half the echo's "
          "rate; on 2 cores the threads compete with the batch: bench/RESULTS.md)");
ABSL_FLAG(int32_t, concurrent_batches, 0,
          "decode batches that may run at once, each on its own executor thread (batches of "
          "different sequences); 0 = what the backend runs side by side (CUDA: its lanes, "
          "SDS_CUDA_LANES, default 1; CPU: 1). 1 with --inline_idle_batches");
ABSL_FLAG(int32_t, idle_spin_us, 0,
          "microseconds the batcher's two threads spin for new work before they sleep: a "
          "request arriving meanwhile skips a thread wake-up (lower latency at low load) "
          "at the cost of up to two busy cores while idle; for hosts with cores to spare "
          "(GPU servers). 0 = sleep at once; at most 10000");
ABSL_FLAG(int32_t, max_decode_batch_items, 1024,
          "most requests one DecodeBatch call may hold (INVALID_ARGUMENT beyond, before "
          "they are parsed); a call larger than --max_batch_size runs as several batches");
ABSL_FLAG(int32_t, metrics_threads, 8,
          "threads serving /metrics: each holds one connection while it waits for its request");
ABSL_FLAG(int32_t, metrics_request_timeout_ms, 5000,
          "/metrics: milliseconds a connection may take to send its request (and to read the "
          "answer) before it is closed");
ABSL_FLAG(bool, allow_client_shm, false,
          "accept RegisterRegion and region references in DecodeLayer: tensors in shared "
          "memory (POSIX shm, CUDA IPC) of runners on this host");
ABSL_FLAG(int32_t, max_regions_per_tenant, 64,
          "most shared-memory regions one tenant may register");
ABSL_FLAG(int64_t, max_region_bytes, int64_t{64} << 30, "largest shared-memory region, in bytes");
ABSL_FLAG(int32_t, max_topk, 2048, "largest K per request (per KV head for [Hkv, K])");
ABSL_FLAG(int32_t, cpu_threads, 0,
          "CPU backend threads; 0 = the CPUs this process may use (affinity mask and cgroup "
          "CPU quota)");
ABSL_FLAG(int32_t, cpu_prewake_us, 1000,
          "CPU backend: when a DecodeBatch arrives, wake the pool's threads and let them "
          "poll (yielding) for its batch, up to this long (0 = off; see README)");
ABSL_FLAG(int32_t, drain_timeout_s, 10, "on SIGTERM/SIGINT, seconds to finish queued work");
ABSL_FLAG(std::string, auth_token, "",
          "one token of tenant 'default' (every RPC then needs 'authorization: Bearer "
          "<token>'); visible in ps: prefer --auth_tokens_file");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "file of 'TENANT TOKEN' lines: every RPC needs a token, and its tenant is its "
          "token's (x-tenant-id may only repeat it); tokens of at least 16 bytes");
ABSL_FLAG(std::string, auth_tokens_env, "",
          "name of an environment variable holding 'TENANT TOKEN' entries (lines or "
          "';'-separated), as --auth_tokens_file");
ABSL_FLAG(bool, tenant_from_client_cert, false,
          "the tenant is the client certificate's common name (needs --tls_client_ca_file)");
ABSL_FLAG(int64_t, max_sequences_per_tenant, 0,
          "sequences one tenant may hold (its forks included); 0 = no limit");
ABSL_FLAG(int64_t, max_pages_per_tenant, 0,
          "cache pages one tenant may hold (shared pages once); 0 = no limit");
ABSL_FLAG(bool, reflection, true, "serve gRPC server reflection (grpcurl without a .proto)");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM certificate (chain) of the gRPC listener: TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: clients must present a certificate it signed (mutual TLS)");
ABSL_FLAG(int32_t, max_concurrent_streams, 1024,
          "concurrent calls (streams) per client connection (HTTP/2 SETTINGS)");
ABSL_FLAG(int32_t, max_connection_idle_ms, 300000,
          "a connection with no call for this long is closed (GOAWAY; clients reconnect)");
ABSL_FLAG(int32_t, keepalive_time_ms, 60000,
          "ping an idle connection this often, and drop it when the ping goes unanswered "
          "within --keepalive_timeout_ms (a vanished client frees its calls)");
ABSL_FLAG(int32_t, keepalive_timeout_ms, 20000, "see --keepalive_time_ms");
ABSL_FLAG(int32_t, max_unanswered_per_stream, 4096,
          "answers a DecodeStream may hold for a client that does not read them before it "
          "stops reading (bounds a slow reader's memory)");
ABSL_FLAG(int64_t, max_receive_message_bytes, int64_t{256} << 20,
          "largest request message of any method (an AppendKV prefill is the largest)");

namespace sds::server {
namespace {

absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

absl::StatusOr<std::vector<float>> ParseScaleList(const std::string& flag, const std::string& text,
                                                  int32_t num_layers) {
  std::vector<float> values;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    float value = 0;
    if (!absl::SimpleAtof(absl::StripAsciiWhitespace(part), &value) || !std::isfinite(value) ||
        value <= 0) {
      return Bad(absl::StrCat("--", flag, ": '", part, "' is not a positive finite float"));
    }
    values.push_back(value);
  }
  if (values.size() == 1) values.assign(num_layers, values[0]);
  if (static_cast<int32_t>(values.size()) != num_layers) {
    return Bad(absl::StrCat("--", flag, " has ", values.size(), " values; give one for all ",
                            "layers or one per layer (--num_layers=", num_layers, ")"));
  }
  return values;
}

absl::Status ReadScalesFile(const std::string& path, int32_t num_layers, std::vector<float>* k,
                            std::vector<float>* v) {
  std::ifstream in(path);
  if (!in) return Bad(absl::StrCat("--scales_file: cannot open '", path, "'"));
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    absl::string_view text = line;
    if (auto hash = text.find('#'); hash != absl::string_view::npos) text = text.substr(0, hash);
    text = absl::StripAsciiWhitespace(text);
    if (text.empty()) continue;
    std::vector<std::string> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t,"), absl::SkipEmpty());
    float ks = 0, vs = 0;
    if (fields.size() != 2 || !absl::SimpleAtof(fields[0], &ks) ||
        !absl::SimpleAtof(fields[1], &vs) || !std::isfinite(ks) || !std::isfinite(vs) || ks <= 0 ||
        vs <= 0) {
      return Bad(absl::StrCat("--scales_file ", path, ":", line_no,
                              ": expected 'k_scale v_scale' (positive floats)"));
    }
    k->push_back(ks);
    v->push_back(vs);
  }
  if (static_cast<int32_t>(k->size()) != num_layers) {
    return Bad(absl::StrCat("--scales_file ", path, " has ", k->size(), " layers, --num_layers is ",
                            num_layers));
  }
  return absl::OkStatus();
}

absl::Status CheckPositive(const char* flag, int64_t value) {
  if (value <= 0) return Bad(absl::StrCat("--", flag, " must be > 0 (got ", value, ")"));
  return absl::OkStatus();
}

// The tokens (file, environment variable, --auth_token) and the certificate tenancy.
absl::Status ReadCallerAuth(ServerOptions* opt) {
  CallerAuthOptions auth;
  auth.single_token = absl::GetFlag(FLAGS_auth_token);
  opt->single_token_bytes = auth.single_token.size();
  auth.tenant_from_client_cert = absl::GetFlag(FLAGS_tenant_from_client_cert);
  const std::string file = absl::GetFlag(FLAGS_auth_tokens_file);
  const std::string env = absl::GetFlag(FLAGS_auth_tokens_env);
  if (!file.empty() && !env.empty()) return Bad("give --auth_tokens_file or --auth_tokens_env");
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) return Bad(absl::StrCat("--auth_tokens_file: cannot read '", file, "'"));
    std::stringstream text;
    text << in.rdbuf();
    auth.tokens_text = text.str();
    auth.where = absl::StrCat("--auth_tokens_file '", file, "'");
    struct stat st {};
    opt->tokens_file_readable_by_others = stat(file.c_str(), &st) == 0 && (st.st_mode & 077) != 0;
  } else if (!env.empty()) {
    const char* value = std::getenv(env.c_str());
    if (value == nullptr || *value == '\0') {
      return Bad(absl::StrCat("--auth_tokens_env: environment variable ", env, " is not set"));
    }
    auth.tokens_text = value;
    auth.where = absl::StrCat("--auth_tokens_env ", env);
  }
  absl::StatusOr<CallerAuth> made = CallerAuth::Create(auth);
  if (!made.ok()) return made.status();
  if ((!file.empty() || !env.empty()) && made->num_tokens() == 0) {
    return Bad(absl::StrCat(auth.where, " holds no token"));
  }
  opt->auth = *std::move(made);
  return absl::OkStatus();
}

}  // namespace

int32_t AnswerThreadsFor(int32_t flag, int usable_cpus) {
  if (flag != -1) return flag;
  return usable_cpus >= 8 ? 4 : 0;
}

const char* ScaleModeName(ScaleMode mode) {
  return mode == ScaleMode::kPerTokenHead ? "per_token_head" : "per_tensor";
}

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  ServerOptions opt;
  opt.listen = absl::GetFlag(FLAGS_listen);
  opt.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  opt.backend = absl::GetFlag(FLAGS_backend);
  if (opt.backend != "auto" && opt.backend != "cpu" && opt.backend != "cuda") {
    return Bad(absl::StrCat("--backend must be auto, cpu or cuda (got '", opt.backend, "')"));
  }
  if (opt.listen.empty()) return Bad("--listen must not be empty");

  CacheConfig& cache = opt.backend_config.cache;
  cache.num_layers = absl::GetFlag(FLAGS_num_layers);
  cache.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  cache.head_dim = absl::GetFlag(FLAGS_head_dim);
  cache.page_size = absl::GetFlag(FLAGS_page_size);
  opt.backend_config.num_q_heads = absl::GetFlag(FLAGS_num_q_heads);
  opt.backend_config.max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  opt.backend_config.max_topk = absl::GetFlag(FLAGS_max_topk);
  opt.backend_config.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  opt.backend_config.cpu_prewake_us = absl::GetFlag(FLAGS_cpu_prewake_us);
  opt.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  opt.max_queue_depth = absl::GetFlag(FLAGS_max_queue_depth);
  opt.eager_batching = absl::GetFlag(FLAGS_eager_batching);
  opt.staging_threads = absl::GetFlag(FLAGS_staging_threads);
  opt.answer_threads = absl::GetFlag(FLAGS_answer_threads);
  opt.idle_spin_us = absl::GetFlag(FLAGS_idle_spin_us);
  opt.concurrent_batches = absl::GetFlag(FLAGS_concurrent_batches);
  opt.inline_idle_batches = absl::GetFlag(FLAGS_inline_idle_batches);
  opt.drain_timeout_s = absl::GetFlag(FLAGS_drain_timeout_s);
  if (absl::Status s = ReadCallerAuth(&opt); !s.ok()) return s;
  opt.backend_config.cache.max_sequences_per_tenant = absl::GetFlag(FLAGS_max_sequences_per_tenant);
  opt.backend_config.cache.max_pages_per_tenant = absl::GetFlag(FLAGS_max_pages_per_tenant);
  if (opt.backend_config.cache.max_sequences_per_tenant < 0 ||
      opt.backend_config.cache.max_pages_per_tenant < 0) {
    return Bad("--max_sequences_per_tenant and --max_pages_per_tenant must be >= 0 (0 = none)");
  }
  opt.reflection = absl::GetFlag(FLAGS_reflection);
  opt.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  opt.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  opt.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  if (opt.tls.cert_file.empty() != opt.tls.key_file.empty()) {
    return Bad("--tls_cert_file and --tls_key_file must be given together");
  }
  if (!opt.tls.client_ca_file.empty() && opt.tls.cert_file.empty()) {
    return Bad("--tls_client_ca_file needs --tls_cert_file and --tls_key_file (TLS)");
  }
  if (absl::GetFlag(FLAGS_tenant_from_client_cert) && opt.tls.client_ca_file.empty()) {
    return Bad("--tenant_from_client_cert needs --tls_client_ca_file (mutual TLS)");
  }
  opt.grpc_limits.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  opt.grpc_limits.max_connection_idle_ms = absl::GetFlag(FLAGS_max_connection_idle_ms);
  opt.grpc_limits.keepalive_time_ms = absl::GetFlag(FLAGS_keepalive_time_ms);
  opt.grpc_limits.keepalive_timeout_ms = absl::GetFlag(FLAGS_keepalive_timeout_ms);
  opt.grpc_limits.max_receive_message_bytes = absl::GetFlag(FLAGS_max_receive_message_bytes);
  opt.max_unanswered_per_stream = absl::GetFlag(FLAGS_max_unanswered_per_stream);
  opt.max_decode_batch_items = absl::GetFlag(FLAGS_max_decode_batch_items);
  opt.allow_client_shm = absl::GetFlag(FLAGS_allow_client_shm);
  opt.region_limits.max_regions_per_tenant = absl::GetFlag(FLAGS_max_regions_per_tenant);
  opt.region_limits.max_region_bytes =
      static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_max_region_bytes)));
  opt.metrics_http.threads = absl::GetFlag(FLAGS_metrics_threads);
  opt.metrics_http.request_timeout_ms = absl::GetFlag(FLAGS_metrics_request_timeout_ms);

  for (auto [flag, value] : std::initializer_list<std::pair<const char*, int64_t>>{
           {"num_layers", cache.num_layers},
           {"num_q_heads", opt.backend_config.num_q_heads},
           {"num_kv_heads", cache.num_kv_heads},
           {"head_dim", cache.head_dim},
           {"page_size", cache.page_size},
           {"max_batch_size", opt.backend_config.max_batch_size},
           {"max_topk", opt.backend_config.max_topk},
           {"max_queue_depth", opt.max_queue_depth},
           {"max_decode_batch_items", opt.max_decode_batch_items},
           {"metrics_threads", opt.metrics_http.threads},
           {"max_regions_per_tenant", opt.region_limits.max_regions_per_tenant},
           {"max_region_bytes", absl::GetFlag(FLAGS_max_region_bytes)},
           {"metrics_request_timeout_ms", opt.metrics_http.request_timeout_ms},
           {"drain_timeout_s", opt.drain_timeout_s},
           {"max_concurrent_streams", opt.grpc_limits.max_concurrent_streams},
           {"max_connection_idle_ms", opt.grpc_limits.max_connection_idle_ms},
           {"keepalive_time_ms", opt.grpc_limits.keepalive_time_ms},
           {"keepalive_timeout_ms", opt.grpc_limits.keepalive_timeout_ms},
           {"max_unanswered_per_stream", opt.max_unanswered_per_stream},
           {"max_receive_message_bytes", opt.grpc_limits.max_receive_message_bytes}}) {
    if (absl::Status s = CheckPositive(flag, value); !s.ok()) return s;
  }
  if (opt.backend_config.num_q_heads % cache.num_kv_heads != 0) {
    return Bad(absl::StrCat("--num_q_heads (", opt.backend_config.num_q_heads,
                            ") must be a multiple of --num_kv_heads (", cache.num_kv_heads, ")"));
  }
  if ((cache.page_size & (cache.page_size - 1)) != 0) {
    return Bad(absl::StrCat("--page_size (", cache.page_size, ") must be a power of two"));
  }
  if (opt.max_queue_delay_us < 0) return Bad("--max_queue_delay_us must be >= 0");
  if (opt.staging_threads < 1 || opt.staging_threads > 64)
    return Bad("--staging_threads must be in [1, 64]");
  if (opt.concurrent_batches < 0 || opt.concurrent_batches > 8)
    return Bad("--concurrent_batches must be in [0, 8]");
  if (opt.idle_spin_us < 0 || opt.idle_spin_us > 10000)
    return Bad("--idle_spin_us must be in [0, 10000]");
  if (opt.answer_threads < -1 || opt.answer_threads > 64)
    return Bad("--answer_threads must be in [0, 64], or -1 (auto)");
  opt.answer_threads = AnswerThreadsFor(opt.answer_threads, UsableCpus());
  if (opt.inline_idle_batches && !opt.eager_batching) {
    return Bad("--inline_idle_batches needs --eager_batching (it runs batches that close at once)");
  }
  if (opt.backend_config.cpu_threads < 0) return Bad("--cpu_threads must be >= 0");
  if (opt.backend_config.cpu_prewake_us < 0 || opt.backend_config.cpu_prewake_us > kMaxCpuPrewakeUs)
    return Bad(absl::StrCat("--cpu_prewake_us must be in [0, ", kMaxCpuPrewakeUs, "]"));

  const std::string mode = absl::GetFlag(FLAGS_scale_mode);
  const std::string k_text = absl::GetFlag(FLAGS_k_scales);
  const std::string v_text = absl::GetFlag(FLAGS_v_scales);
  const std::string scales_file = absl::GetFlag(FLAGS_scales_file);
  if (mode == "per_token_head") {
    cache.scale_mode = ScaleMode::kPerTokenHead;
    if (!k_text.empty() || !v_text.empty() || !scales_file.empty()) {
      return Bad("--k_scales/--v_scales/--scales_file apply to --scale_mode=per_tensor only");
    }
  } else if (mode == "per_tensor") {
    cache.scale_mode = ScaleMode::kPerTensor;
    if (!scales_file.empty() && (!k_text.empty() || !v_text.empty())) {
      return Bad("give either --scales_file or --k_scales/--v_scales, not both");
    }
    if (k_text.empty() != v_text.empty()) {
      return Bad("--k_scales and --v_scales must be given together");
    }
    if (!scales_file.empty()) {
      absl::Status s = ReadScalesFile(scales_file, cache.num_layers, &cache.layer_k_scales,
                                      &cache.layer_v_scales);
      if (!s.ok()) return s;
    } else if (!k_text.empty()) {
      auto k = ParseScaleList("k_scales", k_text, cache.num_layers);
      if (!k.ok()) return k.status();
      auto v = ParseScaleList("v_scales", v_text, cache.num_layers);
      if (!v.ok()) return v.status();
      cache.layer_k_scales = *std::move(k);
      cache.layer_v_scales = *std::move(v);
    } else {
      opt.scales_are_default = true;
      cache.layer_k_scales.assign(cache.num_layers, 1.0f);
      cache.layer_v_scales.assign(cache.num_layers, 1.0f);
    }
  } else {
    return Bad(
        absl::StrCat("--scale_mode must be per_tensor or per_token_head (got '", mode, "')"));
  }

  const int64_t cache_bytes = absl::GetFlag(FLAGS_cache_bytes);
  const int64_t cache_pages = absl::GetFlag(FLAGS_cache_pages);
  if (cache_bytes < 0 || cache_pages < 0) return Bad("--cache_bytes/--cache_pages must be >= 0");
  if (cache_bytes > 0 && cache_pages > 0) {
    return Bad("give either --cache_bytes or --cache_pages, not both");
  }
  if (cache_pages > 0) {
    cache.num_pages = cache_pages;
  } else {
    const int64_t bytes = cache_bytes > 0 ? cache_bytes : int64_t{256} << 20;
    const int64_t per_page = PagedKvCache::BytesPerPage(cache);
    cache.num_pages = per_page > 0 ? bytes / per_page : 0;
    if (cache.num_pages <= 0) {
      return Bad(absl::StrCat("--cache_bytes (", bytes, ") is smaller than one page (", per_page,
                              " bytes)"));
    }
  }
  return opt;
}

}  // namespace sds::server
