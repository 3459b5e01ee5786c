// kvpoolctl: inspect and operate a running kvpoold (DESIGN.md §10). Parses the command line and
// hands it to kvpool::client::ctl::Run(); see client/kvpoolctl.h for the commands.
//
// Flags are parsed here rather than by absl::ParseCommandLine so that every bad command line,
// unknown flags and malformed values included, exits with status 2 and one clear line.

#include <cstdint>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/kvpoolctl.h"
#include "kvpool/util/mutex_mode.h"
#include "kvpool/util/version.h"
#include "kvpool/v1/wire.h"

ABSL_FLAG(std::string, socket_dir, "",
          "kvpoold's runtime directory (default: $XDG_RUNTIME_DIR/kvpool, else /tmp/kvpool-$UID)");
ABSL_FLAG(bool, json, false, "print machine-readable JSON");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "deadline of the attach and of each call");
ABSL_FLAG(uint64_t, session, 0, "sequences: only this session's (0: all)");
ABSL_FLAG(bool, all, false, "trace: every block; evict: the whole prefix cache");
ABSL_FLAG(std::string, format, "text", "trace: text, json or chrome (Chrome/Perfetto JSON)");
ABSL_FLAG(bool, follow, false, "events: keep streaming new events");
ABSL_FLAG(uint64_t, from, 0, "events: first sequence number wanted (0: only new events)");
ABSL_FLAG(bool, snapshot, false, "events: start with a snapshot of the cached blocks");
ABSL_FLAG(int64_t, blocks, 0, "evict: how many unused cached blocks");
ABSL_FLAG(uint64_t, namespace, 0, "explain: the namespace id to explain in (0: kvpoolctl's own)");
ABSL_FLAG(std::string, pool, "",
          "the pool to show or act on (stats without it: every pool; sequences: every pool)");
ABSL_FLAG(std::string, tenant, "",
          "the tenant to attach as (none: an admin-only session where tenants are configured); "
          "invalidate: the tenant to invalidate (kvpoolctl then attaches with none)");
ABSL_FLAG(std::string, model, "",
          "the model name to attach with (explain's namespace; none: \"default\"); invalidate: "
          "the model to invalidate (none: every model of the tenant)");

namespace {

namespace ctl = kvpool::client::ctl;

int UsageError(const std::string& why) {
  std::cerr << "kvpoolctl: " << why << " (kvpoolctl --help lists the commands)\n";
  return ctl::kExitUsage;
}

// Sets one flag from "--name[=value]" (value from `next` when needed); returns an error line.
std::string SetFlag(std::string_view arg, const std::vector<std::string_view>& rest, size_t* i) {
  const std::string_view body = arg.substr(arg.starts_with("--") ? 2 : 1);
  const size_t eq = body.find('=');
  std::string name(body.substr(0, eq));
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  std::string value;
  if (eq != std::string_view::npos) {
    value = std::string(body.substr(eq + 1));
  } else if (flag != nullptr && flag->IsOfType<bool>()) {
    value = "true";
  } else if (flag == nullptr && name.starts_with("no") &&
             (flag = absl::FindCommandLineFlag(name.substr(2))) != nullptr &&
             flag->IsOfType<bool>()) {
    value = "false";
  } else if (flag != nullptr) {
    if (*i + 1 >= rest.size()) return "--" + name + " needs a value";
    value = std::string(rest[++*i]);
  }
  if (flag == nullptr) return "unknown flag " + std::string(arg);
  std::string error;
  if (!flag->ParseFrom(value, &error)) return "--" + name + ": " + error;
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    if (arg == "--") {
      positional.insert(positional.end(), args.begin() + static_cast<long>(i) + 1, args.end());
      break;
    }
    if (arg == "-h" || arg == "--help" || arg == "help") {
      std::cout << ctl::Usage();
      return ctl::kExitOk;
    }
    if (arg == "--version") {  // the project's version (CMakeLists.txt project())
      std::cout << "kvpoolctl " << kvpool::kVersion << "\n";
      return ctl::kExitOk;
    }
    if (arg.size() > 1 && arg[0] == '-') {
      if (std::string error = SetFlag(arg, args, &i); !error.empty()) return UsageError(error);
    } else {
      positional.emplace_back(arg);
    }
  }

  if (positional.empty()) {
    std::cerr << ctl::Usage();
    return ctl::kExitUsage;
  }
  ctl::Invocation inv;
  {
    inv.command = positional.front();
    inv.args.assign(positional.begin() + 1, positional.end());
  }
  inv.json = absl::GetFlag(FLAGS_json);
  inv.session = absl::GetFlag(FLAGS_session);
  inv.all = absl::GetFlag(FLAGS_all);
  inv.format = absl::GetFlag(FLAGS_format);
  inv.follow = absl::GetFlag(FLAGS_follow);
  inv.from = absl::GetFlag(FLAGS_from);
  inv.snapshot = absl::GetFlag(FLAGS_snapshot);
  inv.blocks = absl::GetFlag(FLAGS_blocks);
  inv.namespace_id = absl::GetFlag(FLAGS_namespace);
  inv.pool = absl::GetFlag(FLAGS_pool);
  inv.tenant = absl::GetFlag(FLAGS_tenant);
  inv.model = absl::GetFlag(FLAGS_model);
  if (absl::Status s = ctl::ValidateInvocation(inv); !s.ok()) {
    return UsageError(std::string(s.message()));
  }
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  if (timeout <= absl::ZeroDuration()) return UsageError("--timeout must be positive");

  kvpool::client::ConnectOptions options;
  options.runtime_dir = absl::GetFlag(FLAGS_socket_dir);
  options.client_name = "kvpoolctl";
  // No tenant: with tenants configured, an admin-only session; without, the "default" tenant.
  // invalidate names its target with --tenant and --model: it attaches as no tenant.
  const bool targets = inv.command == "invalidate";
  options.tenant = targets ? "" : inv.tenant;
  options.model = targets || inv.model.empty() ? "default" : inv.model;
  options.timeout = timeout;
  options.decode_doorbell = false;  // it never decodes: no daemon thread for it
  absl::StatusOr<std::unique_ptr<kvpool::client::Client>> client =
      kvpool::client::Client::Connect(options);
  if (!client.ok()) {
    std::cerr << "kvpoolctl: cannot attach: " << std::string(client.status().message());
    if (client.status().code() == absl::StatusCode::kUnavailable) {
      std::cerr << " (is kvpoold running? --socket_dir selects its runtime directory)";
    }
    std::cerr << "\n";
    return ctl::kExitFailure;
  }
  return ctl::Run(**client, inv, std::cout, std::cerr);
}
