"""Tool-call parsers: how ``tool_choice: auto`` tells a model's tool calls from its text.

``hermes`` (the format of Hermes, Qwen2.5 and Qwen3 chat templates): each call is a JSON object ``{"name": ...,
"arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text before the first one is the answer's
content. Text whose blocks do not all parse as calls is content, as written (a model that began a call and was cut
at ``max_tokens`` answers in text). Streamed (``HermesStream``), the content is sent as it comes, held back only
where it could be the start of ``<tool_call>``, and the calls once the answer is complete.

``llama3_json`` (Llama 3.1 / 3.2 / 3.3 templates' JSON tool calling): an answer that is calls is JSON objects
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), one or more separated by ``;``, optionally after
``<|python_tag|>``; any other answer is content. Streamed (``Llama3JsonStream``), an answer that begins with ``{``
or the tag (after whitespace) is held to the end, any other is sent as it comes.
"""

from __future__ import annotations

import json
import re

PYTHON_TAG = "<|python_tag|>"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """An answer -> (its content, its calls as (function name, JSON arguments)); no calls: (the text, [])."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in BLOCK.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                or not isinstance(call.get("arguments", {}), dict):
            return text, []
        calls.append((call["name"], json.dumps(call.get("arguments", {}))))
    if not calls or text.rfind(CLOSE) < text.rfind(OPEN):  # an unclosed call: the text as written
        return text, []
    content = text[:start].strip()
    return content or None, calls


class HermesStream:
    """One streamed answer: ``feed`` each text delta -> the content to send now; ``finish`` -> (the content still
    held, the calls) once the answer is complete."""

    def __init__(self):
        self.text = ""  # everything fed
        self.sent = 0  # characters of it sent as content
        self.calling = False  # a <tool_call> began: the rest waits for the end

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.calling:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent:start], start
            return out
        held = _partial_suffix(self.text, OPEN)  # the end may be the start of "<tool_call>"
        out, self.sent = self.text[self.sent:len(self.text) - held], len(self.text) - held
        return out

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        """-> (the content not yet sent, the calls); an answer whose calls do not parse sends the rest as content."""
        content, calls = parse_hermes(self.text)
        if not calls:
            return self.text[self.sent:], []
        return "", calls  # (the content before the first call was sent as it came)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """An answer -> (its content, its calls as (function name, JSON arguments)); an answer that is not all calls:
    (the text, [])."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            call, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        arguments = call.get("parameters", call.get("arguments", {})) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return text, []
        calls.append((call["name"], json.dumps(arguments)))
        rest = body[end:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return text, []  # something after a call that is no call
        at = len(body) - len(rest)
    return None, calls


class Llama3JsonStream:
    """One streamed answer in ``llama3_json``'s format (``HermesStream``'s interface): content as it comes unless the
    answer begins as a call, then everything at the end."""

    def __init__(self):
        self.text = ""
        self.sent = 0
        self.calling: bool | None = None  # None until the first non-whitespace character says which

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.calling is None:
            head = self.text.lstrip()
            if not head or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]) and len(head) < len(PYTHON_TAG):
                return ""  # (whitespace, or what may still be the tag: wait)
            self.calling = head.startswith("{") or head.startswith(PYTHON_TAG)
        if self.calling:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        content, calls = parse_llama3_json(self.text)
        if not calls:
            return self.text[self.sent:], []
        return "", calls


# ServeArgs.tool_call_parser -> (the whole answer's parser, a streamed answer's)
PARSER_KINDS = {"hermes": (parse_hermes, HermesStream), "llama3_json": (parse_llama3_json, Llama3JsonStream)}
