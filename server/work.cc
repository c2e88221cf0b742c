#include "server/work.h"

#include <vector>

#include "server/pending_writes.h"

namespace sds::server {

void Complete(DecodeWork& work, absl::Span<const absl::Status> status) {
  if (work.pending != nullptr) work.pending->RemoveItems(work.items);
  if (status.size() == 1 && work.items.size() != 1) {
    // One status for all (the queue refused, expired or stopped the unit): one Done per
    // item, which allocates nothing (a sink takes its items in any number of Done calls).
    for (DecodeItem* item : work.items) work.sink->Done({&item, 1}, status);
    return;
  }
  work.sink->Done(work.items, status);
}

}  // namespace sds::server
