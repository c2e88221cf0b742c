// decode_loadgen: load generator for the Sparse Decode Server. See --help.
#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/csv_report.h"
#include "client/loadgen/help.h"
#include "client/loadgen/point.h"
#include "client/loadgen/stop_signal.h"
#include "client/loadgen/sweep.h"

namespace {

using sds::client::DecodeClient;
using sds::loadgen::Config;

int Run(const Config& c) {
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

  std::unique_ptr<sds::loadgen::CsvReport> csv;
  if (!c.csv.empty()) {
    auto created = sds::loadgen::CsvReport::Create(c.csv);
    if (!created.ok()) {
      std::fprintf(stderr, "decode_loadgen: --csv: %s\n", created.status().ToString().c_str());
      return 3;
    }
    csv = *std::move(created);
  }
  // Without --sweep the run is a sweep of one point, the flags' own.
  std::vector<Config> points;
  if (c.sweep.dimension.empty()) points.push_back(c);
  for (double v : c.sweep.values) points.push_back(sds::loadgen::AtPoint(c, v));
  int exit_code = 0;
  for (const Config& point : points) {
    if (sds::loadgen::StopRequested()) return 128 + sds::loadgen::StopSignal();
    if (!c.sweep.dimension.empty()) {
      std::fprintf(stderr, "decode_loadgen: sweep point %s=%s\n", c.sweep.dimension.c_str(),
                   sds::loadgen::PointValue(point).c_str());
    }
    sds::loadgen::PointOutcome o = sds::loadgen::RunPoint(point, clients, *info);
    if (csv != nullptr) {
      absl::Status st = csv->Row(point, o.result ? &*o.result : nullptr,
                                 o.result ? &o.summary : nullptr, o.failure);
      if (!st.ok()) {
        std::fprintf(stderr, "decode_loadgen: --csv: %s\n", st.ToString().c_str());
        if (o.exit_code == 0) o.exit_code = 3;
      }
    }
    exit_code = o.exit_code;
    // A benchmark must not pass on a partial sweep: the first failed point ends it.
    if (exit_code != 0) {
      if (!c.sweep.dimension.empty()) {
        std::fprintf(stderr, "decode_loadgen: FAILED: sweep stopped at %s=%s\n",
                     c.sweep.dimension.c_str(), sds::loadgen::PointValue(point).c_str());
      }
      break;
    }
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for the Sparse Decode Server: prefills sequences, then decodes "
      "(unary, batch or stream) in a closed or open loop and reports throughput and latency; "
      "--sweep runs one point per value of a dimension and --csv writes a row per point.");
  sds::loadgen::ConfigureFlagsUsage();
  if (sds::loadgen::PrintHelpIfAsked(argc, argv)) return 0;
  absl::ParseCommandLine(argc, argv);
  // As in the servers (server/mutex_tuning.h): Debian's abseil checks lock order on every
  // absl::Mutex lock, gRPC's own included, under one global spin lock.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto config = sds::loadgen::ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "decode_loadgen: %s\n", config.status().ToString().c_str());
    return 2;
  }
  // Before any sequence exists: a signal then stops the run and releases them.
  sds::loadgen::InstallStopHandlers();
  try {
    return Run(*config);
  } catch (const std::exception& e) {
    // Unwinding to here released the sequences (point.cc's ReleaseGuard).
    std::fprintf(stderr, "decode_loadgen: FAILED: exception: %s\n", e.what());
    return 4;
  }
}
