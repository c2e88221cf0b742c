#include "server/decode_submit.h"

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace sds::server {

namespace {

absl::Status QueueFailure(const std::exception& e) {
  return absl::InternalError(absl::StrCat("internal error while queueing the request: ", e.what()));
}

}  // namespace

void DecodeAdmission::Submit(absl::Span<DecodeItem* const> items, DecodeSink* sink,
                             Clock::time_point deadline, const std::function<bool()>& cancelled,
                             bool whole_batch, Batcher::SubmitterRun* claim) const {
  if (items.empty()) return;
  std::vector<absl::Status> status;
  std::vector<DecodeItem*> admitted;  // for taking the counts back (allocated up front)
  try {
    status.resize(items.size());
    admitted.reserve(items.size());
    pending_->Reserve(items.size());   // CheckAndAddItems then allocates nothing
  } catch (const std::exception& e) {  // bad_alloc: nothing counted yet
    const absl::Status failed = QueueFailure(e);
    for (DecodeItem* item : items) sink->Done({&item, 1}, {&failed, 1});
    return;
  }
  if (Clock::now() > deadline) {
    status.assign(items.size(),
                  absl::DeadlineExceededError("deadline passed before the request was queued"));
    sink->Done(items, status);
    return;
  }
  pending_->CheckAndAddItems(*cache_, items, absl::MakeSpan(status));
  // From here the admitted items' counts are owned by `units` (their completion removes
  // them); if building the units throws, they are taken back and every item fails.
  std::vector<DecodeItem*> refused;
  std::vector<absl::Status> refused_status;
  std::vector<DecodeWork> units;
  try {
    BuildUnits(items, status, sink, deadline, cancelled, whole_batch, &refused, &refused_status,
               &units);
  } catch (const std::exception& e) {
    for (size_t i = 0; i < items.size(); ++i)
      if (status[i].ok()) admitted.push_back(items[i]);  // reserved: no allocation
    pending_->RemoveItems(admitted);
    status.assign(items.size(), QueueFailure(e));
    sink->Done(items, status);
    return;
  }
  if (!refused.empty()) sink->Done(refused, refused_status);
  if (units.empty()) return;
  if (units.size() == 1 && items.size() == 1) {
    absl::Status queued;
    try {
      queued = batcher_->SubmitDecode(std::move(units[0]), claim);
    } catch (const std::exception& e) {  // bad_alloc before it was queued
      queued = QueueFailure(e);
    }
    // Refused: the unit was moved into the call, so it is rebuilt to be answered here
    // (its one item, its sink and its pending count).
    if (!queued.ok()) {
      DecodeWork refused_unit;
      refused_unit.items.push_back(items[0]);  // inline storage: no allocation
      refused_unit.sink = sink;
      refused_unit.pending = pending_;
      Complete(refused_unit, {&queued, 1});
    }
    return;
  }
  std::vector<absl::Status> queued;
  try {
    queued = batcher_->SubmitDecodes(&units);
  } catch (const std::exception& e) {  // bad_alloc before any unit was queued
    queued.assign(units.size(), QueueFailure(e));
  }
  for (size_t u = 0; u < units.size(); ++u) {
    if (!queued[u].ok()) Complete(units[u], {&queued[u], 1});  // refused: left intact
  }
}

void DecodeAdmission::BuildUnits(absl::Span<DecodeItem* const> items,
                                 std::vector<absl::Status>& status, DecodeSink* sink,
                                 Clock::time_point deadline, const std::function<bool()>& cancelled,
                                 bool whole_batch, std::vector<DecodeItem*>* refused,
                                 std::vector<absl::Status>* refused_status,
                                 std::vector<DecodeWork>* units) const {
  const size_t max_items = static_cast<size_t>(batcher_->max_batch_size());
  absl::flat_hash_set<std::pair<absl::string_view, int32_t>> in_unit;
  auto start_unit = [&] {
    DecodeWork& unit = units->emplace_back();
    unit.sink = sink;
    unit.pending = pending_;
    unit.deadline = deadline;
    unit.cancelled = cancelled;
    in_unit.clear();
    return &unit;
  };
  DecodeWork* unit = nullptr;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!status[i].ok()) {
      refused->push_back(items[i]);
      refused_status->push_back(status[i]);
      continue;
    }
    DecodeItem* item = items[i];
    // A second item of a (sequence, layer) starts a new unit, which runs in a later batch.
    if (unit == nullptr || unit->items.size() == max_items ||
        (items.size() > 1 && !in_unit.emplace(item->key, item->layer).second)) {
      unit = start_unit();
      if (items.size() > 1) in_unit.emplace(item->key, item->layer);
    }
    unit->items.push_back(item);
  }
  if (unit != nullptr) unit->closes_batch = whole_batch;
}

}  // namespace sds::server
