"""What a request returns."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.sampling.logprobs import TokenLogprob  # (what a token's logprobs are: the sampling package's type)


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """vLLM's ``CompletionOutput``: one sample of a prompt (``RequestOutput.outputs``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)  # not frozen: built per request every step, and a frozen __init__ costs 5x
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, prompt excluded; cut at the stop
    text: str  # detokenized token_ids (special tokens skipped), cut before a stop string; "" until finished
    finish_reason: str | None  # "stop", "length", "error" (see ``error``), or None while running
    new_token_ids: list[int]  # committed by the step that produced this output
    error: str | None = None  # why this request alone failed (finish_reason "error"); other requests go on
    # what kind of failure: "unsatisfiable_constraints" (its own constraints left no token: the client's error), or
    # None (the engine's)
    error_code: str | None = None
    num_draft_tokens: int = 0  # drafts of this request the target verified so far
    num_accepted_tokens: int = 0  # of those, the ones it accepted (each saved one target step)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when SamplingParams.logprobs is set
    index: int = 0  # which of its prompt's n samples this is (0 with n = 1)
    first_token_time: float | None = None  # time.monotonic() when the engine committed its first token
    # one per prompt token when SamplingParams.prompt_logprobs is set (the first None: nothing precedes it); with
    # output_kind "delta" only in the output that carries the first generated tokens
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission (vLLM's field)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: ``outputs[0].text`` and ``.token_ids`` are this sample's (each of a prompt's ``n`` samples
        is an output of its own here, ``index`` telling which)."""
        return [CompletionOutput(self.index, self.text, self.token_ids, self.finish_reason, self.logprobs)]
