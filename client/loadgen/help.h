// decode_loadgen's --help. absl's own lists only the flags defined in the binary's main
// file (ours live in config.cc: it printed "No flags matched") and exits 1.
#pragma once

namespace sds::loadgen {

// Points absl's --help, --helpshort and --helppackage at the load generator's own files
// (--helpfull still lists every flag linked in). Call before absl::ParseCommandLine.
void ConfigureFlagsUsage();
// With a bare --help / -help / -h / --helpshort among the arguments: prints the usage
// message and every load generator flag with its type, default and help text to stdout,
// and returns true (the caller exits 0). --help=SUBSTRING is left to absl.
bool PrintHelpIfAsked(int argc, char** argv);

}  // namespace sds::loadgen
