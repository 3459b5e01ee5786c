"""kvpool-frontend processes over a real kvpoold, driven with real HTTP: the OpenAI endpoints,
streaming, cached-token accounting across two frontends, bad requests, a full pool, draining,
and clients that disconnect mid-stream."""

import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import unittest

import kvpool
from kvpool_testing import (Daemon, Frontend, http, run, stream, train_sentencepiece, wait_until,
                            write_checkpoint)

CONFIG = ("pool_bytes: 33554432 max_blocks_per_seq: 256\n"
          'tenant_quota_blocks { key: "tight" value: 8 }\n')


class FrontendTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(CONFIG)
        cls.a = Frontend(cls.daemon.dir, "--no_auth")
        cls.b = Frontend(cls.daemon.dir, "--no_auth")
        cls.admin = kvpool.Client.connect(cls.daemon.dir, client_name="test-admin")

    @classmethod
    def tearDownClass(cls):
        cls.admin.close()
        for f in (cls.a, cls.b):
            f.stop()
        cls.daemon.close()

    def complete(self, frontend, **body):
        body.setdefault("model", "tiny")
        body.setdefault("temperature", 0)  # greedy: the tests compare texts across calls
        return http(frontend.url + "/v1/completions", body)

    def idle(self):
        """Every request's sequence has been freed."""
        return wait_until(lambda: self.admin.get_stats().sequences == 0)

    def test_models_and_health(self):
        status, _, models = http(self.a.url + "/v1/models")
        self.assertEqual(status, 200)
        self.assertEqual([m["id"] for m in models["data"]], ["tiny"])
        self.assertEqual(models["data"][0]["max_model_len"], 4096)
        status, _, health = http(self.b.url + "/health")
        self.assertEqual((status, health["status"]), (200, "ok"))

    def test_completion_and_cached_tokens_across_frontends(self):
        prompt = ("Zebras: the pool is shared by all its frontends. " * 5)[:200]  # + BOS
        status, _, first = self.complete(self.a, prompt=prompt, max_tokens=8)
        self.assertEqual(status, 200, first)
        self.assertEqual(first["object"], "text_completion")
        self.assertEqual(first["choices"][0]["finish_reason"], "length")
        usage = first["usage"]
        self.assertEqual(usage["prompt_tokens"], 201)
        self.assertEqual(usage["completion_tokens"], 8)
        self.assertEqual(usage["total_tokens"], 209)
        self.assertLessEqual(usage["prompt_tokens_details"]["cached_tokens"], 1)  # at most BOS
        # The other frontend: the same greedy text, the prompt from the daemon's prefix cache
        # (all but its last token, whose logits give the first generated token: 200), reported
        # in whole blocks of 16.
        status, _, second = self.complete(self.b, prompt=prompt, max_tokens=8)
        self.assertEqual(second["choices"][0]["text"], first["choices"][0]["text"])
        self.assertEqual(second["usage"]["prompt_tokens_details"]["cached_tokens"], 192)
        # The next turn, through the first frontend again: the prompt and the reply are cached.
        turn2 = prompt + first["choices"][0]["text"] + " And the next question?"
        status, _, third = self.complete(self.a, prompt=turn2, max_tokens=4)
        self.assertEqual(status, 200, third)
        self.assertGreaterEqual(third["usage"]["prompt_tokens_details"]["cached_tokens"], 201 + 7)
        # Token-id prompts are taken as they are.
        status, _, ids = self.complete(self.b, prompt=[256, 300, 301, 302], max_tokens=2)
        self.assertEqual(ids["usage"]["prompt_tokens"], 4)
        self.assertTrue(self.idle())

    def test_streaming_sends_one_event_per_token(self):
        prompt = "Streams arrive one token at a time."
        _, _, whole = self.complete(self.a, prompt=prompt, max_tokens=12)
        status, events = stream(self.b.url + "/v1/completions", {
            "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}})
        self.assertEqual(status, 200)
        self.assertEqual(events[-1], "[DONE]")
        tokens = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"] is None]
        self.assertEqual(len(tokens), 12)
        final = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        self.assertEqual(final[0]["choices"][0]["finish_reason"], "length")
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        self.assertEqual(text, whole["choices"][0]["text"])
        usage = events[-2]["usage"]
        self.assertEqual(usage["completion_tokens"], 12)
        self.assertEqual(len({e["id"] for e in events[:-1]}), 1)
        # Chat: a role event first, then the content, the same as the non-streaming answer.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        status, _, answer = http(self.a.url + "/v1/chat/completions",
                                 {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6})
        self.assertEqual(status, 200, answer)
        self.assertEqual(answer["object"], "chat.completion")
        self.assertEqual(answer["choices"][0]["message"]["role"], "assistant")
        status, events = stream(self.b.url + "/v1/chat/completions", {
            "model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 6, "stream": True})
        self.assertEqual(events[0]["object"], "chat.completion.chunk")
        self.assertEqual(events[0]["choices"][0]["delta"]["role"], "assistant")
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        self.assertEqual(content, answer["choices"][0]["message"]["content"])
        self.assertTrue(self.idle())

    def test_stop_strings_end_the_text_before_them(self):
        prompt = "Stop here, please."
        _, _, whole = self.complete(self.a, prompt=prompt, max_tokens=10)
        text = whole["choices"][0]["text"]
        cut = text.index("|>", text.index("|>") + 2) + 2  # after the second token's text
        stop = text[cut:cut + 5]
        for frontend in (self.a, self.b):
            _, _, stopped = self.complete(frontend, prompt=prompt, max_tokens=10, stop=[stop, "zzz"])
            self.assertEqual(stopped["choices"][0]["text"], text[:cut])
            self.assertEqual(stopped["choices"][0]["finish_reason"], "stop")
        _, events = stream(self.a.url + "/v1/completions", {
            "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 10, "stop": stop, "stream": True})
        self.assertEqual("".join(e["choices"][0]["text"] for e in events[:-1]), text[:cut])
        self.assertEqual(events[-2]["choices"][0]["finish_reason"], "stop")

    def test_logprobs_come_from_the_daemons_top_k(self):
        _, _, out = self.complete(self.a, prompt="Which token next?", max_tokens=3, logprobs=2)
        lp = out["choices"][0]["logprobs"]
        self.assertEqual(len(lp["tokens"]), 3)
        self.assertEqual("".join(lp["tokens"]), out["choices"][0]["text"])
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
            self.assertEqual(len(top), 2)
            self.assertAlmostEqual(max(top.values()), chosen, places=5)
            self.assertLess(chosen, 0)
        status, _, chat = http(self.b.url + "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 3})
        content = chat["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(content), 2)
        self.assertEqual(len(content[0]["top_logprobs"]), 3)

    def test_sampling_follows_the_seed_across_frontends(self):
        body = dict(prompt="Sample this, please.", max_tokens=12, temperature=1.5, top_p=0.95,
                    seed=1234, logprobs=1)
        status, _, one = self.complete(self.a, **body)
        self.assertEqual(status, 200, one)
        _, _, two = self.complete(self.b, **body)
        self.assertEqual(two["choices"][0]["text"], one["choices"][0]["text"])
        lp = one["choices"][0]["logprobs"]
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
            self.assertLessEqual(chosen, max(top.values()) + 1e-6)  # the chosen, not the top one
        self.assertTrue(any(c < max(t.values()) - 1e-6
                            for c, t in zip(lp["token_logprobs"], lp["top_logprobs"])),
                        "a hot sample of 12 tokens that only ever chose the likeliest token")
        # Without a seed each request draws its own; OpenAI's default temperature is 1.
        texts = {self.complete(self.a, prompt="Sample this, please.", max_tokens=12,
                               temperature=None)[2]["choices"][0]["text"] for _ in range(3)}
        self.assertGreater(len(texts), 1)
        self.assertTrue(self.idle())

    def test_bad_requests_get_400_and_change_nothing(self):
        before = self.admin.get_stats()
        url = self.a.url
        cases = [
            ("/v1/completions", None, b"{not json", 400, None),
            ("/v1/completions", {"prompt": "x"}, None, 400, "model"),
            ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, None, 404, "model"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 2.5}, None, 400, "temperature"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2}, None, 400, "n"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, None, 400, "top_p"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "frobnicate": 1}, None, 400, "frobnicate"),
            ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, None, 400, "prompt"),
            ("/v1/completions", {"model": "tiny", "prompt": ""}, None, 400, "prompt"),
            ("/v1/completions", {"model": "tiny", "prompt": [1, 8192]}, None, 400, "prompt"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5000}, None, 400, "max_tokens"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, None, 400, "logprobs"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["a"] * 5}, None, 400, "stop"),
            ("/v1/completions", {"model": "tiny", "prompt": "x", "stream_options": {}}, None, 400, "stream_options"),
            ("/v1/chat/completions", {"model": "tiny", "messages": []}, None, 400, "messages"),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, None, 400, "messages"),
            ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400, "messages"),
        ]
        for path, body, raw, want, param in cases:
            status, _, err = http(url + path, body, raw=raw)
            self.assertEqual(status, want, (body, err))
            self.assertIn("message", err["error"])
            self.assertEqual(err["error"]["param"], param, body)
        status, _, err = http(url + "/v1/nothing")
        self.assertEqual(status, 404)
        self.assertIn("error", err)
        after = self.admin.get_stats()
        for field in ("sequences", "prefill_calls", "decode_tokens", "active_blocks"):
            self.assertEqual(getattr(after, field), getattr(before, field), field)

    def test_exhausted_pool_is_429_with_the_shortfall(self):
        with Frontend(self.daemon.dir, "--no_auth", "--tenant=tight") as tight:
            status, headers, err = http(tight.url + "/v1/completions",
                                        {"model": "tiny", "prompt": "y" * 300, "max_tokens": 2})
            self.assertEqual(status, 429, err)
            self.assertEqual(headers["Retry-After"], "1")
            self.assertEqual(err["error"]["code"], "resource_exhausted")
            self.assertIn("short by", err["error"]["message"])
            status, _, ok = http(tight.url + "/v1/completions",
                                 {"model": "tiny", "prompt": "y" * 50, "max_tokens": 2})
            self.assertEqual(status, 200, ok)
        self.assertTrue(self.idle())

    def test_a_client_that_disconnects_mid_stream_frees_its_sequence(self):
        body = json.dumps({"model": "tiny", "prompt": "Talk for a long time.", "max_tokens": 3000,
                           "stream": True}).encode()
        for frontend in (self.a, self.b):
            s = socket.create_connection(("127.0.0.1", frontend.port), timeout=30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            received = b""
            while received.count(b"data: ") < 3:
                received += s.recv(4096)
            self.assertEqual(self.admin.get_stats().sequences, 1)
            s.close()
            self.assertTrue(self.idle(), "the abandoned sequence was not freed")
            decoded = self.admin.get_stats().decode_tokens
            self.assertLess(decoded, 3000)
            status, _, health = http(frontend.url + "/health")
            self.assertEqual(status, 200)
        self.assertTrue(self.admin.check_invariants().ok)

    def test_concurrent_streams_of_one_frontend_decode_together(self):
        import concurrent.futures

        prompts = [f"Stream number {i} of four, decoding side by side." for i in range(4)]
        alone = [self.complete(self.b, prompt=p, max_tokens=40)[2]["choices"][0]["text"]
                 for p in prompts]
        before = http(self.a.url + "/health")[2]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(
                lambda p: self.complete(self.a, prompt=p, max_tokens=40)[2], prompts))
        self.assertEqual([t["choices"][0]["text"] for t in together], alone)
        after = http(self.a.url + "/health")[2]
        calls = after["decode_calls"] - before["decode_calls"]
        sequences = after["decode_sequences"] - before["decode_sequences"]
        self.assertEqual(sequences, 4 * 39)  # the first token of each comes from its Prefill
        self.assertLess(calls, sequences)  # streams shared Decode calls

    def test_http_loadgen_reports_latencies_and_cached_tokens(self):
        rc, out = run([sys.executable, "-m", "kvpool_frontend.loadgen", "--url", self.a.url,
                       "--url", self.b.url, "--concurrency", "2", "--requests", "6",
                       "--shared_prefix", "300", "--prompt", "20", "--max_tokens", "5", "--json"])
        self.assertEqual(rc, 0, out)
        summary = json.loads(out)
        self.assertEqual(summary["completed"], 6)
        self.assertEqual(summary["tokens"], 30)
        self.assertGreater(summary["ttft_p50_ms"], 0)
        self.assertGreater(summary["itl_p50_ms"], 0)
        # Every prompt after the first few shares the 300-byte prefix with an earlier one.
        self.assertGreater(summary["cached_fraction"], 0.5)


class DrainTest(unittest.TestCase):
    def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones(self):
        with Daemon(CONFIG) as daemon, kvpool.Client.connect(daemon.dir) as admin:
            frontend = Frontend(daemon.dir, "--no_auth", "--drain_timeout=30")
            body = json.dumps({"model": "tiny", "prompt": "Finish this.", "max_tokens": 60,
                               "stream": True}).encode()
            s = socket.create_connection(("127.0.0.1", frontend.port), timeout=60)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            received = s.recv(4096)
            frontend.process.send_signal(signal.SIGTERM)
            self.assertTrue(wait_until(lambda: http(frontend.url + "/health")[0] == 503))
            status, _, err = http(frontend.url + "/v1/completions",
                                  {"model": "tiny", "prompt": "late", "max_tokens": 1})
            self.assertEqual(status, 503)
            self.assertEqual(err["error"]["code"], "draining")
            while chunk := s.recv(65536):
                received += chunk
            s.close()
            self.assertIn(b'"finish_reason":"length"', received)
            self.assertIn(b"data: [DONE]", received)
            self.assertEqual(frontend.process.wait(timeout=30), 0)
            frontend.process.stdout.close()
            self.assertTrue(wait_until(lambda: admin.get_stats().sessions_detached >= 2))
            stats = admin.get_stats()
            self.assertEqual((stats.sequences, stats.sessions_reclaimed), (0, 0))

    def test_daemon_drain_is_503_and_a_killed_frontend_is_reclaimed(self):
        with Daemon(CONFIG) as daemon, kvpool.Client.connect(daemon.dir) as admin:
            frontend = Frontend(daemon.dir, "--no_auth")
            status, _, _ = http(frontend.url + "/v1/completions",
                                {"model": "tiny", "prompt": "before", "max_tokens": 1})
            self.assertEqual(status, 200)
            admin.drain()
            status, _, err = http(frontend.url + "/v1/completions",
                                  {"model": "tiny", "prompt": "after", "max_tokens": 1})
            self.assertEqual(status, 503, err)
            self.assertEqual(err["error"]["type"], "service_unavailable")
            frontend.process.kill()
            frontend.process.wait()
            frontend.process.stdout.close()
            self.assertTrue(wait_until(lambda: admin.get_stats().sessions_reclaimed == 1))


    def test_a_restarted_daemon_is_attached_to_again(self):
        directory = tempfile.mkdtemp(prefix="kvpool-pytest-")
        self.addCleanup(shutil.rmtree, directory, True)
        daemon = Daemon(CONFIG, directory)
        with Frontend(directory, "--no_auth") as frontend:
            request = {"model": "tiny", "prompt": "again", "max_tokens": 2}
            self.assertEqual(http(frontend.url + "/v1/completions", request)[0], 200)
            daemon.close()
            status, _, err = http(frontend.url + "/v1/completions", request)
            self.assertEqual(status, 503, err)
            self.assertEqual(http(frontend.url + "/health")[0], 503)
            daemon = Daemon(CONFIG, directory)  # a new daemon, a new epoch: the old token is void
            status, _, out = http(frontend.url + "/v1/completions", request)
            self.assertEqual(status, 200, out)
            self.assertEqual(http(frontend.url + "/health")[0], 200)
        daemon.close()


class CheckpointFrontendTest(unittest.TestCase):
    """A Hugging Face checkpoint with its SentencePiece tokenizer: the frontend finds the
    tokenizer beside the daemon's checkpoint and renders chats with the llama-2 template."""

    def test_sentencepiece_checkpoint_end_to_end(self):
        import sentencepiece

        directory = tempfile.mkdtemp(prefix="kvpool-checkpoint-")
        self.addCleanup(shutil.rmtree, directory, True)
        sp = sentencepiece.SentencePieceProcessor(model_file=train_sentencepiece(directory, 400))
        write_checkpoint(directory, vocab_size=512)
        with Daemon(f'pool_bytes: 16777216 model {{ checkpoint: "{directory}" }}') as daemon, \
                Frontend(daemon.dir, "--no_auth") as frontend:
            name = os.path.basename(directory)
            self.assertEqual(http(frontend.url + "/v1/models")[2]["data"][0]["id"], name)
            prompt = "the pool keeps every block"
            status, _, out = http(frontend.url + "/v1/completions",
                                  {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": 6})
            self.assertEqual(status, 200, out)
            self.assertEqual(out["usage"]["prompt_tokens"], 1 + len(sp.encode(prompt)))
            self.assertIn(out["usage"]["completion_tokens"], range(1, 7))
            _, events = stream(frontend.url + "/v1/completions",
                               {"model": name, "prompt": prompt, "temperature": 0, "max_tokens": 6, "stream": True})
            self.assertEqual("".join(e["choices"][0]["text"] for e in events[:-1]),
                             out["choices"][0]["text"])
            messages = [{"role": "system", "content": "brief"},
                        {"role": "user", "content": "a frontend streams tokens"}]
            status, _, chat = http(frontend.url + "/v1/chat/completions",
                                   {"model": name, "messages": messages, "max_tokens": 4})
            self.assertEqual(status, 200, chat)
            rendered = "[INST] <<SYS>>\nbrief\n<</SYS>>\n\na frontend streams tokens [/INST]"
            self.assertEqual(chat["usage"]["prompt_tokens"], 1 + len(sp.encode(rendered)))


if __name__ == "__main__":
    unittest.main()
