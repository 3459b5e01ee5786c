#pragma once

// kvpoold's main loop. main.cc parses the four flags and calls Run(); everything else is here.

#include <string>

namespace kvpool::daemon {

// What the command line may override (STYLE.md: flags only for these).
struct RunOptions {
  std::string config_path;  // textproto; empty: the embedded defaults
  std::string listen;       // runtime directory override (sockets go there)
  std::string backend;      // "auto", "cpu", "cuda"; empty: the config's
  std::string log_level;    // empty: the config's
};

// Runs the daemon until SIGTERM or SIGINT, then shuts down in order: health NOT_SERVING, stop
// accepting, drain in-flight RPCs, release every session, release the pool. A second signal
// forces an immediate exit. Returns the process exit code: 0 after a clean shutdown, 2 for an
// invalid configuration (each problem printed on its own line), 1 for any other start failure.
// REQUIRES: called from the main thread before any other thread exists (it blocks the signals it
// waits for).
int Run(const RunOptions& options);

}  // namespace kvpool::daemon
