// kvpoold: the KV-cache pool daemon. Parses its four flags and runs (daemon/daemon.h).

#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "daemon/daemon.h"

ABSL_FLAG(std::string, config, "",
          "textproto config (proto/kvpool/v1/config.proto); none: defaults");
ABSL_FLAG(std::string, listen, "", "runtime directory for the sockets (overrides the config)");
ABSL_FLAG(std::string, backend, "", "auto, cpu or cuda (overrides the config)");
ABSL_FLAG(std::string, log_level, "", "trace, debug, info, warn, error, critical, off");

int main(int argc, char** argv) {
  // --help lists this file's flags (absl's default looks for a file named after the binary).
  absl::SetFlagsUsageConfig({.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "daemon/main.cc");
  }});
  absl::SetProgramUsageMessage(
      "shares one accelerator's paged KV-cache pool with the serving processes of this "
      "host.");
  absl::ParseCommandLine(argc, argv);
  return kvpool::daemon::Run({.config_path = absl::GetFlag(FLAGS_config),
                              .listen = absl::GetFlag(FLAGS_listen),
                              .backend = absl::GetFlag(FLAGS_backend),
                              .log_level = absl::GetFlag(FLAGS_log_level)});
}
