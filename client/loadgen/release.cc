#include "client/loadgen/release.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_join.h"
#include "client/loadgen/parallel_for.h"

namespace sds::loadgen {

void SequenceLedger::Add(std::string id) {
  std::lock_guard<std::mutex> lock(mu_);
  ids_.push_back(std::move(id));
}

std::vector<std::string> SequenceLedger::Take() {
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(ids_);
  return out;
}

bool SequenceLedger::empty() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ids_.empty();
}

ReleaseReport ReleaseSequences(const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
                               const std::vector<std::string>& ids,
                               std::chrono::milliseconds per_call,
                               std::chrono::milliseconds budget) {
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + budget;
  std::mutex mu;
  ReleaseReport report;
  ParallelFor(
      static_cast<int>(ids.size()), 8,
      [&](int i) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now());
        absl::Status st = absl::DeadlineExceededError("the release budget was spent");
        if (left.count() > 0) {
          // wait_for_ready off: an unreachable server fails the call at once.
          st = clients[i % clients.size()]
                   ->ReleaseSequence(ids[i], {std::min(per_call, left), false})
                   .status();
        }
        std::lock_guard<std::mutex> lock(mu);
        if (st.ok()) {
          ++report.released;
        } else if (st.code() == absl::StatusCode::kNotFound) {
          ++report.absent;
        } else {
          ++report.failed;
          report.failed_ids.push_back(ids[i]);
          if (report.first_error.empty()) report.first_error = st.ToString();
        }
        return absl::OkStatus();
      },
      /*stop_on_error=*/false)
      .IgnoreError();
  return report;
}

void PrintReleaseReport(const ReleaseReport& r) {
  std::fprintf(stderr, "decode_loadgen: released %d sequences (%d not on the server)\n", r.released,
               r.absent);
  if (r.failed == 0) return;
  // The ids let an operator release them by hand; a long list is cut.
  const size_t shown = std::min<size_t>(r.failed_ids.size(), 8);
  std::fprintf(stderr,
               "decode_loadgen: could NOT release %d sequences (they hold their pages until the "
               "server expires or loses them): %s%s; first error: %s\n",
               r.failed,
               absl::StrJoin(r.failed_ids.begin(), r.failed_ids.begin() + shown, " ").c_str(),
               shown < r.failed_ids.size() ? " ..." : "", r.first_error.c_str());
}

}  // namespace sds::loadgen
