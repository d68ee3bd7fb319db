"""When a request ends: EOS, stop token ids, stop strings, ``max_tokens``, ``max_model_len``.

Checked token by token over what a step committed, so a stop inside an accepted block cuts
the block there: nothing after it is emitted or counted.
"""

from __future__ import annotations

from runtime.sequence import Sequence

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
        ``max_model_len`` is reached before it ("length"; on the same token, "stop")."""
        params = seq.params
        stops = self.eos_token_ids if not params.ignore_eos else frozenset()
        if params.stop_token_ids:
            stops = stops | frozenset(params.stop_token_ids)
        room = min(params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        if stops and not stops.isdisjoint(tokens):  # in C: the usual step holds no stop token
            first = next(i for i, token in enumerate(tokens) if token in stops)
            if first < room:
                return first + 1, "stop"
        if room <= len(tokens):
            return max(room, 0), "length"
        return len(tokens), None

    def check(self, seq: Sequence) -> str | None:
        """The finish reason after ``seq``'s last appended token, or None to go on."""
        token = seq.output_token_ids[-1]
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if params.stop and self._stop_string_in_tail(seq):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stop_string_in_tail(self, seq: Sequence) -> bool:
        window = max(len(s) for s in seq.params.stop) + STOP_WINDOW_SLACK
        tail = self.tokenizer.decode(seq.output_token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in seq.params.stop)

    def text(self, seq: Sequence) -> str:
        """The output text, cut before the earliest stop string."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return text[:min(cuts)] if cuts else text
