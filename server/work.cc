#include "server/work.h"

#include <vector>

#include "server/pending_writes.h"

namespace sds::server {

void Complete(DecodeWork& work, absl::Span<const absl::Status> status) {
  if (work.pending != nullptr) work.pending->RemoveItems(work.items);
  if (status.size() == 1 && work.items.size() != 1) {
    // One status for all: the rare path (the queue refused, expired or stopped the unit).
    const std::vector<absl::Status> all(work.items.size(), status[0]);
    work.sink->Done(work.items, all);
    return;
  }
  work.sink->Done(work.items, status);
}

}  // namespace sds::server
