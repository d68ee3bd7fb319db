"""The plain-data seam between the scheduler and the model runner (lists and ints, no tensors).

What crosses a process boundary (a Ray actor call in the cluster layer) is exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.sampling.logprobs import TokenLogprob
from runtime.sampling.sampling_params import SamplingParams


@dataclass(slots=True)  # not frozen: built per request every step, and a frozen __init__ costs 5x
class ScheduledRequest:
    """One request's share of a step.

    Invariant: ``token_ids`` occupy positions ``start_position ..`` and ``page_ids`` cover them.
    A decoding request feeds ``[anchor, d_1 .. d_k]`` (``num_drafts = k``); a prefill feeds a chunk of
    committed tokens (``num_drafts = 0``). ``sample`` is set when the step must commit tokens:
    every decode, and the prefill chunk that reaches the last committed token.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    page_ids: list[int]
    num_drafts: int
    sample: bool
    params: SamplingParams
    seed: int
    # (prompt ids, output ids) before this step, only for requests that use penalties
    penalty_history: tuple[list[int], list[int]] | None = None
    # a prefill chunk of a request that asked for prompt_logprobs: (r, the prompt tokens its rows r, r+1, ..
    # predict), the rows whose prompt logprobs are not yet recorded (a row predicts the prompt's next token)
    prompt_rows: tuple[int, list[int]] | None = None
    # SamplingParams.min_tokens not reached: (n, ids) -> the first n rows that commit tokens may not draw these
    # (the stop tokens: their logits are -inf)
    banned: tuple[int, tuple[int, ...]] | None = None
    # SamplingParams.structured_outputs: [rows, ceil(V / 32)] int32, the tokens its grammar allows at each row that
    # commits a token (runtime.sampling.grammar.row_masks; numpy, on the host)
    token_mask: object | None = None
    # SamplingParams.bad_words: per row that commits a token, the tokens that would complete a bad word there
    # (runtime.sampling.bad_words.row_bans; None: none this step)
    row_bans: tuple[tuple[int, ...], ...] | None = None

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.token_ids)

    @property
    def feeds_prompt(self) -> bool:
        """A prompt chunk (a prefill), not a decode or a verify (a last chunk of one token reads as a decode)."""
        return self.num_drafts == 0 and (len(self.token_ids) > 1 or not self.sample)


@dataclass(frozen=True, slots=True)
class PackedPlan:
    """A packed verify step (``runtime.worker.packed_verify``, confidence scheduling's packed layout): how many drafts it
    verifies over its requests, and what the device ranks them by. Every request of the step feeds a greedy block
    of up to K drafts (shorter where the scheduler drafted less, ``ConfidenceScheduler.packed_draft_len``, or cut at
    its token limit); the step is laid out as a grid of the longest, shorter blocks padded with drafts that propose
    nothing (confidence 0)."""

    budget: int  # drafts verified over the step (the scheduler's columns x requests)
    columns: int  # the scheduler's columns (a packed graph of them feeds its batch bucket x (columns + 1) rows)
    confidences: list[list[float]]  # [S][K'] each request's drafts' confidences, in batch order, 0-padded (K' <= K)
    slope: list[float]  # [K] the survival fit's slope of each position (runtime.spec.confidence)
    bias: list[list[float]]  # [H][K] and its bias, per verify-history class and position
    history: list[int]  # [S] each request's verify-history class (runtime.spec.history.next_history)


@dataclass(frozen=True, slots=True)
class PackedAhead:
    """The next step is expected to be a packed verify (``PackedPlan``) of these columns, ranked under this
    survival fit: the worker plans its attention while the drafter drafts, and may launch it ahead
    with the confidences just drafted (on the device), each request's history class updated on the device from this
    step's verification (``next_history``'s rule)."""

    columns: int
    slope: list[float]  # [K]
    bias: list[list[float]]  # [H][K]
    history: list[int]  # [S] each request's class before this step's verification, in this step's order


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    requests: list[ScheduledRequest]
    num_next_drafts: int  # block length drafted after this step for every sampled request (0: none)
    maintain_draft_context: bool  # False once speculation is off for good: the drafter is idle
    released_request_ids: list[str] = field(default_factory=list)  # the runner drops their state
    scrub_page_ids: list[int] = field(default_factory=list)  # zeroed in every cache before the step (faulted pages)
    # the engine expects the next step to be these requests decoding one token more (plain greedy decoding, nothing
    # waiting, none at its token limit), or with a drafter each verifying ``next_verify_len`` drafts of the block
    # drafted now: the worker may launch it before this one is read back
    run_ahead: bool = False
    # with a drafter: the drafts a decoding request verifies next step (the block drafted now, or confidence
    # scheduling's cap for it; 0: unknown): the worker plans that step's attention while the drafter drafts
    next_verify_len: int = 0
    packed: PackedPlan | None = None  # a packed verify step: each request verifies the drafts the device picks
    # the next step is expected to be a packed verify of full blocks of next_verify_len drafts (its plan, its launch)
    next_packed: PackedAhead | None = None
    # pipelined drafting (a separate drafter): this step serves one request group, and its requests' next blocks are
    # drafted during the next step (beside the other group's verify); False: drafted in this step
    pipelined: bool = False


@dataclass(slots=True)  # not frozen: built per request every step, and a frozen __init__ costs 5x
class RequestStepResult:
    request_id: str
    token_ids: list[int]  # committed this step: accepted drafts, then one target token
    num_accepted: int  # accepted drafts among token_ids
    next_draft_ids: list[int]  # the block proposed for the next step (after confidence truncation)
    error: str | None = None  # a fault of this request alone (non-finite logits in its rows): it fails, others go on
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them
    next_draft_confidence: list[float] | None = None  # the confidence head's c_k of each next_draft_ids entry
    # a packed verify step: the drafts of its block the device chose to verify, at most those fed (else all fed)
    num_verified: int | None = None
    # the prompt logprobs of the entry's prompt_rows, one per target token (when it had them)
    prompt_logprobs: list[TokenLogprob] | None = None
