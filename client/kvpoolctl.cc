#include "client/kvpoolctl.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>

#include "client/kvpoolctl_format.h"
#include "fmt/format.h"

namespace kvpool::client::ctl {
namespace {

struct CommandSpec {
  std::string_view name;
  size_t min_args;
  size_t max_args;
};

constexpr CommandSpec kCommands[] = {
    {"stats", 0, 0}, {"sessions", 0, 0},  {"sequences", 0, 0}, {"pins", 0, 0},
    {"trace", 0, 1}, {"events", 0, 0},    {"explain", 1, 1},   {"evict", 0, 0},
    {"check", 0, 0}, {"log-level", 1, 1}, {"drain", 0, 0},     {"invalidate", 0, 0},
};

absl::StatusOr<int32_t> ParseBlockId(const std::string& text) {
  int32_t id = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), id);
  if (ec != std::errc() || end != text.data() + text.size() || id < 0) {
    return absl::InvalidArgumentError(fmt::format("'{}' is not a block id", text));
  }
  return id;
}

std::string StatusLine(const absl::Status& status) {
  return fmt::format("{}: {}", absl::StatusCodeToString(status.code()),
                     std::string(status.message()));
}

}  // namespace

std::string Usage() {
  return "usage: kvpoolctl [--socket_dir=DIR] [--json] [--timeout=10s] [--pool=NAME] COMMAND ...\n"
         "       kvpoolctl --help | --version\n"
         "  stats                                  pool gauges and counters (every pool)\n"
         "  sessions                               attached client sessions\n"
         "  sequences [--session=N]                live sequences and their block tables\n"
         "  pins                                   retention pins of every session\n"
         "  trace (BLOCK | --all) [--format=text|json|chrome]\n"
         "                                         per-block operation history\n"
         "  events [--follow] [--from=N] [--snapshot]\n"
         "                                         prefix-cache events\n"
         "  explain TOKENS_FILE [--namespace=N]    why a prompt matches as far as it does\n"
         "  evict (--blocks=N | --all)             evict unused cached blocks\n"
         "  invalidate --tenant=T [--model=M]      drop every tier's blocks of T (of its model M)\n"
         "  check                                  verify the pool's invariants (exit 1 if not)\n"
         "  log-level LEVEL                        set the daemon's log level\n"
         "  drain                                  stop taking new sequences\n";
}

absl::Status ValidateInvocation(const Invocation& inv) {
  if (inv.command.empty()) return absl::InvalidArgumentError("no command given");
  const CommandSpec* spec = nullptr;
  for (const CommandSpec& c : kCommands) {
    if (c.name == inv.command) spec = &c;
  }
  if (spec == nullptr) {
    return absl::InvalidArgumentError(fmt::format("unknown command '{}'", inv.command));
  }
  if (inv.args.size() < spec->min_args || inv.args.size() > spec->max_args) {
    return absl::InvalidArgumentError(fmt::format(
        "{} takes {} argument{}, got {}", inv.command,
        spec->min_args == spec->max_args ? std::to_string(spec->min_args)
                                         : fmt::format("{} to {}", spec->min_args, spec->max_args),
        spec->max_args == 1 ? "" : "s", inv.args.size()));
  }
  if (inv.command == "trace") {
    if (inv.all == !inv.args.empty()) {
      return absl::InvalidArgumentError("trace takes a block id or --all (one of them)");
    }
    if (!inv.args.empty()) {
      if (absl::Status s = ParseBlockId(inv.args[0]).status(); !s.ok()) return s;
    }
    if (absl::Status s = ParseTraceFormat(inv.format).status(); !s.ok()) return s;
  }
  if (inv.command == "evict") {
    if (inv.blocks < 0) return absl::InvalidArgumentError("--blocks must be positive");
    if ((inv.blocks > 0) == inv.all) {
      return absl::InvalidArgumentError("evict takes --blocks=N or --all (one of them)");
    }
  }
  if (inv.command == "invalidate" && inv.tenant.empty()) {
    return absl::InvalidArgumentError("invalidate needs --tenant=T (and optionally --model=M)");
  }
  if (inv.command == "log-level" && inv.args[0].empty()) {
    return absl::InvalidArgumentError("log-level needs a level name");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ParseTokens(std::string_view text) {
  std::vector<int32_t> tokens;
  size_t i = 0;
  const auto separator = [](char c) {
    return c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  while (i < text.size()) {
    if (separator(text[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && !separator(text[j])) ++j;
    const std::string_view word = text.substr(i, j - i);
    int64_t value = -1;
    const auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), value);
    if (ec != std::errc() || end != word.data() + word.size() || value < 0 ||
        value > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          fmt::format("token {} ('{}') is not a token id", tokens.size() + 1, word));
    }
    tokens.push_back(static_cast<int32_t>(value));
    i = j;
  }
  return tokens;
}

absl::StatusOr<std::vector<int32_t>> ReadTokensFile(const std::string& path) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    std::ifstream file(path, std::ios::binary);
    if (!file) {
      const int err = errno;
      const std::string why = fmt::format("cannot open {}: {}", path, std::strerror(err));
      if (err == ENOENT) return absl::NotFoundError(why);
      if (err == EACCES) return absl::PermissionDeniedError(why);
      return absl::InternalError(why);
    }
    std::ostringstream buffer;
    buffer << file.rdbuf();
    if (file.bad()) return absl::InternalError(fmt::format("cannot read {}", path));
    text = std::move(buffer).str();
  }
  absl::StatusOr<std::vector<int32_t>> tokens = ParseTokens(text);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: {}", path, std::string(tokens.status().message())));
  }
  return tokens;
}

// The commands that read: stats, sessions, sequences, pins, trace, events, explain. Not one of
// them: nullopt.
std::optional<absl::Status> RunQuery(const Client& client, const Invocation& inv,
                                     std::ostream& out) {
  const std::string& command = inv.command;
  if (command == "stats") {
    // One pool (--pool), or each of them in turn.
    absl::StatusOr<v1::GetStatsResponse> stats = client.GetStats(inv.pool);
    if (!stats.ok()) return stats.status();
    out << FormatStats(*stats, inv.json);
    if (inv.pool.empty()) {
      for (const std::string& pool : stats->pools()) {
        if (pool == stats->pool()) continue;
        absl::StatusOr<v1::GetStatsResponse> other = client.GetStats(pool);
        if (!other.ok()) return other.status();
        out << (inv.json ? "" : "\n") << FormatStats(*other, inv.json);
      }
    }
  } else if (command == "sessions") {
    absl::StatusOr<v1::ListSessionsResponse> sessions = client.ListSessions();
    if (!sessions.ok()) return sessions.status();
    out << FormatSessions(*sessions, inv.json);
  } else if (command == "sequences") {
    absl::StatusOr<v1::ListSequencesResponse> sequences =
        client.ListSequences(inv.session, inv.pool);
    if (!sequences.ok()) return sequences.status();
    out << FormatSequences(*sequences, inv.json);
  } else if (command == "pins") {
    absl::StatusOr<std::vector<v1::PinInfo>> pins = client.ListPins(/*all_sessions=*/true);
    if (!pins.ok()) return pins.status();
    v1::ListPinsResponse response;
    for (v1::PinInfo& pin : *pins) *response.add_pins() = std::move(pin);
    out << FormatPins(response, inv.json);
  } else if (command == "trace") {
    TraceFormat format = *ParseTraceFormat(inv.format);  // validated above
    if (inv.json && format == TraceFormat::kText) format = TraceFormat::kJson;
    absl::StatusOr<v1::DumpBlockTraceResponse> trace =
        inv.all ? client.DumpAllBlockTraces(inv.pool)
                : client.DumpBlockTrace(*ParseBlockId(inv.args[0]), inv.pool);
    if (!trace.ok()) return trace.status();
    out << FormatTrace(*trace, format);
  } else if (command == "events") {
    v1::WatchEventsRequest request;
    request.set_from_seq(inv.from);
    request.set_follow(inv.follow);
    request.set_snapshot(inv.snapshot);
    request.set_pool(inv.pool);
    return client.WatchEvents(request, [&](const v1::WatchEventsResponse& response) {
      out << FormatEvents(response, inv.json);
      out.flush();  // --follow output is read live, often through a pipe
      return static_cast<bool>(out);
    });
  } else if (command == "explain") {
    absl::StatusOr<std::vector<int32_t>> tokens = ReadTokensFile(inv.args[0]);
    if (!tokens.ok()) return tokens.status();
    absl::StatusOr<v1::ExplainMatchResponse> explain =
        client.ExplainMatch(*tokens, inv.namespace_id, inv.pool);
    if (!explain.ok()) return explain.status();
    out << FormatExplain(*explain, inv.json);
  } else {
    return std::nullopt;
  }
  return absl::OkStatus();
}

// The commands that act: evict, invalidate, log-level, drain.
absl::Status RunAction(const Client& client, const Invocation& inv, std::ostream& out) {
  const std::string& command = inv.command;
  if (command == "evict") {
    absl::StatusOr<int64_t> evicted =
        inv.all ? client.EvictAll(inv.pool) : client.Evict(inv.blocks, inv.pool);
    if (!evicted.ok()) return evicted.status();
    v1::EvictResponse response;
    response.set_evicted(*evicted);
    out << (inv.json ? ToJson(response) + "\n" : fmt::format("evicted {} block(s)\n", *evicted));
  } else if (command == "invalidate") {
    absl::StatusOr<v1::InvalidateResponse> done = client.Invalidate(inv.tenant, inv.model);
    if (!done.ok()) return done.status();
    out << (inv.json ? ToJson(*done) + "\n"
                     : fmt::format("invalidated tenant {}{}{} (generation {}): {} session(s) moved "
                                   "to new namespaces, {} tier block(s) dropped\n",
                                   inv.tenant, inv.model.empty() ? "" : " model ", inv.model,
                                   done->generation(), done->sessions(), done->tier_blocks()));
  } else if (command == "log-level") {
    if (absl::Status s = client.SetLogLevel(inv.args[0]); !s.ok()) return s;
    v1::SetLogLevelRequest level;
    level.set_level(inv.args[0]);
    out << (inv.json ? ToJson(level) + "\n" : fmt::format("log level set to {}\n", inv.args[0]));
  } else if (command == "drain") {
    absl::StatusOr<int64_t> live = client.Drain();
    if (!live.ok()) return live.status();
    v1::DrainResponse response;
    response.set_sequences(*live);
    out << (inv.json ? ToJson(response) + "\n"
                     : fmt::format("kvpoold is draining; {} sequence(s) still live\n", *live));
  }
  return absl::OkStatus();
}

int Run(const Client& client, const Invocation& inv, std::ostream& out, std::ostream& err) {
  const auto fail = [&](const absl::Status& status) {
    err << "kvpoolctl: " << inv.command << ": " << StatusLine(status) << "\n";
    return kExitFailure;
  };
  if (absl::Status s = ValidateInvocation(inv); !s.ok()) {
    err << "kvpoolctl: " << std::string(s.message()) << " (kvpoolctl --help lists the commands)\n";
    return kExitUsage;
  }
  if (inv.command == "check") {
    absl::StatusOr<v1::CheckInvariantsResponse> check = client.CheckInvariants();
    if (!check.ok()) return fail(check.status());
    out << FormatCheck(*check, inv.json);
    if (!check->ok()) return kExitFailure;
  } else {
    std::optional<absl::Status> done = RunQuery(client, inv, out);
    if (!done.has_value()) done = RunAction(client, inv, out);
    if (!done->ok()) return fail(*done);
  }
  out.flush();
  if (!out) return fail(absl::InternalError("cannot write the output"));
  return kExitOk;
}

}  // namespace kvpool::client::ctl
