// The config file (daemon/edge/config.h): arbitrary text as a kvpoold.textproto through
// LoadConfig, as `kvpoold --config=FILE` reads it.
//
// Checked on every input: LoadConfig refuses only with the codes config.h names, and a refusal
// says why; a config it accepts validates, turns into engine options (one pool at least, every
// layout sized, every tenant's pool in range), and reads back to itself when written out as
// text (ApplyDefaults is idempotent: the file an operator saves from a running config means
// the same).

#include <cstddef>
#include <cstdint>
#include <string>

#include "daemon/edge/config.h"
#include "fuzz/fuzz_util.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/pool_layout.h"

namespace kvpool::fuzz {
namespace {

void CheckAccepted(const v1::DaemonConfig& config) {
  Require(daemon::ValidateConfig(config).empty(), "LoadConfig accepted an invalid config");
  v1::DaemonConfig again = config;
  daemon::ApplyDefaults(&again);
  Require(google::protobuf::util::MessageDifferencer::Equals(config, again),
          "ApplyDefaults is not idempotent");

  absl::StatusOr<daemon::EngineOptions> options = daemon::MakeEngineOptions(config, 1);
  // MakeEngineOptions reads the credential files a config names (secret_file, an enabled
  // tiers.redis.password_file); a fuzzed path seldom names a good one, and refusing it is right.
  const bool names_a_file =
      !config.secret_file().empty() ||
      (config.tiers().redis().enabled() && !config.tiers().redis().password_file().empty());
  if (names_a_file && !options.ok()) {
    Require(options.status().code() == absl::StatusCode::kInvalidArgument,
            "a bad credential file refused with a code other than INVALID_ARGUMENT");
  } else {
    RequireOk(options.status(), "MakeEngineOptions of an accepted config");
    Require(!options->pools.empty(), "engine options without a pool");
    for (const daemon::PoolOptions& pool : options->pools) {
      RequireOk(kernels::ValidateLayout(pool.layout), "a pool layout that does not validate");
      Require(pool.layout.num_blocks > 0, "a pool without blocks");
    }
    for (const auto& [name, tenant] : options->tenants) {
      Require(tenant.pool >= 0 && static_cast<size_t>(tenant.pool) < options->pools.size(),
              "a tenant's pool out of range");
    }
  }

  std::string text;
  Require(google::protobuf::TextFormat::PrintToString(config, &text), "PrintToString");
  MemFile saved(text);
  absl::StatusOr<v1::DaemonConfig> reread = daemon::LoadConfig(saved.path());
  RequireOk(reread.status(), "an accepted config, written out, does not load");
  Require(google::protobuf::util::MessageDifferencer::Equals(config, *reread),
          "an accepted config, written out, reads back different");
}

}  // namespace
}  // namespace kvpool::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvpool::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvpool::fuzz;
  MemFile file({reinterpret_cast<const char*>(data), size});
  absl::StatusOr<kvpool::v1::DaemonConfig> config = kvpool::daemon::LoadConfig(file.path());
  if (!config.ok()) {
    Require(config.status().code() == absl::StatusCode::kInvalidArgument,
            "LoadConfig refused a readable file with a code other than INVALID_ARGUMENT");
    Require(!config.status().message().empty(), "LoadConfig refused without saying why");
    return 0;
  }
  CheckAccepted(*config);
  return 0;
}
