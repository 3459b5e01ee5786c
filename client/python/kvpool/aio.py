"""AsyncClient: the asyncio twin of kvpool.Client (grpc.aio), for frontends and routers.

Every method has the blocking client's name, arguments, results and errors (see kvpool.client);
calls are coroutines and streams are async iterators. The attach handshake itself is blocking
socket I/O bounded by `timeout`; connect() runs it in a worker thread so the event loop keeps
serving.

Thread-safety: use one AsyncClient from the event loop that connected it.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Iterable, List, Optional, Sequence as Seq, Tuple, Union

import grpc
import grpc.aio

from kvpool import _calls
from kvpool._calls import AllocateItem, Sequence
from kvpool._proto import kvpool_pb2, kvpool_pb2_grpc
from kvpool.attach import GRPC_SOCKET
from kvpool.client import CHANNEL_OPTIONS, _Session


class AsyncClient(_Session):
    """An asyncio session with kvpoold. See kvpool.client.Client for each call's contract."""

    def __init__(self, *_args, **_kwargs):
        raise TypeError("use await kvpool.aio.AsyncClient.connect()")

    @classmethod
    async def connect(cls, socket_dir: Optional[str] = None, *, tenant: str = "default",
                      model: str = "default", kv_access: bool = False,
                      client_name: Optional[str] = None, timeout: float = 10.0,
                      trusted_daemon_uids: Iterable[int] = ()) -> "AsyncClient":
        runtime_dir, attachment, mapping = await asyncio.to_thread(
            cls._attach_blocking, socket_dir, tenant, model, kv_access, client_name, timeout,
            trusted_daemon_uids)
        self = object.__new__(cls)
        self._init_session(runtime_dir, timeout, attachment, mapping)
        self._channel = grpc.aio.insecure_channel(
            f"unix:{os.path.join(runtime_dir, GRPC_SOCKET)}", options=CHANNEL_OPTIONS)
        self.stub = kvpool_pb2_grpc.KvPoolStub(self._channel)
        return self

    async def close(self) -> None:
        """Ends the session (unmap, Detach, close). Idempotent. Calls still in flight fail."""
        if self._socket is None:
            return
        if self._pid == os.getpid():  # not in a forked child (kvpool.client: fork)
            await self._channel.close()
        self._end_session()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method: str, request, timeout: Optional[float] = None):
        self._check_open()
        try:
            return await getattr(self.stub, method)(
                request, timeout=self._timeout if timeout is None else timeout,
                metadata=self._metadata)
        except grpc.RpcError as e:
            raise _calls.rpc_error(e) from None

    # --- Control ---

    async def allocate(self, items: Iterable[Union[AllocateItem, Seq[int]]]) -> List[Sequence]:
        items = list(items)
        response = await self._call("Allocate", _calls.allocate_request(items))
        return _calls.allocate_result(response, len(items))

    async def allocate_one(self, prompt: Seq[int], num_tokens: int = 0, priority: int = 0,
                           cache_salt: str = "") -> Sequence:
        return (await self.allocate([AllocateItem(prompt, num_tokens, priority, cache_salt)]))[0]

    async def grow(self, items: Iterable[Tuple[int, int]]) -> List[Sequence]:
        request = _calls.grow_request(items)
        return _calls.grow_result(request, await self._call("Grow", request))

    async def grow_one(self, sequence_id: int, num_tokens: int) -> Sequence:
        return (await self.grow([(sequence_id, num_tokens)]))[0]

    async def truncate(self, sequence_id: int, num_tokens: int) -> None:
        await self._call("Truncate", _calls.truncate_request(sequence_id, num_tokens))

    async def fork(self, sequence_id: int) -> Sequence:
        response = await self._call("Fork", _calls.fork_request(sequence_id))
        return _calls.to_sequence("Fork", response.sequence)

    async def commit(self, sequence_id: int, num_tokens: int, new_tokens: Seq[int] = ()) -> None:
        await self._call("Commit", _calls.commit_request(sequence_id, num_tokens, new_tokens))

    async def free(self, sequence_ids: Iterable[int], commit: bool = False) -> None:
        await self._call("Free", _calls.free_request(sequence_ids, commit))

    async def match_prefix(self, tokens: Seq[int], cache_salt: str = "") -> int:
        return (await self._call("MatchPrefix", _calls.match_prefix_request(
            tokens, cache_salt))).matched_tokens

    async def pin_prefix(self, tokens: Seq[int], ttl_s: float, priority: int = 0,
                         cache_salt: str = ""):
        return (await self._call("Pin", _calls.pin_request(
            tokens=tokens, ttl_s=ttl_s, priority=priority, cache_salt=cache_salt))).pin

    async def pin_sequence(self, sequence_id: int, ttl_s: float, priority: int = 0):
        return (await self._call("Pin", _calls.pin_request(sequence_id=sequence_id, ttl_s=ttl_s,
                                                           priority=priority))).pin

    async def renew_pin(self, pin_id: int, ttl_s: float):
        return (await self._call("RenewPin", _calls.renew_pin_request(pin_id, ttl_s))).pin

    async def unpin(self, pin_id: int) -> None:
        await self._call("Unpin", kvpool_pb2.UnpinRequest(pin_id=pin_id))

    async def list_pins(self, all_sessions: bool = False):
        return list((await self._call(
            "ListPins", kvpool_pb2.ListPinsRequest(all_sessions=all_sessions))).pins)

    async def ping(self) -> None:
        await self._call("Ping", kvpool_pb2.PingRequest())

    # --- Compute ---

    async def prefill(self, tokens: Seq[int], sequence_id: int = 0, top_k: int = 0,
                      priority: int = 0, timeout: Optional[float] = None, cache_salt: str = "",
                      sampling: _calls.SamplingLike = None, logprobs: bool = False):
        return await self._call(
            "Prefill", _calls.prefill_request(tokens, sequence_id, top_k, priority, cache_salt,
                                              sampling, logprobs),
            timeout)

    async def decode(self, items: Iterable[Tuple[int, int]], top_k: int = 0,
                     timeout: Optional[float] = None, sampling=None, logprobs: bool = False):
        request = _calls.decode_request(items, top_k, sampling, logprobs)
        return _calls.decode_result(request, await self._call("Decode", request, timeout))

    def generate(self, prompt: Seq[int], max_tokens: int, *, sequence_id: int = 0,
                 stop_tokens: Seq[int] = (), priority: int = 0, free_when_done: bool = False,
                 cache_salt: str = "", sampling: _calls.SamplingLike = None,
                 logprobs: bool = False, top_k: int = 0) -> AsyncIterator:
        self._check_open()
        request = _calls.generate_request(prompt, max_tokens, sequence_id, stop_tokens, priority,
                                          free_when_done, cache_salt, sampling, logprobs, top_k)
        return _stream(self.stub.Generate(request, metadata=self._metadata))

    # --- Admin ---

    async def get_stats(self, pool: str = ""):
        return await self._call("GetStats", kvpool_pb2.GetStatsRequest(pool=pool))

    async def list_sessions(self):
        return await self._call("ListSessions", kvpool_pb2.ListSessionsRequest())

    async def list_sequences(self, session_id: int = 0, pool: str = ""):
        with _calls.building("ListSequences"):
            request = kvpool_pb2.ListSequencesRequest(session_id=session_id, pool=pool)
        return _calls.list_sequences_result(await self._call("ListSequences", request))

    async def dump_block_trace(self, block_id: int, pool: str = ""):
        with _calls.building("DumpBlockTrace"):
            request = kvpool_pb2.DumpBlockTraceRequest(block_id=block_id, pool=pool)
        return await self._call("DumpBlockTrace", request)

    async def dump_all_block_traces(self, pool: str = ""):
        return await self._call("DumpBlockTrace", kvpool_pb2.DumpBlockTraceRequest(all=True, pool=pool))

    def watch_events(self, from_seq: int = 0, *, snapshot: bool = False, follow: bool = False,
                     pool: str = "") -> AsyncIterator:
        self._check_open()
        request = _calls.watch_request(from_seq, snapshot, follow, pool)
        return _stream(self.stub.WatchEvents(request, metadata=self._metadata,
                                             timeout=None if follow else self._timeout))

    async def explain_match(self, tokens: Seq[int], namespace_id: int = 0, pool: str = ""):
        with _calls.building("ExplainMatch"):
            request = kvpool_pb2.ExplainMatchRequest(tokens=list(tokens), namespace_id=namespace_id,
                                                     pool=pool)
        return await self._call("ExplainMatch", request)

    async def evict(self, blocks: int, pool: str = "") -> int:
        with _calls.building("Evict"):
            request = kvpool_pb2.EvictRequest(blocks=blocks, pool=pool)
        return (await self._call("Evict", request)).evicted

    async def evict_all(self, pool: str = "") -> int:
        return (await self._call("Evict", kvpool_pb2.EvictRequest(all=True, pool=pool))).evicted

    async def check_invariants(self):
        return await self._call("CheckInvariants", kvpool_pb2.CheckInvariantsRequest())

    async def set_log_level(self, level: str) -> None:
        with _calls.building("SetLogLevel"):
            request = kvpool_pb2.SetLogLevelRequest(level=level)
        await self._call("SetLogLevel", request)

    async def drain(self) -> int:
        return (await self._call("Drain", kvpool_pb2.DrainRequest())).sequences


async def _stream(call) -> AsyncIterator:
    """A server stream's messages; KvPoolError on failure; closing the iterator cancels it."""
    try:
        async for message in call:
            yield message
    except grpc.RpcError as e:
        raise _calls.rpc_error(e) from None
    finally:
        call.cancel()
