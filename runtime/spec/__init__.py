"""Speculation policy: how much each step drafts and verifies.

- ``guard``: the speculation guard (on by default): per request and per batch, whether drafting pays at all, from
  acceptance and the engine's own step times; it drops whole blocks before they are verified.
- ``confidence``: confidence scheduling, the verify budget a step chooses from the drafter's confidences, in the
  ragged, padded or packed layout; with its parts: ``survival`` (the online survival fit), ``history`` (a request's
  verify-history class), ``hold`` (drafting holds), ``stats`` (what it decided and measured), ``wire`` (confidences
  in the step's integer transfer, what the runner needs).
- ``step_costs`` and ``mixed_step_costs``: the step-time model confidence scheduling prices its choices with.

Nothing here changes which token a request commits: every policy only shortens or drops blocks before they are
verified, from what was observed before the step.
"""
