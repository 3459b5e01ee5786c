"""kvpool-frontend's pieces alone: the byte and SentencePiece tokenizers and streaming
detokenization, the chat templates, the OpenAI request mapping, stop strings, the keys file and
its tool, sharing domains, and admission (a seeded run against a reference model)."""

import asyncio
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

import kvpool

from kvpool import Sampling
from kvpool_frontend import auth, chat, protocol, tokenizer
from kvpool_frontend.admission import Admission
from kvpool_frontend.auth import KeyStore, KeysFileError, Limits
from kvpool_frontend.generation import DecodeBatcher, StopMatcher
from kvpool_frontend.protocol import ApiError
from kvpool_frontend.tokenizer import ByteTokenizer, Detokenizer, TokenizerError
from kvpool_testing import train_sentencepiece


def stream_text(tok, prompt, generated):
    detok = Detokenizer(tok.decode, prompt)
    return "".join(detok.add(t) for t in generated) + detok.flush()


class ByteTokenizerTest(unittest.TestCase):
    def setUp(self):
        self.tok = ByteTokenizer(8192)

    def test_bytes_specials_and_opaque_tokens(self):
        self.assertEqual(self.tok.encode("hi é"), [104, 105, 32, 0xC3, 0xA9])
        self.assertEqual(self.tok.encode("a<|300|>b"), [97, 300, 98])
        # Out of the opaque range, or of the vocabulary: plain text.
        self.assertEqual(self.tok.encode("<|257|>"), list(b"<|257|>"))
        self.assertEqual(self.tok.encode("<|8192|>"), list(b"<|8192|>"))
        self.assertEqual(self.tok.decode([256, 104, 300, 257]), "h<|300|>")
        self.assertEqual((self.tok.bos_id, self.tok.eos_id), (256, 257))
        with self.assertRaises(TokenizerError):
            self.tok.decode([8192])
        with self.assertRaises(TokenizerError):
            ByteTokenizer(100)

    def test_generated_text_reencodes_to_the_same_tokens(self):
        generated = [4000, 104, 0xE2, 0x82, 0xAC, 258, 8191]
        text = self.tok.decode(generated)
        self.assertEqual(text, "<|4000|>h€<|258|><|8191|>")
        self.assertEqual(self.tok.encode(text), generated)

    def test_streaming_never_splits_a_character(self):
        detok = Detokenizer(self.tok.decode, [256, 65])
        self.assertEqual(detok.add(0xE2), "")
        self.assertEqual(detok.add(0x82), "")
        self.assertEqual(detok.add(0xAC), "€")
        self.assertEqual(detok.add(300), "<|300|>")
        self.assertEqual(detok.add(0xC3), "")
        self.assertEqual(detok.flush(), "\ufffd")  # a half character at the end
        self.assertEqual(stream_text(self.tok, [256], [104, 0xC3, 0xA9, 257, 33]), "hé!")


class SentencePieceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="kvpool-sp-")
        train_sentencepiece(cls.dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_loads_from_a_checkpoint_directory_and_round_trips(self):
        tok = tokenizer.load("auto", self.dir, 512)  # the daemon's model is the checkpoint dir
        self.assertEqual(tok.name, "sentencepiece")
        self.assertEqual((tok.bos_id, tok.eos_id, tok.vocab_size), (1, 2, 400))
        ids = tok.encode("the pool streams tokens")
        self.assertEqual(tok.decode(ids), "the pool streams tokens")
        # Characters the vocabulary lacks go through byte fallback, and stream whole.
        ids = tok.encode("shares 日本")
        self.assertEqual(tok.decode(ids), "shares 日本")
        prompt = tok.encode("a frontend")
        self.assertEqual(stream_text(tok, prompt, ids), " " + tok.decode(ids))

    def test_the_models_padding_tokens_decode_to_nothing(self):
        # A model's vocabulary padded past the tokenizer's (512 > 400): a sampled step may choose
        # a padding id; it has no text, and only ids past the model's are errors.
        tok = tokenizer.load("auto", self.dir, 512)
        ids = tok.encode("the pool")
        self.assertEqual(tok.decode(ids + [470] + ids), tok.decode(ids + ids))
        self.assertEqual(tok.token_bytes(511), b"")
        self.assertEqual(stream_text(tok, [], ids + [470]), tok.decode(ids))
        with self.assertRaises(TokenizerError):
            tok.decode([512])

    def test_a_tokenizer_larger_than_the_model_is_refused(self):
        with self.assertRaises(TokenizerError):
            tokenizer.load(os.path.join(self.dir, "tokenizer.model"), "tiny", 100)
        with self.assertRaises(TokenizerError):
            tokenizer.load("/nonexistent/tokenizer.model", "tiny", 8192)
        self.assertEqual(tokenizer.load("auto", "tiny", 8192).name, "bytes")

    def test_llama2_chat_template(self):
        tok = tokenizer.load(self.dir, "x", 512)
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
        pieces = chat.render("llama-2", messages, tok.bos_id, tok.eos_id)
        self.assertEqual(pieces, [1, "[INST] <<SYS>>\nS\n<</SYS>>\n\nU1 [/INST]", " A1 ", 2, 1,
                                  "[INST] U2 [/INST]"])
        ids = chat.encode(pieces, tok)
        self.assertEqual(ids[0], 1)
        self.assertEqual(ids.count(2), 1)
        with self.assertRaises(chat.TemplateError):
            chat.render("llama-2", [{"role": "assistant", "content": "x"}], 1, 2)


class ChatTemplateTest(unittest.TestCase):
    def test_kvpool_template(self):
        pieces = chat.render("kvpool", [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        ], 256, 257)
        self.assertEqual(pieces, [256, "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"])

    def test_bad_messages(self):
        for messages in ([], "hi", [{"role": "tool", "content": "x"}], [{"role": "user"}],
                         [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}],
                         [{"role": "user", "content": [{"type": "image_url"}]}]):
            with self.assertRaises(chat.TemplateError, msg=messages):
                chat.render("kvpool", messages, 256, 257)


class ProtocolTest(unittest.TestCase):
    def test_greedy_values_are_accepted_and_logprobs_map_to_top_k(self):
        p = protocol.parse_completion({"model": "m", "prompt": "x", "temperature": 0, "top_p": 1,
                                       "top_k": -1, "n": 1, "seed": 7, "logprobs": 3,
                                       "stop": "\n"}, "m")
        self.assertEqual((p.max_tokens, p.top_k, p.stop), (16, 3, ["\n"]))
        p = protocol.parse_completion({"model": "m", "prompt": "x", "logprobs": 0}, "m")
        self.assertEqual(p.top_k, 1)  # the chosen token's own log-probability
        p = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "m")
        self.assertEqual((p.max_tokens, p.top_k, p.logprobs), (None, 0, None))
        p = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "logprobs": True, "top_logprobs": 5,
                                 "max_completion_tokens": 9}, "m")
        self.assertEqual((p.max_tokens, p.top_k), (9, 5))
        self.assertEqual(protocol.parse_completion({"model": "m", "prompt": [[1, 2]]}, "m").prompt, [1, 2])

    def test_sampling_parameters_map_to_the_daemons(self):
        p = protocol.parse_completion({"model": "m", "prompt": "x", "temperature": 0.7,
                                       "top_p": 0.9, "top_k": 40, "presence_penalty": 0.5,
                                       "frequency_penalty": -1, "seed": -1}, "m")
        self.assertEqual(p.daemon_sampling, Sampling(0.7, 0.9, 40, 0.5, -1.0, 2 ** 64 - 1))
        # OpenAI's default temperature is 1; without a seed one is drawn per request.
        a = protocol.parse_completion({"model": "m", "prompt": "x"}, "m").daemon_sampling
        b = protocol.parse_completion({"model": "m", "prompt": "x"}, "m").daemon_sampling
        self.assertEqual((a.temperature, a.top_p, a.top_k), (1.0, 1.0, 0))
        self.assertNotEqual(a.seed, b.seed)
        # Greedy (temperature 0, no penalties): nothing is sent, the daemon's argmax.
        p = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "temperature": 0, "top_k": -1}, "m")
        self.assertIsNone(p.daemon_sampling)
        p = protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "temperature": 0, "frequency_penalty": 1}, "m")
        self.assertEqual(p.daemon_sampling.frequency_penalty, 1.0)

    def test_refusals_name_the_field(self):
        cases = [
            ({"model": "m", "prompt": "x", "temperature": 2.01}, "temperature"),
            ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
            ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
            ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
            ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
            ({"model": "m", "prompt": "x", "top_k": 1.5}, "top_k"),
            ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
            ({"model": "m", "prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
            # JSON integers past any float (json.loads takes up to 4300 digits).
            ({"model": "m", "prompt": "x", "temperature": 10 ** 400}, "temperature"),
            ({"model": "m", "prompt": "x", "top_p": 10 ** 400}, "top_p"),
            ({"model": "m", "prompt": "x", "presence_penalty": -10 ** 400}, "presence_penalty"),
            ({"model": "m", "prompt": "x", "frequency_penalty": 10 ** 400}, "frequency_penalty"),
            ({"model": "m", "prompt": "x", "top_k": 10 ** 400}, "top_k"),
            ({"model": "m", "prompt": "x", "top_k": 2 ** 31}, "top_k"),  # past the wire's int32
            ({"model": "m", "prompt": "x", "seed": 10 ** 400}, "seed"),
            ({"model": "m", "prompt": "x", "logprobs": 10 ** 400}, "logprobs"),
            ({"model": "m", "prompt": "x", "n": 10 ** 400}, "n"),
            ({"model": "m", "prompt": "x", "seed": 2 ** 64}, "seed"),
            ({"model": "m", "prompt": "x", "seed": 1.0}, "seed"),
            ({"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
            ({"model": "m", "prompt": "x", "echo": True}, "echo"),
            ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
            ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
            ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
            ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
            ({"model": "m", "prompt": [1, "a"]}, "prompt"),
            ({"model": "m"}, "prompt"),
            ({"prompt": "x"}, "model"),
        ]
        for body, field in cases:
            with self.assertRaises(ApiError, msg=body) as e:
                protocol.parse_completion(body, "m")
            self.assertEqual((e.exception.status, e.exception.param), (400, field), body)
        with self.assertRaises(ApiError) as e:
            protocol.parse_completion({"model": "other", "prompt": "x"}, "m")
        self.assertEqual(e.exception.status, 404)
        with self.assertRaises(ApiError) as e:
            protocol.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                 "top_logprobs": 2}, "m")
        self.assertEqual(e.exception.param, "top_logprobs")
        with self.assertRaises(ApiError) as e:
            protocol.parse_completion(["not", "an", "object"], "m")
        self.assertEqual(e.exception.status, 400)


class StopMatcherTest(unittest.TestCase):
    def test_holds_back_a_possible_stop_and_cuts_at_one(self):
        m = StopMatcher(["END", "\n\n"])
        self.assertEqual(m.feed("abc E"), ("abc ", False))
        self.assertEqual(m.feed("N"), ("", False))
        self.assertEqual(m.feed("X"), ("ENX", False))
        self.assertEqual(m.feed("one\n"), ("one", False))
        self.assertEqual(m.feed("\nafter"), ("", True))
        m = StopMatcher(["END"])
        self.assertEqual(m.feed("xEN"), ("x", False))
        self.assertEqual(m.flush(), "EN")
        self.assertEqual(StopMatcher([]).feed("anything"), ("anything", False))
        self.assertEqual(StopMatcher(["bc", "abcd"]).feed("xabcd"), ("x", True))  # the first one


class FakeDecoder:
    """A client whose Decode returns token + 1 per sequence; it fails any batch that holds
    sequence `bad` (all or none, as the daemon), and records the batches it was sent."""

    def __init__(self, bad=None):
        self.bad = bad
        self.batches = []
        self.samplings = []  # each call's sampling argument

    async def decode(self, items, top_k=0, sampling=None, logprobs=False):
        from kvpool._proto import kvpool_pb2

        items = list(items)
        self.batches.append([s for s, _ in items])
        self.samplings.append(sampling)
        await asyncio.sleep(0.01)
        if any(s == self.bad for s, _ in items):
            raise kvpool.KvPoolError(kvpool.StatusCode.RESOURCE_EXHAUSTED, "pool is full")
        return kvpool_pb2.DecodeResponse(next_tokens=[t + 1 for _, t in items])


class DecodeBatcherTest(unittest.TestCase):
    def test_streams_waiting_together_share_one_call(self):
        async def scenario():
            client, batcher = FakeDecoder(), DecodeBatcher()

            async def stream(seq, steps):
                token = seq * 100
                for _ in range(steps):
                    token, _, _ = await batcher.submit(client, seq, token, 0)
                return token

            results = await asyncio.gather(stream(1, 5), stream(2, 5), stream(3, 3))
            self.assertEqual(results, [105, 205, 303])
            self.assertEqual(client.batches, [[1, 2, 3]] * 3 + [[1, 2]] * 2)
            self.assertEqual((batcher.calls, batcher.sequences), (5, 13))
            await batcher.idle(1)  # nothing in flight: returns at once

        asyncio.run(scenario())

    def test_a_failing_batch_fails_only_the_sequence_that_fails(self):
        async def scenario():
            client, batcher = FakeDecoder(bad=2), DecodeBatcher()
            futures = [batcher.submit(client, s, 10 * s, 0) for s in (1, 2, 3)]
            results = await asyncio.gather(*futures, return_exceptions=True)
            self.assertEqual(results[0], (11, None, ()))
            self.assertIsInstance(results[1], kvpool.KvPoolError)
            self.assertEqual(results[1].code, kvpool.StatusCode.RESOURCE_EXHAUSTED)
            self.assertEqual(results[2], (31, None, ()))
            self.assertEqual(client.batches[0], [1, 2, 3])
            self.assertEqual(sorted(client.batches[1:]), [[1], [2], [3]])

        asyncio.run(scenario())

    def test_each_sequence_keeps_its_own_sampling_in_a_shared_call(self):
        async def scenario():
            client, batcher = FakeDecoder(), DecodeBatcher()
            hot = kvpool.Sampling(temperature=1.2, seed=5)
            futures = [batcher.submit(client, 1, 10, 0, hot), batcher.submit(client, 2, 20, 0),
                       batcher.submit(client, 3, 30, 0, kvpool.Sampling(top_p=0.5, seed=6))]
            await asyncio.gather(*futures)
            self.assertEqual(client.batches, [[1, 2, 3]])
            # One set per sequence, in order; the greedy one keeps the defaults (the argmax).
            self.assertEqual(client.samplings[0],
                             [hot, kvpool.Sampling(), kvpool.Sampling(top_p=0.5, seed=6)])
            # All greedy: no parameters at all.
            await batcher.submit(client, 4, 40, 0)
            self.assertIsNone(client.samplings[1])

        asyncio.run(scenario())


class FrontendMetricsTest(unittest.TestCase):
    """GET /metrics over a frontend on a fake daemon: vLLM's request families and the frontend's
    own count what was served (issue 30)."""

    def test_requests_tokens_latencies_and_refusals_are_counted(self):
        from frontend_fakes import InProcessFrontend
        from prometheus_client.parser import text_string_to_metric_families

        from kvpool_frontend.server import Options

        server = InProcessFrontend(Options(max_running=8))
        self.addCleanup(server.close)
        post = lambda body: server.request("POST", "/v1/completions", data=json.dumps(body),
                                           headers={"Content-Type": "application/json"})
        self.assertEqual(post({"model": "tiny", "prompt": "one", "max_tokens": 3})[0], 200)
        status, _, raw = post({"model": "tiny", "prompt": "two", "max_tokens": 5, "stream": True})
        self.assertEqual(status, 200, raw)
        self.assertEqual(post({"model": "tiny", "prompt": "x", "temperature": 9})[0], 400)
        server.settle()
        status, headers, raw = server.request("GET", "/metrics")
        self.assertEqual(status, 200)
        self.assertTrue(headers["Content-Type"].startswith("text/plain"))
        samples = {}
        for family in text_string_to_metric_families(raw.decode()):
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                samples[key] = sample.value

        def value(name, **labels):
            return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))))

        self.assertEqual(value("vllm:request_success_total", finished_reason="length"), 2)
        self.assertEqual(value("vllm:generation_tokens_total"), 3 + 5)
        self.assertEqual(value("vllm:prompt_tokens_total"), 4 + 4)  # BOS + the bytes
        self.assertEqual(value("vllm:time_to_first_token_seconds_count"), 2)
        self.assertEqual(value("vllm:inter_token_latency_seconds_count"), 2 + 4)
        self.assertEqual(value("vllm:e2e_request_latency_seconds_count"), 2)
        self.assertEqual(value("vllm:num_requests_running"), 0)
        self.assertEqual(value("kvpool_frontend_http_requests_total",
                               endpoint="/v1/completions", code="200"), 2)
        self.assertEqual(value("kvpool_frontend_http_requests_total",
                               endpoint="/v1/completions", code="400"), 1)
        # A path nobody serves is counted under "other": the labels stay bounded.
        self.assertEqual(server.request("GET", "/no/such/path")[0], 404)
        raw = server.request("GET", "/metrics")[2].decode()
        self.assertIn('endpoint="other"', raw)
        self.assertNotIn("/no/such/path", raw)


H1, H2 = auth.hash_key("kvp-one"), auth.hash_key("kvp-two")


class KeysFileTest(unittest.TestCase):
    def test_keys_groups_and_limits(self):
        keys = KeyStore.parse(json.dumps({
            "defaults": {"concurrent_requests": 2, "max_tokens": 100},
            "keys": [{"name": "alice", "sha256": H1},
                     {"name": "bot", "sha256": H2, "group": "ci", "limits": {"max_tokens": 7}}]}))
        alice = keys.authenticate("Bearer kvp-one")
        bot = keys.authenticate("bearer   kvp-two")
        self.assertEqual((alice.name, alice.salt), ("alice", f"key:{H1}"))
        self.assertEqual((bot.name, bot.salt), ("bot", "group:ci"))
        self.assertEqual(alice.limits, Limits(2, 32768, 100, 1 << 20))
        self.assertEqual(bot.limits, Limits(2, 32768, 7, 1 << 20))
        for header in (None, "Bearer kvp-three", "Bearer " + H1, "Basic kvp-one"):
            with self.assertRaises(ApiError) as e:
                keys.authenticate(header)
            self.assertEqual((e.exception.status, e.exception.code), (401, "invalid_api_key"))
            self.assertIn("WWW-Authenticate", e.exception.headers)

    def test_malformed_files_are_refused_with_the_reason(self):
        cases = [
            ("[]", "expected an object"),
            ('{"keys": {}}', "must be a list"),
            ('{"keys": [], "extra": 1}', "expected an object"),
            ('{"keys": [{"name": "a b", "sha256": "%s"}]}' % H1, "name must be"),
            ('{"keys": [{"name": "a", "sha256": "%s"}]}' % H1.upper(), "sha256 must be"),
            ('{"keys": [{"name": "a", "sha256": "%s", "group": "x/y"}]}' % H1, "group must be"),
            ('{"keys": [{"name": "a", "sha256": "%s", "limits": {"max_tokens": 0}}]}' % H1,
             "max_tokens must be an integer >= 1"),
            ('{"keys": [{"name": "a", "sha256": "%s", "limits": {"rpm": 3}}]}' % H1,
             "unknown limit 'rpm'"),
            ('{"keys": [{"name": "a", "sha256": "%s", "key": "x"}]}' % H1, "unknown field"),
            ('{"keys": [{"name": "a", "sha256": "%s"}, {"name": "a", "sha256": "%s"}]}'
             % (H1, H2), "used twice"),
            ('{"keys": [{"name": "a", "sha256": "%s"}, {"name": "b", "sha256": "%s"}]}'
             % (H1, H1), "the same sha256"),
            ('{"defaults": {"body_bytes": true}}', "body_bytes must be"),
            ("{", "not JSON"),
        ]
        for text, message in cases:
            with self.assertRaises(KeysFileError) as e:
                KeyStore.parse(text)
            self.assertIn(message, str(e.exception), text)

    def test_a_file_others_may_write_is_refused(self):
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        path = os.path.join(directory, "keys.json")
        with open(path, "w") as f:
            f.write('{"keys": []}')
        for mode, ok in ((0o600, True), (0o644, True), (0o620, False), (0o602, False)):
            os.chmod(path, mode)
            if ok:
                self.assertEqual(KeyStore.load(path).names, [])
            else:
                with self.assertRaises(KeysFileError) as e:
                    KeyStore.load(path)
                self.assertIn("others may write", str(e.exception))
        os.symlink(path, path + ".link")
        with self.assertRaises(KeysFileError):
            KeyStore.load(path + ".link")


class SharingDomainTest(unittest.TestCase):
    def test_salts_never_collide(self):
        # Every (caller, request salt) pair gets its own salt: the caller's salt has no '/'.
        bases = [f"key:{H1}", f"key:{H2}", "group:ci", "group:cj", auth.ANONYMOUS_SALT]
        fields = [None, "a", "a/b", "b", "/", "key:x", "x" * auth.MAX_REQUEST_SALT_BYTES]
        salts = [auth.request_salt(b, f) for b in bases for f in fields]
        self.assertEqual(len(set(salts)), len(salts))
        self.assertTrue(all(len(s.encode()) <= 256 for s in salts))

    def test_bad_request_salts_are_400(self):
        for field in ("", 3, ["a"], "x" * (auth.MAX_REQUEST_SALT_BYTES + 1), "\ud800",
                      "é" * 65):
            with self.assertRaises(ApiError) as e:
                auth.request_salt("key:x", field)
            self.assertEqual((e.exception.status, e.exception.param), (400, "cache_salt"))


class KeysToolTest(unittest.TestCase):
    def run_tool(self, *args):
        done = subprocess.run([sys.executable, "-m", "kvpool_frontend.keys",
                               f"--keys_file={self.path}", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=30)
        return done.returncode, done.stdout, done.stderr

    def setUp(self):
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        self.path = os.path.join(directory, "keys.json")

    def test_add_prints_the_key_once_and_stores_its_hash(self):
        rc, out, _ = self.run_tool("add", "alice", "--concurrent_requests=3")
        self.assertEqual(rc, 0)
        key = out.strip()
        self.assertTrue(key.startswith("kvp-") and len(key) > 40, key)
        self.assertEqual(stat.S_IMODE(os.stat(self.path).st_mode), 0o600)
        with open(self.path) as f:
            text = f.read()
        self.assertNotIn(key, text)
        self.assertIn(auth.hash_key(key), text)
        rc, out, _ = self.run_tool("add", "bot", "--group=ci")
        bot_key = out.strip()
        keys = KeyStore.load(self.path)
        self.assertEqual(keys.names, ["alice", "bot"])
        self.assertEqual(keys.authenticate("Bearer " + key).limits.concurrent_requests, 3)
        self.assertEqual(keys.authenticate("Bearer " + bot_key).salt, "group:ci")
        self.assertEqual(self.run_tool("add", "alice")[0], 1)  # taken
        self.assertEqual(self.run_tool("add", "bad name")[0], 1)
        rc, out, _ = self.run_tool("list")
        self.assertEqual(out.splitlines(), ["alice concurrent_requests=3", "bot group=ci"])
        self.assertEqual(self.run_tool("remove", "alice")[0], 0)
        self.assertEqual(KeyStore.load(self.path).names, ["bot"])
        self.assertEqual(self.run_tool("remove", "alice")[0], 1)


class AdmissionTest(unittest.TestCase):
    """Admission driven by a seeded random sequence of calls, checked after every step against a
    reference model (counts per key, the blocks of each run)."""

    def test_random_calls_match_the_reference_model(self):
        for seed in range(20):
            rng = random.Random(seed)
            max_running, budget = rng.randint(1, 6), rng.randint(4, 60)
            a = Admission(max_running, budget, block_size=16)
            limits = {k: rng.randint(1, 4) for k in "abcd"}
            held = {k: 0 for k in limits}   # the model: request slots per key
            runs = []                       # the model: blocks of each run slot
            for step in range(300):
                op = rng.random()
                if op < 0.3:
                    key = rng.choice("abcd")
                    refusal = a.enter(key, limits[key])
                    if held[key] >= limits[key]:
                        self.assertEqual((refusal.status, refusal.retry_after), (429, 1))
                    else:
                        self.assertIsNone(refusal)
                        held[key] += 1
                elif op < 0.5:
                    keys = [k for k, n in held.items() if n]
                    if keys:
                        key = rng.choice(keys)
                        a.leave(key)
                        held[key] -= 1
                elif op < 0.8:
                    blocks = a.blocks_for(rng.randint(1, 400), rng.randint(1, 400))
                    refusal = a.start(blocks)
                    if blocks > budget:
                        self.assertEqual((refusal.status, refusal.retry_after), (400, None))
                    elif len(runs) >= max_running or sum(runs) + blocks > budget:
                        self.assertEqual((refusal.status, refusal.code), (429, "overloaded"))
                    else:
                        self.assertIsNone(refusal)
                        runs.append(blocks)
                elif runs:
                    a.finish(runs.pop(rng.randrange(len(runs))))
                self.assertIsNone(a.check_invariants(), (seed, step))
                self.assertEqual((a.running, a.reserved_blocks), (len(runs), sum(runs)))
                self.assertEqual({k: a.requests(k) for k in held}, held)

    def test_blocks_cover_the_whole_context(self):
        a = Admission(4, 100, block_size=16)
        self.assertEqual(a.blocks_for(1, 15), 1)
        self.assertEqual(a.blocks_for(1, 16), 2)
        self.assertEqual(a.blocks_for(200, 56), 16)


if __name__ == "__main__":
    unittest.main()
