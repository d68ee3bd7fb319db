"""Per-request token state. Pure Python."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from runtime.sampling.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # a request is itself: `in` and `remove` on the queues compare identities
class Sequence:
    """One request.

    Invariants: ``num_computed`` tokens of ``prompt + output`` are in the target's KV (and the
    drafter's context); a request decodes when ``num_computed == len(tokens) - 1`` (the last committed
    token is the anchor, fed next step with ``draft_ids``); ``page_ids`` cover ``num_computed``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    page_ids: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    draft_confidence: list[float] | None = None  # the confidence head's c_k of each draft_ids entry
    # what its last verify with drafts did (runtime.spec.history.next_history): the confidence scheduler's
    # survival fit has a bias per class
    verify_history: int = 0  # HISTORY_NONE
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache (not computed)
    num_draft_tokens: int = 0  # drafts verified for this request (as counted in the engine's metrics)
    num_accepted_tokens: int = 0
    output_logprobs: list | None = None  # TokenLogprob per output token, when params.logprobs is set
    # params.prompt_logprobs: the prompt's tokens' TokenLogprob recorded so far ([None] first: nothing precedes the
    # first token), in prompt order; complete once the prompt is computed
    prompt_logprobs: list | None = None
    grammar: object | None = None  # params.structured_outputs: its xgrammar matcher (runtime.sampling.grammar), on the host
    bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (runtime.sampling.bad_words)
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full pages (chained)
    num_registered_pages: int = 0  # leading pages of page_ids registered in the prefix cache (or matched from it)
    follows: Sequence | None = None  # another sample of the same prompt: wait until it computed the prompt
    index: int = 0  # which of its prompt's n samples this is
    first_token_time: float | None = None  # time.monotonic() when its first output token was committed
    group: int | None = None  # pipelined drafting: the request group (0 or 1) whose steps serve it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed == self.num_tokens - 1

    def trim_drafts(self, n: int) -> None:
        """Keep the first ``n`` proposed drafts (and their confidences)."""
        if len(self.draft_ids) > n:
            self.draft_ids = self.draft_ids[:n]
            if self.draft_confidence is not None:
                self.draft_confidence = self.draft_confidence[:n]

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:] if start < prompt_len else []
        return head + self.output_token_ids[max(start - prompt_len, 0): end - prompt_len]

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
