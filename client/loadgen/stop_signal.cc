#include "client/loadgen/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>

namespace sds::loadgen {
namespace {

// Lock-free, so the handler may store to it (async-signal-safe).
std::atomic<int> stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

void OnStop(int sig) {
  int none = 0;
  stop_signal.compare_exchange_strong(none, sig);
  // The next one kills: a user whose clean-up hangs is not stuck with it.
  signal(sig, SIG_DFL);
  static const char kMsg[] =
      "\ndecode_loadgen: stopping: releasing the sequences (signal again to kill)\n";
  (void)!write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
}

}  // namespace

void InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnStop;
  sigemptyset(&sa.sa_mask);
  // A blocking call the signal interrupts goes on rather than failing with EINTR.
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool StopRequested() { return stop_signal.load() != 0; }

int StopSignal() { return stop_signal.load(); }

}  // namespace sds::loadgen
