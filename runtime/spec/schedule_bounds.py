"""What any verify schedule could gain over whole blocks, priced on a step-time table.

Given the acceptance per position of whole blocks (``acceptance[q]``: the share of requests whose draft ``q`` was
accepted when every draft was verified; these are the true survivals, since a draft's acceptance depends only on its
prefix) and the step-time table the engine schedules by (``StepCostTable``), two bounds per batch size:

- ``padded_best``: the best single cap Q for every request (what graphs padded to one length a step allow):
  ``1 + sum(acceptance[:Q])`` committed tokens a request over the table's step of ``batch x (Q + 1)`` tokens,
  against whole blocks. A schedule that varies Q from step to step beats it a little (steps differ), no more.
- ``oracle_ragged``: a schedule that knew which drafts each request will accept and fed exactly those (``tau``
  tokens a request for ``tau`` committed), against whole blocks. No scheduler reaches it; one that ranks drafts by
  confidence (per request, ragged) recovers the part its confidences tell apart.

Both are computed, not measured: a table's cells are noisy, so read them to a few percent. The goal's target
(1.10x the tuned schedule at 64 requests and above) is out of every schedule's reach where ``oracle_ragged`` is
below it (a pair whose requests accept alike, or a step whose cost barely grows with its tokens).
"""

from __future__ import annotations

from runtime.spec.step_costs import StepCostTable


def schedule_bounds(batch: int, acceptance: list[float], table: StepCostTable) -> dict:
    """``batch`` requests drafting ``len(acceptance)`` tokens each -> the bounds above, with ``tau`` and the table's
    whole-block and oracle step times."""
    k = len(acceptance)
    if batch < 1 or k < 1:
        raise ValueError(f"schedule_bounds: a batch >= 1 and at least one position expected, got {batch}, {k}")
    tau = 1.0 + sum(acceptance)
    whole_ms = table.predict_ms(batch, batch * (k + 1))
    whole = tau / whole_ms  # committed tokens per request per ms
    caps = [(1.0 + sum(acceptance[:q])) / table.predict_ms(batch, batch * (q + 1)) for q in range(k + 1)]
    best = max(range(k + 1), key=caps.__getitem__)
    oracle_ms = table.predict_ms(batch, round(batch * tau))
    return {"concurrency": batch, "tau": tau, "whole_block_step_ms": whole_ms, "padded_best_cap": best,
            "padded_best": caps[best] / whole, "oracle_ragged_step_ms": oracle_ms, "oracle_ragged": whole_ms / oracle_ms}
