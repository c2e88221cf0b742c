// The sequences a run created, and their release on every way out of it: a run that
// leaves them holds their pages on the server until its idle expiry or a restart (a
// failed prefill once left 41 sequences and 2009 of 2048 pages used).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "client/decode_client.h"

namespace sds::loadgen {

struct ReleaseReport {
  int released = 0;  // answered OK: their pages are free again
  int absent = 0;    // NOT_FOUND: never created (a failed create) or already gone
  int failed = 0;    // still on the server, as far as this process knows
  std::vector<std::string> failed_ids;
  std::string first_error;
};

// Every sequence the run asked the server to create. Added before the CreateSequence
// call: one whose answer was lost (a deadline) may exist all the same.
class SequenceLedger {
 public:
  void Add(std::string id);
  // The ids added since the last Take, now owned by the caller.
  std::vector<std::string> Take();
  bool empty() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::string> ids_;
};

// Releases `ids` round-robin over `clients`, 8 at a time. Never waits on a server that
// does not answer: every call has `per_call` as its deadline, cut to what is left of
// `budget` (then the rest fail at once), and does not wait for a connection.
ReleaseReport ReleaseSequences(const std::vector<std::unique_ptr<client::DecodeClient>>& clients,
                               const std::vector<std::string>& ids,
                               std::chrono::milliseconds per_call,
                               std::chrono::milliseconds budget);

// One stderr line: how many were released, and which could not be (and why).
void PrintReleaseReport(const ReleaseReport& r);

}  // namespace sds::loadgen
