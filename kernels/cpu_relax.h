// The spin-wait hint of a polling loop (x86 `pause`, Arm `yield`): spares the sibling
// hyperthread and the memory pipeline while a thread polls a flag another one sets.
// Shared by the CPU pool's finishing poll and the server batcher's spin.
#pragma once

namespace sds {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace sds
