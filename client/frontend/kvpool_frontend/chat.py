"""Chat templates: how kvpool-frontend turns /v1/chat/completions messages into prompt tokens.

"kvpool" (the default with the byte tokenizer): BOS, then each message as

    <|{role}|>\n{content}\n

and finally "<|assistant|>\n", after which the model writes the reply. (The role markers are
plain text: with the byte tokenizer, bytes.)

"llama-2" (the default with a SentencePiece tokenizer), Llama 2 chat's format, BOS and EOS as
token ids:

    <s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST]

Roles: system (at most one, first), user, assistant; "developer" counts as system. Content is a
string or a list of {"type": "text", "text": ...} parts. Anything else is a TemplateError (400).
"""

from __future__ import annotations

from typing import Dict, List, Union

TEMPLATES = ("kvpool", "llama-2")

Piece = Union[str, int]  # text to encode, or a special token id


class TemplateError(ValueError):
    pass


def _content(message: Dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise TemplateError(
                    f"messages[{index}].content: only text parts ({{\"type\": \"text\", "
                    f"\"text\": ...}}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise TemplateError(f"messages[{index}].content must be a string or a list of text parts")


def normalize(messages) -> List[Dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TemplateError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise TemplateError(
                f"messages[{i}].role {role!r} is not supported (system, user, assistant)")
        if role == "system" and i != 0:
            raise TemplateError(f"messages[{i}]: a system message must come first")
        out.append({"role": role, "content": _content(m, i)})
    return out


def render(template: str, messages, bos_id, eos_id) -> List[Piece]:
    """The prompt as pieces (text and special ids), ending where the assistant's reply starts."""
    messages = normalize(messages)
    if template == "kvpool":
        pieces: List[Piece] = [bos_id] if bos_id is not None else []
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        pieces.append(text + "<|assistant|>\n")
        return pieces
    if template == "llama-2":
        return _llama2(messages, bos_id, eos_id)
    raise TemplateError(f"unknown chat template {template!r}")


def _llama2(messages, bos_id, eos_id) -> List[Piece]:
    system = None
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    pieces: List[Piece] = []
    expect = "user"
    for i, m in enumerate(messages):
        if m["role"] != expect:
            raise TemplateError("llama-2 chat: after the system message, user and assistant "
                                "messages must alternate, starting with user")
        if m["role"] == "user":
            text = m["content"]
            if system is not None and i == 0:
                text = f"<<SYS>>\n{system}\n<</SYS>>\n\n{text}"
            if bos_id is not None:
                pieces.append(bos_id)
            pieces.append(f"[INST] {text.strip()} [/INST]")
            expect = "assistant"
        else:
            pieces.append(f" {m['content'].strip()} ")
            if eos_id is not None:
                pieces.append(eos_id)
            expect = "user"
    if expect != "assistant":
        raise TemplateError("llama-2 chat: the last message must be the user's")
    return pieces


def encode(pieces: List[Piece], tokenizer) -> List[int]:
    ids: List[int] = []
    for p in pieces:
        if isinstance(p, int):
            ids.append(p)
        else:
            ids.extend(tokenizer.encode(p))
    return ids
