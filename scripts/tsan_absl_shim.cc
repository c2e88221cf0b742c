// LD_PRELOAD shim for ThreadSanitizer runs against Debian's libabsl_synchronization,
// which is built without TSan: its Mutex, CondVar and Notification synchronise through
// their own atomics and futexes, so TSan sees none of the happens-before they give and
// reports every access they protect (the paged cache's state, gRPC's) as a race. Each
// function here takes the place of the library's (an LD_PRELOAD definition comes first
// in symbol lookup), calls the library's through dlsym(RTLD_NEXT) and tells TSan what it
// did: __tsan_release before an unlock, __tsan_acquire after a lock. That gives TSan the
// happens-before edges, not a mutex model: no lock-order (deadlock) reports for these
// locks, and reader locks order readers among themselves too (more order than the
// library promises, so a race between two readers would be missed).
// The symbols are those of abseil 20220623 as Debian names it (inline namespace
// debian3); scripts/tsan_batcher.sh checks that the library still exports them.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);

namespace {

// absl::Duration and absl::Time by value: {int64 hi; uint32 lo}, two registers.
struct Duration {
  int64_t hi;
  uint32_t lo;
};
struct Time {
  Duration rep;
};

template <typename Fn>
Fn Real(const char* symbol) {
  void* fn = dlsym(RTLD_NEXT, symbol);
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_shim: %s not found\n", symbol);
    std::abort();
  }
  return reinterpret_cast<Fn>(fn);
}

}  // namespace

// Each wrapper is named by the mangled symbol of the member function it replaces; the
// object is the first argument (the Itanium C++ ABI's `this`).
#define SDS_SYM(name) __asm__(name)

// --- Mutex ---
extern "C" void MutexLock(void* mu) SDS_SYM("_ZN4absl7debian35Mutex4LockEv");
extern "C" void MutexLock(void* mu) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex4LockEv");
  real(mu);
  __tsan_acquire(mu);
}
extern "C" void MutexUnlock(void* mu) SDS_SYM("_ZN4absl7debian35Mutex6UnlockEv");
extern "C" void MutexUnlock(void* mu) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex6UnlockEv");
  __tsan_release(mu);
  real(mu);
}
extern "C" void MutexReaderLock(void* mu) SDS_SYM("_ZN4absl7debian35Mutex10ReaderLockEv");
extern "C" void MutexReaderLock(void* mu) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex10ReaderLockEv");
  real(mu);
  __tsan_acquire(mu);
}
extern "C" void MutexReaderUnlock(void* mu) SDS_SYM("_ZN4absl7debian35Mutex12ReaderUnlockEv");
extern "C" void MutexReaderUnlock(void* mu) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian35Mutex12ReaderUnlockEv");
  __tsan_release(mu);
  real(mu);
}
extern "C" bool MutexTryLock(void* mu) SDS_SYM("_ZN4absl7debian35Mutex7TryLockEv");
extern "C" bool MutexTryLock(void* mu) {
  static auto real = Real<bool (*)(void*)>("_ZN4absl7debian35Mutex7TryLockEv");
  const bool locked = real(mu);
  if (locked) __tsan_acquire(mu);
  return locked;
}
extern "C" bool MutexReaderTryLock(void* mu) SDS_SYM("_ZN4absl7debian35Mutex13ReaderTryLockEv");
extern "C" bool MutexReaderTryLock(void* mu) {
  static auto real = Real<bool (*)(void*)>("_ZN4absl7debian35Mutex13ReaderTryLockEv");
  const bool locked = real(mu);
  if (locked) __tsan_acquire(mu);
  return locked;
}
extern "C" void MutexLockWhen(void* mu, const void* cond)
    SDS_SYM("_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
extern "C" void MutexLockWhen(void* mu, const void* cond) {
  static auto real =
      Real<void (*)(void*, const void*)>("_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  real(mu, cond);
  __tsan_acquire(mu);
}
extern "C" void MutexAwait(void* mu, const void* cond)
    SDS_SYM("_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
extern "C" void MutexAwait(void* mu, const void* cond) {
  static auto real =
      Real<void (*)(void*, const void*)>("_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(mu);
  real(mu, cond);
  __tsan_acquire(mu);
}

// --- CondVar: Wait releases the mutex and takes it again; Signal orders the waker
// before the woken thread even when the waker does not hold the mutex. ---
extern "C" void CondVarWait(void* cv, void* mu)
    SDS_SYM("_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
extern "C" void CondVarWait(void* cv, void* mu) {
  static auto real = Real<void (*)(void*, void*)>("_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  real(cv, mu);
  __tsan_acquire(mu);
  __tsan_acquire(cv);
}
extern "C" bool CondVarWaitWithTimeout(void* cv, void* mu, Duration timeout)
    SDS_SYM("_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
extern "C" bool CondVarWaitWithTimeout(void* cv, void* mu, Duration timeout) {
  static auto real = Real<bool (*)(void*, void*, Duration)>(
      "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool timed_out = real(cv, mu, timeout);
  __tsan_acquire(mu);
  __tsan_acquire(cv);
  return timed_out;
}
extern "C" bool CondVarWaitWithDeadline(void* cv, void* mu, Time deadline)
    SDS_SYM("_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
extern "C" bool CondVarWaitWithDeadline(void* cv, void* mu, Time deadline) {
  static auto real = Real<bool (*)(void*, void*, Time)>(
      "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool timed_out = real(cv, mu, deadline);
  __tsan_acquire(mu);
  __tsan_acquire(cv);
  return timed_out;
}
extern "C" void CondVarSignal(void* cv) SDS_SYM("_ZN4absl7debian37CondVar6SignalEv");
extern "C" void CondVarSignal(void* cv) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian37CondVar6SignalEv");
  __tsan_release(cv);
  real(cv);
}
extern "C" void CondVarSignalAll(void* cv) SDS_SYM("_ZN4absl7debian37CondVar9SignalAllEv");
extern "C" void CondVarSignalAll(void* cv) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian37CondVar9SignalAllEv");
  __tsan_release(cv);
  real(cv);
}

// --- Notification ---
extern "C" void NotificationNotify(void* n) SDS_SYM("_ZN4absl7debian312Notification6NotifyEv");
extern "C" void NotificationNotify(void* n) {
  static auto real = Real<void (*)(void*)>("_ZN4absl7debian312Notification6NotifyEv");
  __tsan_release(n);
  real(n);
}
extern "C" void NotificationWait(const void* n)
    SDS_SYM("_ZNK4absl7debian312Notification19WaitForNotificationEv");
extern "C" void NotificationWait(const void* n) {
  static auto real =
      Real<void (*)(const void*)>("_ZNK4absl7debian312Notification19WaitForNotificationEv");
  real(n);
  __tsan_acquire(const_cast<void*>(n));
}
extern "C" bool NotificationWaitWithTimeout(const void* n, Duration timeout)
    SDS_SYM("_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
extern "C" bool NotificationWaitWithTimeout(const void* n, Duration timeout) {
  static auto real = Real<bool (*)(const void*, Duration)>(
      "_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(n, timeout);
  if (notified) __tsan_acquire(const_cast<void*>(n));
  return notified;
}
extern "C" bool NotificationWaitWithDeadline(const void* n, Time deadline)
    SDS_SYM("_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
extern "C" bool NotificationWaitWithDeadline(const void* n, Time deadline) {
  static auto real = Real<bool (*)(const void*, Time)>(
      "_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(n, deadline);
  if (notified) __tsan_acquire(const_cast<void*>(n));
  return notified;
}
