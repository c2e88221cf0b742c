#include "client/loadgen/config.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/loadgen/sweep.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "decode server host:port");
ABSL_FLAG(std::string, mode, "unary", "unary | batch | stream");
ABSL_FLAG(std::string, stream_api, "auto",
          "--mode=stream: sync (a thread per stream), callback (gRPC's callback API, no "
          "thread per stream) or auto (sync up to 4 streams, else callback)");
ABSL_FLAG(int32_t, concurrency, 1,
          "closed loop: concurrent callers; open loop: most calls in flight");
ABSL_FLAG(double, rate, 0, "open loop: Poisson arrivals per second (calls); 0 = closed loop");
ABSL_FLAG(double, duration_s, 10, "measured seconds, after the warm-up");
ABSL_FLAG(int64_t, requests, 0, "stop after this many calls (0 = by --duration_s)");
ABSL_FLAG(double, warmup_s, 1, "seconds at the start excluded from the statistics");
ABSL_FLAG(int32_t, channels, 1, "gRPC channels (TCP connections), shared round-robin");
ABSL_FLAG(int32_t, batch_size, 64, "requests per DecodeBatch call (--mode=batch)");
ABSL_FLAG(std::string, transport, "bytes",
          "--mode=batch: bytes (DecodeBatch, tensors in the message) or shm (DecodeLayer, "
          "tensors in shared memory; the server on this host with --allow_client_shm)");
ABSL_FLAG(int32_t, prefill_len, 1024, "tokens prefilled per sequence and layer");
ABSL_FLAG(int32_t, prefill_chunk, 256, "tokens per AppendKV call");
ABSL_FLAG(int32_t, max_new_tokens, 256,
          "decoded tokens per sequence before positions wrap back (rewriting same data)");
ABSL_FLAG(int32_t, topk, 512, "indices per request, drawn from the sequence's prefix");
ABSL_FLAG(bool, per_head_indices, false, "send [Hkv, K] indices instead of [K]");
ABSL_FLAG(bool, return_lse, false, "ask for lse");
ABSL_FLAG(int32_t, timeout_ms, 2000, "deadline of every call");
ABSL_FLAG(int32_t, keepalive_ms, 10000,
          "HTTP/2 keepalive ping interval, and its answer's timeout (0 = off): a server gone "
          "without a reset fails the calls and streams within about twice this");
ABSL_FLAG(double, stall_s, 5, "abort when nothing succeeded this long and errors were seen");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(std::string, tenant_id, "", "x-tenant-id metadata");
ABSL_FLAG(std::string, token, "", "bearer token (authorization metadata)");
ABSL_FLAG(std::string, label, "", "free text copied into the JSON");
ABSL_FLAG(std::string, json_out, "", "write the summary as JSON here");
ABSL_FLAG(std::string, plot_prefix, "",
          "write <prefix>_latency_time.png and <prefix>_latency_dist.png (gnuplot), from "
          "<prefix>_*.dat and <prefix>_plots.gp");
ABSL_FLAG(bool, plot_render, true,
          "run gnuplot on the plot script; false: write the data and the script only (a "
          "host without gnuplot; render elsewhere with `gnuplot <prefix>_plots.gp`)");
ABSL_FLAG(bool, release, true,
          "release the sequences it created when it ends, whichever way (a failed prefill, "
          "errors, SIGINT/SIGTERM, an exception)");
ABSL_FLAG(double, release_timeout_s, 10,
          "most seconds all the releases may take together (each call also has "
          "--timeout_ms): a server that does not answer cannot hold up the exit");
ABSL_FLAG(double, progress_s, 5,
          "a progress line on stderr this often (elapsed, calls, token-layers/s, errors); "
          "0 = none");
ABSL_FLAG(std::string, sweep, "",
          "DIMENSION:V1,V2,...: one run per value, each prefilled, run for --duration_s and "
          "released; DIMENSION is concurrency (alias streams), rate or batch_size "
          "(--mode=batch). Stops at the first failed point. Write the points with --csv");
ABSL_FLAG(std::string, csv, "",
          "write one CSV row per run (per --sweep point): the point, calls, token-layers/s, "
          "p50/p90/p99 latency, errors, result");

namespace sds::loadgen {

absl::StatusOr<Config> ConfigFromFlags() {
  Config c;
  c.target = absl::GetFlag(FLAGS_target);
  c.mode_name = absl::GetFlag(FLAGS_mode);
  if (c.mode_name == "unary") {
    c.mode = Mode::kUnary;
  } else if (c.mode_name == "batch") {
    c.mode = Mode::kBatch;
  } else if (c.mode_name == "stream") {
    c.mode = Mode::kStream;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--mode=", c.mode_name, ": use unary, batch or stream"));
  }
  c.concurrency = absl::GetFlag(FLAGS_concurrency);
  const std::string api = absl::GetFlag(FLAGS_stream_api);
  c.stream_api_auto = api == "auto";
  if (api == "sync" || (api == "auto" && c.concurrency <= kSyncStreamsUpTo)) {
    c.stream_api = StreamApi::kSync;
  } else if (api == "callback" || api == "auto") {
    c.stream_api = StreamApi::kCallback;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream_api=", api, ": use auto, sync or callback"));
  }
  c.rate = absl::GetFlag(FLAGS_rate);
  c.duration_s = absl::GetFlag(FLAGS_duration_s);
  c.requests = absl::GetFlag(FLAGS_requests);
  c.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  c.channels = absl::GetFlag(FLAGS_channels);
  c.batch_size = c.mode == Mode::kBatch ? absl::GetFlag(FLAGS_batch_size) : 1;
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "bytes" && transport != "shm") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport=", transport, ": use bytes or shm"));
  }
  c.shm_transport = transport == "shm";
  if (c.shm_transport && c.mode != Mode::kBatch) {
    return absl::InvalidArgumentError("--transport=shm needs --mode=batch");
  }
  c.prefill_len = absl::GetFlag(FLAGS_prefill_len);
  c.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  c.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  c.topk = absl::GetFlag(FLAGS_topk);
  c.per_head_indices = absl::GetFlag(FLAGS_per_head_indices);
  c.return_lse = absl::GetFlag(FLAGS_return_lse);
  c.timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  c.keepalive_ms = absl::GetFlag(FLAGS_keepalive_ms);
  c.stall_s = absl::GetFlag(FLAGS_stall_s);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.tenant_id = absl::GetFlag(FLAGS_tenant_id);
  c.token = absl::GetFlag(FLAGS_token);
  c.label = absl::GetFlag(FLAGS_label);
  c.json_out = absl::GetFlag(FLAGS_json_out);
  c.plot_prefix = absl::GetFlag(FLAGS_plot_prefix);
  c.plot_render = absl::GetFlag(FLAGS_plot_render);
  c.release = absl::GetFlag(FLAGS_release);
  const double release_s = absl::GetFlag(FLAGS_release_timeout_s);
  if (!(release_s > 0 && release_s < 86400)) {
    return absl::InvalidArgumentError("--release_timeout_s must be in (0, 86400)");
  }
  c.release_timeout_ms = static_cast<int>(release_s * 1000);
  c.progress_s = absl::GetFlag(FLAGS_progress_s);
  if (c.progress_s < 0) return absl::InvalidArgumentError("--progress_s must be >= 0");
  c.csv = absl::GetFlag(FLAGS_csv);
  absl::StatusOr<SweepSpec> sweep = ParseSweep(absl::GetFlag(FLAGS_sweep));
  if (!sweep.ok()) return sweep.status();
  c.sweep = *std::move(sweep);
  if (!c.sweep.dimension.empty()) {
    // One file each would be overwritten by the next point.
    if (!c.json_out.empty() || !c.plot_prefix.empty()) {
      return absl::InvalidArgumentError("--sweep writes --csv; not --json_out or --plot_prefix");
    }
    if (c.sweep.dimension == "batch_size" && c.mode != Mode::kBatch) {
      return absl::InvalidArgumentError("--sweep=batch_size:... needs --mode=batch");
    }
  }
  if (c.concurrency < 1 || c.channels < 1 || c.batch_size < 1 || c.topk < 1 || c.prefill_len < 1 ||
      c.prefill_chunk < 1 || c.max_new_tokens < 1 || c.timeout_ms < 1) {
    return absl::InvalidArgumentError(
        "--concurrency, --channels, --batch_size, --topk, --prefill_len, --prefill_chunk, "
        "--max_new_tokens and --timeout_ms must be >= 1");
  }
  if (c.keepalive_ms < 0) return absl::InvalidArgumentError("--keepalive_ms must be >= 0");
  if (c.rate < 0 || c.duration_s < 0 || c.warmup_s < 0 || c.requests < 0) {
    return absl::InvalidArgumentError("--rate, --duration_s, --warmup_s, --requests must be >= 0");
  }
  if (c.duration_s == 0 && c.requests == 0) {
    return absl::InvalidArgumentError("set --duration_s or --requests");
  }
  return c;
}

}  // namespace sds::loadgen
