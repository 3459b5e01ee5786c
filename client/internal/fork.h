#pragma once

// The attach sockets of this process's live Clients, closed in a forked child.
//
// A session belongs to the process that connected (client.h). A forked child inherits a copy of
// the attach socket (SOCK_CLOEXEC only helps across exec), and a copy keeps the session open: the
// parent's death, even by SIGKILL, would not end it while the child lives. So the child closes
// every registered socket at once, from a pthread_atfork child handler.
//
// That handler runs in the child of a possibly multithreaded parent, where only async-signal-safe
// calls are allowed: no mutex, no allocation. The registry is therefore a fixed array of atomic
// slots (lock-free on every platform we build for) and the handler only loads, stores and
// close()s.
//
// Limits: at most kForkSlots sockets are registered at once (more Clients are not closed in a
// child, as before); a fork between the attach socket's creation and its registration (another
// thread attaching at that moment) leaves the child a copy.
//
// Thread-safe; async-signal-safe in the child handler.

#include <cstddef>

namespace kvpool::client::internal {

inline constexpr size_t kForkSlots = 64;

// Registers the attach socket `fd` (open) to be closed in forked children. Returns its slot, or
// -1 when every slot is taken (the socket is then not closed in children).
int RegisterAttachSocket(int fd);

// Unregisters `slot` (from RegisterAttachSocket; -1 is a no-op). Returns false when the fork
// handler already closed the socket in this process (a child forked after the registration): the
// descriptor number is then free, and may already name another file, so the caller must not
// close it. REQUIRES: called before the caller closes the socket (a slot never names a closed
// descriptor that the handler could close again).
bool UnregisterAttachSocket(int slot);

}  // namespace kvpool::client::internal
