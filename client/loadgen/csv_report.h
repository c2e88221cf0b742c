// --csv: one row per run (per --sweep point), written as each point ends, so that a
// sweep cut short keeps the points it finished.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/loadgen/config.h"
#include "client/loadgen/report.h"
#include "client/loadgen/runner.h"

namespace sds::loadgen {

class CsvReport {
 public:
  // Creates `path` and writes the header.
  static absl::StatusOr<std::unique_ptr<CsvReport>> Create(const std::string& path);
  ~CsvReport();
  // `failure`: why the point failed, empty when it passed; `result`/`summary` null when
  // the point did not get to run (a failed prefill).
  absl::Status Row(const Config& point, const RunResult* result, const Summary* summary,
                   const std::string& failure);

 private:
  CsvReport(std::string path, std::FILE* f) : path_(std::move(path)), f_(f) {}
  std::string path_;
  std::FILE* f_;
};

}  // namespace sds::loadgen
