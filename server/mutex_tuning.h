// Process-wide abseil Mutex setting of the gRPC servers: decode_server, and the
// end-to-end bench's echo server, so that the ceiling it measures gets it too (the load
// generator sets it as well).
#pragma once

#include "absl/synchronization/mutex.h"

namespace sds {

// Debian's abseil is built without NDEBUG, so every absl::Mutex lock runs the deadlock
// detector: a process-wide lock-order graph updated under one global spin lock. gRPC
// 1.51's own locks (grpc_core::Mutex, gpr_mu) are absl::Mutex, so every call pays it:
// 51 ns instead of 12 per lock-unlock pair of two mutexes on the 2-core VM, and a point
// where all threads serialise. A debugging aid, off in the binaries (tests keep it).
inline void DisableMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace sds
