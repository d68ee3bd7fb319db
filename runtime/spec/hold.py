"""Drafting holds: where drafting does not pay at a batch size, the engine drafts nothing there for a while
(``runtime.spec.confidence``, point 6)."""

from __future__ import annotations
from runtime.spec.tuning import TUNING


class DraftingHold:
    """Point 6 of the module doc, the engine's side: per batch size (``ConfidenceScheduler.bucket``), the steps on
    which it drafts nothing after drafting did not pay there. ``record`` each judgement at the step it was made:
    one that did not pay stops the drafting from that step for the hold (``TUNING.hold_first`` steps, doubling each time
    it did not pay again, up to ``TUNING.hold_most``); one that paid resets it. After a hold the engine drafts a block (the
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

    def __init__(self, first: int = TUNING.hold_first, most: int = TUNING.hold_most):
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
