"""Incremental text for streaming: what to send after each step, never taking back what was sent."""

from __future__ import annotations

from runtime.engine.outputs import RequestOutput

REPLACEMENT = "\ufffd"


class TextStream:
    """Sends the decoded output as it grows.

    While a request runs, a trailing partial character (U+FFFD) and the last ``len(longest stop) - 1``
    characters are held back, since they may still turn into a stop string that must not be emitted.
    The finished output's ``text`` (already cut before any stop string) is authoritative.

    Decoding is incremental (as vLLM detokenizes): each step decodes only the tokens since the last text it
    accepted plus the few before them (``prefix_offset``: context for a leading space or a multi-token
    character), so a stream costs O(new tokens) a step instead of decoding its whole output again.
    """

    def __init__(self, tokenizer, stop: str | list[str] | None, skip_special_tokens: bool = True):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # (SamplingParams': the finished text decodes alike)
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent = 0  # characters sent
        self.text = ""  # the running output's text decoded so far
        self.prefix_offset = 0  # tokens [prefix_offset, read_offset): context decoded again with the new ones
        self.read_offset = 0  # tokens whose text is in self.text
        self.ids: list[int] = []  # the output's tokens so far, from each output's new_token_ids (any output_kind)

    def delta(self, out: RequestOutput) -> str:
        """The text to send after ``out`` (each of the request's outputs in turn, none skipped)."""
        self.ids.extend(out.new_token_ids)
        if out.finished:
            text = out.text
        else:
            if self.tokenizer:
                self._advance(self.ids)
            text = self.text[:len(self.text) - self.holdback] if self.holdback else self.text
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new

    def _advance(self, ids: list[int]) -> None:
        """Append the text of ``ids[read_offset:]`` unless it ends in a partial character (then wait for more)."""
        if len(ids) <= self.read_offset:
            return
        known = self.tokenizer.decode(ids[self.prefix_offset:self.read_offset],
                                      skip_special_tokens=self.skip_special_tokens)
        grown = self.tokenizer.decode(ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(grown) > len(known) and not grown.endswith(REPLACEMENT):
            self.text += grown[len(known):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
