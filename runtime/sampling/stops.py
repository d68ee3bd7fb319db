"""When a request ends: EOS, stop token ids, stop strings, ``max_tokens``, ``max_model_len``.

Checked token by token over what a step committed, so a stop inside an accepted block cuts
the block there: nothing after it is emitted or counted.
"""

from __future__ import annotations

from runtime.scheduling.sequence import Sequence

# Tokens of output decoded to look for a stop string, beyond the longest stop string's length.
STOP_WINDOW_SLACK = 8


class StopCriteria:
    def __init__(self, eos_token_ids: frozenset[int], tokenizer, max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def cut(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
        """For ``tokens`` about to be appended to ``seq`` (which has no stop strings): how many to keep and the
        finish reason after the last kept one (None to go on). The same answer as appending them one by one with
        ``check`` after each: the first stop token ends the output with "stop", unless ``max_tokens`` or
        ``max_model_len`` is reached before it ("length"; on the same token, "stop"); none before ``min_tokens``."""
        params = seq.params
        stops = self.eos_token_ids if not params.ignore_eos else frozenset()
        if params.stop_token_ids:
            stops = stops | frozenset(params.stop_token_ids)
        room = min(params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        if stops and not stops.isdisjoint(tokens):  # in C: the usual step holds no stop token
            early = max(params.min_tokens - len(seq.output_token_ids) - 1, 0)  # tokens that may not stop
            first = next((i for i, token in enumerate(tokens) if token in stops and i >= early), None)
            if first is not None and first < room:
                return first + 1, "stop"
        if room <= len(tokens):
            return max(room, 0), "length"
        return len(tokens), None

    def check(self, seq: Sequence) -> str | None:
        """The finish reason after ``seq``'s last appended token, or None to go on."""
        token = seq.output_token_ids[-1]
        params = seq.params
        stoppable = len(seq.output_token_ids) >= params.min_tokens  # (before, its stop tokens were never drawn)
        if stoppable and (token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)):
            return "stop"
        if stoppable and params.stop and self._stop_string_in_tail(seq):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stop_string_in_tail(self, seq: Sequence) -> bool:
        window = max(len(s) for s in seq.params.stop) + STOP_WINDOW_SLACK
        start = max(len(seq.output_token_ids) - window, 0)
        tail = self.tokenizer.decode(seq.output_token_ids[start:], skip_special_tokens=seq.params.skip_special_tokens)
        return first_stop(tail, seq.params.stop, self._held_chars(seq, start)) is not None

    def _held_chars(self, seq: Sequence, start: int) -> int:
        """Characters of the output's text from token ``start`` on that ``min_tokens`` holds: those of its first
        ``min_tokens - 1`` tokens (a stop string counts only where it ends past them, so once the output may stop,
        one that was complete before does not end it then)."""
        held = seq.params.min_tokens - 1
        if held <= start:
            return 0
        return len(self.tokenizer.decode(seq.output_token_ids[start:held],
                                         skip_special_tokens=seq.params.skip_special_tokens))

    def text(self, seq: Sequence) -> str:
        """The output text, cut before the earliest stop string (of those that end past ``min_tokens``' hold), or
        after it with ``include_stop_str_in_output``."""
        if self.tokenizer is None:
            return ""
        params = seq.params
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens)
        found = first_stop(text, params.stop, self._held_chars(seq, 0)) if params.stop else None
        if found is None:
            return text
        at, stop = found
        return text[:at + len(stop)] if params.include_stop_str_in_output else text[:at]


def first_stop(text: str, stops, held: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``stops`` in ``text`` that ends past its first ``held`` characters: (where
    it begins, which stop); None without one."""
    found = []
    for stop in stops:
        at = text.find(stop, max(held - len(stop) + 1, 0))
        if at >= 0:
            found.append((at, stop))
    return min(found) if found else None
