"""What confidence scheduling decided for one step, and what it predicted that to give (its metrics read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Decision:
    """One step's verify budget and what it was predicted to give (for metrics)."""

    budget: int  # drafts verified over the batch
    offered: int  # drafts proposed over the batch
    expected_tokens: float  # committed tokens the survivals predict for the step
    predicted_ms: float  # the step time the table predicts
    whole_expected_tokens: float  # the same two, had the step verified whole blocks (what the choice was against)
    whole_predicted_ms: float
    # [K'] each position's corrected survival summed over the step's requests (0 where nothing was proposed): what
    # the scheduler believed of every draft, verified or not (a whole-block engine's acceptance per position is
    # what it should be)
    position_survival: list[float]
    # the drafting judgement's plain alternative: the ms it priced a plain step of the same requests at (a
    # token each, nothing drafted), and whether drafting paid against it (None: no plain steps profiled)
    plain_ms: float | None = None
    drafting_pays: bool | None = None
    # whether this decision raised the next one's budget to whole blocks to gather evidence (``_explores``)
    explores: bool = False
