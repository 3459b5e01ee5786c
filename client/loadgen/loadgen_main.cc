// kvpool-loadgen: drives a live kvpoold with several frontend processes (client/loadgen/loadgen.h)
// and prints what it saw. Exits 1 when any request failed or any reused KV was wrong.

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/loadgen/loadgen.h"
#include "kvpool/util/mutex_mode.h"
#include "kvpool/util/version.h"

ABSL_FLAG(std::string, mode, "model",
          "model: tokens from the daemon's model (Prefill/Decode); kv: the clients write KV "
          "themselves and verify what they reuse");
ABSL_FLAG(std::string, socket_dir, "", "kvpoold's runtime directory (default: the standard one)");
ABSL_FLAG(int32_t, workers, 4, "frontend processes");
ABSL_FLAG(uint64_t, seed, 1, "generated workload: seed");
ABSL_FLAG(int32_t, tenants, 3, "generated workload: tenants (each its own system prompt)");
ABSL_FLAG(int32_t, conversations, 24, "generated workload: conversations");
ABSL_FLAG(int32_t, turns, 4, "generated workload: turns per conversation");
ABSL_FLAG(std::string, trace, "", "replay a Mooncake-format trace instead of generating");
ABSL_FLAG(int64_t, max_requests, 0, "stop after this many requests (0: all)");
ABSL_FLAG(int64_t, max_prompt_tokens, 0,
          "cut prompts to this (0: fit the model's context and the pool)");
ABSL_FLAG(int64_t, max_reply_tokens, 256, "cut replies to this many tokens");
ABSL_FLAG(bool, decode_doorbell, true,
          "model mode: decode through each session's decode doorbell (false: the Decode RPC)");

int main(int argc, char** argv) {
  kvpool::SetProgramDeadlockDetection();
  // --help lists this file's flags (absl's default looks for a file named after the binary).
  // --version prints the project's version (CMakeLists.txt project(), the package's version).
  absl::SetFlagsUsageConfig(
      {.contains_help_flags =
           [](absl::string_view file) { return absl::EndsWith(file, "loadgen/loadgen_main.cc"); },
       .version_string = [] { return absl::StrCat("kvpool-loadgen ", kvpool::kVersion, "\n"); }});
  absl::SetProgramUsageMessage("Drives kvpoold with several client processes.");
  absl::ParseCommandLine(argc, argv);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "model" && mode != "kv") {
    std::fprintf(stderr, "kvpool-loadgen: --mode must be model or kv (got '%s')\n", mode.c_str());
    return 2;
  }
  const absl::StatusOr<kvpool::loadgen::Summary> summary = kvpool::loadgen::Run({
      .runtime_dir = absl::GetFlag(FLAGS_socket_dir),
      .mode = mode == "model" ? kvpool::loadgen::Mode::kModel : kvpool::loadgen::Mode::kKv,
      .workers = absl::GetFlag(FLAGS_workers),
      .seed = absl::GetFlag(FLAGS_seed),
      .tenants = absl::GetFlag(FLAGS_tenants),
      .conversations = absl::GetFlag(FLAGS_conversations),
      .turns = absl::GetFlag(FLAGS_turns),
      .trace = absl::GetFlag(FLAGS_trace),
      .max_requests = absl::GetFlag(FLAGS_max_requests),
      .max_prompt_tokens = absl::GetFlag(FLAGS_max_prompt_tokens),
      .max_reply_tokens = absl::GetFlag(FLAGS_max_reply_tokens),
      .decode_doorbell = absl::GetFlag(FLAGS_decode_doorbell),
  });
  if (!summary.ok()) {
    std::fprintf(stderr, "kvpool-loadgen: %s\n", summary.status().ToString().c_str());
    return 1;
  }
  return summary->errors == 0 && summary->kv_mismatches == 0 ? 0 : 1;
}
