"""kvpool-frontend's HTTP server: OpenAI-compatible endpoints over one kvpool.aio.AsyncClient
session (compute-only: the daemon's model does the work).

  POST /v1/completions        prompt (string or token ids) -> text; SSE when "stream": true
  POST /v1/chat/completions   messages (chat template: chat.py) -> assistant message; SSE too
  GET  /v1/models             the one served model
  GET  /health                200 while serving; 503 while draining or when kvpoold is unreachable

Streams send one event per generated token (its text may be empty while a UTF-8 character or a
possible stop string is incomplete), then a final event with finish_reason, the usage event when
stream_options.include_usage, and "data: [DONE]". The prompt is prefilled before the response
starts, so a refusal still gets its HTTP status. Usage counts prompt, completion and cached
tokens (prompt_tokens_details.cached_tokens: prompt tokens the daemon's prefix cache supplied).

Errors are OpenAI-style JSON ({"error": {"message", "type", "param", "code"}}): 400 bad input,
404 unknown model or path, 429 when the pool (or a quota) is exhausted (the shortfall in the
message, Retry-After: 1), 503 while draining (this frontend's SIGTERM, or the daemon's drain) or
when the daemon is unreachable, 504 when a call runs past its deadline, 500 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import List, Optional

from aiohttp import web

import kvpool
import kvpool.aio
from kvpool import KvPoolError, StatusCode

from kvpool_frontend import chat, protocol
from kvpool_frontend.generation import ClientGone, DecodeBatcher, Generation, Step
from kvpool_frontend.protocol import ApiError, Params
from kvpool_frontend.tokenizer import TokenizerError

log = logging.getLogger("kvpool.frontend")

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


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class Frontend:
    """The server's state: the daemon session, the tokenizer, requests in flight. One event loop."""

    def __init__(self, client: kvpool.aio.AsyncClient, tokenizer, template: str,
                 served_model: str, connect_args: dict):
        self.client = client
        self.tokenizer = tokenizer
        self.template = template
        self.served_model = served_model
        self.max_position = client.model_max_position
        self.vocab_size = client.model_vocab_size
        self.created = int(time.time())
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._frees: set = set()
        self.batcher = DecodeBatcher()
        self._connect_args = connect_args
        self._stale = False
        self._reconnect_lock = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=16 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

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

    async def models(self, request: web.Request) -> web.Response:
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

    async def _body(self, request: web.Request):
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError):
            raise protocol.bad("the request body is not valid JSON") from None

    def _prompt(self, params: Params) -> List[int]:
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
        if params.max_tokens is None:
            params.max_tokens = self.max_position - len(ids)
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
        body = await self._body(request)
        params = (protocol.parse_chat if chat else protocol.parse_completion)(
            body, self.served_model)
        prompt = self._prompt(params)
        transport = request.transport

        def generation(client) -> Generation:
            gen = Generation(client, self.batcher, prompt, params.max_tokens, params.stop,
                             params.top_k, self.tokenizer.eos_id, self.tokenizer.decode,
                             self._track_free)
            gen.abandoned = lambda: transport is None or transport.is_closing()
            return gen

        gen = generation(await self._usable_client())
        self.in_flight += 1
        self._idle.clear()
        try:
            try:
                await gen.start()
            except KvPoolError as e:
                # The session is gone (the daemon restarted): attach anew and try once more.
                if e.code not in (StatusCode.UNAUTHENTICATED, StatusCode.UNAVAILABLE):
                    raise
                self._stale = True
                gen = generation(await self._usable_client())
                await gen.start()
            if params.stream:
                return await self._stream(request, gen, params)
            return await self._whole(gen, params)
        except ClientGone:  # nobody reads the answer; the sequence is freed below
            return web.Response(status=499)
        except KvPoolError as e:
            self._note(e)
            raise
        finally:
            gen.close()
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

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

    async def _whole(self, gen: Generation, params: Params) -> web.Response:
        steps = [s async for s in gen.steps()]
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
        return web.json_response(out, dumps=lambda o: _json(o).decode())

    async def _stream(self, request: web.Request, gen: Generation,
                      params: Params) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        head = self._head(params, chunk=True)

        async def send(choices, **extra):
            await response.write(b"data: " + _json({**head, "choices": choices, **extra}) + b"\n\n")

        if params.chat:
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}])
        try:
            async for step in gen.steps():
                logprobs = self._logprobs([step], params) if params.logprobs is not None else None
                if params.chat:
                    await send([{"index": 0, "delta": {"content": step.text},
                                 "logprobs": logprobs, "finish_reason": None}])
                else:
                    await send([{"index": 0, "text": step.text, "logprobs": logprobs,
                                 "finish_reason": None}])
        except (ClientGone, ConnectionResetError):  # the client went away mid-stream
            return response
        except KvPoolError as e:  # too late for a status: the error is the stream's last event
            self._note(e)
            await response.write(b"data: " + _json(api_error(e).body()) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            return response
        delta = {"delta": {}} if params.chat else {"text": ""}
        await send([{"index": 0, **delta, "logprobs": None, "finish_reason": gen.finish_reason}])
        if params.include_usage:
            await send([], usage=self._usage(gen))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

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
