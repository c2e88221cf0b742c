#include "client/loadgen/help.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace sds::loadgen {
namespace {

// The load generator's flags are those defined in this directory's files.
bool OurFile(absl::string_view filename) { return absl::StrContains(filename, "client/loadgen/"); }

}  // namespace

void ConfigureFlagsUsage() {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = OurFile;
  config.contains_helpshort_flags = OurFile;
  config.contains_helppackage_flags = OurFile;
  absl::SetFlagsUsageConfig(config);
}

bool PrintHelpIfAsked(int argc, char** argv) {
  bool asked = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;  // what follows is not a flag
    asked |= a == "--help" || a == "-help" || a == "-h" || a == "--helpshort" || a == "-helpshort";
  }
  if (!asked) return false;
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (OurFile(flag->Filename())) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::printf("%s\n\nFlags:\n", std::string(absl::ProgramUsageMessage()).c_str());
  for (const absl::CommandLineFlag* f : flags) {
    std::printf("  --%s (default: \"%s\")\n      %s\n", std::string(f->Name()).c_str(),
                f->DefaultValue().c_str(), f->Help().c_str());
  }
  std::printf(
      "\nExit status: 0 pass; 1 errors, nothing completed, or a sweep point failed; 2 "
      "bad flags, an unreachable server or a failed prefill; 3 an output not "
      "written; 4 an exception; 5 sequences left unreleased; 128+N stopped by "
      "signal N.\n");
  std::fflush(stdout);
  return true;
}

}  // namespace sds::loadgen
