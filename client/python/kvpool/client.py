"""Client: one session with kvpoold, blocking (the asyncio twin is kvpool.aio.AsyncClient).

connect() attaches over <runtime_dir>/attach.sock (kvpool.attach), maps the pool when the session
has KV access (kvpool.mapping) and opens the gRPC channel to <runtime_dir>/kvpoold.sock. Every
call carries the session token ("kvpool-session-token") and a deadline (`timeout` seconds), and
raises KvPoolError with the daemon's canonical code and message (RESOURCE_EXHAUSTED with its
shortfall). A failed call changes nothing in the daemon; batched calls are all-or-nothing. Codes:
those of kvpool.proto, plus DEADLINE_EXCEEDED when the daemon does not answer in time,
UNAVAILABLE when the gRPC socket cannot be reached, INVALID_ARGUMENT for arguments that do not
fit the request (wrong types, out of range), INTERNAL for a malformed response.

The session lives until close() (or the end of a `with` block): it drops the mapping, sends the
Detach frame and closes the attach socket; the daemon then releases everything the session holds.
A process that dies without closing is reclaimed all the same.

fork: the session belongs to the process that connected. In a forked child every open client is
closed at once (os.register_at_fork): the child's copy of the attach socket is closed without a
Detach, so the child's calls fail FAILED_PRECONDITION, its close() (or `with`, or __del__) does
nothing to the parent's session, and the parent's death (even by SIGKILL) still ends the session
while the child lives on. The child's own copy of a memfd mapping goes with it (the parent's
stays mapped); a CUDA mapping is only forgotten and the gRPC channel left alone, as neither
driver may be used in a forked child.

Thread-safety: every call may run concurrently from any number of threads (gRPC channels and
stubs are thread-safe; the rest is immutable after connect()). close() must not race calls.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Iterable, Iterator, List, Optional, Sequence as Seq, Tuple, Union

import grpc

from kvpool import _calls
from kvpool._calls import (  # noqa: F401 (re-exported)
    AllocateItem, Sampling, Sequence, apply_grow, apply_window_grow)
from kvpool._proto import attach_pb2, kvpool_pb2, kvpool_pb2_grpc
from kvpool.attach import (
    GRPC_SOCKET,
    PROTOCOL_VERSION,
    SESSION_TOKEN_KEY,
    attach,
    default_runtime_dir,
    detach,
    send_detach,
)
from kvpool.errors import KvPoolError, invalid_argument
from kvpool.layout import Layout
from kvpool.mapping import PoolMapping

# Whole-pool traces and sequence listings outgrow gRPC's 4 MiB default.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]

# Every session still open in this process, for the fork handler below.
_open_sessions: "weakref.WeakSet[_Session]" = weakref.WeakSet()


def _close_sessions_after_fork() -> None:
    """In a forked child: the sessions are the parent's (see the module docstring)."""
    for session in list(_open_sessions):
        session._leave_to_parent()


os.register_at_fork(after_in_child=_close_sessions_after_fork)


class _Session:
    """What attach established: shared by Client and AsyncClient."""

    def _init_session(self, runtime_dir: str, timeout: float, attachment, mapping):
        r = attachment.response
        self._runtime_dir = runtime_dir
        self._timeout = timeout
        self._socket = attachment.socket
        self._attach = r
        self._layout = Layout(r.layout)
        self._mapping = mapping
        self._metadata = ((SESSION_TOKEN_KEY, r.session_token),)
        self._pid = os.getpid()  # the session's owner: only it may end the session
        _open_sessions.add(self)

    @staticmethod
    def _attach_blocking(socket_dir, tenant, model, kv_access, client_name, timeout, trusted):
        """Attach + mapping, as both clients do it. Returns (runtime_dir, attachment, mapping)."""
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise invalid_argument(f"timeout must be a positive number of seconds, not {timeout!r}")
        runtime_dir = socket_dir or default_runtime_dir()
        with _calls.building("AttachRequest"):
            request = attach_pb2.AttachRequest(
                protocol_version=PROTOCOL_VERSION,
                client_name=client_name or os.path.basename(sys.argv[0] or "python"),
                tenant=tenant,
                model=model,
                kv_access=bool(kv_access),
            )
        with _calls.building("trusted_daemon_uids"):
            trusted = [int(uid) for uid in trusted]
        attachment = attach(runtime_dir, request, timeout, trusted)
        try:
            mapping = None
            if attachment.response.kv_access:
                fds, attachment.fds = attachment.fds, []
                mapping = PoolMapping.create(attachment.response, fds)
            elif attachment.fds:
                raise invalid_argument("kvpoold sent descriptors to a session it says is compute-only")
            Layout(attachment.response.layout)  # validates it for compute-only sessions too
        except BaseException:
            if mapping is not None:  # unmapped before the goodbye, as _end_session does
                mapping.close()
            attachment.close_fds()
            detach(attachment.socket)
            raise
        return runtime_dir, attachment, mapping

    def _end_session(self) -> None:
        if self._pid != os.getpid():  # a fork that ran no at-fork handler (a C extension's)
            self._leave_to_parent()
            return
        sock, self._socket = self._socket, None
        if sock is None:
            return
        _open_sessions.discard(self)
        # The mapping first, then the goodbye, then the close: the daemon ends the session on
        # Detach at once and may hand its blocks to another tenant, so by then this process must
        # not map them (the C++ client's destructor orders it the same way).
        if self._mapping is not None:
            self._mapping.close()
        send_detach(sock)
        sock.close()

    def _leave_to_parent(self) -> None:
        """In a process other than the owner: closes this process's copy of the attach socket,
        with no Detach (that would end the owner's session), and of the mapping (a CUDA one is
        only forgotten); the gRPC channel is left alone. The client is closed here from then
        on."""
        sock, self._socket = self._socket, None
        _open_sessions.discard(self)
        if sock is not None:
            sock.close()
        if self._mapping is not None:
            self._mapping._abandon()

    # --- Session facts ---
    @property
    def session_id(self) -> int:
        return self._attach.session_id

    @property
    def session_token(self) -> str:
        return self._attach.session_token

    @property
    def namespace_id(self) -> int:
        return self._attach.namespace_id

    @property
    def epoch(self) -> int:
        """The daemon's start (changes on restart)."""
        return self._attach.epoch

    @property
    def admin(self) -> bool:
        return self._attach.admin

    @property
    def daemon_version(self) -> str:
        return self._attach.daemon_version

    @property
    def model_name(self) -> str:
        """The daemon's model ("" when it runs none: compute calls then fail)."""
        return self._attach.model_name

    @property
    def model_vocab_size(self) -> int:
        return self._attach.model_vocab_size

    @property
    def model_max_position(self) -> int:
        return self._attach.model_max_position

    @property
    def runtime_dir(self) -> str:
        return self._runtime_dir

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def pool(self) -> str:
        return self._attach.pool

    @property
    def kv_access(self) -> bool:
        return self._mapping is not None

    @property
    def mapping(self) -> Optional[PoolMapping]:
        """The pool's mapping; None for a compute-only session."""
        return self._mapping

    @property
    def closed(self) -> bool:
        return self._socket is None

    @property
    def metadata(self):
        """The metadata every session call carries (for callers driving the stub themselves)."""
        return self._metadata

    def _check_open(self) -> None:
        if self._socket is None:
            raise KvPoolError(grpc.StatusCode.FAILED_PRECONDITION, "the kvpool client is closed")


class Client(_Session):
    """A blocking session with kvpoold. See the module docstring."""

    def __init__(self, *_args, **_kwargs):
        raise TypeError("use kvpool.Client.connect()")

    @classmethod
    def connect(cls, socket_dir: Optional[str] = None, *, tenant: str = "default",
                model: str = "default", kv_access: bool = False,
                client_name: Optional[str] = None, timeout: float = 10.0,
                trusted_daemon_uids: Iterable[int] = ()) -> "Client":
        """Attaches to kvpoold in `socket_dir` (default: $XDG_RUNTIME_DIR/kvpool, else
        /tmp/kvpool-$UID) and maps its pool when `kv_access`. `tenant` and `model` (with the
        layout) name the prefix-sharing namespace. `timeout` bounds the attach and every call.
        The runtime directory must be one this process trusts (kvpool.runtime_dir: owned by root,
        by us, by one of `trusted_daemon_uids`, or placed by root) and the daemon must answer as
        its owner, both checked before anything is sent.
        Raises KvPoolError: UNAVAILABLE (no daemon there), PERMISSION_DENIED (not allowed, KV
        access not granted, or a runtime directory or listener not to trust), DEADLINE_EXCEEDED,
        INVALID_ARGUMENT, or the daemon's refusal code; nothing is held after an error."""
        runtime_dir, attachment, mapping = cls._attach_blocking(
            socket_dir, tenant, model, kv_access, client_name, timeout, trusted_daemon_uids)
        self = object.__new__(cls)
        self._init_session(runtime_dir, timeout, attachment, mapping)
        self._channel = grpc.insecure_channel(
            f"unix:{os.path.join(runtime_dir, GRPC_SOCKET)}", options=CHANNEL_OPTIONS)
        self.stub = kvpool_pb2_grpc.KvPoolStub(self._channel)
        return self

    def close(self) -> None:
        """Ends the session (unmap, Detach, close). Idempotent. In a forked child it does not
        end the parent's session (see the module docstring)."""
        if self._socket is None:
            return
        if self._pid == os.getpid():
            self._channel.close()
        self._end_session()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_socket", None) is not None:
            self.close()

    def _call(self, method: str, request, timeout: Optional[float] = None):
        self._check_open()
        try:
            return getattr(self.stub, method)(
                request, timeout=self._timeout if timeout is None else timeout,
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _calls.rpc_error(e) from None

    # --- Control ---

    def allocate(self, items: Iterable[Union[AllocateItem, Seq[int]]]) -> List[Sequence]:
        """One sequence per item (an AllocateItem, or a bare prompt), all or none; full tables in
        item order, each with the prompt tokens already cached (matched_tokens)."""
        items = list(items)
        return _calls.allocate_result(self._call("Allocate", _calls.allocate_request(items)), len(items))

    def allocate_one(self, prompt: Seq[int], num_tokens: int = 0, priority: int = 0,
                     cache_salt: str = "") -> Sequence:
        return self.allocate([AllocateItem(prompt, num_tokens, priority, cache_salt)])[0]

    def grow(self, items: Iterable[Tuple[int, int]]) -> List[Sequence]:
        """(sequence_id, new length) per item, all or none; the changed tail of each table, in
        item order (apply with apply_grow). A length <= the current one is a no-op."""
        request = _calls.grow_request(items)
        return _calls.grow_result(request, self._call("Grow", request))

    def grow_one(self, sequence_id: int, num_tokens: int) -> Sequence:
        return self.grow([(sequence_id, num_tokens)])[0]

    def truncate(self, sequence_id: int, num_tokens: int) -> None:
        self._call("Truncate", _calls.truncate_request(sequence_id, num_tokens))

    def fork(self, sequence_id: int) -> Sequence:
        """The child sequence, full table (sharing the parent's blocks copy-on-write)."""
        return _calls.to_sequence("Fork", self._call("Fork", _calls.fork_request(sequence_id)).sequence)

    def commit(self, sequence_id: int, num_tokens: int, new_tokens: Seq[int] = ()) -> None:
        """Publishes tokens [0, num_tokens) into the prefix cache; `new_tokens` are the tokens past
        the prompt the daemon has not seen yet."""
        self._call("Commit", _calls.commit_request(sequence_id, num_tokens, new_tokens))

    def free(self, sequence_ids: Iterable[int], commit: bool = False) -> None:
        """Frees the sequences (all or none); `commit` publishes their known tokens first."""
        self._call("Free", _calls.free_request(sequence_ids, commit))

    def match_prefix(self, tokens: Seq[int], cache_salt: str = "") -> int:
        """Leading tokens of `tokens` cached in this session's namespace, within `cache_salt`'s
        sharing domain (lookup only)."""
        return self._call("MatchPrefix",
                          _calls.match_prefix_request(tokens, cache_salt)).matched_tokens

    # Retention pins (kvpool.proto PinRequest): keep a cached prefix of this session's namespace,
    # or what one of its sequences published, out of eviction for `ttl_s` seconds, at a priority
    # up to the tenant's ceiling. A pin ends by itself, with unpin(), or with the session.

    def pin_prefix(self, tokens: Seq[int], ttl_s: float, priority: int = 0,
                   cache_salt: str = ""):
        """Pins the wholly cached prefix `tokens` (of `cache_salt`'s domain); returns the
        PinInfo."""
        return self._call("Pin", _calls.pin_request(tokens=tokens, ttl_s=ttl_s, priority=priority,
                                                    cache_salt=cache_salt)).pin

    def pin_sequence(self, sequence_id: int, ttl_s: float, priority: int = 0):
        """Pins what `sequence_id` has published so far; returns the PinInfo."""
        return self._call("Pin", _calls.pin_request(sequence_id=sequence_id, ttl_s=ttl_s,
                                                    priority=priority)).pin

    def renew_pin(self, pin_id: int, ttl_s: float):
        """The pin now ends `ttl_s` seconds from now; returns the PinInfo."""
        return self._call("RenewPin", _calls.renew_pin_request(pin_id, ttl_s)).pin

    def unpin(self, pin_id: int) -> None:
        self._call("Unpin", kvpool_pb2.UnpinRequest(pin_id=pin_id))

    def list_pins(self, all_sessions: bool = False):
        """This session's pins; with `all_sessions`, everyone's (admin sessions only)."""
        return list(self._call("ListPins",
                               kvpool_pb2.ListPinsRequest(all_sessions=all_sessions)).pins)

    def ping(self) -> None:
        self._call("Ping", kvpool_pb2.PingRequest())

    # --- Compute (FAILED_PRECONDITION when the daemon runs no model) ---
    # `cache_salt` (new sequences; kvpool.proto AllocateItem.cache_salt, at most 256 bytes): the
    # prefix-sharing domain within the session's namespace. Calls with different salts never
    # share cached blocks; "" is the session's namespace itself. A frontend gives each of its
    # users a salt of its own.

    def prefill(self, tokens: Seq[int], sequence_id: int = 0, top_k: int = 0,
                priority: int = 0, timeout: Optional[float] = None,
                cache_salt: str = "", sampling: _calls.SamplingLike = None,
                logprobs: bool = False) -> "kvpool_pb2.PrefillResponse":
        """sequence_id 0: a new sequence whose prompt is matched against the prefix cache (of
        `cache_salt`'s domain); otherwise `tokens` extend that sequence. Returns the first
        generated token (pending). `timeout`: this call's deadline in seconds (default: the
        client's). `sampling` (kvpool.Sampling or a dict of its fields): how the token is chosen
        (None: greedy); `logprobs`: also return its log-probability."""
        return self._call("Prefill", _calls.prefill_request(tokens, sequence_id, top_k, priority,
                                                            cache_salt, sampling, logprobs),
                          timeout)

    def decode(self, items: Iterable[Tuple[int, int]], top_k: int = 0,
               timeout: Optional[float] = None, sampling=None,
               logprobs: bool = False) -> "kvpool_pb2.DecodeResponse":
        """One step for every (sequence_id, pending token), all or none. `sampling`: None
        (greedy), one for every sequence, or a list with one per sequence."""
        request = _calls.decode_request(items, top_k, sampling, logprobs)
        return _calls.decode_result(request, self._call("Decode", request, timeout))

    def generate(self, prompt: Seq[int], max_tokens: int, *, sequence_id: int = 0,
                 stop_tokens: Seq[int] = (), priority: int = 0, free_when_done: bool = False,
                 cache_salt: str = "", sampling: _calls.SamplingLike = None,
                 logprobs: bool = False, top_k: int = 0) -> Iterator["kvpool_pb2.GenerateResponse"]:
        """Streams generated tokens (no deadline). Closing the iterator early cancels the call.
        `sampling` applies to every token, with one seed for the stream."""
        self._check_open()
        request = _calls.generate_request(prompt, max_tokens, sequence_id, stop_tokens, priority,
                                          free_when_done, cache_salt, sampling, logprobs, top_k)
        return _stream(self.stub.Generate(request, metadata=self._metadata))

    # --- Admin (PERMISSION_DENIED unless admin) ---

    def get_stats(self, pool: str = "") -> "kvpool_pb2.GetStatsResponse":
        return self._call("GetStats", kvpool_pb2.GetStatsRequest(pool=pool))

    def list_sessions(self) -> "kvpool_pb2.ListSessionsResponse":
        return self._call("ListSessions", kvpool_pb2.ListSessionsRequest())

    def list_sequences(self, session_id: int = 0, pool: str = "") -> "kvpool_pb2.ListSequencesResponse":
        with _calls.building("ListSequences"):
            request = kvpool_pb2.ListSequencesRequest(session_id=session_id, pool=pool)
        return _calls.list_sequences_result(self._call("ListSequences", request))

    def dump_block_trace(self, block_id: int, pool: str = "") -> "kvpool_pb2.DumpBlockTraceResponse":
        with _calls.building("DumpBlockTrace"):
            request = kvpool_pb2.DumpBlockTraceRequest(block_id=block_id, pool=pool)
        return self._call("DumpBlockTrace", request)

    def dump_all_block_traces(self, pool: str = "") -> "kvpool_pb2.DumpBlockTraceResponse":
        return self._call("DumpBlockTrace", kvpool_pb2.DumpBlockTraceRequest(all=True, pool=pool))

    def watch_events(self, from_seq: int = 0, *, snapshot: bool = False, follow: bool = False,
                     pool: str = "") -> Iterator["kvpool_pb2.WatchEventsResponse"]:
        """Cache events; with `follow` the stream stays open (no deadline) until the iterator is
        closed, otherwise it ends after the replay (usual deadline)."""
        self._check_open()
        request = _calls.watch_request(from_seq, snapshot, follow, pool)
        return _stream(self.stub.WatchEvents(request, metadata=self._metadata,
                                             timeout=None if follow else self._timeout))

    def explain_match(self, tokens: Seq[int], namespace_id: int = 0,
                      pool: str = "") -> "kvpool_pb2.ExplainMatchResponse":
        with _calls.building("ExplainMatch"):
            request = kvpool_pb2.ExplainMatchRequest(tokens=list(tokens), namespace_id=namespace_id,
                                                     pool=pool)
        return self._call("ExplainMatch", request)

    def evict(self, blocks: int, pool: str = "") -> int:
        """Evicts up to `blocks` unused cached blocks; returns how many were evicted."""
        with _calls.building("Evict"):
            request = kvpool_pb2.EvictRequest(blocks=blocks, pool=pool)
        return self._call("Evict", request).evicted

    def evict_all(self, pool: str = "") -> int:
        """Empties the prefix cache (FAILED_PRECONDITION while cached blocks are in use)."""
        return self._call("Evict", kvpool_pb2.EvictRequest(all=True, pool=pool)).evicted

    def check_invariants(self) -> "kvpool_pb2.CheckInvariantsResponse":
        return self._call("CheckInvariants", kvpool_pb2.CheckInvariantsRequest())

    def set_log_level(self, level: str) -> None:
        with _calls.building("SetLogLevel"):
            request = kvpool_pb2.SetLogLevelRequest(level=level)
        self._call("SetLogLevel", request)

    def drain(self) -> int:
        """Stops the daemon taking new sequences; returns how many are still live."""
        return self._call("Drain", kvpool_pb2.DrainRequest()).sequences


def _stream(call) -> Iterator:
    """A server stream's messages; KvPoolError on failure; closing the iterator cancels it."""
    try:
        yield from call
    except grpc.RpcError as e:
        raise _calls.rpc_error(e) from None
    finally:
        call.cancel()
