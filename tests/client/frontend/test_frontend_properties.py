"""Property-based tests (Debian's python3-hypothesis) of kvpool-frontend's request handling, over
a fake daemon client in this process (frontend_fakes.py): whatever the body and headers, the
answer is a 2xx or a 4xx with an OpenAI-style error body, never a 500; every limit of an API key
holds for every size; the Authorization header is taken only in its one valid form. Derandomized
(the same examples on every run) and without an example database."""

import atexit
import json
import logging
import shutil
import string
import tempfile
import unittest

from hypothesis import HealthCheck, configuration, given, settings
from hypothesis import strategies as st

from frontend_fakes import BLOCK_SIZE, InProcessFrontend
from kvpool_frontend import auth
from kvpool_frontend.auth import KeyStore, Limits
from kvpool_frontend.protocol import ApiError, CHAT_FIELDS, COMPLETION_FIELDS
from kvpool_frontend.server import Options

# Hypothesis caches Unicode tables under its home directory: not in the source tree.
_home = tempfile.mkdtemp(prefix="kvpool-hypothesis-")
atexit.register(shutil.rmtree, _home, True)
configuration.set_hypothesis_home_dir(_home)
settings.register_profile("kvpool", derandomize=True, database=None, deadline=None,
                          max_examples=150, print_blob=False,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvpool")

KEY = "kvp-property-test-key"
LIMITS = Limits(concurrent_requests=4, prompt_tokens=300, max_tokens=8, body_bytes=8192)


def store(limits=LIMITS):
    return KeyStore.parse(json.dumps({"keys": [
        {"name": "tester", "sha256": auth.hash_key(KEY), "limits": vars(limits)}]}))


AUTH = {"Authorization": f"Bearer {KEY}"}

# Text with any code point, lone surrogates included (JSON can carry "\ud800"; UTF-8 cannot).
any_char = st.characters(blacklist_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(any_char, max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)

# Values a field is likely to be checked against: its valid range, its edges, and the wrong type.
field_values = (st.integers(-2, 40)
                | st.sampled_from([0, 1, -1, 20, 21, 4096, 2 ** 31, 10 ** 30, 10 ** 400, -10 ** 400])
                | st.booleans() | st.none() | st.floats(allow_nan=True)
                | st.text(max_size=12) | st.lists(st.integers(-1, 9000), max_size=6)
                | st.lists(st.text(max_size=4), max_size=5) | json_values)
short_text = st.text(min_size=1, max_size=12)
# Values each field takes when it is valid (or absent: None), so whole valid requests are drawn.
GOOD = {
    "max_tokens": st.integers(1, 12), "stream": st.booleans(), "user": short_text,
    "seed": st.integers(), "stop": st.none() | short_text | st.lists(short_text, max_size=4),
    "temperature": st.none() | st.sampled_from([0, 2]) | st.floats(0, 2),
    "top_p": st.none() | st.just(1) | st.floats(0, 1, exclude_min=True),
    "top_k": st.none() | st.integers(-1, 64), "n": st.sampled_from([1, None]),
    "presence_penalty": st.none() | st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.sampled_from([{}, None]), "ignore_eos": st.sampled_from([False, None]),
    "cache_salt": st.none() | st.text(any_char, min_size=1, max_size=40),
}
GOOD_COMPLETION = {**GOOD, "logprobs": st.none() | st.integers(0, 20),
                   "echo": st.just(False), "best_of": st.just(1), "suffix": st.none()}
GOOD_CHAT = {**GOOD, "max_completion_tokens": st.integers(1, 12), "logprobs": st.booleans()}
prompts = (st.text(any_char, min_size=1, max_size=60)
           | st.lists(st.integers(0, 8191), min_size=1, max_size=60))
turns = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                        "content": st.text(any_char, max_size=30)}),
                 min_size=1, max_size=3)
messages = st.builds(lambda system, rest: system + rest,
                     st.sampled_from([[], [{"role": "system", "content": "be brief"}]]), turns)


def requests(fields, good, required):
    """Valid bodies, and valid bodies with one field (of `fields`, or an unknown one) replaced by
    anything or removed."""
    valid = st.fixed_dictionaries({"model": st.just("tiny"), **required},
                                  optional={k: v for k, v in good.items()})
    names = sorted(fields | {"frobnicate"})
    replaced = st.builds(lambda body, name, value: {**body, name: value}, valid,
                         st.sampled_from(names), field_values)
    removed = st.builds(lambda body, name: {k: v for k, v in body.items() if k != name}, valid,
                        st.sampled_from(names))
    return valid | replaced | removed


completion_bodies = requests(COMPLETION_FIELDS, GOOD_COMPLETION, {"prompt": prompts})
chat_bodies = requests(CHAT_FIELDS, GOOD_CHAT, {"messages": messages})

# Header values an HTTP client can send: printable Latin-1 without line breaks.
header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                             blacklist_characters="\x7f"), max_size=80)


class HandlerPropertyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # the framing errors
        cls.server = InProcessFrontend(Options(keys=store(), max_running=64))

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def check(self, status, headers, raw, framing=False):
        """Any answer: a 2xx with a body of its kind, or a 4xx with an error body. `framing`: the
        request's Content-Length, Transfer-Encoding or Expect may be malformed, which aiohttp's
        HTTP layer answers (a 4xx in plain text) before any handler runs."""
        self.assertNotEqual(status, 500, raw[:300])
        self.assertTrue(200 <= status < 300 or 400 <= status < 500, (status, raw[:300]))
        if framing and status >= 400 and not raw.startswith(b"{"):
            return
        if status >= 400:
            error = json.loads(raw)["error"]
            self.assertIsInstance(error["message"], str)
            self.assertIn("type", error)
            if status == 429:
                self.assertIn("Retry-After", headers)
        elif headers["Content-Type"].startswith("text/event-stream"):
            self.assertTrue(raw.endswith(b"data: [DONE]\n\n"), raw[-200:])
            self.assertNotIn(b'"error"', raw)
        else:
            out = json.loads(raw)
            self.assertEqual(len(out["choices"]), 1)
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            self.assertEqual(cached % BLOCK_SIZE, 0)
            self.assertLessEqual(out["usage"]["completion_tokens"], LIMITS.max_tokens)

    def post(self, path, body=None, data=None, headers=AUTH):
        if data is None:
            data = json.dumps(body).encode()
        status, response_headers, raw = self.server.request(
            "POST", path, data=data, headers={**headers, "Content-Type": "application/json"})
        self.server.settle()
        self.check(status, response_headers, raw)
        return status, raw

    def tearDown(self):
        self.server.settle()
        self.assertEqual(self.server.client.live, {}, "a sequence was not freed")
        admission = self.server.frontend.admission
        self.assertIsNone(admission.check_invariants())
        self.assertEqual((admission.running, admission.reserved_blocks), (0, 0))

    @given(completion_bodies)
    def test_completion_bodies_never_crash(self, body):
        self.post("/v1/completions", body)

    @given(chat_bodies)
    def test_chat_bodies_never_crash(self, body):
        self.post("/v1/chat/completions", body)

    @given(json_values)
    def test_any_json_value_is_a_4xx(self, body):
        status, _ = self.post("/v1/completions", body)
        self.assertEqual(status // 100, 4)

    @given(st.binary(max_size=200))
    def test_any_bytes_are_a_4xx_or_a_completion(self, data):
        self.post("/v1/chat/completions", data=data)

    @given(st.one_of(st.just(f"Bearer {KEY}"), header_text,
                     st.builds(str.__add__, st.sampled_from(["Bearer ", "bearer  ", "Basic ", ""]),
                               st.sampled_from([KEY, KEY + "x", KEY[:-1], KEY.upper(), ""]))),
           st.dictionaries(st.sampled_from(["Content-Length", "X-Api-Key", "Transfer-Encoding",
                                            "Content-Type", "Accept", "Expect"]),
                           header_text, max_size=3))
    def test_any_headers_never_crash(self, authorization, headers):
        headers = {**headers, "Authorization": authorization}
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        status, response_headers, raw = self.server.request(
            "POST", "/v1/completions", data=body, headers=headers)
        self.server.settle()
        self.check(status, response_headers, raw,
                   framing=bool({"Content-Length", "Transfer-Encoding", "Expect"} & set(headers)))
        if status == 200:
            scheme, token = authorization.split()
            self.assertEqual((scheme.lower(), token), ("bearer", KEY))

    def test_integers_past_any_float_are_400_naming_the_field(self):
        # json.loads takes integers of up to 4300 digits; float() of one past 1e308 overflows.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        for path, base, fields in [
                ("/v1/completions", {"model": "tiny", "prompt": "hi"},
                 ["temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed",
                  "max_tokens", "n", "best_of", "logprobs"]),
                ("/v1/chat/completions", chat,
                 ["temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed",
                  "max_tokens", "n", "top_logprobs"])]:
            for field in fields:
                for value in (10 ** 400, -10 ** 400):
                    status, raw = self.post(path, {**base, field: value})
                    self.assertEqual((status, json.loads(raw)["error"]["param"]), (400, field),
                                     (path, field, value))

    def test_deep_nesting_and_huge_numbers_are_400(self):
        for data in [b"[" * 1500 + b"]" * 1500, b'{"model": "tiny", "prompt": ' + b"[" * 2000,
                     b'{"model": "tiny", "prompt": [' + b"9" * 5000 + b"]}",
                     b'{"model": "tiny", "prompt": "\\ud800"}', b"\xff\xfe{"]:
            status, _ = self.post("/v1/completions", data=data)
            self.assertEqual(status, 400, data[:40])


class LimitPropertyTest(unittest.TestCase):
    """Each limit of a key, for every size around it."""

    @classmethod
    def setUpClass(cls):
        cls.server = InProcessFrontend(Options(keys=store(), max_running=64))

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def tearDown(self):
        self.server.settle()
        self.assertEqual(self.server.client.live, {})

    def post(self, data, headers=None):
        status, _, raw = self.server.request("POST", "/v1/completions", data=data,
                                             headers={**AUTH, **(headers or {})})
        self.server.settle()
        return status, (json.loads(raw) if status != 200 else None)

    @given(st.integers(1, 2 * LIMITS.body_bytes), st.booleans())
    def test_body_bytes(self, size, chunked):
        body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
        data = body + b" " * max(0, size - len(body))
        if chunked:  # no Content-Length: the limit holds while reading
            async def chunks():
                for i in range(0, len(data), 1000):
                    yield data[i:i + 1000]
            status, err = self.post(chunks())
        else:
            status, err = self.post(data)
        if len(data) > LIMITS.body_bytes:
            self.assertEqual(status, 413, err)
            self.assertEqual(err["error"]["code"], "request_too_large")
        else:
            self.assertEqual(status, 200, err)

    @given(st.integers(1, 2 * LIMITS.prompt_tokens))
    def test_prompt_tokens(self, n):
        status, err = self.post(json.dumps({"model": "tiny", "prompt": [65] * n,
                                            "max_tokens": 1}).encode())
        if n > LIMITS.prompt_tokens:
            self.assertEqual((status, err["error"]["code"]), (400, "prompt_too_long"))
        else:
            self.assertEqual(status, 200, err)

    @given(st.integers(1, 4 * LIMITS.max_tokens), st.booleans())
    def test_max_tokens(self, n, chat):
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
        status, _, raw = self.server.request(
            "POST", path, json={"model": "tiny", "max_tokens": n, **body}, headers=AUTH)
        self.server.settle()
        if n > LIMITS.max_tokens:
            self.assertEqual((status, json.loads(raw)["error"]["param"]), (400, "max_tokens"))
        else:
            self.assertEqual(status, 200, raw)
            self.assertEqual(json.loads(raw)["usage"]["completion_tokens"], n)

    def test_defaults_are_lowered_to_the_limit(self):
        for path, body in [("/v1/completions", {"prompt": "hi"}),  # default 16
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]})]:
            status, _, raw = self.server.request("POST", path, json={"model": "tiny", **body},
                                                 headers=AUTH)
            self.assertEqual(status, 200, raw)
            self.assertEqual(json.loads(raw)["usage"]["completion_tokens"], LIMITS.max_tokens)
        self.server.settle()


# A header with something other than one token after "Bearer": never a key.
token_chars = string.ascii_letters + string.digits + "-._~+/"


class BearerPropertyTest(unittest.TestCase):
    @given(st.text(token_chars, min_size=1, max_size=512), st.text("=", max_size=3),
           st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]), st.integers(1, 3),
           st.integers(0, 2))
    def test_valid_headers_give_their_token(self, token, pad, scheme, spaces, trailing):
        header = scheme + " " * spaces + token + pad + " " * trailing
        self.assertEqual(auth.bearer_token(header), token + pad)

    @given(header_text)
    def test_any_header_is_a_token_of_the_alphabet_or_401(self, header):
        try:
            token = auth.bearer_token(header)
        except ApiError as e:
            self.assertEqual(e.status, 401)
            self.assertEqual(e.code, "invalid_api_key")
            return
        self.assertTrue(header.lower().startswith("bearer "))
        self.assertEqual(header.split()[1], token)
        self.assertTrue(set(token.rstrip("=")) <= set(token_chars))

    @given(st.text(token_chars, min_size=1, max_size=40),
           st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                          blacklist_characters=token_chars + "= "),
                   min_size=1, max_size=3),
           st.integers(0, 40))
    def test_a_foreign_character_anywhere_in_the_token_is_refused(self, token, bad, at):
        at = min(at, len(token))
        with self.assertRaises(ApiError):
            auth.bearer_token("Bearer " + token[:at] + bad + token[at:])

    def test_missing_other_schemes_and_overlong(self):
        for header in [None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token abc",
                       "Bearer a b", "Bearer " + "a" * 513, "Bearer\tabc", " Bearer abc"]:
            with self.assertRaises(ApiError) as e:
                auth.bearer_token(header)
            self.assertEqual(e.exception.status, 401, header)

    @given(st.text(token_chars, min_size=1, max_size=64), st.text(token_chars, min_size=1,
                                                                  max_size=64))
    def test_only_the_stored_key_authenticates(self, stored, presented):
        keys = KeyStore.parse(json.dumps({"keys": [
            {"name": "k", "sha256": auth.hash_key(stored)}]}))
        if presented == stored:
            self.assertEqual(keys.authenticate("Bearer " + presented).name, "k")
        else:
            with self.assertRaises(ApiError) as e:
                keys.authenticate("Bearer " + presented)
            self.assertEqual(e.exception.status, 401)


if __name__ == "__main__":
    unittest.main()
