#pragma once

// The client half of the attach protocol (attach.proto): connect to <runtime_dir>/attach.sock,
// send the AttachRequest, receive the AttachResponse and its descriptors.
//
// Free function; thread-safe.

#include <sys/types.h>

#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/util/unique_fd.h"
#include "kvpool/v1/attach.pb.h"

namespace kvpool::client::internal {

struct Attachment {
  UniqueFd socket;  // kept open for the session's life: its close ends the session
  v1::AttachResponse response;
  std::vector<UniqueFd> fds;  // in the order of response.fds()
};

// Attaches to the daemon in `runtime_dir`, waiting at most `timeout` for it to answer. Before
// sending anything it checks that the directory is one to trust and that the socket's peer runs
// as the directory's owner (TrustedDaemonUid; `trusted`: uids trusted beyond root and our own).
// Errors: UNAVAILABLE (nothing listens there, or the daemon hung up without answering; the
// message names the socket path), PERMISSION_DENIED (a directory not to trust, a listener of
// another uid, the socket is not accessible, or the daemon refused the peer), DEADLINE_EXCEEDED (no
// answer in time), INVALID_ARGUMENT (path too long, malformed answer), any other code the daemon
// refused with (AttachResponse.error_code), INTERNAL (I/O). Nothing stays open after an error.
absl::StatusOr<Attachment> Attach(const std::string& runtime_dir, const v1::AttachRequest& request,
                                  absl::Duration timeout, std::span<const uid_t> trusted = {});

// The exchange on an already connected and checked `socket` (`path` names it in messages): sends
// `request`, then reads the answer. A daemon that hung up before the request went out but left a
// refusal is reported with the refusal's code. Errors as for Attach.
absl::StatusOr<Attachment> Exchange(UniqueFd socket, const std::string& path,
                                    const v1::AttachRequest& request, absl::Duration timeout);

}  // namespace kvpool::client::internal
