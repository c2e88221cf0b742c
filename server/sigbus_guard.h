// Reads and writes of shared memory that another process may shrink under the server.
// A runner that truncates its POSIX shared-memory object below a registered region
// makes the next access to the lost pages raise SIGBUS, which would kill the server;
// accesses made through RunGuarded end instead, and report it. With the handler
// installed (InstallSigbusGuard), a SIGBUS outside RunGuarded still ends the process
// as it would have.
#pragma once

#include <csetjmp>

namespace sds::server {

namespace sigbus_internal {
// The innermost RunGuarded of this thread, or null.
extern thread_local sigjmp_buf* guard;
}  // namespace sigbus_internal

// Installs the process's SIGBUS handler (once; call before serving).
void InstallSigbusGuard();

// Runs `fn`; false when it touched memory whose backing is gone (SIGBUS). `fn` must only
// copy or read bytes: it is left with longjmp, so nothing in it may own a resource or
// need a destructor. Without InstallSigbusGuard it just runs `fn`.
template <typename Fn>
bool RunGuarded(Fn&& fn) {
  sigjmp_buf env;
  sigjmp_buf* const outer = sigbus_internal::guard;
  // The mask is not saved (a system call per access): the handler runs with SIGBUS
  // unblocked (SA_NODEFER), so leaving it by longjmp leaves the mask as it was.
  if (sigsetjmp(env, 0) != 0) {
    sigbus_internal::guard = outer;
    return false;
  }
  sigbus_internal::guard = &env;
  fn();
  sigbus_internal::guard = outer;
  return true;
}

}  // namespace sds::server
