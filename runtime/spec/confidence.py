"""Hardware-aware confidence scheduling: each step verifies the drafts that pay on this hardware at this load.

DSpark paper, Algorithm 1, in its production form (section 5.2). The confidence head's ``c_k`` is the chance that
draft k survives given its prefix did; calibrated per position with a temperature (``sigmoid(logit(c_k) / T_k)``)
its cumulative product is the draft's survival ``a_k``. Verifying a set of drafts commits, in expectation, one
token per request plus the survivals of the drafts verified; the step costs ``StepCostTable.predict_ms(batch,
tokens fed)``. The scheduler, in either of two step layouts:

1. **ragged** (eager kernels: a step costs the tokens it feeds): it ranks every proposed draft of the batch by
   survival (ties: earlier position, then earlier request), so any budget of B drafts is a prefix of each
   request's block (survival never grows along a block), and verifies the top ``B`` (the paper's global top-k);
   **padded** (CUDA graphs, ``runtime.worker.graphs``: every request of a step is padded to the step's longest verify,
   so the step costs its batch x (longest + 1) tokens whatever the others verify): it verifies
   ``min(proposed, Q)`` drafts of every request under one cap ``Q`` (the tier search over the cost curve's
   steps: under padding, a draft below the cap is free and one above it costs a whole column), and since the cap
   is chosen before the block it applies to is drafted, the engine drafts only ``Q + 1`` of it
   (``Engine.drafts_follow_cap``: the drafts past the cap would never be verified, and the one past it keeps that
   position's confidence in view; the startup profile times each cap so); **packed** (``runtime.worker.packed_verify``,
   steps of ``packed_from`` requests or more): the device picks the top ``S x columns`` drafts of the step's blocks,
   and the engine drafts one past the longest share a request took of this step's block at the columns chosen for
   the next (``packed_draft_len``);
2. the budget (B per request, scaled to this step's batch; or Q) comes from the **previous** step's confidences:
   the choice of which drafts to verify then depends only on each draft's prefix and on other requests, never on
   the draft token being verified, which is what keeps rejection sampling lossless (a budget chosen from the
   current tokens is not: paper, appendix A);
3. from this step's confidences it chooses the budget for the next step: the B (or Q) maximizing expected
   committed tokens per predicted second over every value from 0 to all of them (the cost curve has steps, so no
   local search), or 0 when the best beats verifying nothing by less than ``min_gain``, or all of them when it
   beats verifying every proposed draft by less than ``min_gain`` (a trim must beat the table's noise: on a
   target whose verify costs the same at any length, the scheduler then verifies whole blocks, as the fixed
   schedule does; a ragged trim also pays host work for its gathered rows that the uniform-step profile does not
   price). The predicted step includes what else it feeds (prefill chunks of a mixed step, as the previous step
   had), so verify tokens are priced at the step's real place on the cost curve, and the context its requests
   attend over (``StepCostTable``: cells learned at other contexts are read as if at this one). A mixed step (it
   feeds more than verifies) runs eagerly and costs more than the table's cell of its sizes by an amount the
   verify lengths hardly move: it is priced as that cell plus the excess learned from the mixed steps served
   (``runtime.spec.mixed_step_costs``), so a trim's saving is weighed against the whole step it is part of. So is a
   verify step an engine that launches steps ahead did not launch ahead (``serial``: it adds the host's step work
   to the device's), and such steps teach that excess, not the table's cells, which stay those of steps launched
   ahead as the startup profile timed them.

4. the survivals are fitted online to what the engine's own verifications accepted (``SurvivalCorrection``: per
   position a logistic regression of each reached draft's acceptance on its confidence's logit and its request's
   verify-history class, with the offline calibration as its prior): a temperature fitted offline on other text
   leaves a bias the scheduler pays for (earlier runs on an H200: the late drafts' survivals predicted 10-25%
   low, so it trimmed drafts that would have paid, 0.89-0.96 of the tuned schedule's throughput at 16-256
   requests). The fit reads only steps already committed, so, like the lag of point 2, it never looks at the
   tokens being verified. A draft position is only learned where it is reached, so every ``TUNING.explore_every``-th
   decision below whole blocks verifies whole blocks (~3% of steps): a cap that under-predicted survivals put
   below the drafts that pay would otherwise never see the evidence that lifts it. Whole blocks, not one draft
   more: where the cost curve has a step past the cap (a GEMM tile, a graph bucket) one more column does not pay
   on its own while the whole block does, and one run (256 requests, one draft more) left the positions two past
   the cap at their under-predicted survivals, capped at 3.7 of 7 drafts for 0.90 of the whole blocks'
   throughput. The step counter, not the tokens, decides when.
5. a request's **verify history** is what its last verify with drafts did (``history_classes``: none yet, rejected
   the draft after j accepted ones, accepted all n it verified; ``next_history``), and the fit has a bias per class
   and position (the class says where the request stopped, or how far it got: "accepted all" of a verify trimmed to
   one draft says nothing of its second draft, and one run's requests that rejected did so at the second).
   Acceptance is correlated from step to step within a request (a request in a stretch the drafter predicts well
   stays in it), and a confidence head trained briefly does not see it: one run (a 2.7B target, its drafter trained
   35 s) accepted 0.79 / 0.61 / 0.58 / 0.58 / ... at 64 requests (the requests that survive two drafts survive them
   all), where an oracle verifying only the drafts that will be accepted gains 1.18x and the scheduler of the time
   (a survived-over-predicted ratio per position), its survivals alike for every request (Brier skill -0.05 at
   position 0), verified whole blocks; one run with the fit: skill 0.36-0.44 past position 0. The class is the
   previous step's outcome, committed before this step's block is verified, so it keeps the selection lossless as
   the lag of point 2 does; a packed step launched ahead computes it on the device from the step before's verdicts
   (``GraphedTargetForward.launch_verify_ahead``, ``runtime.worker.packed_verify.history_after``).

6. **drafting at all**: a step that verifies nothing still drafts the next block (the drafter's forward, at 256
   requests on a 2.7B target ~35% of a plain decode step), so verifying nothing is no match for plain decoding, and
   where no verify pays the step it costs, the scheduler says so (``drafting_pays``: the best choice's expected
   tokens per predicted ms against plain decoding's, a token a request per ``StepCostTable.plain``'s step, the
   drafter's cost taken off at the step's place on the curve, or for a mixed step the plain table plus the mixed
   excess read per verify row, ``MixedStepCosts.plain_excess_ms``; no margin), and the engine drafts nothing at that
   batch size for a while (``DraftingHold``: 16 steps, doubling up to 512 while it keeps not paying), then drafts
   again to look (its blocks verified whole; the hold's next judgement waits for the look's outcome, refitted at
   once). A step judged not to pay is refitted at once too, with its own outcome, and where some cap pays on
   the refitted survivals the hold it began ends (``_pays_after_refit``: a judgement made on a fit of other
   requests costs a step, not a hold). A hold a mixed step's judgement began (prompt chunks beside the verifies,
   whose cost they set) ends at the first decode step after it: decode steps are judged on their own. One run (an
   H200, a 2.7B pair): at 256 requests the tuned schedule drafts nothing, and under mixed prefill + decode load
   the confidence-scheduled engine, drafting every step, served 0.70 of its tokens/s. The choice reads
   confidences of drafts already proposed and the step count, never the tokens being verified.

The first step (no earlier confidences) verifies whole blocks. The host work is a few numpy operations over the
batch's ``S x K`` confidences (numpy, not torch: a CPU torch op costs several microseconds of dispatch, and at
batch 1 on a small target the scheduler's forty-odd ops cost a third of the step). A step of at most
``TUNING.small_step`` proposed drafts is decided in plain Python instead (the same arithmetic in the same order): between
two engine steps numpy's code is cold, and each distinct numpy call's first use after a step costs microseconds
(a 2-core CPU host: a 7-element sum 23 us first, 1 us after), so at a few requests the calls, not the arithmetic,
were the cost: a padded decision and its learning right after a step 247 / 254 / 314 / 255 us with numpy at 1 / 4 /
8 / 16 requests, 57 / 90 / 118 / 202 us in Python; a ragged one 313 / 330 / 368 / 336 against 75 / 123 / 188 / 288
(``benchmarks/scheduler_host.py``; at 32 requests numpy wins, 279 against 345
and 331 against 515 us, hence 128 drafts). The online fit gathers its evidence as it comes and converts it
when it folds.
"""

from __future__ import annotations

import numpy as np

from runtime.spec.decision import Decision
from runtime.spec.history import HISTORY_NONE, history_list, history_rows
from runtime.spec.hold import DraftingHold
from runtime.spec.mixed_step_costs import MixedStepCosts
from runtime.spec.packed_layout import packed_draft_len, top_drafts
from runtime.spec.step_costs import StepCostTable
from runtime.spec.survival import SurvivalCorrection
from runtime.spec.tuning import TUNING

LAYOUTS = ("ragged", "padded", "packed")


class ConfidenceScheduler:
    def __init__(self, max_draft_len: int, costs: StepCostTable, temperatures: list[float] | None = None,
                 min_gain: float = 0.04, layout: str = "ragged", packed_from: int = 1,
                 graph_batches: list[int] | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"confidence scheduling layout: one of {LAYOUTS}, got {layout!r}")
        temps = list(temperatures) if temperatures else [1.0] * max_draft_len
        if len(temps) == 1:
            temps = temps * max_draft_len
        if len(temps) < max_draft_len or any(t <= 0 for t in temps):
            raise ValueError(f"confidence temperatures: {max_draft_len} positive values expected, got {temps}")
        self.max_draft_len, self.costs, self.min_gain = max_draft_len, costs, min_gain
        # steps that feed something besides the verifies (prefill chunks, decodes without drafts) run eagerly or
        # pad differently and cost more: they are priced as the verify steps' table plus a learned excess
        # (``MixedStepCosts``) and teach only that excess (one table for both let a ramp's mixed steps teach the
        # whole-block cell at 256 requests 15 ms where a graphed whole-block step took 11.7: one run trimmed to 5.8
        # of 7 drafts and lost 14%; a table of their own priced one run's mixed steps 35% low)
        self.mixed_costs = MixedStepCosts(costs)
        # plain steps that feed prompt chunks beside their decodes (a drafting hold's mixed steps, nothing drafted):
        # the plain table plus an excess of their own, learned from those steps; what a mixed step's drafting is
        # judged against once TUNING.plain_mixed_min of them were served (before: the drafting steps' excess read per
        # verify row, MixedStepCosts.plain_excess_ms)
        self.plain_mixed = MixedStepCosts(costs.plain) if costs.plain is not None else None
        # whether the steps being priced run serially: on an engine that launches steps ahead (the startup profile
        # times such steps), a step it did not launch ahead costs the host's whole step work on top (set by the
        # engine before each decision, from the step being served: the regime persists from one step to the next)
        self.serial = False
        self.temperatures = np.asarray(temps[:max_draft_len], dtype=np.float64)
        self.inverse_temperatures = 1.0 / self.temperatures
        self.layout = layout
        # the packed layout: steps of at least this many requests are packed (allot_packed); smaller ones are
        # padded, as a graphed engine's steps below its packed graphs' buckets are (allot)
        self.packed_from = packed_from
        # padded and packed steps run in CUDA graphs captured at these batch sizes: a step of n requests costs the
        # smallest one holding them (its padding rows are computed too), and is priced (and learned) at that cell;
        # none: a step costs its own batch
        self.graph_batches = sorted(graph_batches) if graph_batches else []
        self.budget_per_request: float | None = None  # ragged: chosen from the previous step's confidences
        self.cap: int | None = None  # padded: likewise
        self.columns: int | None = None  # packed: drafts per request of the next step's budget, likewise
        # packed: how long a block to draft for the step of ``columns`` (None: the schedule's whole block), one past
        # the longest share a request took of this step's block at those columns (``packed_draft_len``)
        self.packed_draft_len: int | None = None
        self.step_columns = 0  # packed: the columns of the budget the last allot_packed returned
        self.last: Decision | None = None
        self.correction = SurvivalCorrection(max_draft_len, self.inverse_temperatures)
        # point 6: whether the last decision's best choice beat plain decoding (None: no plain steps profiled)
        self.drafting_pays: bool | None = None
        self.hold = DraftingHold()  # where the engine drafts nothing, and until when (its steps)
        self.reversals = 0  # judgements that drafting did not pay which the refit after them reversed (learn)
        self._judged: tuple | None = None  # the last judgement's step: requests, others, their tokens, context, plain
        self.decisions = 0  # budgets (or caps) chosen
        self.explored = 0  # of them, raised to whole blocks to gather evidence (TUNING.explore_every)
        # the last allot's (confidences [S, K] padded with 0, lengths, history), to learn (arrays or lists)
        self._pending: tuple | None = None
        self._unsettled = None  # a deferred decision's rest, until it ran (allot_deferred, settle)

    def defer_learning(self, host_work) -> None:
        """Fold the survival fit's evidence (and refit) in tasks queued on ``host_work`` (``runtime.engine.host_work.HostWork``:
        run while the device computes a step) instead of in ``learn``, which the engine calls between steps."""
        self.correction.defer_to = host_work

    def ranking(self, k: int) -> tuple[list[float], list[list[float]]]:
        """What a packed step ranks its first ``k`` drafts by: the survival fit's slopes [k] and biases [H][k], per
        verify-history class and position (``SurvivalCorrection``)."""
        return self.correction.slope_list[:k], [row[:k] for row in self.correction.bias_list]

    def predict_ms_many(self, batch: int, tokens, context: int, other_tokens: int) -> np.ndarray:
        """[N] predicted ms of a step of ``batch`` requests feeding each of ``tokens`` [N], ``other_tokens`` of them
        besides the verifies: the verify steps' table, or where it feeds more (a mixed step) or runs serially
        (``serial``) ``mixed_costs``."""
        if other_tokens or self.serial:
            return self.mixed_costs.predict_ms_many(batch, tokens, context, other_tokens)
        return self.costs.predict_ms_many(batch, tokens, context)

    def predict_ms_list(self, batch: int, tokens: tuple[int, ...], context: int, other_tokens: int) -> list[float]:
        """``predict_ms_many`` as a list (a small step's plain-Python path)."""
        if other_tokens or self.serial:
            return self.mixed_costs.predict_ms_list(batch, tokens, context, other_tokens)
        return self.costs.predict_ms_list(batch, tokens, context)

    def observe_step(self, batch: int, tokens: int, seconds: float, context: int, other_tokens: int,
                     serial: bool = False) -> None:
        """A served drafting step into what prices its kind: the verify steps' table, or (``other_tokens``: it fed
        more than verifies; ``serial``: an engine that launches steps ahead did not launch this one ahead) the
        excess of ``mixed_costs``."""
        if other_tokens or serial:
            self.mixed_costs.observe(batch, tokens, seconds, context, other_tokens)
        else:
            self.costs.observe(batch, tokens, seconds, context)

    def observe_plain_mixed_step(self, batch: int, seconds: float, context: int, other_tokens: int) -> None:
        """A served plain step of ``batch`` requests that fed ``other_tokens`` (prompt chunks) beside its one-token
        decodes, nothing drafted: into ``plain_mixed`` (the plain table at its batch, a token a request, plus their
        excess), which prices a mixed step's plain alternative once it has seen ``TUNING.plain_mixed_min``."""
        if self.plain_mixed is not None:
            self.plain_mixed.observe(batch, batch, seconds, context, other_tokens)

    def graph_rows(self, num: int) -> int:
        """The requests a graphed step of ``num`` requests computes: its graph's batch (``num`` past the largest)."""
        return next((b for b in self.graph_batches if b >= num), num)  # (the graphs' bucket)

    def _priced(self, num: int, other_requests: int, other_tokens: int, per_request: np.ndarray | tuple,
                context: int) -> np.ndarray | list[float]:
        """Predicted ms of a padded or packed step of ``num`` deciding requests feeding ``per_request`` tokens each
        (one entry per choice), beside ``other_requests`` / ``other_tokens``: a pure verify step at its graph's
        cell (``graph_rows``), a mixed one at its own sizes (its graph, if any, depends on the prefill chunk)."""
        batch, verifying = (num + other_requests, num) if other_tokens else (self.graph_rows(num),) * 2
        if isinstance(per_request, tuple):
            return self.predict_ms_list(batch, tuple(other_tokens + verifying * q for q in per_request), context,
                                        other_tokens)
        return self.predict_ms_many(batch, other_tokens + verifying * per_request, context, other_tokens)

    def bucket(self, num: int) -> int:
        """The batch size a ``DraftingHold`` keys ``num`` requests by: the graph holding them, else the power of
        two at or above ``num`` (a step of any size in it judged alike)."""
        return self.graph_rows(num) if self.graph_batches else 1 << max(num - 1, 0).bit_length()

    def _judge_drafting(self, num: int, expected: float, predicted_ms: float, none_ms: float,
                        other_requests: int = 0, other_tokens: int = 0, context: int = 0) -> None:
        """Point 6 of the module doc: ``drafting_pays`` from the best choice's ``expected`` committed tokens in
        ``predicted_ms`` against plain decoding, ``num`` tokens in a plain step of the same requests (``_plain_ms``).
        No ``min_gain`` margin: a trim is undone next step, a hold lasts 16 to 512 steps, so drafting stops only where
        it is believed to lose (simulated on one run's costs at 256 requests, 60% hard requests: with the 4% margin
        the holds served 1.007 of the best of plain decoding and fixed caps, without it 1.071, alike elsewhere)."""
        plain = self.costs.plain
        if plain is None or not plain.measured:
            self.drafting_pays = None
            return
        plain_ms = self._plain_ms(num, none_ms, other_requests, other_tokens, context)
        self.drafting_pays = expected * plain_ms >= num * predicted_ms
        self._judged = (num, other_requests, other_tokens, context, plain_ms)  # (to judge again after a refit)
        if self.last is not None:  # (made just before, by the same decision: its metrics show the judgement)
            self.last.plain_ms, self.last.drafting_pays = plain_ms, self.drafting_pays

    def _plain_ms(self, num: int, none_ms: float, other_requests: int, other_tokens: int, context: int) -> float:
        """The predicted ms of plain decoding in place of a drafting step of ``num`` deciding requests: for a step
        of verifies alone, the step that verifies nothing (``none_ms``) less the drafter's cost at this batch (the
        verify-nothing step against the plain step of ``StepCostTable.plain`` at its graph's rows); for a mixed step
        (``other_tokens`` besides the verifies), the plain table at its batch (a token a request) plus the excess
        learned from plain mixed steps (``plain_mixed``, once ``TUNING.plain_mixed_min`` were served: a drafting hold's), or
        before that the plain excess of ``MixedStepCosts.plain_excess_ms``: the mixed excess was learned from
        drafting steps, whose
        requests fed K + 1 rows each, and read whole beside a plain step it priced one run's plain alternative at
        10.4 ms where plain mixed steps took 3.9 (and one run's, 12.6-15.1 against 10.9: drafting kept looking as if
        it paid in mixed steps where it lost, 0.88 of the tuned engine's plain decoding). The drafter's cost is the
        two tables' difference at the step's own context, each read there by its own context slope (so where the
        verify-nothing cell is the one ``none_ms`` read, the plain alternative is the plain table's step at this
        context): read at no context (the verify table's cell less its learned slope times its profiled context, the
        plain table's, no slope learned, its steps being the holds', as profiled) the difference priced plain
        decoding the verify slope times the step's whole context dearer than its cell (256 requests: 10.1
        ms, 6.4 + 1.1e-4 ms x 32K context tokens, where the held plain steps took 6.1)."""
        plain = self.costs.plain
        if other_tokens:
            batch = num + other_requests
            if self.plain_mixed is not None and self.plain_mixed.observations >= TUNING.plain_mixed_min:  # measured
                return max(self.plain_mixed.predict_ms_list(batch, (batch,), context, other_tokens)[0], 1e-6)
            return max(plain.predict_ms_list(batch, (batch,), context)[0]
                       + self.mixed_costs.plain_excess_ms(batch, other_tokens), 1e-6)
        rows = self.graph_rows(num)  # (cached Python lists: no numpy call on a small step's path)
        drafting_ms = max(self.costs.predict_ms_list(rows, (rows,), context)[0]
                          - plain.predict_ms_list(rows, (rows,), context)[0], 0.0)
        return max(none_ms - drafting_ms, 1e-6)

    def survival(self, confidence: np.ndarray, history=None) -> np.ndarray:
        """confidence [S, K] (0 where nothing was proposed), history [S] verify-history classes (None: all
        ``HISTORY_NONE``) -> the believed survival [S, K], non-increasing in k (``SurvivalCorrection.survival``)."""
        return self.correction.survival(confidence, history)

    def survival_row(self, confidence: list[float], k: int, history: int = HISTORY_NONE) -> list[float]:
        """``survival`` of one request's confidences [K'] in plain Python, padded with 0 to ``k``."""
        return self.correction.survival_row(confidence, k, history)

    def allot(self, confidences: list[list[float]], other_requests: int = 0, other_tokens: int = 0,
              context: int = 0, history: list[int] | None = None) -> list[int]:
        """Each request's proposed drafts' confidences (in block order) -> how many of them to verify.

        ``other_requests`` / ``other_tokens``: what else the step is expected to feed (prefill chunks, decodes
        without drafts; the engine passes the previous step's): the step's cost is predicted with them, so on a
        mixed step a verify token is priced where the step really is on the cost curve. ``context``: the KV tokens
        the step's requests attend over before what they feed, summed (the cost grows with it). ``history``: each
        request's verify-history class (``next_history``; None: all ``HISTORY_NONE``)."""
        self.settle()
        num = len(confidences)
        padded = self.layout != "ragged"  # the packed layout's steps below packed_from are padded
        if num * self.max_draft_len <= TUNING.small_step:
            if padded:
                return self._allot_padded_small(confidences, other_requests, other_tokens, context, history)
            return self._allot_ragged_small(confidences, other_requests, other_tokens, context, history)
        sizes = np.fromiter((len(c) for c in confidences), dtype=np.int64, count=num)
        offered = int(sizes.sum())
        if num == 0 or offered == 0:
            return [0] * num
        k = int(sizes.max())
        table = confidence_table(confidences, sizes, k)
        history = history_rows(history, num, len(self.correction.history_names))
        survival = self.survival(table, history)
        if padded:
            lengths = self._allot_padded(survival, sizes, other_requests, other_tokens, context)
            self._pending = (table, lengths, history)
            return lengths.tolist()
        proposed = np.arange(k)[None, :] < sizes[:, None]
        if self.budget_per_request is None:  # nothing earlier to take the capacity from: whole blocks
            budget = offered
        else:
            budget = min(round(self.budget_per_request * num), offered)
        if budget >= offered:  # everything proposed is verified: no ranking needed
            lengths, chosen = sizes, float(survival.sum())
        else:
            lengths = top_drafts(survival, proposed, budget)
            chosen = float(survival[np.arange(k)[None, :] < lengths[:, None]].sum())
        predicted = self.predict_ms_many(num + other_requests, other_tokens + num + np.arange(offered + 1), context,
                                         other_tokens)
        column_sums = survival.sum(axis=0)  # [K] each position's survivals, summed
        self.last = Decision(budget, offered, num + chosen, float(predicted[budget]), num + float(column_sums.sum()),
                             float(predicted[offered]), column_sums.tolist())
        ranked = -np.sort(-survival[proposed])
        expected = num + np.concatenate([[0.0], ranked.cumsum()])  # [B+1] committed tokens under each budget
        best = self._best(expected, predicted)
        self._judge_drafting(num, float(expected[best]), float(predicted[best]), float(predicted[0]),
                             other_requests, other_tokens, context)
        self.budget_per_request = self.max_draft_len if self._explores(best < offered, best) else best / num
        self._pending = (table, lengths, history)
        return lengths.tolist()

    def allot_deferred(self, confidences: list[list[float]], other_requests: int, other_tokens: int, context: int,
                       history: list[int] | None, host_work, then=None) -> list[int]:
        """``allot``'s padded decision with what does not decide this step deferred: each request verifies
        ``min(proposed, cap)`` drafts at once (the cap an earlier step chose: what ``allot`` returns), and the rest
        of ``allot`` (this step's survivals, its ``last`` Decision, the next cap, whether drafting pays), then
        ``then()``, runs as a task on ``host_work`` (``runtime.engine.host_work.HostWork``: while the device computes this
        step), or, if that has not run it, when the next decision or ``learn`` calls ``settle``. The same choices
        as ``allot`` made at once, in the same order; what moves is when ``last``, ``cap`` and ``drafting_pays``
        become current: the block drafted during this step follows the cap as it stood
        (``Engine.drafts_follow_cap``), a step behind. For steps that are neither packed nor launched ahead (a
        mixed step: prefill chunks beside the verifies), whose host work between steps the device waits for
        (~0.4 ms a decision at 64 requests on an H200 host, one run)."""
        if self.layout == "ragged":  # its lengths rank this step's survivals: nothing decides it before they exist
            raise ValueError("confidence scheduling: a ragged decision cannot be deferred (its lengths rank the "
                             "step's own survivals)")
        self.settle()
        cap, serial = self.cap, self.serial
        lengths = [len(c) if cap is None else min(len(c), cap) for c in confidences]

        def rest() -> None:  # priced in the regime of the step it decided (the engine sets serial per step)
            now, self.serial = self.serial, serial
            try:
                self.allot(confidences, other_requests, other_tokens, context, history)
            finally:
                self.serial = now
            if then is not None:
                then()

        self._unsettled = rest
        host_work.add(self.settle)
        return lengths

    def settle(self) -> None:
        """Run a deferred decision's rest (``allot_deferred``) if it has not run yet; idempotent."""
        rest, self._unsettled = self._unsettled, None
        if rest is not None:
            rest()

    def learn(self, verified: list[int], accepted: list[int]) -> bool:
        """How many drafts each request of the last ``allot`` verified (at most what it was allotted: the step may
        have trimmed more, at a token limit) and accepted, in its order (-1: unknown, e.g. the request left the
        step or failed): the online survival fit's evidence. Call once per allot, after the step
        committed. -> whether a judgement that drafting does not pay was reversed by the refit after it
        (``_pays_after_refit``; ``drafting_pays`` is then True): the engine ends the drafting hold it began."""
        self.settle()
        if self._pending is None:
            return False
        confidence, allotted, history = self._pending
        self._pending = None
        if len(verified) != len(confidence) or len(accepted) != len(confidence):
            raise ValueError(f"confidence scheduling: {len(verified)} verified and {len(accepted)} accepted counts "
                             f"for a step of {len(confidence)} verifying requests")
        self.correction.learn(confidence, allotted, verified, accepted, history)
        if self.drafting_pays is False:  # (point 6) the next judgement of drafting at all reads this step's outcome
            self.correction.refit_now()
            if self._pays_after_refit(confidence, history):
                self.drafting_pays = True
                self.reversals += 1
                return True
        return False

    def _pays_after_refit(self, confidence, history) -> bool:
        """Whether, refitted on every verify so far, drafting pays for the last judgement's step after all: some
        cap ``q`` (each request verifying its first ``q`` drafts of the step just learned, confidences [S, K'] and
        classes; packing or ranking picks drafts at least as good, so this is the least it gives), chosen as a
        decision chooses (``_best``), commits as much per predicted ms, at that step's prices (its requests, what
        else it fed, its context), as plain decoding of them. A judgement is made on the fit as it stood, which
        folds evidence every ``TUNING.fold_every`` steps: after a change of load it can be a fit of other requests (one run
        on an H200: concurrency 1's one request rejected every draft; the four requests after it accepted 5.2
        tokens a request a step, and the first judgement, on a fit of that one request, held drafting off for 16 of
        their steps); the hold it reverses costs a step, not ``TUNING.hold_first``. Chosen by the decision's own rule (its
        ``min_gain`` margins), the next judgement, on the same fit and prices, pays too, so a reversal is not undone
        by the evidence it was made on (a hold begun and reversed every step)."""
        if self._judged is None:
            return False
        num, other_requests, other_tokens, context, plain_ms = self._judged
        table = np.asarray(confidence, dtype=np.float64)  # [S, K'] (0 past a block)
        if table.ndim != 2 or table.shape[0] == 0 or num == 0:
            return False
        k = table.shape[1]
        survival = self.survival(table, history_rows(history, table.shape[0], len(self.correction.history_names)))
        per_request = np.concatenate([[0.0], survival.sum(axis=0).cumsum()]) / table.shape[0]  # [K'+1] under cap q
        predicted = np.asarray(self._priced(num, other_requests, other_tokens, np.arange(k + 1) + 1, context))
        expected = num * (1.0 + per_request)  # [K'+1] committed tokens under each cap
        best = self._best(expected, predicted)
        return bool(expected[best] * plain_ms >= num * predicted[best])

    def _small_step(self, confidences: list[list[float]], history: list[int] | None) -> tuple | None:
        """A small step in plain Python: (requests S, longest block K, sizes [S], drafts proposed, the confidences
        and the believed survivals [S][K] lists, 0 past a block, classes [S]), or None when nothing was proposed."""
        sizes = [len(c) for c in confidences]
        offered = sum(sizes)
        if offered == 0:
            return None
        k = max(sizes)
        history = history_list(history, len(sizes), len(self.correction.history_names))
        padded = [list(c) + [0.0] * (k - len(c)) for c in confidences]
        return (len(sizes), k, sizes, offered, padded,
                [self.survival_row(c, k, h) for c, h in zip(confidences, history)], history)

    def _allot_ragged_small(self, confidences: list[list[float]], other_requests: int, other_tokens: int,
                            context: int, history: list[int] | None) -> list[int]:
        """The ragged decision of ``allot`` in plain Python for a small step (``TUNING.small_step``): the same budget, the
        same drafts (``top_drafts``'s ranking: survival, then the earlier position, then the earlier request)."""
        step = self._small_step(confidences, history)
        if step is None:
            return [0] * len(confidences)
        num, k, sizes, offered, padded, survival, history = step
        drafts = [(survival[i][j], i) for j in range(k) for i in range(num) if j < sizes[i]]  # position-major
        order = sorted(drafts, key=lambda draft: -draft[0])  # stable: ties keep the earlier position, request
        budget = offered if self.budget_per_request is None else min(round(self.budget_per_request * num), offered)
        if budget >= offered:  # everything proposed is verified: no ranking needed
            lengths = sizes
        else:
            lengths = [0] * num
            for _, i in order[:budget]:
                lengths[i] += 1
        expected, total = [float(num)], 0.0  # [offered + 1] committed tokens under each budget
        for value, _ in order:
            total += value
            expected.append(num + total)
        predicted = self.predict_ms_list(num + other_requests,
                                         tuple(other_tokens + num + b for b in range(offered + 1)), context,
                                         other_tokens)
        chosen = sum(sum(row[:n]) for row, n in zip(survival, lengths))
        self.last = Decision(budget, offered, num + chosen, predicted[budget], expected[-1], predicted[-1],
                             [sum(column) for column in zip(*survival)])
        best = self._best(expected, predicted)
        self._judge_drafting(num, expected[best], predicted[best], predicted[0], other_requests, other_tokens,
                             context)
        self.budget_per_request = self.max_draft_len if self._explores(best < offered, best) else best / num
        self._pending = (padded, lengths, history)
        return list(lengths)

    def _allot_padded_small(self, confidences: list[list[float]], other_requests: int, other_tokens: int,
                            context: int, history: list[int] | None) -> list[int]:
        """``_allot_padded`` in plain Python for a small step (``TUNING.small_step``): the same decision."""
        step = self._small_step(confidences, history)
        if step is None:
            return [0] * len(confidences)
        num, k, sizes, offered, padded, survival, history = step
        lengths = sizes if self.cap is None else [min(n, self.cap) for n in sizes]
        column_sums = [sum(column) for column in zip(*survival)]  # [K] each position's survivals, summed
        expected, total = [float(num)], 0.0  # [K+1] committed tokens under each cap
        for value in column_sums:
            total += value
            expected.append(num + total)
        predicted = self._priced(num, other_requests, other_tokens, tuple(q + 1 for q in range(k + 1)), context)
        chosen = sum(sum(row[:n]) for row, n in zip(survival, lengths))
        self.last = Decision(sum(lengths), offered, num + chosen, predicted[max(lengths)], expected[-1],
                             predicted[-1], column_sums)
        cap = self._best(expected, predicted)
        self._judge_drafting(num, expected[cap], predicted[cap], predicted[0], other_requests, other_tokens,
                             context)
        self.cap = self.max_draft_len if self._explores(cap < k, cap) else cap
        self._pending = (padded, lengths, history)
        return list(lengths)

    def _allot_padded(self, survival: np.ndarray, sizes: np.ndarray, other_requests: int,
                      other_tokens: int, context: int) -> np.ndarray:
        """The padded layout: every request verifies ``min(proposed, cap)`` (the lengths [S] returned), the cap
        chosen from the previous step; the next cap from this step's survivals [S, K] (0 where nothing was
        proposed)."""
        num, k = survival.shape
        lengths = sizes if self.cap is None else np.minimum(sizes, self.cap)
        column_sums = survival.sum(axis=0)  # [K] each position's survivals, summed
        columns = np.concatenate([[0.0], column_sums.cumsum()])  # [K+1] survivals under each cap
        # a step of cap Q feeds num x (Q + 1) tokens (Q: its longest verify), its graph's rows x (Q + 1)
        predicted = self._priced(num, other_requests, other_tokens, np.arange(k + 1) + 1, context)
        verified = int(lengths.max())
        chosen = float(survival[np.arange(k)[None, :] < lengths[:, None]].sum())
        self.last = Decision(int(lengths.sum()), int(sizes.sum()), num + chosen, float(predicted[verified]),
                             num + float(columns[-1]), float(predicted[-1]), column_sums.tolist())
        cap = self._best(num + columns, predicted)
        self._judge_drafting(num, num + float(columns[cap]), float(predicted[cap]), float(predicted[0]),
                             other_requests, other_tokens, context)
        self.cap = self.max_draft_len if self._explores(cap < k, cap) else cap
        return lengths

    def allot_packed(self, confidences: list[list[float]], other_requests: int = 0, other_tokens: int = 0,
                     context: int = 0, history: list[int] | None = None) -> int:
        """The packed layout (``runtime.worker.packed_verify``): each request's proposed drafts' confidences (in block
        order) -> the drafts this step verifies over the batch, ``columns`` x requests (at most what was proposed),
        with ``columns`` chosen from an earlier step; which drafts, the device picks from this block's confidences
        (the top survivals over the step). The next ``columns`` from this step's survivals: the c maximizing
        expected committed tokens (the requests, plus the top ``requests x c`` survivals) per predicted second of a
        step feeding ``rows x (c + 1)`` tokens (what a packed graph of c columns feeds: ``rows`` its batch bucket,
        ``graph_rows``), with ``min_gain`` and
        the exploration as for a cap. ``history``: as for ``allot`` (the device ranks under the same classes)."""
        self.settle()
        num = len(confidences)
        sizes = [len(c) for c in confidences]
        offered = sum(sizes)
        if num == 0 or offered == 0:  # (blocks cut to nothing at their token limits)
            self.step_columns = 0
            return 0
        k = max(sizes)
        history = history_rows(history, num, len(self.correction.history_names))
        padded = confidence_table(confidences, sizes, k)
        survival = self.survival(padded, history)  # [S, K], over the whole step at once (as allot)
        column_sums = survival.sum(axis=0)  # [K] each position's survivals, summed
        ranked = np.concatenate([[0.0], np.sort(survival.reshape(-1))[::-1].cumsum()])  # [S*K+1] top-b sums
        shares = np.minimum(num * np.arange(k + 1), offered)  # [K+1] drafts verified under each c
        expected = num + ranked[shares]
        predicted = self._priced(num, other_requests, other_tokens, np.arange(k + 1) + 1, context)
        columns = k if self.columns is None else min(self.columns, k)
        self.step_columns = columns
        self.last = Decision(int(shares[columns]), offered, float(expected[columns]), float(predicted[columns]),
                             float(expected[-1]), float(predicted[-1]), column_sums.tolist())
        best = self._best(expected, predicted)
        self._judge_drafting(num, float(expected[best]), float(predicted[best]), float(predicted[0]),
                             other_requests, other_tokens, context)
        self.columns = self.max_draft_len if self._explores(best < k, best) else best
        self.packed_draft_len = packed_draft_len(survival, sizes, self.columns, self.max_draft_len)
        # a step that cannot be packed (a prefill chunk joins it) verifies under a cap: the padded layout's choice
        # from these survivals, ready for it (a request verifies its first Q drafts, priced as Q columns are)
        self.cap = self._best(num + np.concatenate([[0.0], column_sums.cumsum()]), predicted)
        self._pending = (padded, sizes, history)  # learn(): the verified counts the device reports bound the allotted
        return int(shares[columns])

    def _explores(self, below_whole_blocks: bool, best: int = -1) -> bool:
        """Count a decision; whether it verifies whole blocks instead of the choice ``best``, so that every position
        past the choice keeps being learned: every ``TUNING.explore_every``-th decision that is below whole blocks, and one
        that verifies nothing where drafting did not pay (``drafting_pays`` False: the next verify is the look after
        a drafting hold, and verifying nothing there would teach the fit nothing, so a belief that nothing pays
        could never be proved wrong)."""
        self.decisions += 1
        if below_whole_blocks and (self.decisions % TUNING.explore_every == 0 or (best == 0 and self.drafting_pays is False)):
            self.explored += 1
            if self.last is not None:  # (made just before, by the same decision: the step trace shows it)
                self.last.explores = True
            return True
        return False

    def _best(self, expected: np.ndarray, predicted_ms: np.ndarray) -> int:
        """The index maximizing expected / predicted, or 0 or the last where the best beats them by less than
        ``min_gain`` (see the module doc)."""
        if isinstance(expected, list):  # the plain-Python path (a small step)
            rate = [e / p for e, p in zip(expected, predicted_ms)]
            best = max(range(len(rate)), key=rate.__getitem__)  # the first maximum, as argmax
        else:
            rate = expected / predicted_ms
            best = int(rate.argmax())
        full = len(rate) - 1
        if rate[best] < (1 + self.min_gain) * rate[0]:
            return 0
        if rate[best] < (1 + self.min_gain) * rate[full]:
            return full
        return best


def confidence_table(confidences: list[list[float]], sizes, k: int) -> np.ndarray:
    """S blocks' confidences of ``sizes`` [S] drafts -> [S, k] float64, 0 past each block."""
    if min(sizes) == k:  # the usual step: every block proposed in full
        return np.asarray(confidences, dtype=np.float64)
    table = np.zeros((len(confidences), k))
    for i, c in enumerate(confidences):
        table[i, :len(c)] = c
    return table
