"""What confidence scheduling decided and measured, step by step and in sums (``get_metrics``, the bench's trace)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.spec.confidence import ConfidenceScheduler
from runtime.spec.decision import Decision
from runtime.spec.tuning import TUNING

# one step of the trace: its number (ConfidenceStats.steps once it was counted), the requests it scheduled, whether
# a drafting hold kept it from drafting a next block (a decided step too, where the hold begins), whether it ran
# serially (not launched ahead by an engine that runs ahead), its measured ms; then, for a step the scheduler decided
# (else None): the drafts it verified and the drafts proposed over the batch, the committed tokens expected and got,
# the predicted ms of the step and of whole blocks, the plain step drafting was judged against and the verdict, and
# whether the decision made the next step verify whole blocks; then, for every step, its prompt chunks' tokens; last,
# for a decided step, the drafts its deciding requests verified (the budget as the step spent it: a packed step's
# device choice, a step that could not be packed every draft fed)
TRACE_FIELDS = ("step", "requests", "held", "serial", "ms", "budget", "offered", "expected_tokens",
                "committed_tokens", "predicted_ms", "whole_predicted_ms", "plain_ms", "drafting_pays", "explores",
                "prompt_tokens", "verified")


@dataclass
class ConfidenceStats:
    """What the scheduler chose and how its predictions held (engine metrics), and step by step (``trace``)."""

    decisions: int = 0
    budget: int = 0  # drafts verified, summed over decisions
    offered: int = 0  # drafts proposed, summed
    requests: int = 0  # requests with drafts, summed
    expected_tokens: float = 0.0
    predicted_ms: float = 0.0  # summed over decisions
    whole_expected_tokens: float = 0.0  # the same two for whole blocks, summed over decisions
    whole_predicted_ms: float = 0.0
    position_survival: list[float] = field(default_factory=list)  # [K] summed over decisions' requests
    measured_ms: float = 0.0  # summed over every step timed (ramps, prefill-only steps included)
    steps: int = 0
    decided_ms: float = 0.0  # summed over the steps a decision was made for: what predicted_ms predicted
    decided_steps: int = 0
    judged: int = 0  # decisions that judged drafting against plain decoding (Decision.plain_ms)
    judged_plain_ms: float = 0.0  # the plain alternative's predicted ms, summed over them
    judged_paid: int = 0  # of them, those where drafting paid
    committed_tokens: int = 0  # tokens the verifying requests committed (accepted drafts + one each), summed
    unpacked_steps: int = 0  # packed layout: decided steps that verified whole blocks instead (runtime.engine.core)
    drafting_off_steps: int = 0  # steps that drafted nothing because drafting did not pay (DraftingHold)
    serial_steps: int = 0  # timed steps an engine that runs ahead did not launch ahead (priced with the excess)
    last: dict = field(default_factory=dict)
    # the newest TUNING.trace_steps steps, one tuple of TRACE_FIELDS each (``record_step``): what the means above average
    # over, so a run's figures can be taken apart step by step (``trace_since``); a snapshot made with
    # ``dataclasses.replace`` starts an empty one (its counters are what a snapshot compares)
    trace: deque = field(default_factory=lambda: deque(maxlen=TUNING.trace_steps), init=False, repr=False)

    def record_decision(self, decision: Decision, requests: int) -> None:
        self.decisions += 1
        self.budget += decision.budget
        self.offered += decision.offered
        self.requests += requests
        self.expected_tokens += decision.expected_tokens
        self.predicted_ms += decision.predicted_ms
        self.whole_expected_tokens += decision.whole_expected_tokens
        self.whole_predicted_ms += decision.whole_predicted_ms
        grow = len(decision.position_survival) - len(self.position_survival)
        if grow > 0:
            self.position_survival.extend([0.0] * grow)
        for j, value in enumerate(decision.position_survival):
            self.position_survival[j] += value
        if decision.plain_ms is not None:
            self.judged += 1
            self.judged_plain_ms += decision.plain_ms
            self.judged_paid += bool(decision.drafting_pays)
        self.last = {"verify_budget": decision.budget, "offered": decision.offered, "requests": requests,
                     "predicted_step_ms": decision.predicted_ms, "expected_tokens": decision.expected_tokens,
                     "plain_step_ms": decision.plain_ms, "drafting_pays": decision.drafting_pays}

    def record_outcome(self, committed: int, verified: int | None = None) -> None:
        """The last decision's step committed ``committed`` tokens over its deciding requests, which verified
        ``verified`` drafts (None: not known)."""
        self.committed_tokens += committed
        if self.last:
            self.last["committed_tokens"] = committed
            self.last["verified_drafts"] = verified

    def record_step(self, ms: float, decided: bool = True, serial: bool = False, requests: int = 0,
                    held: bool = False, committed: int | None = None, decision: Decision | None = None,
                    prompt_tokens: int = 0, verified: int | None = None) -> None:
        """A timed step; ``decided``: the scheduler chose its verify budget (its prediction is comparable);
        ``serial``: not launched ahead by an engine that runs ahead. For the trace: the ``requests`` it scheduled,
        whether a drafting hold kept it from drafting (``held``), for a decided step the tokens its deciding
        requests ``committed``, the ``decision`` (``ConfidenceScheduler.last``) that chose its verifies and the
        drafts they ``verified``, and the prompt chunks' tokens it fed beside its decodes and verifies
        (``prompt_tokens``: a mixed step's)."""
        self.steps += 1
        self.serial_steps += serial
        self.measured_ms += ms
        if decided:
            self.decided_steps += 1
            self.decided_ms += ms
            if self.last:
                self.last["measured_step_ms"] = ms
        chosen = decision if decided else None
        self.trace.append((self.steps, requests, held, serial, round(ms, 4)) + (
            (chosen.budget, chosen.offered, round(chosen.expected_tokens, 3), committed,
             round(chosen.predicted_ms, 4), round(chosen.whole_predicted_ms, 4),
             None if chosen.plain_ms is None else round(chosen.plain_ms, 4), chosen.drafting_pays, chosen.explores)
            if chosen is not None else (None,) * 9) + (prompt_tokens, verified if chosen is not None else None))

    def trace_since(self, step: int = 0, until: int | None = None) -> dict:
        """The trace's steps numbered above ``step`` and up to ``until`` (``steps`` counts read before and after a
        run; those the trace still holds) -> {"fields": TRACE_FIELDS, "steps": [[...], ...]}, a step a list in the
        fields' order, and ``summary`` (``trace_summary``)."""
        rows = [list(row) for row in self.trace if row[0] > step and (until is None or row[0] <= until)]
        return {"fields": list(TRACE_FIELDS), "steps": rows, "summary": trace_summary(rows)}

    def as_dict(self, scheduler: ConfidenceScheduler) -> dict:
        per = max(self.requests, 1)
        scheduler.correction.fold()  # the evidence gathered since the last fold, so the figures shown are current
        return {"decisions": self.decisions, "mean_verify_budget_per_request": self.budget / per,
                "mean_offered_per_request": self.offered / per,
                "mean_expected_tokens_per_request": self.expected_tokens / per,
                "mean_committed_tokens_per_request": self.committed_tokens / per,
                "mean_predicted_step_ms": self.predicted_ms / max(self.decisions, 1),
                # what whole blocks were predicted to give at the same steps (measured: the tuned engine's)
                "mean_whole_block_expected_tokens_per_request": self.whole_expected_tokens / per,
                "mean_whole_block_predicted_step_ms": self.whole_predicted_ms / max(self.decisions, 1),
                # the survival it believed at each position, over every request it decided for (verified or not)
                "mean_predicted_survival_per_position": [round(v / per, 4) for v in self.position_survival],
                "mean_measured_step_ms": self.measured_ms / max(self.steps, 1),
                # the steps mean_predicted_step_ms predicted, measured (the mean above has the ramps' steps too)
                "mean_measured_decided_step_ms": self.decided_ms / max(self.decided_steps, 1),
                # the drafting judgement (point 6): the plain step it priced drafting against, and how often it paid
                "mean_judged_plain_step_ms": self.judged_plain_ms / self.judged if self.judged else None,
                "drafting_paid_share": self.judged_paid / self.judged if self.judged else None,
                "layout": scheduler.layout, "next_budget_per_request": scheduler.budget_per_request,
                "next_cap": scheduler.cap,
                "survival_correction": [round(float(r), 4) for r in scheduler.correction.ratio],
                "survival_fit": scheduler.correction.fitted(),
                "survival_skill_per_position": scheduler.correction.skill.per_position(),
                "explored_decisions": scheduler.explored, "unpacked_steps": self.unpacked_steps,
                # point 6: steps that drafted nothing since drafting did not pay, and the holds that began
                "drafting_off_steps": self.drafting_off_steps, "drafting_holds": scheduler.hold.holds,
                "drafting_judgements_reversed": scheduler.reversals,
                # holds a mixed step's judgement began that the first decode step after them ended
                "drafting_mixed_holds_ended": scheduler.hold.mixed_ended,
                "serial_steps": self.serial_steps,
                # (None: no plain steps profiled, the drafting never stops)
                "plain_cost_table_observations": scheduler.costs.plain.observations
                if scheduler.costs.plain is not None else None,
                "cost_table_observations": scheduler.costs.observations,
                # the mixed steps' excess over the verify steps' table (MixedStepCosts)
                "mixed_step_observations": scheduler.mixed_costs.observations,
                "mixed_step_excess": scheduler.mixed_costs.to_json()["excess"],
                "cost_table_ms_per_context_token": scheduler.costs.ms_per_context_token, "last": dict(self.last)}


def trace_summary(rows: list) -> dict:
    """Trace steps (``TRACE_FIELDS`` lists) by kind -> per kind its steps, their mean measured ms and, for decided
    ones, the mean predicted ms of the step and of whole blocks and the mean drafts allotted (``budget``), proposed
    and verified (None for rows recorded before that field): ``decided``
    (launched ahead) and ``decided_serial`` (not: priced with the serial excess, ``ConfidenceScheduler.serial``),
    ``held`` (undecided and held: a plain step), ``other`` (ramps, prefill-only steps, a look's first step...); per
    kind also how many were ``mixed`` (fed prompt chunks: ``prompt_tokens``)."""
    at = {name: i for i, name in enumerate(TRACE_FIELDS)}
    kinds: dict[str, list] = {}
    for row in rows:
        if row[at["budget"]] is not None:
            kind = "decided_serial" if row[at["serial"]] else "decided"
        else:
            kind = "held" if row[at["held"]] else "other"
        kinds.setdefault(kind, []).append(row)
    summary = {}
    for kind, members in kinds.items():
        def mean(name: str) -> float | None:
            values = [r[at[name]] for r in members if r[at[name]] is not None]
            return round(sum(values) / len(values), 4) if values else None

        # (the steps that fed prompt chunks too: mixed, priced and timed apart from pure decode or verify steps)
        summary[kind] = {"steps": len(members), "ms": mean("ms"), "mixed": sum(r[at["prompt_tokens"]] > 0
                                                                               for r in members)}
        if kind.startswith("decided"):
            summary[kind].update(predicted_ms=mean("predicted_ms"), whole_predicted_ms=mean("whole_predicted_ms"),
                                 budget=mean("budget"), offered=mean("offered"), verified=mean("verified"),
                                 expected_tokens=mean("expected_tokens"), committed_tokens=mean("committed_tokens"),
                                 explores=sum(bool(r[at["explores"]]) for r in members),
                                 drafting_paid=sum(r[at["drafting_pays"]] is True for r in members),
                                 drafting_lost=sum(r[at["drafting_pays"]] is False for r in members))
    return summary
