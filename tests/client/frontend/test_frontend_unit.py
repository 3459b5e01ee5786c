"""kvpool-frontend's pieces alone: the byte and SentencePiece tokenizers and streaming
detokenization, the chat templates, the OpenAI request mapping, and stop strings."""

import asyncio
import os
import shutil
import tempfile
import unittest

import kvpool

from kvpool_frontend import chat, protocol, tokenizer
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

    def test_refusals_name_the_field(self):
        cases = [
            ({"model": "m", "prompt": "x", "temperature": 1.0}, "temperature"),
            ({"model": "m", "prompt": "x", "top_k": 40}, "top_k"),
            ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
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

    async def decode(self, items, top_k=0):
        from kvpool._proto import kvpool_pb2

        items = list(items)
        self.batches.append([s for s, _ in items])
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
                    token, _ = await batcher.submit(client, seq, token, 0)
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
            self.assertEqual(results[0], (11, ()))
            self.assertIsInstance(results[1], kvpool.KvPoolError)
            self.assertEqual(results[1].code, kvpool.StatusCode.RESOURCE_EXHAUSTED)
            self.assertEqual(results[2], (31, ()))
            self.assertEqual(client.batches[0], [1, 2, 3])
            self.assertEqual(sorted(client.batches[1:]), [[1], [2], [3]])

        asyncio.run(scenario())


if __name__ == "__main__":
    unittest.main()
