// One run of the load (a sweep's point, or the whole run without --sweep): prefill, run,
// release, report. Its sequences are released on every way out of it: a failed prefill,
// decode errors, the end of --duration_s, SIGINT/SIGTERM, an exception.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/decode_client.h"
#include "client/loadgen/config.h"
#include "client/loadgen/report.h"
#include "client/loadgen/runner.h"

namespace sds::loadgen {

struct PointOutcome {
  // The process's exit status were this the last point (the list is in help.cc).
  int exit_code = 0;
  std::string failure;  // why it failed; empty when it passed
  // Set once the run happened (not after a failed or interrupted prefill).
  std::optional<RunResult> result;
  Summary summary;
};

PointOutcome RunPoint(const Config& config,
                      const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
                      const client::v1::ModelInfo& info);

}  // namespace sds::loadgen
