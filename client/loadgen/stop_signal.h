// SIGINT/SIGTERM stop the run instead of killing the process, so that the sequences it
// created are released (a killed load generator leaves their pages used on the server
// until its idle expiry or a restart). A second signal kills it as usual.
#pragma once

namespace sds::loadgen {

// Installs the handlers (once, before any sequence is created).
void InstallStopHandlers();
// True once SIGINT or SIGTERM arrived.
bool StopRequested();
// The signal that asked for the stop (0: none), for the exit status (128 + signal).
int StopSignal();

}  // namespace sds::loadgen
