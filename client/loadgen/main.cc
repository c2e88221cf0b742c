// decode_loadgen: load generator for the Sparse Decode Server. See --help.
#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/report.h"
#include "client/loadgen/runner.h"
#include "client/loadgen/workload.h"

namespace {

using sds::client::DecodeClient;

// Runs fn(i) for i in [0, n) on up to `threads` threads; returns the first error.
absl::Status ParallelFor(int n, int threads, const std::function<absl::Status(int)>& fn) {
  std::atomic<int> next{0};
  std::mutex mu;
  absl::Status first;
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min(n, threads); ++t) {
    pool.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < n;) {
        absl::Status st = fn(i);
        if (!st.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (first.ok()) first = st;
          next = n;  // stop handing out work
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  return first;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for the Sparse Decode Server: prefills sequences, then decodes "
      "(unary, batch or stream) in a closed or open loop and reports throughput and latency.");
  absl::ParseCommandLine(argc, argv);
  // As in the servers (server/mutex_tuning.h): Debian's abseil checks lock order on every
  // absl::Mutex lock, gRPC's own included, under one global spin lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto config = sds::loadgen::ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "decode_loadgen: %s\n", config.status().ToString().c_str());
    return 2;
  }
  const sds::loadgen::Config& c = *config;

  std::vector<std::unique_ptr<DecodeClient>> clients;
  for (int i = 0; i < c.channels; ++i) {
    sds::client::ClientOptions opts;
    opts.timeout = std::chrono::milliseconds(c.timeout_ms);
    opts.tenant_id = c.tenant_id;
    opts.bearer_token = c.token;
    opts.dedicated_connection = c.channels > 1;
    // A peer gone without a reset fails the streams too (they have no deadline). The
    // run's traffic keeps the server's ping policy happy (see ClientOptions).
    opts.keepalive_time = std::chrono::milliseconds(c.keepalive_ms);
    opts.keepalive_timeout = opts.keepalive_time;
    clients.push_back(DecodeClient::Connect(c.target, opts));
  }
  // Wait a little for a server that is still starting.
  auto info = clients[0]->GetModelInfo({std::chrono::milliseconds(10000), true});
  if (!info.ok()) {
    std::fprintf(stderr, "decode_loadgen: GetModelInfo on %s failed: %s\n", c.target.c_str(),
                 info.status().ToString().c_str());
    return 2;
  }
  const sds::client::Shape shape{info->num_q_heads(), info->num_kv_heads(), info->head_dim()};
  for (auto& cl : clients) cl->SetShape(shape);
  sds::loadgen::Workload workload(c, shape, info->num_layers());

  const int nseq = c.NumSequences();
  std::fprintf(stderr, "decode_loadgen: prefilling %d sequences x %d layers x %d tokens\n", nseq,
               info->num_layers(), c.prefill_len);
  absl::Status st = ParallelFor(
      nseq, 4, [&](int s) { return workload.Prefill(*clients[s % clients.size()], s); });
  if (!st.ok()) {
    std::fprintf(stderr, "decode_loadgen: prefill failed: %s\n", st.ToString().c_str());
    return 2;
  }

  sds::loadgen::Runner runner(c, clients, workload);
  sds::loadgen::RunResult result = runner.Run();
  sds::loadgen::Summary summary = sds::loadgen::Summarize(result, info->num_layers());
  sds::loadgen::PrintTable(c, *info, result, summary);

  // A run whose asked-for outputs are missing must not pass for a good one: scripts read
  // whatever JSON is there.
  bool outputs_ok = true;
  if (!c.json_out.empty()) {
    st = sds::loadgen::WriteJson(c.json_out, c, *info, result, summary);
    if (!st.ok()) {
      std::fprintf(stderr, "decode_loadgen: JSON: %s\n", st.ToString().c_str());
      outputs_ok = false;
    }
  }
  if (!c.plot_prefix.empty()) {
    st = sds::loadgen::WritePlots(c.plot_prefix, c, result);
    if (!st.ok()) {
      std::fprintf(stderr, "decode_loadgen: plots: %s\n", st.ToString().c_str());
      outputs_ok = false;
    }
  }
  if (c.release && !result.aborted) {
    ParallelFor(nseq, 8, [&](int s) {
      clients[s % clients.size()]
          ->ReleaseSequence(workload.SequenceId(s), {std::chrono::milliseconds(1000), false})
          .IgnoreError();
      return absl::OkStatus();
    }).IgnoreError();
  }
  // Overload is a result, not an error (as in wrk2 and vegeta): exit 0, but loudly.
  if (result.not_sent > 0) {
    std::fprintf(stderr,
                 "decode_loadgen: OVERLOAD: the server did not keep up with --rate=%g; not sent "
                 "before the end: %lld arrivals, charged their wait so far in the latency\n",
                 c.rate, (long long)result.not_sent);
  }
  // Under a long overload the calls of the window may all still be queued behind the
  // warm-up's: then the charged arrivals are the result.
  if (result.stats.calls.empty() && result.not_sent_charged.empty()) {
    std::fprintf(stderr, "decode_loadgen: FAILED: no call completed in the measured window\n");
    return 1;
  }
  if (summary.errors_total > 0 || result.aborted) {
    std::fprintf(stderr, "decode_loadgen: FAILED: %lld errors%s\n", (long long)summary.errors_total,
                 result.aborted ? " (aborted)" : "");
    return 1;
  }
  if (!outputs_ok) {
    std::fprintf(stderr, "decode_loadgen: FAILED: an output asked for was not written\n");
    return 3;
  }
  return 0;
}
