"""Confidence scheduling's constants in one frozen object: what each one sets is said beside it; the modules
read ``TUNING``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConfidenceTuning:
    """The constants of the survival fit (``survival``), the scheduler's decisions (``confidence``), drafting
    holds (``hold``) and the step trace (``stats``)."""

    # the diagnostic ratio's pseudo-drafts per position at ratio 1
    correction_prior: float = 32.0
    # verified drafts per position the diagnostic ratio weighs (older ones fade)
    correction_window: float = 4096.0
    # the fit's ridge precision around the calibration: the weight of a draft (see SurvivalCorrection)
    fit_prior: float = 1.0
    # reached drafts per position the fit weighs (the newest)
    fit_window: int = 2048
    # reached drafts gathered before the fit is redone (checked when evidence is folded in)
    fit_every: int = 2048
    # or after this many folds (fold_every steps each) with any new evidence: a small batch learns too
    refit_folds: int = 8
    # or once the new reached drafts are this share of those the window holds (a young fit moves)
    refit_growth: float = 0.25
    # the fit's parameters stay within +-this (the slope within [0, this])
    fit_limit: float = 30.0
    # per refit, from the parameters before (warm: the fit moves little between refits)
    newton_steps: int = 2
    # a Newton step that does not lower a position's penalized loss is halved up to this many times
    halvings: int = 12
    # while a step had to be halved (far from the optimum), up to this many steps a refit
    damped_steps: int = 8
    # a Newton step moving no parameter by more than this is taken without checking the loss
    trusted_step: float = 0.5
    # steps of evidence the correction gathers before it folds them in (its numpy work, once for all)
    fold_every: int = 8
    # a fold deferred to the device's wait (SurvivalCorrection.defer_to) runs at once past this
    fold_deferred_most: int = 32
    # every this many decisions below whole blocks, the next step verifies whole blocks
    explore_every: int = 32
    # plain mixed steps served before their own excess prices a mixed step's plain alternative
    plain_mixed_min: int = 16
    # a step of at most this many drafts (requests x max_draft_len) is decided in plain Python
    small_step: int = 128
    # steps the engine drafts nothing at a batch size after drafting did not pay there (DraftingHold)
    hold_first: int = 16
    # the hold doubles each time it did not pay again, up to this: one look costs a block's drafting
    hold_most: int = 512
    # the step trace keeps the newest this many steps (ConfidenceStats.trace)
    trace_steps: int = 4096


TUNING = ConfidenceTuning()
