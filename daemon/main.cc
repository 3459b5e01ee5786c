// kvpoold: the KV-cache pool daemon. Parses its four flags, loads the config, and runs a Daemon
// (daemon/daemon.h) until SIGTERM or SIGINT. Exit codes: 0 after a clean shutdown, 2 for an
// invalid configuration (one line per problem), 1 for any other start failure.

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/daemon.h"
#include "daemon/edge/config.h"
#include "daemon/signal_watcher.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/version.h"

ABSL_FLAG(std::string, config, "",
          "textproto config (proto/kvpool/v1/config.proto); none: defaults");
ABSL_FLAG(std::string, listen, "", "runtime directory for the sockets (overrides the config)");
ABSL_FLAG(std::string, backend, "", "auto, cpu or cuda (overrides the config)");
ABSL_FLAG(std::string, log_level, "", "trace, debug, info, warn, error, critical, off");

namespace {

// The config file with the flags applied on top. Exit code 2 (and why, on stderr) when invalid.
absl::StatusOr<kvpool::v1::DaemonConfig> Configure() {
  absl::StatusOr<kvpool::v1::DaemonConfig> config =
      kvpool::daemon::LoadConfig(absl::GetFlag(FLAGS_config));
  if (!config.ok()) return config.status();
  if (!absl::GetFlag(FLAGS_listen).empty()) config->set_runtime_dir(absl::GetFlag(FLAGS_listen));
  if (!absl::GetFlag(FLAGS_backend).empty()) config->set_backend(absl::GetFlag(FLAGS_backend));
  if (!absl::GetFlag(FLAGS_log_level).empty()) {
    config->set_log_level(absl::GetFlag(FLAGS_log_level));
  }
  if (std::vector<std::string> problems = kvpool::daemon::ValidateConfig(*config);
      !problems.empty()) {
    std::string lines;
    for (const std::string& p : problems) lines += (lines.empty() ? "flag: " : "\nflag: ") + p;
    return absl::InvalidArgumentError(lines);
  }
  return config;
}

}  // namespace

int main(int argc, char** argv) {
  // --help lists this file's flags (absl's default looks for a file named after the binary).
  // --version prints the project's version (CMakeLists.txt project(), the package's version).
  absl::SetFlagsUsageConfig(
      {.contains_help_flags =
           [](absl::string_view file) { return absl::EndsWith(file, "daemon/main.cc"); },
       .version_string = [] { return absl::StrCat("kvpoold ", kvpool::kVersion, "\n"); }});
  absl::SetProgramUsageMessage(
      "shares one accelerator's paged KV-cache pool with the serving processes of this host.");
  absl::ParseCommandLine(argc, argv);
#ifdef NDEBUG
  // Debian's Abseil checks every lock for deadlock cycles, which costs on every lock; debug
  // builds and the tests keep the check (the lock order is in daemon/engine/engine.h).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#else
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
#endif
  kvpool::daemon::SignalWatcher& signals = kvpool::daemon::SignalWatcher::Install();

  absl::StatusOr<kvpool::v1::DaemonConfig> config = Configure();
  if (!config.ok()) {
    std::fprintf(stderr, "kvpoold: invalid configuration:\n%s\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  if (absl::Status s = kvpool::SetLogLevel(config->log_level()); !s.ok()) {
    std::fprintf(stderr, "kvpoold: %s\n", s.ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<kvpool::daemon::Daemon>> daemon =
      kvpool::daemon::Daemon::Create(*config, kvpool::Clock::Real());
  if (!daemon.ok()) {
    kvpool::Logger("daemon").critical("{}", daemon.status().ToString());
    return 1;
  }
  signals.OnFirstSignal([d = daemon->get()] { d->RequestShutdown(); });
  if (absl::Status s = (*daemon)->Start(); !s.ok()) {
    kvpool::Logger("daemon").critical("{}", s.ToString());
    return 1;
  }
  (*daemon)->Wait();
  (*daemon)->Shutdown();
  return 0;
}
