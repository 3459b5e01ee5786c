"""The attach handshake on <runtime_dir>/attach.sock (attach.proto, proto/kvpool/v1/wire.h).

Frames are a 4-byte little-endian length followed by the serialized message; the daemon's
accepting AttachResponse carries the pool's descriptors as SCM_RIGHTS. The connection stays open
for the life of the session: closing it (however the process ends) releases everything the
session holds; a client that ends normally sends an empty Detach frame first. A forked child
holds no copy of it and never sends Detach (kvpool.client: fork), so the last copy is the
connecting process's.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import time
from typing import Iterable, List, Optional

import grpc

from kvpool._proto import attach_pb2
from kvpool.errors import KvPoolError, code_from_number
from kvpool.runtime_dir import trusted_daemon_uid

GRPC_SOCKET = "kvpoold.sock"
ATTACH_SOCKET = "attach.sock"
SESSION_TOKEN_KEY = "kvpool-session-token"
PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
MAX_FDS = 4
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1


def default_runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/kvpool when XDG_RUNTIME_DIR is set (and not empty), else /tmp/kvpool-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg:
        return os.path.join(xdg, "kvpool")
    return f"/tmp/kvpool-{os.getuid()}"


def encode_frame(message) -> bytes:
    body = message.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise KvPoolError(grpc.StatusCode.INVALID_ARGUMENT, "frame too large")
    return struct.pack("<I", len(body)) + body


def _close_all(fds: List[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def receive_frame(sock: socket.socket, message, deadline: float) -> List[int]:
    """Reads one frame into `message`; returns the descriptors that came with it (the caller owns
    them). Raises DEADLINE_EXCEEDED, UNAVAILABLE (the peer closed), INVALID_ARGUMENT (oversized
    or unparsable frame), INTERNAL (I/O, or descriptors cut short); no descriptor is left open
    after an error."""
    buffer = b""
    want = 4
    have_length = False
    fds: List[int] = []
    try:
        while len(buffer) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvPoolError(grpc.StatusCode.DEADLINE_EXCEEDED, "attach socket timed out")
            sock.settimeout(left)
            try:
                data, got, flags, _ = socket.recv_fds(
                    sock, min(4096, want - len(buffer)), MAX_FDS, socket.MSG_CMSG_CLOEXEC
                )
            except socket.timeout:
                continue
            except InterruptedError:
                continue
            except ConnectionResetError as e:
                raise KvPoolError(
                    grpc.StatusCode.UNAVAILABLE, f"the peer reset the attach socket: {e}"
                ) from e
            except OSError as e:
                raise KvPoolError(grpc.StatusCode.INTERNAL, f"recvmsg: {e}") from e
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise KvPoolError(grpc.StatusCode.INTERNAL, "descriptors of the attach frame were cut short")
            if not data:
                raise KvPoolError(grpc.StatusCode.UNAVAILABLE, "the peer closed the attach socket")
            buffer += data
            if not have_length and len(buffer) >= 4:
                (length,) = struct.unpack_from("<I", buffer)
                if length > MAX_FRAME_BYTES:
                    raise KvPoolError(grpc.StatusCode.INVALID_ARGUMENT, "oversized attach frame")
                want = 4 + length
                have_length = True
        try:
            message.ParseFromString(buffer[4:])
        except Exception as e:  # protobuf's DecodeError
            raise KvPoolError(grpc.StatusCode.INVALID_ARGUMENT, "unparsable attach frame") from e
    except BaseException:
        _close_all(fds)
        raise
    return fds


@dataclasses.dataclass
class Attachment:
    """An accepted attach: the open session socket, the response and its descriptors (owned)."""

    socket: socket.socket
    response: "attach_pb2.AttachResponse"
    fds: List[int]

    def close_fds(self) -> None:
        _close_all(self.fds)
        self.fds = []


def _connect(path: str, timeout: float) -> socket.socket:
    if len(path.encode()) > _SUN_PATH_MAX:
        raise KvPoolError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"attach socket path {path} is longer than {_SUN_PATH_MAX} bytes",
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as e:
        sock.close()
        raise KvPoolError(
            grpc.StatusCode.UNAVAILABLE, f"no kvpoold listening at {path} ({e.strerror})"
        ) from e
    except PermissionError as e:
        sock.close()
        raise KvPoolError(grpc.StatusCode.PERMISSION_DENIED, f"connect {path}: {e.strerror}") from e
    except socket.timeout as e:
        sock.close()
        raise KvPoolError(grpc.StatusCode.DEADLINE_EXCEEDED, f"connect {path}: timed out") from e
    except OSError as e:
        sock.close()
        raise KvPoolError(grpc.StatusCode.UNAVAILABLE, f"connect {path}: {e.strerror or e}") from e
    return sock


def _check_peer(sock: socket.socket, path: str, daemon_uid: int) -> None:
    """Before sending anything: the peer must run as the uid the runtime directory says (or root)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid not in (daemon_uid, 0):
        raise KvPoolError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"the process listening at {path} (pid {pid}) runs as uid {uid}, but the runtime "
            f"directory belongs to uid {daemon_uid}: not sending it anything",
        )


def attach(runtime_dir: str, request, timeout: float, trusted: Iterable[int] = ()) -> Attachment:
    """Connects to <runtime_dir>/attach.sock, sends `request` and returns the accepted attach.

    The runtime directory is checked first (kvpool.runtime_dir: `trusted` names uids the daemon
    may run as beyond root and our own), then the listener's uid, before anything is sent.
    Raises KvPoolError: UNAVAILABLE (no daemon listens there), PERMISSION_DENIED (socket not
    accessible, a runtime directory not to trust, the listener is not its owner, or the daemon
    refused this peer), DEADLINE_EXCEEDED (no answer within `timeout` seconds),
    INVALID_ARGUMENT (path too long, malformed answer), or the code the daemon refused with.
    Nothing is held after an error.
    """
    daemon_uid = trusted_daemon_uid(runtime_dir, trusted)
    path = os.path.join(runtime_dir, ATTACH_SOCKET)
    deadline = time.monotonic() + timeout
    sock = _connect(path, timeout)
    try:
        _check_peer(sock, path, daemon_uid)
        return exchange(sock, path, request, deadline)
    except BaseException:
        sock.close()
        raise


def exchange(sock: socket.socket, path: str, request, deadline: float) -> Attachment:
    """The exchange on a connected, checked socket (`path` names it in messages): sends `request`
    and reads the answer. A daemon that refused this peer at accept may hang up before the request
    goes out (the send fails with EPIPE) while its refusal waits to be read: the refusal's code is
    what is raised. Errors as for attach(); the caller closes `sock` after an error."""
    send_error: Optional[OSError] = None
    try:
        sock.sendall(encode_frame(request))
    except (BrokenPipeError, ConnectionResetError) as e:
        send_error = e
    except OSError as e:
        raise KvPoolError(
            grpc.StatusCode.INTERNAL, f"sending the attach request to {path}: {e}"
        ) from e
    response = attach_pb2.AttachResponse()
    try:
        fds = receive_frame(sock, response, deadline)
    except KvPoolError as e:
        if e.code == grpc.StatusCode.UNAVAILABLE:
            raise KvPoolError(
                grpc.StatusCode.UNAVAILABLE,
                f"kvpoold at {path} closed the connection without answering the attach",
            ) from e
        raise KvPoolError(e.code, f"attaching to {path}: {e.message}") from e
    if response.error:
        _close_all(fds)
        raise KvPoolError(
            code_from_number(response.error_code),
            f"kvpoold at {path} refused the attach: {response.error}",
        )
    if send_error is not None:
        # An answer that is not a refusal to a request the daemon never got: not to be trusted.
        _close_all(fds)
        raise KvPoolError(
            grpc.StatusCode.UNAVAILABLE,
            f"kvpoold at {path} hung up before the attach request was sent: {send_error}",
        )
    sock.settimeout(None)
    return Attachment(sock, response, fds)


def send_detach(sock: socket.socket) -> None:
    """Says goodbye: an empty Detach frame (length 0). Best effort: when the daemon is gone, the
    close that follows ends the session all the same (counted as reclaimed, not detached)."""
    try:
        sock.settimeout(1.0)
        sock.sendall(encode_frame(attach_pb2.Detach()))
    except OSError:
        pass


def detach(sock: Optional[socket.socket]) -> None:
    """send_detach(), then close the session socket."""
    if sock is None:
        return
    try:
        send_detach(sock)
    finally:
        sock.close()
