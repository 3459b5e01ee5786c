"""The OpenAI request fields kvpool-frontend takes, what it maps them to, and what it refuses.

The daemon samples each sequence with its own parameters (kvpool.proto SamplingParams) and can
return the chosen token's and the top-k log-probabilities of each step (k <= 64). So, for
/v1/completions and /v1/chat/completions:

  mapped    model (must be the served name), prompt (a string or one list of token ids) /
            messages, max_tokens (max_completion_tokens for chat), stop (a string or up to 4),
            stream, stream_options.include_usage, logprobs (completions: 0..20 top tokens; chat:
            true, with top_logprobs 0..20) -> the daemon's top_k and the chosen token's
            log-probability, cache_salt (vLLM's: narrows the caller's prefix-sharing domain;
            auth.request_salt), temperature [0, 2] (default 1, OpenAI's), top_p (0, 1],
            top_k (vLLM's extension: -1 or 0 for no cut, else 1..vocab), presence_penalty and
            frequency_penalty [-2, 2], seed (an integer: the same seed and request give the same
            tokens; absent, the frontend draws one per request), user (accepted, unused)
  accepted  only at their default: n 1, best_of 1, logit_bias empty, echo false, suffix absent,
            ignore_eos false
  refused   any other value of those, and any field not listed here: 400 with the field named

Log-probabilities are the model's distribution before temperature, top_k, top_p and penalties
(as OpenAI and vLLM report them). max_tokens defaults to 16 for completions (OpenAI's default)
and to the rest of the context for chat; a default is lowered to the API key's max_tokens limit,
a value the request names above it is refused. prompt + max_tokens must fit the model's context
(model_max_position).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import List, Optional, Union

from kvpool import Sampling

MAX_LOGPROBS = 20
INT32_MAX = 2**31 - 1
MAX_STOP = 4

_COMMON = {"model", "max_tokens", "stop", "stream", "stream_options", "user", "seed",
           "temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty",
           "logit_bias", "ignore_eos", "cache_salt"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, type, message, the offending parameter, a code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers=None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass
class Params:
    """A validated request."""

    chat: bool
    prompt: Union[str, List[int], None] = None  # completions
    messages: Optional[list] = None             # chat
    max_tokens: Optional[int] = None            # None: the rest of the context (chat)
    max_tokens_given: bool = False              # the request named it (else: a default)
    stop: List[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None              # top tokens per step; None: no logprobs
    cache_salt: object = None                   # as sent (auth.request_salt checks it)
    sampling: Sampling = dataclasses.field(default_factory=Sampling)  # seed always set

    @property
    def daemon_sampling(self) -> Optional[Sampling]:
        """What the daemon is asked to sample with; None: greedy (no parameters sent)."""
        s = self.sampling
        if s.temperature == 0 and s.presence_penalty == 0 and s.frequency_penalty == 0:
            return None
        return s

    @property
    def top_k(self) -> int:
        """What the daemon is asked for: at least the chosen token's log-probability."""
        return 0 if self.logprobs is None else max(1, self.logprobs)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _only(body: dict, name: str, allowed, what: str) -> None:
    if name in body and body[name] is not None and body[name] not in allowed:
        raise bad(f"{name}={body[name]!r} is not supported: {what}", name, "unsupported_parameter")


def _number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    bracket = "(" if low_open else "["
    # An int is compared as it is: json.loads takes integers of up to 4300 digits, which
    # math.isfinite and float() cannot convert (OverflowError).
    if (not _is_number(v) or not (_is_int(v) or math.isfinite(v)) or v > high
            or (v <= low if low_open else v < low)):
        raise bad(f"{name} must be a number in {bracket}{low:g}, {high:g}], not {v!r}", name)
    return float(v)


def _sampling(body: dict) -> Sampling:
    """The daemon's sampling parameters for the request's OpenAI ones."""
    top_k = body.get("top_k")
    if top_k is None or top_k == -1:
        top_k = 0
    elif not _is_int(top_k) or not 0 <= top_k <= INT32_MAX:  # the wire's int32
        raise bad(f"top_k must be -1 (no cut) or an integer in [0, {INT32_MAX}], not {top_k!r}",
                  "top_k")
    seed = body.get("seed")
    if seed is None:
        seed = random.getrandbits(64)
    elif not _is_int(seed) or not -2**63 <= seed < 2**64:
        raise bad(f"seed must be a 64-bit integer, not {seed!r}", "seed")
    return Sampling(temperature=_number(body, "temperature", 1.0, 0, 2),
                    top_p=_number(body, "top_p", 1.0, 0, 1, low_open=True),
                    top_k=top_k,
                    presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
                    frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
                    seed=seed % 2**64)


def _defaults_only(body: dict) -> None:
    _only(body, "n", (1,), "one choice per request")
    _only(body, "best_of", (1,), "one choice per request")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    _only(body, "echo", (False,), "the prompt is not echoed")
    _only(body, "ignore_eos", (False,), "generation ends at the model's end-of-sequence token")
    if body.get("suffix") is not None:
        raise bad("suffix is not supported", "suffix", "unsupported_parameter")


def _stop(value) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (not isinstance(value, list) or len(value) > MAX_STOP
            or not all(isinstance(s, str) and s for s in value)):
        raise bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them",
                  "stop")
    return list(value)


def _positive_int(body: dict, name: str) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < 1:
        raise bad(f"{name} must be an integer >= 1, not {v!r}", name)
    return v


def _common(body, served_model: str, allowed) -> Params:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported field {unknown[0]!r}", unknown[0], "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required", "model")
    if model != served_model:
        raise ApiError(404, f"the model {model!r} does not exist (this server has "
                            f"{served_model!r})", param="model", code="model_not_found")
    _defaults_only(body)
    sampling = _sampling(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options supports only include_usage", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    return Params(chat=False, stop=_stop(body.get("stop")), stream=stream,
                  include_usage=include_usage, cache_salt=body.get("cache_salt"),
                  sampling=sampling)


def parse_completion(body, served_model: str) -> Params:
    p = _common(body, served_model, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt must not be empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        pass
    elif isinstance(prompt, list) and prompt:
        raise bad("prompt: batches of several prompts are not supported; send one string or "
                  "one list of token ids per request", "prompt")
    else:
        raise bad("prompt must be a non-empty string or list of token ids", "prompt")
    p.prompt = prompt
    p.max_tokens = _positive_int(body, "max_tokens")
    p.max_tokens_given = p.max_tokens is not None
    p.max_tokens = p.max_tokens or 16
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
        p.logprobs = logprobs
    return p


def parse_chat(body, served_model: str) -> Params:
    p = _common(body, served_model, CHAT_FIELDS)
    p.chat = True
    p.messages = body.get("messages")
    if not isinstance(p.messages, list) or not p.messages:
        raise bad("messages must be a non-empty list", "messages")
    p.max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    p.max_tokens_given = p.max_tokens is not None
    logprobs = body.get("logprobs")
    top = body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    if top is not None:
        if not logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if logprobs:
        p.logprobs = top or 0
    return p
