"""Tokenizers of kvpool-frontend, and incremental detokenization for streaming.

ByteTokenizer (synthetic models, e.g. the daemon's default "tiny" with vocab 8192): a documented
byte-level scheme that needs no file.

    ids 0..255        the UTF-8 bytes of the text
    id 256            <s>   (BOS, prepended to every prompt)
    id 257            </s>  (EOS: generating it ends the completion with finish_reason "stop")
    ids 258..vocab-1  no text of their own: they read and write as the literal "<|N|>"

Encoding turns every "<|N|>" with 258 <= N < vocab back into token N and everything else into
bytes, so a completion's text, sent back as part of the next prompt, is the same tokens again
(and the daemon's prefix cache matches it). BOS/EOS never come out as text.

SentencePieceTokenizer: a checkpoint's tokenizer.model through python3-sentencepiece (BOS and
EOS are the model's own).

Both decode a whole id list to text with errors replaced; Detokenizer turns a growing list of
ids into text deltas without ever emitting a half character.
"""

from __future__ import annotations

import os
import re
from typing import Callable, List, Optional

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_FIRST_OPAQUE = 258
_OPAQUE = re.compile(r"<\|(\d{1,9})\|>")


class TokenizerError(ValueError):
    """A text or an id the tokenizer cannot handle (a 400 for the caller)."""


class ByteTokenizer:
    name = "bytes"

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_FIRST_OPAQUE:
            raise TokenizerError(
                f"the byte tokenizer needs a vocabulary of at least {BYTE_FIRST_OPAQUE} tokens "
                f"(the model has {vocab_size})")
        self.vocab_size = vocab_size
        self.bos_id: Optional[int] = BYTE_BOS
        self.eos_id: Optional[int] = BYTE_EOS

    def encode(self, text: str) -> List[int]:
        """The ids of `text`, without BOS."""
        out: List[int] = []
        last = 0
        for m in _OPAQUE.finditer(text):
            n = int(m.group(1))
            if BYTE_FIRST_OPAQUE <= n < self.vocab_size:
                out.extend(text[last:m.start()].encode("utf-8"))
                out.append(n)
                last = m.end()
        out.extend(text[last:].encode("utf-8"))
        return out

    def token_bytes(self, token: int) -> bytes:
        self.check(token)
        if token < 256:
            return bytes([token])
        if token < BYTE_FIRST_OPAQUE:
            return b""
        return f"<|{token}|>".encode()

    def decode(self, ids: List[int]) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def check(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise TokenizerError(f"token {token} outside the vocabulary [0, {self.vocab_size})")


class SentencePieceTokenizer:
    name = "sentencepiece"

    def __init__(self, path: str, model_vocab_size: int = 0):
        try:
            import sentencepiece
        except ImportError as e:
            raise TokenizerError(
                "a SentencePiece tokenizer needs python3-sentencepiece (deploy/install-deps.sh)"
            ) from e
        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()
        # Models pad their vocabulary past the tokenizer's (to a multiple of 64 or 128): ids in
        # the padding are valid model tokens with no text. A sampled step can choose one.
        self.model_vocab_size = max(model_vocab_size, self.vocab_size)
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def token_bytes(self, token: int) -> bytes:
        self.check(token)
        if token >= self.vocab_size or self._sp.is_control(token):
            return b""
        if self._sp.is_byte(token):  # "<0xAB>" byte fallback
            return bytes([int(self._sp.id_to_piece(token)[3:5], 16)])
        return self._sp.id_to_piece(token).replace("\u2581", " ").encode("utf-8")

    def decode(self, ids: List[int]) -> str:
        for t in ids:
            self.check(t)
        return self._sp.decode([t for t in ids if t < self.vocab_size])

    def check(self, token: int) -> None:
        if not 0 <= token < self.model_vocab_size:
            raise TokenizerError(
                f"token {token} outside the vocabulary [0, {self.model_vocab_size})")


def load(spec: str, model_name: str, vocab_size: int):
    """The tokenizer named by `spec`: "bytes"; a tokenizer.model file or a directory holding one;
    or "auto" (default): the checkpoint directory's tokenizer.model when the daemon's model is a
    checkpoint that has one, else the byte tokenizer. Raises TokenizerError."""
    if spec == "bytes":
        return ByteTokenizer(vocab_size)
    if spec == "auto":
        candidate = os.path.join(model_name, "tokenizer.model") if os.path.isabs(model_name) else ""
        if candidate and os.path.isfile(candidate):
            spec = candidate
        else:
            return ByteTokenizer(vocab_size)
    path = os.path.join(spec, "tokenizer.model") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise TokenizerError(f"no tokenizer at {path}")
    tokenizer = SentencePieceTokenizer(path, vocab_size)
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(
            f"{path} has {tokenizer.vocab_size} tokens but the model's vocabulary is {vocab_size}")
    return tokenizer


class Detokenizer:
    """Text deltas of a growing token list. `context` (the prompt's tail) makes the first tokens
    decode as they would in place (SentencePiece's leading spaces); a delta that would end in a
    replacement character (half of a UTF-8 sequence) waits for the next token."""

    def __init__(self, decode: Callable[[List[int]], str], context: List[int]):
        self._decode = decode
        self._ids = list(context[-4:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token: int) -> str:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            delta = text[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """What is still held back (a trailing half character, as a replacement character)."""
        before = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(before):]
