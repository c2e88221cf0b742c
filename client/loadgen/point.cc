#include "client/loadgen/point.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "client/loadgen/parallel_for.h"
#include "client/loadgen/release.h"
#include "client/loadgen/stop_signal.h"
#include "client/loadgen/workload.h"

namespace sds::loadgen {
namespace {

// Releases what the ledger holds when it goes out of scope without Release() (an
// exception on its way to main), so no way out leaves sequences behind.
class ReleaseGuard {
 public:
  ReleaseGuard(const Config& c, const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
               SequenceLedger& ledger)
      : c_(c), clients_(clients), ledger_(ledger) {}
  ReleaseGuard(const ReleaseGuard&) = delete;
  ReleaseGuard& operator=(const ReleaseGuard&) = delete;
  ~ReleaseGuard() {
    try {
      Release();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "decode_loadgen: releasing the sequences: %s\n", e.what());
    }
  }
  // The report, printed; with --release=false the sequences are kept, as asked.
  ReleaseReport Release() {
    std::vector<std::string> ids = ledger_.Take();
    ReleaseReport r;
    if (ids.empty()) return r;
    if (!c_.release) {
      std::fprintf(stderr, "decode_loadgen: kept %zu sequences on the server (--release=false)\n",
                   ids.size());
      return r;
    }
    r = ReleaseSequences(clients_, ids, std::chrono::milliseconds(c_.timeout_ms),
                         std::chrono::milliseconds(c_.release_timeout_ms));
    PrintReleaseReport(r);
    return r;
  }

 private:
  const Config& c_;
  const std::vector<std::unique_ptr<client::DecodeClient>>& clients_;
  SequenceLedger& ledger_;
};

int InterruptedExit() { return 128 + StopSignal(); }

// Test seam (tests/python/test_loadgen.py): an exception after the prefill must still
// release the sequences.
void MaybeThrowForTest() {
  const char* at = std::getenv("DECODE_LOADGEN_TEST_THROW");
  if (at != nullptr && std::strcmp(at, "after_prefill") == 0) {
    throw std::runtime_error("DECODE_LOADGEN_TEST_THROW=after_prefill");
  }
}

}  // namespace

PointOutcome RunPoint(const Config& c,
                      const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
                      const client::v1::ModelInfo& info) {
  PointOutcome out;
  const client::Shape shape{info.num_q_heads(), info.num_kv_heads(), info.head_dim()};
  Workload workload(c, shape, info.num_layers());
  SequenceLedger ledger;
  ReleaseGuard guard(c, clients, ledger);

  const int nseq = c.NumSequences();
  std::fprintf(stderr, "decode_loadgen: prefilling %d sequences x %d layers x %d tokens\n", nseq,
               info.num_layers(), c.prefill_len);
  absl::Status st = ParallelFor(nseq, 4, [&](int s) {
    if (StopRequested()) return absl::CancelledError("stopped by a signal");
    ledger.Add(workload.SequenceId(s));
    return workload.Prefill(*clients[s % clients.size()], s);
  });
  if (StopRequested()) {
    guard.Release();
    out.exit_code = InterruptedExit();
    out.failure = "stopped by a signal during the prefill";
    return out;
  }
  if (!st.ok()) {
    std::fprintf(stderr, "decode_loadgen: prefill failed: %s\n", st.ToString().c_str());
    guard.Release();
    out.exit_code = 2;
    out.failure = absl::StrCat("prefill failed: ", st.ToString());
    return out;
  }
  MaybeThrowForTest();

  RunResult& result = out.result.emplace();
  {
    Runner runner(c, clients, workload);
    result = runner.Run();
  }
  // Before the reports: the pages are free again however writing them goes.
  const ReleaseReport released = guard.Release();
  Summary& summary = out.summary;
  summary = Summarize(result, info.num_layers());
  PrintTable(c, info, result, summary);

  // A run whose asked-for outputs are missing must not pass for a good one: scripts read
  // whatever JSON is there.
  bool outputs_ok = true;
  if (!c.json_out.empty()) {
    st = WriteJson(c.json_out, c, info, result, summary);
    if (!st.ok()) {
      std::fprintf(stderr, "decode_loadgen: JSON: %s\n", st.ToString().c_str());
      outputs_ok = false;
    }
  }
  if (!c.plot_prefix.empty()) {
    st = WritePlots(c.plot_prefix, c, result);
    if (!st.ok()) {
      std::fprintf(stderr, "decode_loadgen: plots: %s\n", st.ToString().c_str());
      outputs_ok = false;
    }
  }
  // Overload is a result, not an error (as in wrk2 and vegeta): exit 0, but loudly.
  if (result.not_sent > 0) {
    std::fprintf(stderr,
                 "decode_loadgen: OVERLOAD: the server did not keep up with --rate=%g; not sent "
                 "before the end: %lld arrivals, charged their wait so far in the latency\n",
                 c.rate, (long long)result.not_sent);
  }
  if (result.interrupted) {
    out.exit_code = InterruptedExit();
    out.failure = "interrupted by a signal: a partial run";
  } else if (result.stats.calls.empty() && result.not_sent_charged.empty()) {
    // Under a long overload the calls of the window may all still be queued behind the
    // warm-up's: then the charged arrivals are the result.
    out.exit_code = 1;
    out.failure = "no call completed in the measured window";
  } else if (summary.errors_total > 0 || result.aborted) {
    out.exit_code = 1;
    out.failure = absl::StrCat(summary.errors_total, " errors", result.aborted ? " (aborted)" : "");
  } else if (!outputs_ok) {
    out.exit_code = 3;
    out.failure = "an output asked for was not written";
  } else if (released.failed > 0) {
    out.exit_code = 5;
    out.failure = absl::StrCat(released.failed, " sequences could not be released");
  }
  if (!out.failure.empty()) {
    std::fprintf(stderr, "decode_loadgen: FAILED: %s\n", out.failure.c_str());
  }
  return out;
}

}  // namespace sds::loadgen
