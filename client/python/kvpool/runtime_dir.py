"""Which runtime directory a client trusts, and so which uid it expects kvpoold to run as: the
rules of the C++ client (proto/kvpool/v1/runtime_dir.cc, TrustedDaemonUid), in Python.

Whoever controls the runtime directory can put their own sockets in place of the daemon's, and a
client would send them its attach request (and then its prompts). So a client trusts a directory
only if:
  - it is a real directory, opened without following a final symbolic link;
  - no one but its owner may write to it (no group or other write bit);
  - its owner is root, this process's effective uid, a uid the caller names (`trusted`), or a
    uid that only root or this process could have given it: the owner of a directory whose parent
    is owned by root or by us and is writable by no one else (systemd's /run/kvpool). A directory
    in a parent others may write to (/tmp) that belongs to someone else is refused: anyone could
    have made /tmp/kvpool-<your uid> before the daemon did.
The daemon's attach socket must then answer as that owner (or root), checked with SO_PEERCRED
before anything is sent (kvpool.attach).

Free functions; thread-safe.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Iterable, Optional

import grpc

from kvpool.errors import KvPoolError


def shared_writable(mode: int) -> bool:
    """Others than the owner may create or replace entries in a directory of this mode."""
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def untrusted_reason(path: str, dir_stat: os.stat_result, parent_stat: Optional[os.stat_result],
                     me: int, trusted: Iterable[int]) -> Optional[str]:
    """Why the directory `path` (whose fstat is `dir_stat`; `parent_stat` the stat of its parent,
    None when that failed) must not be trusted by a client of effective uid `me` that also trusts
    the uids `trusted`; None when it may be. The rule of the module docstring, without I/O."""
    if shared_writable(dir_stat.st_mode):
        return (f"not trusting kvpoold's runtime directory {path}: others may write to it "
                f"(mode {stat.S_IMODE(dir_stat.st_mode):o})")
    owner = dir_stat.st_uid
    if owner == 0 or owner == me or owner in set(trusted):
        return None
    if (parent_stat is not None and parent_stat.st_uid in (0, me)
            and not shared_writable(parent_stat.st_mode)):
        return None  # placed by root (or us): systemd's RuntimeDirectory=
    return (f"not trusting kvpoold's runtime directory {path}: it belongs to uid {owner}, which "
            f"is neither root, you, nor a uid you trust (trusted_daemon_uids), in a directory "
            f"others may write to")


def _open_dir(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise KvPoolError(grpc.StatusCode.UNAVAILABLE,
                          f"no kvpoold runtime directory at {path}") from e
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                link = stat.S_ISLNK(os.lstat(path).st_mode)
            except OSError:
                link = False
            what = "a symlink: kvpool never follows one" if link else "not a directory"
        else:
            what = f"not openable ({e.strerror})"
        raise KvPoolError(grpc.StatusCode.PERMISSION_DENIED,
                          f"not trusting kvpoold's runtime directory: {path} is {what}") from e


def trusted_daemon_uid(path: str, trusted: Iterable[int] = ()) -> int:
    """The uid the daemon of runtime directory `path` must run as: the directory's owner, when
    this process may trust it (module docstring). `trusted`: uids trusted beyond root and our
    own. Raises KvPoolError: UNAVAILABLE (no such directory: no daemon there), PERMISSION_DENIED
    (a symlink, not a directory, or a directory not to trust: the message says why)."""
    fd = _open_dir(path)
    try:
        dir_stat = os.fstat(fd)  # the directory opened, whatever the path names by now
    finally:
        os.close(fd)
    try:
        parent_stat: Optional[os.stat_result] = os.stat(os.path.dirname(path.rstrip("/")) or ".")
    except OSError:
        parent_stat = None
    reason = untrusted_reason(path, dir_stat, parent_stat, os.geteuid(), trusted)
    if reason is not None:
        raise KvPoolError(grpc.StatusCode.PERMISSION_DENIED, reason)
    return dir_stat.st_uid
