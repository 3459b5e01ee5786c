#pragma once

// The runtime directory that holds kvpoold's sockets, checked from both ends (issue 12,
// docs/trust-model.md). Whoever controls that directory can put their own sockets in place of
// the daemon's, so:
//  - the daemon creates it with mkdir (mode as configured), or uses an existing one only if its
//    own uid owns it, it is a real directory (not a symbolic link) and no one else may write to
//    it; it never changes a mode by path;
//  - a client trusts a directory only if it is owned by root, by the client's own uid, by a uid
//    the client names, or by a uid that only root (or the client) could have given it: the
//    owner of a directory whose parent only root or the client may write (systemd's
//    /run/kvpool); and no one but its owner may write to it. The daemon's attach socket must
//    then answer as that owner (SO_PEERCRED), checked before anything is sent.
//
// Free functions; thread-safe.

#include <sys/stat.h>
#include <sys/types.h>

#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace kvpool::wire {

// Creates `path` with `mode` (through mkdir and an fchmod of the directory it opened, so the
// umask does not narrow it), its parents as needed, or checks the one that is there. Errors:
// FAILED_PRECONDITION with a one-line reason (another uid's directory, a symbolic link, not a
// directory, writable by group or others, in a parent others may write to without the sticky
// bit); INTERNAL (mkdir failed otherwise).
absl::Status PrepareRuntimeDir(const std::string& path, mode_t mode);

// The uid a client may expect the daemon of `path` to run as: the directory's owner, when the
// client trusts it (class comment); `trusted` names uids the client trusts beyond root and its
// own. Errors: UNAVAILABLE (no such directory: no daemon there), PERMISSION_DENIED (a directory
// the client must not trust, with why).
absl::StatusOr<uid_t> TrustedDaemonUid(const std::string& path, std::span<const uid_t> trusted);

// Sets the process umask so that files created in the scope get at most `mode`: the way to give
// a socket file its mode at bind (a chmod by path would follow whatever the path names by then).
// The umask is process-wide: use it only where no other thread creates files.
class ScopedUmask final {
 public:
  explicit ScopedUmask(mode_t mode) : old_(umask(~mode & 0777)) {}
  ~ScopedUmask() { umask(old_); }
  ScopedUmask(const ScopedUmask&) = delete;
  ScopedUmask& operator=(const ScopedUmask&) = delete;

 private:
  const mode_t old_;
};

}  // namespace kvpool::wire
