"""Hardware-aware confidence scheduling: each step verifies the drafts that pay on this hardware at this load.

DSpark paper, Algorithm 1, in its production form (section 5.2). The confidence head's ``c_k`` is the chance that
draft k survives given its prefix did; calibrated per position with a temperature (``sigmoid(logit(c_k) / T_k)``)
its cumulative product is the draft's survival ``a_k``. Verifying a set of drafts commits, in expectation, one
token per request plus the survivals of the drafts verified; the step costs ``StepCostTable.predict_ms(batch,
tokens fed)``. The scheduler, in either of two step layouts:

1. **ragged** (eager kernels: a step costs the tokens it feeds): it ranks every proposed draft of the batch by
   survival (ties: earlier position, then earlier request), so any budget of B drafts is a prefix of each
   request's block (survival never grows along a block), and verifies the top ``B`` (the paper's global top-k);
   **padded** (CUDA graphs, ``runtime.graphs``: every request of a step is padded to the step's longest verify,
   so the step costs its batch x (longest + 1) tokens whatever the others verify): it verifies
   ``min(proposed, Q)`` drafts of every request under one cap ``Q`` (the tier search over the cost curve's
   steps: under padding, a draft below the cap is free and one above it costs a whole column), and since the cap
   is chosen before the block it applies to is drafted, the engine drafts only ``Q + 1`` of it
   (``Engine.drafts_follow_cap``: the drafts past the cap would never be verified, and the one past it keeps that
   position's confidence in view; the startup profile times each cap so); **packed** (``runtime.packed_verify``,
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
   (``runtime.mixed_step_costs``), so a trim's saving is weighed against the whole step it is part of. So is a
   verify step an engine that launches steps ahead did not launch ahead (``serial``: it adds the host's step work
   to the device's), and such steps teach that excess, not the table's cells, which stay those of steps launched
   ahead as the startup profile timed them.

4. the survivals are fitted online to what the engine's own verifications accepted (``SurvivalCorrection``: per
   position a logistic regression of each reached draft's acceptance on its confidence's logit and its request's
   verify-history class, with the offline calibration as its prior): a temperature fitted offline on other text
   leaves a bias the scheduler pays for (earlier runs on an H200: the late drafts' survivals predicted 10-25%
   low, so it trimmed drafts that would have paid, 0.89-0.96 of the tuned schedule's throughput at 16-256
   requests). The fit reads only steps already committed, so, like the lag of point 2, it never looks at the
   tokens being verified. A draft position is only learned where it is reached, so every ``EXPLORE_EVERY``-th
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
   (``GraphedTargetForward.launch_verify_ahead``, ``runtime.packed_verify.history_after``).

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
``SMALL_STEP`` proposed drafts is decided in plain Python instead (the same arithmetic in the same order): between
two engine steps numpy's code is cold, and each distinct numpy call's first use after a step costs microseconds
(a 2-core CPU host: a 7-element sum 23 us first, 1 us after), so at a few requests the calls, not the arithmetic,
were the cost: a padded decision and its learning right after a step 247 / 254 / 314 / 255 us with numpy at 1 / 4 /
8 / 16 requests, 57 / 90 / 118 / 202 us in Python; a ragged one 313 / 330 / 368 / 336 against 75 / 123 / 188 / 288
(``benchmarks/scheduler_host.py``, ``2026-12-02-scheduler-host-cpu``; at 32 requests numpy wins, 279 against 345
and 331 against 515 us, hence 128 drafts). The online fit gathers its evidence as it comes and converts it
when it folds.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from runtime.graph_layout import bucket_of
from runtime.mixed_step_costs import MixedStepCosts
from runtime.step_costs import StepCostTable

CONFIDENCE_SCALE = 1 << 24  # confidences cross the step's one int64 device-to-host transfer as c * 2^24


def confidence_as_ints(confidence: torch.Tensor) -> torch.Tensor:
    """[S, K] confidences -> int64 (c * 2^24, rounded), to ride in the step's integer transfer."""
    return (confidence.float() * CONFIDENCE_SCALE).round().to(torch.int64)


def confidence_from_ints(values: list[int]) -> list[float]:
    """The inverse of ``confidence_as_ints`` on the host."""
    return [c / CONFIDENCE_SCALE for c in values]


CORRECTION_PRIOR = 32.0  # the diagnostic ratio's pseudo-drafts per position at ratio 1
CORRECTION_WINDOW = 4096.0  # verified drafts per position the diagnostic ratio weighs (older ones fade)
FIT_PRIOR = 1.0  # the fit's ridge precision around the calibration: the weight of a draft (see SurvivalCorrection)
FIT_WINDOW = 2048  # reached drafts per position the fit weighs (the newest)
FIT_EVERY = 2048  # reached drafts gathered before the fit is redone (checked when evidence is folded in)
REFIT_FOLDS = 8  # or after this many folds (FOLD_EVERY steps each) with any new evidence: a small batch learns too
REFIT_GROWTH = 0.25  # or once the new reached drafts are this share of those the window holds (a young fit moves)
FIT_LIMIT = 30.0  # the fit's parameters stay within +-this (the slope within [0, this])
NEWTON_STEPS = 2  # per refit, from the parameters before (warm: the fit moves little between refits)
HALVINGS = 12  # a Newton step that does not lower a position's penalized loss is halved up to this many times
DAMPED_STEPS = 8  # while a step had to be halved (far from the optimum), up to this many steps a refit
TRUSTED_STEP = 0.5  # a Newton step moving no parameter by more than this is taken without checking the loss
EXPLORE_EVERY = 32  # every this many decisions below whole blocks, the next step verifies whole blocks
FOLD_EVERY = 8  # steps of evidence the correction gathers before it folds them in (its numpy work, once for all)
FOLD_DEFERRED_MOST = 32  # a fold deferred to the device's wait (SurvivalCorrection.defer_to) runs at once past this
PLAIN_MIXED_MIN = 16  # plain mixed steps served before their own excess prices a mixed step's plain alternative
SMALL_STEP = 128  # a step of at most this many drafts (requests x max_draft_len) is decided in plain Python
HOLD_FIRST = 16  # steps the engine drafts nothing at a batch size after drafting did not pay there (DraftingHold)
HOLD_MOST = 512  # the hold doubles each time it did not pay again, up to this: one look costs a block's drafting
# a request's verify history (point 5 of the module doc): what its last verify with drafts did
HISTORY_NONE = 0  # no verify with drafts yet


def history_classes(max_draft_len: int) -> list[str]:
    """The verify-history classes of an engine drafting up to K drafts, in index order (2K + 1): ``none``, then
    ``rejected_at_j`` (its last verify accepted j drafts and rejected the next), then ``accepted_n`` (it accepted
    all n drafts it verified: it survives at least n)."""
    k = max_draft_len
    return ["none"] + [f"rejected_at_{j}" for j in range(k)] + [f"accepted_{n}" for n in range(1, k + 1)]


def next_history(history: int, verified: int, accepted: int, max_draft_len: int) -> int:
    """A request's class after a verify of ``verified`` drafts of which it accepted ``accepted`` (-1: unknown):
    unchanged where it verified none (or the outcome is unknown); ``rejected_at_{accepted}`` where it rejected one,
    else ``accepted_{verified}``. The device applies the same rule to a packed step it launches ahead
    (``runtime.packed_verify.history_after``)."""
    if verified <= 0 or accepted < 0:
        return history
    if accepted < verified:
        return 1 + min(accepted, max_draft_len - 1)
    return max_draft_len + min(verified, max_draft_len)


def history_rows(history, num: int, classes: int) -> np.ndarray:
    """[S] int64 classes, each below ``classes`` (None: every request ``HISTORY_NONE``)."""
    if history is None:
        return np.zeros(num, dtype=np.int64)
    rows = np.asarray(history, dtype=np.int64).reshape(-1)
    if rows.shape[0] != num or (rows.size and (rows.min() < 0 or rows.max() >= classes)):
        raise bad_history(history, num, classes)
    return rows


def history_list(history, num: int, classes: int) -> list[int]:
    """``history_rows`` in plain Python (a small step: no numpy calls, see the module doc)."""
    if history is None:
        return [HISTORY_NONE] * num
    rows = list(history)
    if len(rows) != num or any(not 0 <= h < classes for h in rows):
        raise bad_history(history, num, classes)
    return rows


def bad_history(history, num: int, classes: int) -> ValueError:
    return ValueError(f"confidence scheduling: {num} verify-history classes in 0..{classes - 1} expected, got "
                      f"{history!r}")


class SurvivalSkill:
    """How much the corrected survivals tell drafts apart, per position: of the drafts verified at position k, the
    Brier score of the survival the scheduler believed (corrected as when the step was decided) against what
    happened (the first k + 1 drafts all accepted), as a skill against always predicting the position's observed
    rate: ``1 - brier / (rate * (1 - rate))``. Near 0: the survivals are the position's average for every request
    (however well calibrated, a schedule can then only cap all requests alike); 1: they foretell each draft.
    Negative: worse than the average (miscalibrated). Only verified drafts count, so a load whose budget trims
    late positions scores them on what it still verified."""

    def __init__(self, max_draft_len: int):
        self.verified = np.zeros(max_draft_len)  # [K] drafts verified at each position
        self.survived = np.zeros(max_draft_len)  # [K] of them, how many survived
        self.squared_error = np.zeros(max_draft_len)  # [K] summed (survival - survived)^2

    def add(self, survival: np.ndarray, lengths: np.ndarray, accepted: np.ndarray) -> None:
        """survival [S, K'] as believed, lengths [S] drafts verified, accepted [S] of them accepted (<= lengths)."""
        k = survival.shape[1]
        verified = np.arange(k)[None, :] < lengths[:, None]  # [S, K']
        survived = (np.arange(k)[None, :] < accepted[:, None]).astype(np.float64)  # [S, K']
        self.verified[:k] += verified.sum(axis=0)
        self.survived[:k] += (survived * verified).sum(axis=0)
        self.squared_error[:k] += (((survival - survived) ** 2) * verified).sum(axis=0)

    def per_position(self) -> list[float | None]:
        """[K] the skill at each position (rounded), None where fewer than 2 drafts were verified or all alike."""
        out = []
        for n, hits, error in zip(self.verified, self.survived, self.squared_error):
            rate = hits / n if n else 0.0
            spread = rate * (1.0 - rate)
            out.append(round(float(1.0 - error / n / spread), 4) if n >= 2 and spread > 0 else None)
        return out


class SurvivalCorrection:
    """The survivals the scheduler believes, corrected online by what the engine's own verifications accepted.

    **The fit** (what the scheduler ranks and prices by): each draft's conditional survival (its prefix survived)
    is ``sigmoid(a_k logit(c_k) + b_k + d_{h,k})`` for a request of verify-history class h, its survival the
    cumulative product along the block (so non-increasing). Per position, ``a_k`` (the slope), ``b_k`` and the class
    offsets ``d_{h,k}`` are a logistic regression on the drafts of that position the engine reached (verified, its
    prefix accepted) and whether each was accepted: the last ``FIT_WINDOW`` of them, a ridge prior of precision
    ``FIT_PRIOR`` at the offline calibration (``a_k = 1 / T_k``, no bias: with no evidence the survivals are STS's),
    redone by ``NEWTON_STEPS`` Newton steps once ``FIT_EVERY`` new drafts were reached. Where the head tells drafts
    apart the slope keeps that; where it does not (a drafter trained briefly: one run) the slope falls and each
    class's bias carries what the requests' histories tell; a bias of the whole position is what the ratio
    correction of earlier runs learned (the offline temperature, fitted on other text, left the late drafts' survivals
    10-25% low, and the scheduler trimmed drafts that would have paid). A multiplicative ratio could not separate
    requests whose survivals spread over orders of magnitude (a temperature of 0.1 pushes them to 0 or 1): a ratio
    of 3 on 1e-6 is still nothing, where a fitted slope of 0.2 brings them to the class's rate.

    **The diagnostic** ``ratio`` [K] (metrics only): of the drafts verified at position k, how many survived over the
    survival the offline calibration predicted for them, with a prior of ``CORRECTION_PRIOR`` drafts at ratio 1 (at
    the position's mean prediction) and a window of ``CORRECTION_WINDOW`` verified drafts.

    A position is learned only where drafts reach it (see ``EXPLORE_EVERY``). Evidence is folded in every
    ``FOLD_EVERY`` steps, the fit made at the first fold with evidence, then redone once ``FIT_EVERY`` new drafts were
    reached, the new ones are ``REFIT_GROWTH`` of the window's, or ``REFIT_FOLDS`` folds went by (a refit costs ~0.7
    ms of numpy: at 64 requests once per ~8 steps; at a few requests each time the evidence grew by a quarter while
    the window fills, at least once per 64 steps); an engine whose executor runs host work while the device computes
    (``defer_to``) folds there, off the step's path, and refits there a slice at a time within its budget.

    The ridge is light (``FIT_PRIOR``: the weight of one draft per parameter): a Gaussian prior on the logit weighs
    most in the tails, and at 4 (the weight of a few drafts) a request whose drafter accepted nothing was still
    believed to keep 7% of its first drafts after 80 rejections (1.17 tokens a step expected where 1.0 came), so
    drafting still looked as if it paid against plain decoding (one run at one request: 0.97 of the tuned
    throughput); at 1, 4% after 24 steps, and the engine stops drafting there (``DraftingHold``)."""

    def __init__(self, max_draft_len: int, inverse_temperatures: np.ndarray | None = None):
        k = max_draft_len
        self.history_names = history_classes(k)
        classes = len(self.history_names)
        inverse = np.ones(k) if inverse_temperatures is None else np.asarray(inverse_temperatures, dtype=np.float64)
        self.inverse_temperatures = inverse[:k]
        # the diagnostic ratio
        self.predicted = np.zeros(k)  # [K] summed calibrated survival of the verified drafts
        self.survived = np.zeros(k)  # [K] how many of them survived
        self.verified = np.zeros(k)  # [K] how many were verified
        self.ratio = np.ones(k)  # [K]
        # the fit: per position (slope, intercept, one offset per class), at the calibration until evidence moves it
        self.prior = np.zeros((k, 2 + classes))
        self.prior[:, 0] = self.inverse_temperatures
        self.theta = self.prior.copy()  # [K, 2 + H]
        self._x = np.zeros((k, FIT_WINDOW))  # [K, W] logit(c) of the reached drafts (a ring per position)
        self._h = np.zeros((k, FIT_WINDOW), dtype=np.int64)  # [K, W] their requests' classes
        self._y = np.zeros((k, FIT_WINDOW))  # [K, W] 1 where accepted
        self._filled = np.zeros(k, dtype=np.int64)  # [K] ring entries in use
        self._next = np.zeros(k, dtype=np.int64)  # [K] where the next one goes
        self._new = 0  # reached drafts since the last fit
        self._folds = 0  # folds since the last fit
        self._lock = threading.Lock()  # evidence and refits: the engine's thread and a metrics scrape's
        self._set_parameters()
        self.learned = False  # no fit yet: the survivals are the calibration's
        self._evidence: list[tuple] = []  # steps not yet folded in: (confidence, allotted, verified, accepted, history)
        # where a due fold waits to run while the device computes the next step (the engine's executor's host work,
        # ``runtime.transfer.HostWork``); None: at once, in ``learn``
        self.defer_to = None
        self._fold_queued = False
        self._refit = None  # a deferred refit under way (its slices: _refit_slices), or None
        self.skill = SurvivalSkill(k)  # how sharp the believed survivals were (metrics; reset_skill)

    def _set_parameters(self) -> None:
        """The fit's parameters as the survivals read them: ``slope`` [K] and ``bias`` [H, K] (numpy and lists)."""
        self.slope = self.theta[:, 0].copy()
        self.bias = (self.theta[:, 1][:, None] + self.theta[:, 2:]).T.copy()  # [H, K]
        self.bias_factor = np.exp(-self.bias)  # [H, K]: sigmoid(a x + b) = 1 / (1 + odds ** a * exp(-b))
        self.slope_list, self.bias_list = self.slope.tolist(), self.bias.tolist()
        identity = bool((self.slope == 1.0).all() and (self.bias == 0.0).all())  # survival = cumprod(c)
        # what the survivals read, swapped in one assignment (a metrics scrape may refit while the engine decides)
        self._params = (self.slope, self.bias_factor, self.slope_list, self.bias_factor.tolist(), identity)

    def reset_skill(self) -> None:
        """Start the skill's sums afresh (a bench's next concurrency); the correction itself keeps its evidence."""
        with self._lock:
            self._fold()
            self.skill = SurvivalSkill(len(self.ratio))

    def survival(self, confidence, history=None) -> np.ndarray:
        """confidence [S, K'] (K' <= K; 0 where nothing was proposed), history [S] classes (None: all
        ``HISTORY_NONE``; classes of ``history_classes``) -> the believed survival [S, K'], in [0, 1] and
        non-increasing along each row."""
        confidence = np.asarray(confidence, dtype=np.float64)
        slope, bias_factor, _, _, identity = self._params
        if identity:
            return np.cumprod(np.maximum(confidence, 0.0), axis=1)
        rows = history_rows(history, confidence.shape[0], len(self.history_names))
        return fitted_survival(confidence, slope, bias_factor[rows, :confidence.shape[1]])

    def survival_row(self, confidence: list[float], k: int, history: int = HISTORY_NONE) -> list[float]:
        """``survival`` of one request's confidences [K'] in plain Python, padded with 0 to ``k``."""
        out, alive = [0.0] * k, 1.0
        _, _, slope, factors, identity = self._params
        factor = factors[history]
        for j, c in enumerate(confidence):
            if not c > 0:  # nothing proposed here (or a confidence of 0): no draft from here on survives
                break
            if not identity:
                c = min(max(c, 1e-9), 1 - 1e-9)
                c = 1.0 / (1.0 + ((1.0 - c) / c) ** slope[j] * factor[j])
            alive *= c
            out[j] = alive
        return out

    def learn(self, confidence, allotted, verified, accepted, history=None) -> None:
        """One step's verified requests: ``confidence`` [S, K'] the head's confidences (0 past a block; an array or
        S lists of one length), ``allotted`` [S] the drafts each was allotted and ``verified`` [S] how many it
        verified (the lesser counts), ``accepted`` [S] how many of them it accepted (-1: unknown, left out),
        ``history`` [S] each one's class when the step was decided (None: all ``HISTORY_NONE``); converted when
        folded in with the steps before it, once ``FOLD_EVERY`` have gathered: at once, or with ``defer_to`` set, by a
        task queued there (the fold and the refit it may bring, ~3 ms of numpy per 8 steps at 256 requests on a
        2-core host, then run while the device computes the next step instead of between steps; the decisions it
        would have moved read it a step later: the fit lags ``FOLD_EVERY`` steps anyway). Deferred folds that do
        not get to run (no step waits on the device) run here once ``FOLD_DEFERRED_MOST`` steps gathered."""
        with self._lock:
            self._evidence.append((confidence, allotted, verified, accepted, history))
            gathered = len(self._evidence)
            if gathered < FOLD_EVERY:
                return
            if self.defer_to is None or gathered >= FOLD_DEFERRED_MOST:
                self._fold()
                return
            if self._fold_queued:
                return
            self._fold_queued = True
        self.defer_to.add(self._deferred_fold)

    def _deferred_fold(self) -> None:
        with self._lock:
            self._fold_queued = False
            self._fold()

    def fold(self) -> None:
        """Fold the gathered steps' evidence into the diagnostic's sums and the fit's window; refit if due. Safe
        beside the engine's own calls (a metrics scrape folds from another thread)."""
        with self._lock:
            self._fold()

    def refit_now(self) -> None:
        """Fold the gathered evidence in and refit, whatever is due (a judgement that depends on the newest step);
        a deferred refit under way is dropped (this one fits newer evidence)."""
        with self._lock:
            self._fold()
            self._refit = None
            self.refit()

    def _fold(self) -> None:
        if not self._evidence:
            return
        steps = [np.asarray(confidence, dtype=np.float64).reshape(len(accepted), -1)
                 for confidence, _, _, accepted, _ in self._evidence]  # each [S, K']
        k = max(step.shape[1] for step in steps)
        confidence = np.concatenate([np.pad(c, ((0, 0), (0, k - c.shape[1]))) if c.shape[1] < k else c
                                     for c in steps])  # [sum S, K'] (0 past a step's blocks)
        lengths = np.minimum(np.concatenate([np.asarray(a, dtype=np.int64) for _, a, _, _, _ in self._evidence]),
                             np.concatenate([np.asarray(v, dtype=np.int64) for _, _, v, _, _ in self._evidence]))
        accepted = np.concatenate([np.asarray(a, dtype=np.int64) for _, _, _, a, _ in self._evidence])
        classes = len(self.history_names)
        history = np.concatenate([history_rows(h, len(a), classes) for _, _, _, a, h in self._evidence])  # [sum S]
        self._evidence = []
        known = accepted >= 0
        if not known.any():
            return
        lengths = np.where(known, np.minimum(lengths, k), 0)  # [S]: a request left out verified nothing
        accepted = np.where(known, np.minimum(accepted, lengths), 0)
        self.skill.add(self.survival(confidence, history), lengths, accepted)  # as believed when decided
        self._add_diagnostic(fitted_survival(confidence, self.inverse_temperatures), lengths, accepted)  # STS's
        c = np.minimum(np.maximum(confidence, 1e-9), 1 - 1e-9)
        logit = np.log(c) - np.log1p(-c)  # [S, K']
        for j in range(k):  # the drafts at position j the engine reached: verified, every draft before accepted
            reached = (j < lengths) & (accepted >= j)
            count = int(reached.sum())
            if count:
                self._append(j, logit[reached, j], history[reached], (accepted[reached] > j).astype(np.float64))
                self._new += count
        self._folds += 1
        # the first fit at the first fold with evidence, then again whenever the evidence grew by REFIT_GROWTH: a
        # small batch would otherwise believe the calibration, then its first few drafts' fit, for REFIT_FOLDS x
        # FOLD_EVERY steps (64 at one request; those runs' drafters accepted nothing there, and the engine
        # kept drafting for 0.93-0.97 of the tuned throughput). Refits grow geometric, then every REFIT_FOLDS folds.
        if self._new >= FIT_EVERY or (self._new and (self._folds >= REFIT_FOLDS or not self.learned
                                                     or self._new >= REFIT_GROWTH * int(self._filled.sum()))):
            if self.defer_to is None:
                self.refit()
            elif self._refit is None:  # in slices, in the host work's budget (a refit already running: it goes on)
                self._refit = self._refit_slices()
                self.defer_to.add(self._advance_refit)

    def _advance_refit(self) -> None:
        """A deferred refit's next slice (``_refit_slices``); queued again until it ends."""
        with self._lock:
            if self._refit is None:  # (superseded by a refit at once: refit_now)
                return
            try:
                next(self._refit)
            except StopIteration:
                self._refit = None
                return
        self.defer_to.add(self._advance_refit)

    def _add_diagnostic(self, survival: np.ndarray, lengths: np.ndarray, accepted: np.ndarray) -> None:
        k = survival.shape[1]
        # at position j: the requests that verified (accepted) more than j drafts (counts, reverse-cumulated)
        self.verified[:k] += np.bincount(lengths, minlength=k + 1)[::-1].cumsum()[::-1][1:]
        self.survived[:k] += np.bincount(accepted, minlength=k + 1)[::-1].cumsum()[::-1][1:]
        self.predicted[:k] += (survival * (np.arange(k)[None, :] < lengths[:, None])).sum(axis=0)
        if self.verified.max() > CORRECTION_WINDOW:  # the oldest evidence fades past the window
            scale = np.minimum(1.0, CORRECTION_WINDOW / np.maximum(self.verified, 1.0))  # [K]
            self.predicted *= scale
            self.survived *= scale
            self.verified *= scale
        # the prior: CORRECTION_PRIOR drafts at the position's mean prediction, all surviving as predicted
        prior = CORRECTION_PRIOR * self.predicted / np.maximum(self.verified, 1e-12)  # [K]
        positive = self.predicted + prior > 0  # a position never verified, or predicted 0 throughout: ratio 1
        self.ratio = np.where(positive, (self.survived + prior) / np.where(positive, self.predicted + prior, 1.0),
                              1.0)

    def _append(self, j: int, x: np.ndarray, h: np.ndarray, y: np.ndarray) -> None:
        """Position ``j``'s reached drafts into its ring (the newest ``FIT_WINDOW`` kept)."""
        x, h, y = x[-FIT_WINDOW:], h[-FIT_WINDOW:], y[-FIT_WINDOW:]
        slots = (self._next[j] + np.arange(len(x))) % FIT_WINDOW
        self._x[j, slots], self._h[j, slots], self._y[j, slots] = x, h, y
        self._next[j] = (self._next[j] + len(x)) % FIT_WINDOW
        self._filled[j] = min(FIT_WINDOW, self._filled[j] + len(x))

    def refit(self) -> None:
        """Refit at once (``_refit_slices`` run to the end): see there."""
        for _ in self._refit_slices():
            pass

    def _refit_slices(self):
        """``NEWTON_STEPS`` Newton steps of every position's ridge logistic regression, from the current parameters.
        The features are logit(c), 1 and the class's one-hot, so the gradient and Hessian are sums per position and
        class of a few weighted terms: one ``bincount`` each over the window (a refit of 7 x 2048 drafts ~0.7 ms on a
        2-core CPU host, where dense [K, W, F] products of 7 x 4096 and four steps cost 5). A step that moves a
        parameter by more than ``TRUSTED_STEP`` is damped: a position whose penalized loss it does not lower takes
        half of it, and so on (``HALVINGS``), else none of it; while steps are being halved (the fit far from its
        optimum), up to ``DAMPED_STEPS`` steps a refit.
        A full Newton step from saturated probabilities (a head whose logits spread over tens, read at a slope of 10:
        a calibration temperature of 0.1) has a Hessian near the ridge alone and jumps to the parameters' limits:
        one run at 256 requests fitted position 0 at slope 30 and bias 30 (``FIT_LIMIT``), believed a survival of 0.85
        where 0.57 survived (Brier skill -0.34) and verified drafts that did not pay.
        A generator: it yields after taking its copy, within each Newton step and before each loss it evaluates
        (slices of ~0.1-0.4 ms of numpy on a 2-core host; a whole refit 1.3 ms typically, up to 4.3 while steps are
        halved), so a deferred refit runs a slice at a time in the host work's budget (``_advance_refit``); it fits
        a copy of the window taken at its start (folds may come in between) and sets the parameters at its end. Its
        caller holds the lock around each slice."""
        self._new = self._folds = 0
        k, classes = self._x.shape[0], len(self.history_names)
        # the rings fill from their first slot: until one wraps, no slot past the fullest holds a draft, and a young
        # window (refitted the most often: REFIT_GROWTH) costs its size, not FIT_WINDOW's
        width = int(self._filled.max())
        used = (np.arange(width)[None, :] < self._filled[:, None]).astype(np.float64)  # [K, W]
        member = self._h[:, :width].copy()  # [K, W] each draft's class
        index = (np.arange(k)[:, None] * classes + member).reshape(-1)  # [K*W] position-major (position, class)
        x, y = self._x[:, :width].copy(), self._y[:, :width].copy()
        yield

        def per_class(weights: np.ndarray) -> np.ndarray:  # [K, W] -> [K, H] summed per position and class
            return np.bincount(index, weights=weights.reshape(-1), minlength=k * classes).reshape(k, classes)

        def linear(theta: np.ndarray) -> np.ndarray:  # [K, F] -> eta [K, W]
            return theta[:, :1] * x + theta[:, 1:2] + np.take_along_axis(theta[:, 2:], member, axis=1)

        def loss(theta: np.ndarray) -> np.ndarray:  # [K, F] -> [K] each position's penalized negative log-likelihood
            eta = linear(theta)
            return (used * (np.logaddexp(0.0, eta) - y * eta)).sum(1) \
                + 0.5 * FIT_PRIOR * ((theta - self.prior) ** 2).sum(1)

        def bounded(theta: np.ndarray) -> np.ndarray:
            theta = theta.copy()
            theta[:, 0] = np.clip(theta[:, 0], 0.0, FIT_LIMIT)  # the head's order is kept (or ignored), never reversed
            theta[:, 1:] = np.clip(theta[:, 1:], -FIT_LIMIT, FIT_LIMIT)
            return theta

        theta = self.theta.copy()
        ridge = FIT_PRIOR * np.eye(2 + classes)
        damped = False
        for step_index in range(DAMPED_STEPS):
            if step_index >= NEWTON_STEPS and not damped:
                break
            eta = linear(theta)  # [K, W]
            p = 0.5 * (1.0 + np.tanh(0.5 * eta))  # sigmoid, without exp's overflow
            residual, weight = (p - y) * used, p * (1.0 - p) * used
            r, rx = per_class(residual), per_class(residual * x)  # [K, H]
            yield
            w, wx, wxx = per_class(weight), per_class(weight * x), per_class(weight * x * x)
            gradient = np.concatenate([rx.sum(1, keepdims=True), r.sum(1, keepdims=True), r], axis=1) \
                + FIT_PRIOR * (theta - self.prior)  # [K, F]
            hessian = np.zeros((k, 2 + classes, 2 + classes))
            hessian[:, 0, 0], hessian[:, 0, 1], hessian[:, 1, 1] = wxx.sum(1), wx.sum(1), w.sum(1)
            hessian[:, 1, 0] = hessian[:, 0, 1]
            diagonal = np.arange(classes) + 2
            hessian[:, 0, 2:] = hessian[:, 2:, 0] = wx
            hessian[:, 1, 2:] = hessian[:, 2:, 1] = w
            hessian[:, diagonal, diagonal] = w
            step = np.linalg.solve(hessian + ridge, gradient[..., None])[..., 0]  # [K, F]
            yield
            # a slope the step would take below 0 stops at 0, and the other parameters take the Newton step given
            # that (the bound's active set): clipping the slope alone dropped the part of the step it stood for,
            # and where every draft at a position has one confidence (logit(c) and 1 collinear) that was most of
            # it: 80 rejections in a row moved a survival of 0.55 only to 0.21
            pinned = theta[:, 0] - step[:, 0] < 0.0
            if pinned.any():
                h, g = (hessian + ridge)[pinned], gradient[pinned]  # [P, F, F], [P, F]
                moved = theta[pinned, 0]  # the slope's step: to 0
                rest = np.linalg.solve(h[:, 1:, 1:], (g[:, 1:] - h[:, 1:, 0] * moved[:, None])[..., None])[..., 0]
                step[pinned] = np.concatenate([moved[:, None], rest], axis=1)
            scale, worse = np.ones(k), np.zeros(k, dtype=bool)
            candidate = bounded(theta - step)
            searched = np.abs(step).max(axis=1) > TRUSTED_STEP  # near the optimum a Newton step is taken as is
            if searched.any():
                before = loss(theta)
                slack = 1e-9 * (1.0 + np.abs(before))  # rounding: at the optimum a step changes nothing
                for _ in range(HALVINGS + 1):
                    yield
                    worse = searched & (loss(candidate) > before + slack)
                    if not worse.any():
                        break
                    scale = np.where(worse, 0.5 * scale, scale)
                    candidate = bounded(theta - scale[:, None] * step)
            theta = np.where(worse[:, None], theta, candidate)  # a position no step lowered keeps its parameters
            damped = bool((scale < 1.0).any())
        self.theta = theta
        self._set_parameters()
        self.learned = True

    def fitted(self) -> dict:
        """The fit as it stands (metrics): ``slope`` [K] and ``bias`` per class [K], rounded."""
        with self._lock:
            self._fold()
            return {"slope": [round(float(a), 4) for a in self.slope],
                    "bias": {name: [round(float(b), 4) for b in row]
                             for name, row in zip(self.history_names, self.bias)}}


def fitted_survival(confidence: np.ndarray, slope: np.ndarray, bias_factor: np.ndarray | float = 1.0) -> np.ndarray:
    """confidence [S, K] (0 where nothing was proposed), slope [>= K], bias_factor [S, K] (exp(-bias); 1: no bias)
    -> the cumulative product of ``sigmoid(slope_k logit(c_k) + bias)`` [S, K]. At ``slope = 1 / T`` and no bias,
    the offline calibration's survival (STS)."""
    c = np.minimum(np.maximum(confidence, 1e-9), 1 - 1e-9)  # ufuncs: ndarray.clip costs ~5 us more per step
    factor = ((1.0 - c) / c) ** slope[:c.shape[1]] * bias_factor
    return np.cumprod(np.where(confidence > 0, 1.0 / (1.0 + factor), 0.0), axis=1)


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
    # the drafting judgement's plain alternative (point 6): the ms it priced a plain step of the same requests at (a
    # token each, nothing drafted), and whether drafting paid against it (None: no plain steps profiled)
    plain_ms: float | None = None
    drafting_pays: bool | None = None
    # whether this decision raised the next one's budget to whole blocks to gather evidence (``_explores``)
    explores: bool = False


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
        # judged against once PLAIN_MIXED_MIN of them were served (before: the drafting steps' excess read per
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
        self.explored = 0  # of them, raised to whole blocks to gather evidence (EXPLORE_EVERY)
        # the last allot's (confidences [S, K] padded with 0, lengths, history), to learn (arrays or lists)
        self._pending: tuple | None = None
        self._unsettled = None  # a deferred decision's rest, until it ran (allot_deferred, settle)

    def defer_learning(self, host_work) -> None:
        """Fold the survival fit's evidence (and refit) in tasks queued on ``host_work`` (``runtime.transfer.HostWork``:
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
        excess), which prices a mixed step's plain alternative once it has seen ``PLAIN_MIXED_MIN``."""
        if self.plain_mixed is not None:
            self.plain_mixed.observe(batch, batch, seconds, context, other_tokens)

    def graph_rows(self, num: int) -> int:
        """The requests a graphed step of ``num`` requests computes: its graph's batch (``num`` past the largest)."""
        return bucket_of(self.graph_batches, num) or num

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
        learned from plain mixed steps (``plain_mixed``, once ``PLAIN_MIXED_MIN`` were served: a drafting hold's), or
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
            if self.plain_mixed is not None and self.plain_mixed.observations >= PLAIN_MIXED_MIN:  # measured
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
        if num * self.max_draft_len <= SMALL_STEP:
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
        ``then()``, runs as a task on ``host_work`` (``runtime.transfer.HostWork``: while the device computes this
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
        folds evidence every ``FOLD_EVERY`` steps: after a change of load it can be a fit of other requests (one run
        on an H200: concurrency 1's one request rejected every draft; the four requests after it accepted 5.2
        tokens a request a step, and the first judgement, on a fit of that one request, held drafting off for 16 of
        their steps); the hold it reverses costs a step, not ``HOLD_FIRST``. Chosen by the decision's own rule (its
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
        """The ragged decision of ``allot`` in plain Python for a small step (``SMALL_STEP``): the same budget, the
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
        """``_allot_padded`` in plain Python for a small step (``SMALL_STEP``): the same decision."""
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
        """The packed layout (``runtime.packed_verify``): each request's proposed drafts' confidences (in block
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
        past the choice keeps being learned: every ``EXPLORE_EVERY``-th decision that is below whole blocks, and one
        that verifies nothing where drafting did not pay (``drafting_pays`` False: the next verify is the look after
        a drafting hold, and verifying nothing there would teach the fit nothing, so a belief that nothing pays
        could never be proved wrong)."""
        self.decisions += 1
        if below_whole_blocks and (self.decisions % EXPLORE_EVERY == 0 or (best == 0 and self.drafting_pays is False)):
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


def packed_draft_len(survival: np.ndarray, sizes: list[int], columns: int, max_draft_len: int) -> int | None:
    """How long a block the engine drafts for a packed step of ``columns`` columns, chosen (as ``columns``) before
    that block exists: from this step's ``survival`` [S, k] of blocks of ``sizes`` [S] drafts, the drafts the device
    would pick at those columns (``top_drafts``: the top ``S x columns`` survivals, as ``select_lengths`` ranks
    them), one past the longest share a request took; None (the whole block) for ``columns`` of whole blocks. A draft
    past the block proposes nothing (confidence 0, survival 0): the device never picks one while ``columns`` is
    shorter than the block, which it is (the longest share is at least the mean, ``columns``). So the block grows
    by one a step while some request takes all of it, and shrinks as soon as none does: on a pair whose acceptance
    falls along the block (0.55 / 0.17 / 0.15 ... at 64 requests) the packed steps stop drafting the
    positions no verify reaches, which cost the drafter as much as the ones it does (a block of 7 at 64 requests:
    0.9 ms of the drafter's, one run, beside a 6.7-ms trimmed step)."""
    num, k = survival.shape
    if columns >= max_draft_len or num == 0 or k == 0:
        return None
    if columns <= 0:
        return 1  # (nothing verified next step: the first draft keeps that position's confidence in view)
    proposed = np.arange(k)[None, :] < np.asarray(sizes)[:, None]  # [S, k]
    shares = top_drafts(survival, proposed, min(num * columns, int(proposed.sum())))
    return min(max_draft_len, int(shares.max()) + 1)


class DraftingHold:
    """Point 6 of the module doc, the engine's side: per batch size (``ConfidenceScheduler.bucket``), the steps on
    which it drafts nothing after drafting did not pay there. ``record`` each judgement at the step it was made:
    one that did not pay stops the drafting from that step for the hold (``HOLD_FIRST`` steps, doubling each time
    it did not pay again, up to ``HOLD_MOST``); one that paid resets it. After a hold the engine drafts a block (the
    look); the judgement at the step that verifies it was made before its outcome was known (the choice is taken from
    the drafts' confidences, not their verdicts), so it cannot start a hold: the drafting goes on one step more, and
    the next judgement, made once the look's outcome is learned (``ConfidenceScheduler.learn`` refits after a step
    judged not to pay), decides. A judgement that drafting does not pay made while the hold is on (the step that
    verifies the block drafted before the hold began: a packed step's decision is made a step ahead, a mixed one's
    while the step computes) neither restarts nor doubles the hold: it is the evidence the hold began on (counted
    twice, a first hold begun so lasted 33 steps, not 16, and the next one 64: one run at 256 requests ran 25 of its
    30 timed steps plain while drafting paid 1.4x). A hold begun by the judgement of a mixed step (prompt chunks
    beside the verifies: ``record(..., mixed=True)``) is a judgement of mixed steps, whose cost the chunks set: the
    first step that feeds none and admits nobody (``end_mixed``) ends it, and decode steps are judged on their own
    (one run's 256 requests: their hold most likely began while the last prompts were prefilled, the decode steps'
    judgements favouring drafting, and held the decode steps after them, where drafting paid 1.4x); its length (the
    next hold's) is kept. A judgement of a decode step made while such a hold is on makes it a hold of every step."""

    def __init__(self, first: int = HOLD_FIRST, most: int = HOLD_MOST):
        self.first, self.most = first, most
        self.until: dict[int, int] = {}  # bucket -> the first step it drafts again
        self.hold: dict[int, int] = {}  # bucket -> the next hold's length
        self.looked: dict[int, bool] = {}  # bucket -> the look after its last hold was judged already
        self.mixed: dict[int, int] = {}  # bucket -> the step its hold began at (a hold a mixed step's judgement began)
        self.holds = 0  # holds begun
        self.mixed_ended = 0  # holds a mixed step began that a decode step ended (end_mixed)

    def off(self, bucket: int, step: int) -> bool:
        """Whether the engine drafts nothing at ``step`` for a batch in ``bucket``."""
        return step < self.until.get(bucket, -1)

    def record(self, bucket: int, step: int, pays: bool, mixed: bool = False) -> None:
        """A judgement at ``step`` of a batch in ``bucket`` (``mixed``: of a step that fed prompt chunks too)."""
        if pays:
            for state in (self.until, self.hold, self.looked, self.mixed):
                state.pop(bucket, None)
            return
        if bucket in self.until:
            if step < self.until[bucket]:
                if not mixed:  # a decode step's judgement too: the hold holds every step
                    self.mixed.pop(bucket, None)
                return  # held already, on this evidence
            if not self.looked.get(bucket, False):
                self.looked[bucket] = True  # the look's own judgement: its outcome is not learned yet
                return
        hold = self.hold.get(bucket, self.first)
        self.until[bucket] = step + hold
        self.hold[bucket] = min(2 * hold, self.most)
        self.looked[bucket] = False
        if mixed:
            self.mixed[bucket] = step
        else:
            self.mixed.pop(bucket, None)
        self.holds += 1

    def end_mixed(self, step: int) -> int:
        """A step that feeds no prompt chunk and admits nobody (a decode step) at ``step``: the holds mixed steps'
        judgements began at earlier steps end, at every batch size (a batch grows as its prompts come in: the
        hold began at the size before; each one's length kept for the next) -> how many did."""
        ended = [bucket for bucket, began in self.mixed.items() if began < step and self.off(bucket, step)]
        for bucket in ended:
            for state in (self.until, self.looked, self.mixed):
                state.pop(bucket, None)
        self.mixed_ended += len(ended)
        return len(ended)


def top_drafts(survival: np.ndarray, proposed: np.ndarray, budget: int) -> np.ndarray:
    """The lengths [S] that verify the ``budget`` proposed drafts of highest survival (ties: the earlier position,
    then the earlier request), each request's a prefix of its block."""
    survival, proposed = np.asarray(survival, dtype=np.float64), np.asarray(proposed, dtype=bool)
    num = survival.shape[0]
    # position-major order (all first drafts, then all second drafts, ...), then a stable sort by survival
    values = np.where(proposed, survival, -1.0).T.reshape(-1)
    order = np.argsort(-values, kind="stable")[:budget]
    return np.bincount(order % num, minlength=num).astype(np.int64)


def read_calibration(source: str | Path | dict, what: str) -> list[float]:
    """Per-position temperatures: a JSON file ``{"temperatures": [...]}`` (or a config dict holding
    ``confidence_temperatures``). A bad file or value is an error naming ``what``."""
    try:
        data = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        values = data.get("temperatures", data.get("confidence_temperatures"))
        temps = [float(t) for t in ([values] if isinstance(values, (int, float)) else values)]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{what}: expected {{\"temperatures\": [positive numbers]}}: {exc}") from None
    if not temps or any(t <= 0 for t in temps):
        raise ValueError(f"{what}: temperatures must be positive numbers, got {temps}")
    return temps


TRACE_STEPS = 4096  # the step trace keeps the newest this many steps (ConfidenceStats.trace)
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
    unpacked_steps: int = 0  # packed layout: decided steps that verified whole blocks instead (runtime.engine)
    drafting_off_steps: int = 0  # steps that drafted nothing because drafting did not pay (DraftingHold)
    serial_steps: int = 0  # timed steps an engine that runs ahead did not launch ahead (priced with the excess)
    last: dict = field(default_factory=dict)
    # the newest TRACE_STEPS steps, one tuple of TRACE_FIELDS each (``record_step``): what the means above average
    # over, so a run's figures can be taken apart step by step (``trace_since``); a snapshot made with
    # ``dataclasses.replace`` starts an empty one (its counters are what a snapshot compares)
    trace: deque = field(default_factory=lambda: deque(maxlen=TRACE_STEPS), init=False, repr=False)

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
