"""kvpool-frontend's HTTP server: OpenAI-compatible endpoints over one kvpool.aio.AsyncClient
session (compute-only: the daemon's model does the work), safe to put in front of several users.

  POST /v1/completions        prompt (string or token ids) -> text; SSE when "stream": true
  POST /v1/chat/completions   messages (chat template: chat.py) -> assistant message; SSE too
  GET  /v1/models             the one served model
  GET  /health                200 while serving; 503 while draining or when kvpoold is unreachable
                              (the only endpoint that needs no API key)

A request to /v1/* goes through, in order: the API key (auth.py: 401), its key's request slot
(admission.py: 429), the body, read up to the key's body_bytes (413, before reading when
Content-Length says so; 408 past --body_timeout), the OpenAI fields (protocol.py: 400), the key's
prompt and max_tokens limits (400), a run slot (429 when the frontend is full), and only then the
daemon: Prefill and Decode in the key's sharing domain (its cache salt, narrowed by the request's
cache_salt). Responses are written under the stall bound (writer.py).

Streams send one event per generated token (its text may be empty while a UTF-8 character or a
possible stop string is incomplete), then a final event with finish_reason, the usage event when
stream_options.include_usage, and "data: [DONE]". The prompt is prefilled before the response
starts, so a refusal still gets its HTTP status. Usage counts prompt, completion and cached
tokens (prompt_tokens_details.cached_tokens: prompt tokens the daemon's prefix cache supplied,
in whole blocks of the pool: never the exact match, which would spell out a shared prompt).

Errors are OpenAI-style JSON ({"error": {"message", "type", "param", "code"}}): 400 bad input or
over a key's limit, 401 no or unknown API key, 404 unknown model or path, 408 a body that did not
arrive in time, 413 a body over the key's limit, 429 with Retry-After when the key has all its
requests in flight, the frontend is full, or the pool (or a quota) is exhausted (the shortfall in
the message), 503 while draining (this frontend's SIGTERM, or the daemon's drain) or when the
daemon is unreachable, 504 when a call runs past its deadline, 500 otherwise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import List, Optional

from aiohttp import web

import kvpool
import kvpool.aio
from kvpool import KvPoolError, StatusCode

from kvpool_frontend import auth, chat, protocol
from kvpool_frontend.admission import Admission, Refusal
from kvpool_frontend.auth import KeyStore, Limits, Principal
from kvpool_frontend.generation import ClientGone, DecodeBatcher, Generation, Placement, Step
from kvpool_frontend.metrics import CONTENT_TYPE, FrontendMetrics
from kvpool_frontend.protocol import ApiError, Params
from kvpool_frontend.tokenizer import TokenizerError
from kvpool_frontend.writer import BoundedWriter, ClientStalled

log = logging.getLogger("kvpool.frontend")
# The paths counted under their own endpoint label (anything else: "other", bounding the labels).
_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                        "/metrics"})

_STATUS = {
    StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def api_error(e: KvPoolError) -> ApiError:
    status, kind = _STATUS.get(e.code, (500, "server_error"))
    message = f"kvpoold: {e.message}"
    headers = {}
    if e.code == StatusCode.RESOURCE_EXHAUSTED:
        if e.shortfall is not None:
            message = (f"the KV pool is exhausted ({e.shortfall.resource} short by "
                       f"{e.shortfall.blocks} blocks): retry later")
        headers["Retry-After"] = "1"
    return ApiError(status, message, type=kind, code=e.code.name.lower(), headers=headers)


def refused(r: Refusal) -> ApiError:
    headers = {"Retry-After": str(r.retry_after)} if r.retry_after is not None else {}
    kind = "rate_limit_error" if r.status == 429 else "invalid_request_error"
    return ApiError(r.status, r.message, type=kind, code=r.code, headers=headers)


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclasses.dataclass
class Options:
    """What the operator sets (__main__ has the flags and their defaults; admission.py says how
    to size the bounds)."""

    keys: Optional[KeyStore] = None        # None: --no_auth, every caller is anonymous
    anonymous_limits: Limits = auth.DEFAULT_LIMITS  # the anonymous caller's, with --no_auth
    max_running: int = 256                 # generations at once (<= the daemon's decode width)
    kv_budget_blocks: int = 0              # their blocks at most; 0: the pool's blocks
    daemon_calls: int = 48                 # Prefill + Decode calls in flight (< queued calls)
    stream_buffer_bytes: int = 65536       # writer.py: bytes a client may leave unread
    stall_timeout: float = 30.0            # writer.py: seconds a write may wait for room
    body_timeout: float = 30.0             # seconds for a request body to arrive


class Frontend:
    """The server's state: the daemon session, the tokenizer, the keys, admission, requests in
    flight. One event loop."""

    def __init__(self, client: kvpool.aio.AsyncClient, tokenizer, template: str,
                 served_model: str, connect_args: dict, options: Optional[Options] = None):
        self.options = options or Options()
        self.keys = self.options.keys
        self.admission = Admission(self.options.max_running,
                                   self.options.kv_budget_blocks or client.layout.num_blocks,
                                   client.layout.block_size)
        self.client = client
        self.tokenizer = tokenizer
        self.template = template
        self.served_model = served_model
        self.metrics = FrontendMetrics(served_model)
        self.max_position = client.model_max_position
        self.vocab_size = client.model_vocab_size
        self.created = int(time.time())
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._frees: set = set()
        self.gate = asyncio.Semaphore(self.options.daemon_calls)
        self.batcher = DecodeBatcher(self.gate)
        self._connect_args = connect_args
        self._stale = False
        self._reconnect_lock = asyncio.Lock()

    def app(self) -> web.Application:
        # Bodies are read by _body, bounded per key; client_max_size bounds any other read.
        app = web.Application(middlewares=[self._errors], client_max_size=self._max_body_bytes())
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    def _max_body_bytes(self) -> int:
        if self.keys is None:
            return self.options.anonymous_limits.body_bytes
        return self.keys.max_body_bytes()

    def reload_keys(self, keys: KeyStore) -> None:
        """Serves `keys` from now on (requests in flight keep the principal they had)."""
        self.keys = keys

    # --- Life cycle ---

    async def drain(self, timeout: float) -> bool:
        """New requests get 503 from now on; waits (at most `timeout` s) for those in flight."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        if self._frees:
            await asyncio.gather(*self._frees, return_exceptions=True)
        await self.client.close()

    def _track_free(self, task: asyncio.Task) -> None:
        """Keeps the free task alive until it ends (close() waits for those still running)."""
        self._frees.add(task)

        def done(t: asyncio.Task) -> None:
            self._frees.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("freeing a sequence: %s", t.exception())

        task.add_done_callback(done)

    async def _usable_client(self) -> kvpool.aio.AsyncClient:
        """The session, re-attached when an earlier call found it gone (daemon restarted)."""
        if not self._stale:
            return self.client
        async with self._reconnect_lock:
            if self._stale:
                try:
                    await self.client.ping()
                except KvPoolError as e:
                    if e.code not in (StatusCode.UNAUTHENTICATED, StatusCode.UNAVAILABLE):
                        raise
                    fresh = await kvpool.aio.AsyncClient.connect(**self._connect_args)
                    old, self.client = self.client, fresh
                    await old.close()
                    log.warning("re-attached to kvpoold (session %d)", fresh.session_id)
                self._stale = False
        return self.client

    def _note(self, e: KvPoolError) -> None:
        if e.code in (StatusCode.UNAUTHENTICATED, StatusCode.UNAVAILABLE):
            self._stale = True

    # --- Middleware and small endpoints ---

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        request["kvpool_arrival"] = time.monotonic()
        response = await self._answer(request, handler)
        endpoint = request.path if request.path in _ENDPOINTS else "other"
        self.metrics.answered(endpoint, response.status)
        return response

    async def _answer(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except KvPoolError as e:
            self._note(e)
            err = api_error(e)
            return web.json_response(err.body(), status=err.status, headers=err.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ApiError(e.status, e.reason, type="invalid_request_error",
                           code="not_found" if e.status == 404 else None)
            return web.json_response(err.body(), status=e.status)
        except (ClientGone, ConnectionResetError):
            raise  # nobody to answer
        except Exception:  # a bug: still an OpenAI-style body, and the trace in the log
            log.exception("%s %s failed", request.method, request.path)
            err = ApiError(500, "internal error in kvpool-frontend", type="server_error")
            return web.json_response(err.body(), status=500)

    def _authenticate(self, request: web.Request) -> Principal:
        """The caller (401 without a valid key); anonymous with --no_auth."""
        if self.keys is None:
            return auth.anonymous(self.options.anonymous_limits)
        return self.keys.authenticate(request.headers.get("Authorization"))

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus text (metrics.py); no API key, as vLLM's: counts only, no tenant's data."""
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        return web.json_response({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": self.created,
            "owned_by": "kvpool", "max_model_len": self.max_position}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        try:
            client = await self._usable_client()
            await client.ping()
        except KvPoolError as e:
            self._note(e)
            return web.json_response({"status": "unavailable", "error": str(e)}, status=503)
        return web.json_response({"status": "ok", "model": self.served_model,
                                  "session": client.session_id, "in_flight": self.in_flight,
                                  "decode_calls": self.batcher.calls,
                                  "decode_sequences": self.batcher.sequences})

    # --- Completions ---

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _body(self, request: web.Request, limit: int):
        """The JSON body, at most `limit` bytes: 413 as soon as it is known to be larger (from
        Content-Length, before reading anything), 408 when it does not arrive within
        --body_timeout, 400 when it is not JSON."""
        too_large = ApiError(413, f"the request body is over this API key's limit of {limit} "
                                  f"bytes", code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(self.options.body_timeout):
                while chunk := await request.content.readany():
                    body += chunk
                    if len(body) > limit:
                        raise too_large
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.options.body_timeout:g} s", code="timeout") from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            raise protocol.bad("the request body is not valid JSON") from None

    def _prompt(self, params: Params, limits: Limits) -> List[int]:
        try:
            if params.chat:
                pieces = chat.render(self.template, params.messages, self.tokenizer.bos_id,
                                     self.tokenizer.eos_id)
                ids = chat.encode(pieces, self.tokenizer)
            elif isinstance(params.prompt, str):
                bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
                ids = bos + self.tokenizer.encode(params.prompt)
            else:
                ids = list(params.prompt)
                for t in ids:
                    if not 0 <= t < self.vocab_size:
                        raise protocol.bad(f"prompt token {t} is outside the model's vocabulary "
                                           f"[0, {self.vocab_size})", "prompt")
        except (chat.TemplateError, TokenizerError) as e:
            raise protocol.bad(str(e), "messages" if params.chat else "prompt") from None
        except UnicodeError:  # a lone surrogate ("\ud800" in the JSON) has no UTF-8
            raise protocol.bad("the prompt is not valid Unicode",
                               "messages" if params.chat else "prompt") from None
        if len(ids) > limits.prompt_tokens:
            raise protocol.bad(f"the prompt has {len(ids)} tokens; this API key may send at most "
                               f"{limits.prompt_tokens}", "messages" if params.chat else "prompt",
                               "prompt_too_long")
        if params.max_tokens_given and params.max_tokens > limits.max_tokens:
            raise protocol.bad(f"max_tokens {params.max_tokens} is over this API key's limit of "
                               f"{limits.max_tokens}", "max_tokens", "max_tokens_too_large")
        if params.max_tokens is None:
            params.max_tokens = max(1, self.max_position - len(ids))
        params.max_tokens = min(params.max_tokens, limits.max_tokens)
        if len(ids) + params.max_tokens > self.max_position:
            raise protocol.bad(
                f"this model's context is {self.max_position} tokens; the prompt has {len(ids)} "
                f"and max_tokens asks for {params.max_tokens} more", "max_tokens",
                "context_length_exceeded")
        return ids

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.draining:
            raise ApiError(503, "kvpool-frontend is draining: no new requests",
                           type="service_unavailable", code="draining")
        principal = self._authenticate(request)
        refusal = self.admission.enter(principal.name, principal.limits.concurrent_requests)
        if refusal is not None:
            raise refused(refusal)
        self.in_flight += 1
        self._idle.clear()
        try:
            body = await self._body(request, principal.limits.body_bytes)
            params = (protocol.parse_chat if chat else protocol.parse_completion)(
                body, self.served_model)
            salt = auth.request_salt(principal.salt, params.cache_salt)
            prompt = self._prompt(params, principal.limits)
            return await self._run(request, params, prompt, salt)
        finally:
            self.admission.leave(principal.name)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def _run(self, request: web.Request, params: Params, prompt: List[int],
                   salt: str) -> web.StreamResponse:
        """Takes a run slot, generates and writes the answer; the slot is given back once the
        sequence is freed (or at once when none was made)."""
        blocks = self.admission.blocks_for(len(prompt), params.max_tokens)
        refusal = self.admission.start(blocks)
        if refusal is not None:
            raise refused(refusal)
        self.metrics.running.labels(self.served_model).inc()
        transport = request.transport

        def generation(client) -> Generation:
            placement = Placement(salt, client.layout.block_size, self.gate)
            gen = Generation(client, self.batcher, prompt, params.max_tokens, params.stop,
                             params.top_k, self.tokenizer.eos_id, self.tokenizer.decode,
                             self._track_free, placement, params.daemon_sampling)
            gen.abandoned = lambda: transport is None or transport.is_closing()
            return gen

        gen: Optional[Generation] = None
        try:
            gen = generation(await self._usable_client())
            try:
                await gen.start()
            except KvPoolError as e:
                # The session is gone (the daemon restarted): attach anew and try once more.
                if e.code not in (StatusCode.UNAUTHENTICATED, StatusCode.UNAVAILABLE):
                    raise
                self._stale = True
                gen = generation(await self._usable_client())
                await gen.start()
            writer_args = (self.options.stream_buffer_bytes, self.options.stall_timeout)
            if params.stream:
                return await self._stream(request, gen, params, writer_args)
            return await self._whole(request, gen, params, writer_args)
        except (ClientGone, ConnectionResetError):  # nobody reads the answer: freed below
            return web.Response(status=499)
        except KvPoolError as e:
            self._note(e)
            raise
        finally:
            self.metrics.running.labels(self.served_model).dec()
            freeing = gen.close() if gen is not None else None
            if freeing is None:
                self.admission.finish(blocks)
            else:
                freeing.add_done_callback(lambda _: self.admission.finish(blocks))

    def _head(self, params: Params, chunk: bool) -> dict:
        kind = ("chat.completion" if params.chat else "text_completion")
        if params.chat and chunk:
            kind += ".chunk"
        return {"id": ("chatcmpl-" if params.chat else "cmpl-") + uuid.uuid4().hex,
                "object": kind, "created": int(time.time()), "model": self.served_model}

    def _usage(self, gen: Generation) -> dict:
        return {"prompt_tokens": len(gen.prompt), "completion_tokens": gen.completion_tokens,
                "total_tokens": len(gen.prompt) + gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens}}

    async def _whole(self, request: web.Request, gen: Generation, params: Params,
                     writer_args) -> web.StreamResponse:
        steps = [s async for s in self._timed(request, gen)]
        text = "".join(s.text for s in steps)
        out = self._head(params, chunk=False)
        logprobs = self._logprobs(steps, params) if params.logprobs is not None else None
        if params.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": gen.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": gen.finish_reason}
        out["choices"] = [choice]
        out["usage"] = self._usage(gen)
        gen.close()  # the answer is complete: free the sequence before writing it
        body = _json(out)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(body)
        await response.prepare(request)
        writer = BoundedWriter(request, response, *writer_args)
        try:
            await writer.write(body)
            await writer.finish()
        except (ClientStalled, ConnectionResetError):  # the connection is closed
            pass
        return response

    async def _stream(self, request: web.Request, gen: Generation, params: Params,
                      writer_args) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        writer = BoundedWriter(request, response, *writer_args)
        head = self._head(params, chunk=True)

        async def send(choices, **extra):
            await writer.write(b"data: " + _json({**head, "choices": choices, **extra}) + b"\n\n")

        try:
            if params.chat:
                await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
            async for step in self._timed(request, gen):
                logprobs = self._logprobs([step], params) if params.logprobs is not None else None
                if params.chat:
                    await send([{"index": 0, "delta": {"content": step.text},
                                 "logprobs": logprobs, "finish_reason": None}])
                else:
                    await send([{"index": 0, "text": step.text, "logprobs": logprobs,
                                 "finish_reason": None}])
            gen.close()  # the answer is complete: free the sequence before the last writes
            delta = {"delta": {}} if params.chat else {"text": ""}
            await send([{"index": 0, **delta, "logprobs": None,
                         "finish_reason": gen.finish_reason}])
            if params.include_usage:
                await send([], usage=self._usage(gen))
            await writer.write(b"data: [DONE]\n\n")
            await writer.finish()
        except (ClientGone, ClientStalled, ConnectionResetError):  # the client went away
            return response
        except KvPoolError as e:  # too late for a status: the error is the stream's last event
            self._note(e)
            try:
                await writer.write(b"data: " + _json(api_error(e).body()) + b"\n\n")
                await writer.write(b"data: [DONE]\n\n")
            except (ClientStalled, ConnectionResetError):
                pass
        return response

    async def _timed(self, request: web.Request, gen: Generation):
        """gen.steps(), each token's time and the finished request counted in the metrics."""
        arrival = request.get("kvpool_arrival", time.monotonic())
        last = 0.0
        async for step in gen.steps():
            now = time.monotonic()
            self.metrics.token(arrival, last, now)
            last = now
            yield step
        self.metrics.finished(arrival, last or time.monotonic(), len(gen.prompt),
                              gen.completion_tokens, gen.cached_tokens, gen.finish_reason)

    def _token_text(self, token: int) -> str:
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"bytes:\\x{b:02x}" for b in raw)

    def _logprobs(self, steps: List[Step], params: Params) -> dict:
        if params.chat:
            content = []
            for s in steps:
                text = self._token_text(s.token)
                content.append({
                    "token": text, "logprob": s.logprob, "bytes": list(self.tokenizer.token_bytes(s.token)),
                    "top_logprobs": [{"token": self._token_text(t), "logprob": lp,
                                      "bytes": list(self.tokenizer.token_bytes(t))}
                                     for t, lp in s.top[: params.logprobs]]})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for s in steps:
            out["tokens"].append(self._token_text(s.token))
            out["token_logprobs"].append(s.logprob)
            out["top_logprobs"].append(
                {self._token_text(t): lp for t, lp in s.top[: params.logprobs]})
            out["text_offset"].append(offset)
            offset += len(s.text)
        return out
