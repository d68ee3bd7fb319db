"""Incremental text for streaming: what to send after each step, never taking back what was sent."""

from __future__ import annotations

from runtime.outputs import RequestOutput

REPLACEMENT = "\ufffd"


class TextStream:
    """Sends the decoded output as it grows.

    While a request runs, a trailing partial character (U+FFFD) and the last ``len(longest stop) - 1``
    characters are held back, since they may still turn into a stop string that must not be emitted.
    The finished output's ``text`` (already cut before any stop string) is authoritative.
    """

    def __init__(self, tokenizer, stop: str | list[str] | None):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent = 0

    def delta(self, out: RequestOutput) -> str:
        if out.finished:
            text = out.text
        else:
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True) if self.tokenizer else ""
            text = text.rstrip(REPLACEMENT)
            text = text[:len(text) - self.holdback] if self.holdback else text
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new
