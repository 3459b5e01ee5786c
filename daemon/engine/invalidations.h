#pragma once

// The generations of past invalidations (NamespaceTable::Invalidate), kept in a small file so a
// restart does not forget them: with a disk tier the daemon keeps it in the tier's directory
// (EngineOptions::invalidations_file), beside the records it protects. Without it a restart
// derives the old namespace ids again, and a Redis tier's old entries become reachable until they
// expire (docs/tiers.md says so).
//
// Text, one tag per line after a header: "kvpool invalidations v1 <secret fingerprint hex>", then
// "<tag hex> <generation>". Tags are keyed MACs: no client string is written. Written whole to a
// temporary file, synced and renamed over the old one, so a crash leaves the old or the new file.
// Stateless functions; thread-compatible per path.

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace kvpool::daemon {

using Generations = absl::flat_hash_map<uint64_t, uint64_t>;

// The generations in `path`; none when it does not exist, or was written under another secret
// (its tags mean nothing under this one). Errors: DATA_LOSS (unreadable or malformed: the file is
// named, so an operator can look before it is overwritten), the errno of open(2) otherwise.
absl::StatusOr<Generations> LoadGenerations(const std::string& path, uint64_t secret_fingerprint);

// Replaces `path` with `generations`. Errors: the errno of the failing file operation; the old
// file is intact then.
absl::Status SaveGenerations(const std::string& path, uint64_t secret_fingerprint,
                             const Generations& generations);

}  // namespace kvpool::daemon
