"""What a request returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, prompt excluded; cut at the stop
    text: str  # detokenized token_ids (special tokens skipped), cut before a stop string; "" until finished
    finish_reason: str | None  # "stop", "length", or None while running
    new_token_ids: list[int]  # committed by the step that produced this output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
