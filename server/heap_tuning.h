// Process-wide glibc malloc settings of the gRPC servers: decode_server, and the
// end-to-end bench's echo server, so that the ceiling it measures gets them too.
#pragma once

#include <malloc.h>

#include <cstdlib>

namespace sds {

// Keeps freed heap memory in the process instead of handing it back to the kernel at
// once. A DecodeBatch call parses megabytes into one protobuf arena; with glibc's
// defaults such blocks were mmapped (or the heap top trimmed) and faulted back in,
// zeroed, by the next call: 250-470 page faults per seed-shape DecodeBatch of 64 on the
// 2-core VM, none with these settings (bench/RESULTS.md). Blocks up to 32 MB come from
// the heap; a heap's top is trimmed once more than 128 MB of it is free (the per-call
// churn is ~6 MB at a DecodeBatch of 256), so resident memory stays within ~128 MB per
// malloc arena of its peak. When GLIBC_TUNABLES is set the operator's settings win and
// nothing is changed. False when glibc refused a setting.
inline bool KeepFreedHeapMemory() {
  if (std::getenv("GLIBC_TUNABLES") != nullptr) return true;
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 128 << 20) == 1;
}

}  // namespace sds
