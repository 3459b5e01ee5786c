"""One completion over the daemon's model: Prefill the prompt, then one Decode per token, until
max_tokens, the tokenizer's EOS or a stop string; then Free the sequence, publishing the prompt
and what was generated into the prefix cache (so the next turn of the conversation, through any
frontend of the same tenant and model, reuses it).

The sequence is freed however the generation ends: finished, failed, or abandoned because the
HTTP client went away (the handler is cancelled, or the transport closes). The Free runs in a
task of its own that a cancellation of the handler does not stop; Frontend.close() waits for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable, List, Optional, Tuple

from kvpool import KvPoolError

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


class Generation:
    """See the module docstring. Not thread-safe: one per request, on the event loop."""

    def __init__(self, client, prompt: List[int], max_tokens: int, stops: List[str],
                 top_k: int, eos_id: Optional[int], decode_text: Callable[[List[int]], str],
                 on_free: Callable[[asyncio.Task], None]):
        self._client = client
        self.prompt = prompt
        self.max_tokens = max_tokens
        self._top_k = top_k
        self._eos = eos_id
        self._detok = Detokenizer(decode_text, prompt)
        self._stop = StopMatcher(stops)
        self._on_free = on_free
        self.sequence_id = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: Optional[str] = None
        self._first = None
        self.abandoned: Callable[[], bool] = lambda: False

    async def start(self) -> None:
        """Prefills the prompt. Raises KvPoolError (nothing is held then)."""
        self._first = await self._client.prefill(self.prompt, top_k=self._top_k)
        self.sequence_id = self._first.sequence_id
        self.cached_tokens = self._first.reused_tokens

    async def steps(self) -> AsyncIterator[Step]:
        """One Step per generated token; finish_reason is set when it ends. Raises KvPoolError
        when a Decode fails, ClientGone when abandoned() says the HTTP client went away."""
        token, top = self._first.next_token, self._first.top.tokens
        while True:
            self.completion_tokens += 1
            step = Step(token, "", *_logprobs(token, top, self._top_k))
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
            yield step
            if self.abandoned():
                raise ClientGone()
            response = await self._client.decode([(self.sequence_id, token)], top_k=self._top_k)
            token = response.next_tokens[0]
            top = response.top[0].tokens if self._top_k else ()

    def close(self) -> None:
        """Frees the sequence in a task of its own (publishing what was computed)."""
        if not self.sequence_id:
            return
        sequence_id, self.sequence_id = self.sequence_id, 0
        task = asyncio.ensure_future(self._free(sequence_id))
        self._on_free(task)

    async def _free(self, sequence_id: int) -> None:
        try:
            await self._client.free([sequence_id], commit=True)
        except KvPoolError as e:
            if e.code.name != "NOT_FOUND":  # the session ended: the daemon freed it already
                raise


def _logprobs(token: int, top, top_k: int):
    if not top_k:
        return None, []
    pairs = [(t.token, t.logprob) for t in top]
    chosen = next((lp for t, lp in pairs if t == token), pairs[0][1] if pairs else None)
    return chosen, pairs
