#include "client/loadgen/csv_report.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "client/loadgen/sweep.h"

namespace sds::loadgen {
namespace {

// A free-text cell (an error message may hold commas and quotes), RFC 4180 style.
std::string Quoted(const std::string& s) {
  return absl::StrCat("\"", absl::StrReplaceAll(s, {{"\"", "\"\""}, {"\n", " "}}), "\"");
}

}  // namespace

absl::StatusOr<std::unique_ptr<CsvReport>> CsvReport::Create(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<CsvReport> r(new CsvReport(path, f));
  std::fputs(
      "dimension,value,mode,concurrency,rate,batch_size,calls,token_layers,calls_per_s,"
      "token_layers_per_s,p50_us,p90_us,p99_us,errors,not_sent,result\n",
      f);
  if (std::fflush(f) != 0) return absl::DataLossError(absl::StrCat("short write to ", path));
  return r;
}

CsvReport::~CsvReport() { std::fclose(f_); }

absl::Status CsvReport::Row(const Config& c, const RunResult* r, const Summary* s,
                            const std::string& failure) {
  const std::string dimension = c.sweep.dimension.empty() ? "none" : c.sweep.dimension;
  const std::string point = PointValue(c);
  std::string line = absl::StrFormat("%s,%s,%s,%d,%g,%d,", dimension, point, c.mode_name,
                                     c.concurrency, c.rate, c.batch_size);
  if (r != nullptr && s != nullptr) {
    absl::StrAppendFormat(&line, "%d,%d,%.3f,%.3f,%d,%d,%d,%d,%d,", r->stats.calls.size(),
                          r->stats.token_layers, s->calls_per_s, s->token_layers_per_s,
                          s->latency.p50, s->latency.p90, s->latency.p99, s->errors_total,
                          r->not_sent);
  } else {
    line += ",,,,,,,,,";
  }
  line += failure.empty() ? "ok" : Quoted(absl::StrCat("FAILED: ", failure));
  line += "\n";
  if (std::fputs(line.c_str(), f_) < 0 || std::fflush(f_) != 0) {
    return absl::DataLossError(absl::StrCat("short write to ", path_));
  }
  return absl::OkStatus();
}

}  // namespace sds::loadgen
