#include "server/sigbus_guard.h"

#include <signal.h>

#include <mutex>

namespace sds::server {

namespace sigbus_internal {
thread_local sigjmp_buf* guard = nullptr;
}  // namespace sigbus_internal

namespace {

void OnSigbus(int sig, siginfo_t*, void*) {
  if (sigjmp_buf* env = sigbus_internal::guard; env != nullptr) siglongjmp(*env, 1);
  // Not a guarded access: die of it, as without the handler.
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void InstallSigbusGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = &OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, nullptr);
  });
}

}  // namespace sds::server
