"""One completion over the daemon's model: Prefill the prompt, then one Decode step per token
(gathered with the frontend's other streams by DecodeBatcher), until
max_tokens, the tokenizer's EOS or a stop string; then Free the sequence, publishing the prompt
and what was generated into the prefix cache of the request's sharing domain (its cache salt: the
next turn of the conversation, through any frontend of the same tenant and model, reuses it; no
other domain ever sees it).

Prefill and Decode calls go through a gate (an asyncio.Semaphore) that keeps the frontend's calls
in flight below the daemon's limits.queued_calls_per_session: past it a call waits its turn here
instead of failing there (admission.py states the bound).

The sequence is freed however the generation ends: finished, failed, or abandoned because the
HTTP client went away (the handler is cancelled, or the transport closes). The Free runs in a
task of its own that a cancellation of the handler does not stop; Frontend.close() waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator, Callable, List, Optional, Tuple

from kvpool import KvPoolError, Sampling, StatusCode

from kvpool_frontend.tokenizer import Detokenizer


class ClientGone(Exception):
    """The HTTP client closed its connection: stop generating."""


@dataclasses.dataclass
class Step:
    """One generated token, as the HTTP side shows it."""

    token: int
    text: str                            # the text it adds (may be "": held back, or EOS)
    logprob: Optional[float] = None      # when logprobs were asked for
    top: List[Tuple[int, float]] = dataclasses.field(default_factory=list)


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that may be the start of one."""

    def __init__(self, stops: List[str]):
        self._stops = stops
        self._held = ""

    def feed(self, text: str) -> Tuple[str, bool]:
        """(text safe to emit, whether a stop string ended the output)."""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        keep = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buffer)), keep, -1):
                if buffer.endswith(s[:n]):
                    keep = n
                    break
        self._held = buffer[len(buffer) - keep:]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class DecodeBatcher:
    """One Decode call at a time per session, carrying every stream that waits for a token.

    The daemon gathers calls of different sessions into one model step, waiting for each session
    of the previous step to call again; the several streams of one frontend are one session, so
    they must reach it as one call, or they would take turns in steps of their own. A stream
    submits its pending token and gets a future; while a call is in flight submissions queue, and
    when it returns they all go out in the next call (streams woken by one call's results queue
    before it is sent). A failed batch is retried one sequence at a time (the daemon's batches are
    all or nothing, so nothing happened), so only the sequences that fail get the error.
    Every call goes through `gate` (None: no bound), retries included.
    Not thread-safe: one event loop.
    """

    def __init__(self, gate: Optional[asyncio.Semaphore] = None):
        self._gate = gate if gate is not None else contextlib.nullcontext()
        self._pending = {}   # (client, top_k) -> [(sequence_id, token, sampling, future)]
        self._busy = set()   # (client, top_k) with a call in flight
        self._active = {}    # sequence id -> event set once its submitted step has ended
        self.calls = 0       # Decode calls sent
        self.sequences = 0   # sequences carried by them

    def submit(self, client, sequence_id: int, token: int, top_k: int,
               sampling: Optional[Sampling] = None) -> asyncio.Future:
        """The future of (next token, its log-probability, top tokens) of one sequence's decode
        step; the log-probability is None unless top_k > 0. `sampling`: None, greedy."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        key = (client, top_k)
        self._pending.setdefault(key, []).append((sequence_id, token, sampling, future))
        self._active[sequence_id] = asyncio.Event()
        if key not in self._busy:
            self._busy.add(key)
            loop.call_soon(self._send, key)
        return future

    def _send(self, key) -> None:
        batch = self._pending.pop(key, [])
        if not batch:
            self._busy.discard(key)
            return
        asyncio.ensure_future(self._run(key, batch))

    async def _run(self, key, batch) -> None:
        client, top_k = key
        try:
            await self._decode(client, top_k, batch)
        finally:
            # Streams woken by the results queue before this runs: they go out together.
            asyncio.get_running_loop().call_soon(self._send, key)

    async def _decode(self, client, top_k, batch) -> None:
        self.calls += 1
        self.sequences += len(batch)
        try:
            async with self._gate:
                response = await client.decode([(s, t) for s, t, _, _ in batch], top_k=top_k,
                                               sampling=_batch_sampling(batch),
                                               logprobs=top_k > 0)
        except KvPoolError as e:
            if len(batch) == 1:
                self._settle(batch[0], error=e)
                return
            await asyncio.gather(*[self._decode(client, top_k, [item]) for item in batch])
            return
        except BaseException as e:  # cancelled: nobody gets a token
            for item in batch:
                self._settle(item, error=e if isinstance(e, Exception) else asyncio.CancelledError())
            raise
        for i, item in enumerate(batch):
            top = response.top[i].tokens if top_k else ()
            logprob = response.logprobs[i] if top_k else None
            self._settle(item, result=(response.next_tokens[i], logprob, top))

    def _settle(self, item, result=None, error=None) -> None:
        sequence_id, _, _, future = item
        event = self._active.pop(sequence_id, None)
        if event is not None:
            event.set()
        if future.done():  # its stream gave up waiting (cancelled)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    async def idle(self, sequence_id: int) -> None:
        """Returns once no step of the sequence is queued or in flight here."""
        event = self._active.get(sequence_id)
        if event is not None:
            await event.wait()


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a generation runs in the daemon: its sharing domain, and how its calls are paced."""

    cache_salt: str = ""                       # kvpool.proto PrefillRequest.cache_salt
    block_size: int = 1                        # the pool's: cached_tokens is a multiple of it
    gate: Optional[asyncio.Semaphore] = None   # the frontend's call gate (None: no bound)


class Generation:
    """See the module docstring. Not thread-safe: one per request, on the event loop."""

    def __init__(self, client, batcher: DecodeBatcher, prompt: List[int], max_tokens: int,
                 stops: List[str], top_k: int, eos_id: Optional[int],
                 decode_text: Callable[[List[int]], str], on_free: Callable[[asyncio.Task], None],
                 placement: Placement = Placement(), sampling: Optional[Sampling] = None):
        self._client = client
        self._placement = placement
        self._batcher = batcher
        self.prompt = prompt
        self.max_tokens = max_tokens
        self._top_k = top_k
        self._sampling = sampling  # one seed for the whole generation (None: greedy)
        self._eos = eos_id
        self._detok = Detokenizer(decode_text, prompt)
        self._stop = StopMatcher(stops)
        self._on_free = on_free
        self.sequence_id = 0
        # Prompt tokens the prefix cache supplied, in whole blocks: the exact match would tell a
        # caller the shared domain's tokens one at a time (a group's members share a domain).
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self._first = None
        self._decoding: Optional[asyncio.Future] = None  # the next token's Decode, in flight
        self._freeing: Optional[asyncio.Task] = None     # the Free, once close() started it
        self.abandoned: Callable[[], bool] = lambda: False

    async def start(self) -> None:
        """Prefills the prompt in the placement's domain. Raises KvPoolError (nothing is held
        then)."""
        p = self._placement
        async with (p.gate if p.gate is not None else contextlib.nullcontext()):
            self._first = await self._client.prefill(self.prompt, top_k=self._top_k,
                                                     cache_salt=p.cache_salt,
                                                     sampling=self._sampling,
                                                     logprobs=self._top_k > 0)
        self.sequence_id = self._first.sequence_id
        self.cached_tokens = self._first.reused_tokens // p.block_size * p.block_size

    async def steps(self) -> AsyncIterator[Step]:
        """One Step per generated token; finish_reason is set when it ends. Raises KvPoolError
        when a Decode fails, ClientGone when abandoned() says the HTTP client went away."""
        token, logprob, top = self._first.next_token, self._first.logprob, self._first.top.tokens
        while True:
            self.completion_tokens += 1
            step = Step(token, "", *_logprobs(logprob, top, self._top_k))
            if token == self._eos:
                step.text = self._stop.flush()
                self.finish_reason = "stop"
                yield step
                return
            text, stopped = self._stop.feed(self._detok.add(token))
            if stopped:
                step.text, self.finish_reason = text, "stop"
                yield step
                return
            if self.completion_tokens >= self.max_tokens:
                tail, stopped = self._stop.feed(self._detok.flush())
                step.text = text + tail + ("" if stopped else self._stop.flush())
                self.finish_reason = "stop" if stopped else "length"
                yield step
                return
            step.text = text
            if self.abandoned():
                raise ClientGone()
            # The next Decode goes out before this token is written to the client, so the HTTP
            # side of a token overlaps the model step of the next.
            self._decoding = self._batcher.submit(self._client, self.sequence_id, token,
                                                  self._top_k, self._sampling)
            yield step
            token, logprob, top = await self._decoding
            self._decoding = None

    def close(self) -> Optional[asyncio.Task]:
        """Frees the sequence in a task of its own (publishing what was computed), once a
        Decode step of it still queued or in flight has ended. Returns that task (the same one
        on every call), or None when no sequence was made."""
        if self.sequence_id:
            sequence_id, self.sequence_id = self.sequence_id, 0
            self._decoding = None
            self._freeing = asyncio.ensure_future(self._free(sequence_id))
            self._on_free(self._freeing)
        return self._freeing

    async def _free(self, sequence_id: int) -> None:
        await self._batcher.idle(sequence_id)
        try:
            await self._client.free([sequence_id], commit=True)
        except KvPoolError as e:
            # NOT_FOUND, UNAUTHENTICATED: the session ended (the daemon restarted, or this
            # frontend re-attached) and the daemon released the sequence with it.
            if e.code not in (StatusCode.NOT_FOUND, StatusCode.UNAUTHENTICATED):
                raise


def _logprobs(logprob: float, top, top_k: int):
    """The chosen token's log-probability (the daemon's: a sampled token may be outside the top
    tokens) and the top (token, log-probability) pairs."""
    if not top_k:
        return None, []
    return logprob, [(t.token, t.logprob) for t in top]


def _batch_sampling(batch):
    """A Decode's sampling: None when every sequence is greedy, else one per sequence."""
    if all(sampling is None for _, _, sampling, _ in batch):
        return None
    return [sampling if sampling is not None else Sampling() for _, _, sampling, _ in batch]
