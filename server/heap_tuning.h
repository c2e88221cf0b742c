// Process-wide glibc malloc settings of the gRPC servers: decode_server, and the
// end-to-end bench's echo server, so that the ceiling it measures gets them too.
#pragma once

#include <malloc.h>

namespace sds {

// Keeps freed heap memory in the process instead of handing it back to the kernel. A
// DecodeBatch call parses megabytes into one protobuf arena; with glibc's defaults such
// blocks were mmapped (or the heap top trimmed) and faulted back in, zeroed, by the next
// call: 467 page faults per seed-shape DecodeBatch of 64 on the 2-core VM, none with
// these settings (bench/RESULTS.md). Blocks up to 32 MB come from the heap; the heap is
// trimmed only above 1 GB free at its top. False when glibc refused a setting.
inline bool KeepFreedHeapMemory() {
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
}

}  // namespace sds
