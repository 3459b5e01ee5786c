#pragma once

// kvpoolctl's command logic, apart from flag parsing (kvpoolctl_main.cc) so tests can drive it:
// which subcommands exist, what they need, how they call the daemon and what they print.
//
//   kvpoolctl [--socket_dir=DIR] [--json] [--timeout=10s] [--pool=NAME] [--tenant=T] COMMAND ...
//     stats | sessions | sequences [--session=N] | trace (BLOCK | --all)
//     [--format=text|json|chrome] events [--follow] [--from=N] [--snapshot] | explain TOKENS_FILE
//     [--namespace=N] evict (--blocks=N | --all) | invalidate --tenant=T [--model=M] | check |
//     log-level LEVEL | drain
//
// Thread-safe (no shared state).

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"

namespace kvpool::client::ctl {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the daemon refused, failed or found a violation
inline constexpr int kExitUsage = 2;    // bad command line

// One command line, after flag parsing.
struct Invocation {
  std::string command;            // the first positional argument
  std::vector<std::string> args;  // the positional arguments after it
  bool json = false;              // --json: machine-readable output
  uint64_t session = 0;           // sequences --session (0: every session)
  bool all = false;               // trace --all, evict --all
  std::string format = "text";    // trace --format
  bool follow = false;            // events --follow
  uint64_t from = 0;              // events --from (0: only new events)
  bool snapshot = false;          // events --snapshot
  int64_t blocks = 0;             // evict --blocks (0: not given)
  uint64_t namespace_id = 0;      // explain --namespace (0: kvpoolctl's own)
  std::string tenant;             // invalidate --tenant (required there)
  std::string model;              // invalidate --model (empty: every model of the tenant)
  // --pool: the pool of stats, trace, events, explain, evict (empty: the session's; stats then
  // shows every pool) and sequences (empty: every pool).
  std::string pool;
};

// The usage text, one command per line.
std::string Usage();

// OK when `invocation` names a known command with the arguments it needs.
// Errors: INVALID_ARGUMENT with a one-line reason (print it with Usage(), exit kExitUsage).
absl::Status ValidateInvocation(const Invocation& invocation);

// Token ids separated by whitespace and/or commas ("1 2,3,\n4"). Errors: INVALID_ARGUMENT naming
// the first entry that is not an integer in [0, 2^31) and its position.
absl::StatusOr<std::vector<int32_t>> ParseTokens(std::string_view text);

// ParseTokens() of the file at `path` ("-": standard input). Errors: NOT_FOUND (no such file),
// PERMISSION_DENIED, INTERNAL (read error), and ParseTokens()'s.
absl::StatusOr<std::vector<int32_t>> ReadTokensFile(const std::string& path);

// Runs a validated invocation through `client`, printing results to `out` and one-line errors
// ("kvpoolctl: <command>: <status>") to `err`. Returns the exit code (kExitOk, kExitFailure,
// kExitUsage). `events --follow` returns when the stream ends or client.CancelWatches() runs.
int Run(const Client& client, const Invocation& invocation, std::ostream& out, std::ostream& err);

}  // namespace kvpool::client::ctl
