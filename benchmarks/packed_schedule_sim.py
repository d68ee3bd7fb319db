"""What the confidence scheduler's packed layout can gain over the best fixed draft length, on synthetic drafts priced
at a GPU run's measured step times: a CPU simulation of the scheduler's own code (``ConfidenceScheduler.allot_packed``
and its online survival fit), for planning, not a measurement of the engine.

Each step has ``--batch`` requests, each proposing K drafts. A request is "hard" with probability ``--hard-fraction``
(its drafts accepted with a conditional probability drawn from U(0.2, 0.7)) or "easy" (U(0.85, 0.99)), each position
jittered by N(0, 0.05); the confidence head reports sigmoid(logit(p) + N(0, ``--head-noise``)), calibrated by the
temperatures given (a drafter's ``confidence_temperatures``; default 1). Outcomes are drawn from p. A request keeps
its kind (hard or easy) from one step to the next with probability ``--persistence`` (else it is drawn again): 0,
every step independent; near 1, a request stays in a stretch its drafter predicts well or badly (one run on an H200:
the requests that survived two drafts survived them all).

Engines, each over the same sequence of steps:
- whole blocks, and every fixed cap 1..K (what a tuned ``draft_len_schedule`` picks among): the step feeds
  batch x (cap + 1) tokens, priced by the table;
- the packed scheduler: the columns chosen from the previous step, the device's selection (the top survivals over
  the step, corrected per verify-history class) verified, the correction learning the verified and accepted counts,
  each request's class following ``next_history``, as the engine does; a step of 0 < c < K columns costs the
  table's batch x (c + 1) cell plus ``--packed-overhead-ms`` (~0.3 ms);
- the same scheduler told no history (every request of class ``none``: the correction per position alone);
- with ``--plain-ms`` (a plain decode step at this batch, e.g. the AR engine's measured step): plain decoding (what a
  tuned schedule that drafts nothing there serves), and the packed scheduler judging its best choice against it
  (``drafting_pays``) with the engine's drafting holds (``DraftingHold``): a held step costs ``--plain-ms`` and
  commits a token a request (its draw skipped), the last one before a look also drafts (the verify-nothing cell
  less the plain step); each judgement is recorded before the step's outcome is learned, and a hold the refit after
  it reverses ends (``ConfidenceScheduler.learn``), as in the engine; beside it, the same with those holds kept
  (``*_kept``, the engine before 2be9a17);
- with ``--stale-steps N``: every scheduler first learns N steps of one confident request rejecting every draft (a
  fit of other requests, as one run's concurrency 1 before its 4 and 256).
Reports committed tokens per millisecond of each, and the packed scheduler against the best fixed cap (and with
``--plain-ms``, ``packed_with_holds_vs_best``: against the best of plain decoding and every fixed cap).

usage: python3 benchmarks/packed_schedule_sim.py --step-costs STEP_COSTS.json [--batch 256] [--hard-fractions
       0.2,0.5,0.8] [--persistence 0.9] [--temperatures T1,...,TK] [--plain-ms MS] [--stale-steps N]
       [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import numpy as np

from runtime.spec.confidence import ConfidenceScheduler
from runtime.spec.history import HISTORY_NONE, next_history
from runtime.spec.step_costs import StepCostTable


def synthetic_step(rng: np.random.Generator, batch: int, k: int, hard: np.ndarray,
                   head_noise: float) -> tuple[np.ndarray, np.ndarray]:
    """hard [B] each request's kind -> (the head's confidences [B, K], whether each draft is accepted given its
    prefix [B, K])."""
    base = np.where(hard, rng.uniform(0.2, 0.7, batch), rng.uniform(0.85, 0.99, batch))
    p = np.clip(base[:, None] + rng.normal(0.0, 0.05, (batch, k)), 0.01, 0.99)
    logit = np.log(p / (1 - p)) + rng.normal(0.0, head_noise, (batch, k))
    return 1.0 / (1.0 + np.exp(-logit)), rng.random((batch, k)) < p


def draw_steps(rng: np.random.Generator, batch: int, k: int, hard_fraction: float, persistence: float,
               head_noise: float, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``steps`` steps of one batch of requests, each keeping its kind with probability ``persistence``."""
    hard, draws = rng.random(batch) < hard_fraction, []
    for _ in range(steps):
        draws.append(synthetic_step(rng, batch, k, hard, head_noise))
        redraw = rng.random(batch) >= persistence
        hard = np.where(redraw, rng.random(batch) < hard_fraction, hard)
    return draws


def run_packed(scheduler: ConfidenceScheduler, draws: list, step_ms: np.ndarray, overhead_ms: float,
               use_history: bool, plain_ms: float | None = None,
               reversals: bool = True) -> tuple[float, list[int], int]:
    """The packed scheduler over ``draws``: -> (committed tokens per ms, the columns of each step, the steps held
    off). ``plain_ms``: with drafting holds, a held step's cost (the scheduler's table has plain steps); each
    judgement recorded into the hold before the step's outcome is learned, and a hold the refit after it reverses
    ended then, as the engine does (``reversals`` False: not ended, the engine before 2be9a17)."""
    batch, k = draws[0][0].shape
    history = [HISTORY_NONE] * batch
    tokens = ms = 0.0
    columns_chosen, held, step = [], 0, 0
    bucket = scheduler.bucket(batch)
    unblocked = False  # a hold reversed at the step before, which drafted nothing: this one only drafts
    for confidence, accepted in draws:
        if unblocked:
            tokens, ms, step, unblocked = tokens + batch, ms + step_ms[0], step + 1, False
            continue
        if plain_ms is not None and scheduler.hold.off(bucket, step):
            tokens += batch
            # the held step before a look drafts its block: the verify-nothing step less the plain one
            ms += plain_ms if scheduler.hold.off(bucket, step + 1) else step_ms[0]
            held, step = held + 1, step + 1
            continue
        classes = history if use_history else None
        budget = scheduler.allot_packed([list(row) for row in confidence], history=classes)
        columns = scheduler.step_columns
        judged = scheduler.drafting_pays if plain_ms is not None else None
        if judged is not None:
            scheduler.hold.record(bucket, step, judged)
        drafts_nothing = judged is not None and scheduler.hold.off(bucket, step)  # (a decision at once holds this
        # step's drafting)
        survival = scheduler.survival(confidence, classes)
        chosen = np.argsort(-survival.T.reshape(-1), kind="stable")[:budget]  # the device's top survivals
        lengths = np.bincount(chosen % batch, minlength=batch)
        run = np.cumprod(accepted, axis=1)
        committed = np.array([int(run[i, :lengths[i]].sum()) for i in range(batch)])
        if scheduler.learn(lengths.tolist(), committed.tolist()) and drafts_nothing and reversals:
            scheduler.hold.record(bucket, step, True)
            unblocked = True
        history = [next_history(h, int(n), int(a), k) for h, n, a in zip(history, lengths, committed)]
        tokens += batch + committed.sum()
        ms += step_ms[columns] + (overhead_ms if 0 < columns < k else 0.0)
        columns_chosen.append(columns)
        if drafts_nothing:  # this step drafts nothing: it costs the plain step, not a draft
            ms -= step_ms[0] - plain_ms
        step += 1
    return float(tokens / ms), columns_chosen, held


def stale(scheduler: ConfidenceScheduler, rng: np.random.Generator, k: int, head_noise: float,
          steps: int) -> ConfidenceScheduler:
    """``--stale-steps``: the scheduler first learns ``steps`` steps of one request whose head is confident (as an
    easy request's) and whose every draft is rejected (concurrency 1's one request before the four of
    concurrency 4), at its own batch size (its holds apart); its fit then believes confident drafts fail."""
    history = HISTORY_NONE
    for _ in range(steps):
        confidence, _ = synthetic_step(rng, 1, k, np.zeros(1, dtype=bool), head_noise)
        scheduler.allot_packed([list(confidence[0])], history=[history])
        scheduler.learn([k], [0])
        history = next_history(history, k, 0, k)
    return scheduler


def simulate(table: StepCostTable, batch: int, k: int, hard_fraction: float, persistence: float, head_noise: float,
             temperatures: list[float] | None, steps: int, overhead_ms: float, seed: int,
             plain_ms: float | None = None, stale_steps: int = 0) -> dict:
    step_ms = table.predict_ms_many(batch, batch * (np.arange(k + 1) + 1))  # [K+1] a uniform step of q drafts
    draws = draw_steps(np.random.default_rng(seed), batch, k, hard_fraction, persistence, head_noise, steps)
    fixed = {}
    for cap in range(1, k + 1):
        tokens = sum(batch + np.cumprod(accepted, axis=1)[:, :cap].sum() for _, accepted in draws)
        fixed[cap] = float(tokens / (steps * step_ms[cap]))

    def fresh(costs: StepCostTable) -> ConfidenceScheduler:
        scheduler = ConfidenceScheduler(k, costs, temperatures, layout="packed")
        return stale(scheduler, np.random.default_rng(seed + 1), k, head_noise, stale_steps)

    scheduler = fresh(table)
    packed, columns_chosen, _ = run_packed(scheduler, draws, step_ms, overhead_ms, use_history=True)
    alone = fresh(table)
    packed_alone, columns_alone, _ = run_packed(alone, draws, step_ms, overhead_ms, use_history=False)
    best_cap = max(fixed, key=fixed.get)
    holds = {}
    if plain_ms is not None:
        with_plain = table.copy()
        with_plain.plain = StepCostTable([batch], [batch], [[plain_ms]])
        holding = fresh(with_plain)
        held_rate, _, held = run_packed(holding, draws, step_ms, overhead_ms, use_history=True, plain_ms=plain_ms)
        kept = fresh(with_plain)  # the holds the refit reverses kept (the engine before 2be9a17)
        kept_rate, _, kept_held = run_packed(kept, draws, step_ms, overhead_ms, use_history=True, plain_ms=plain_ms,
                                             reversals=False)
        plain_rate = batch / plain_ms
        best = max(plain_rate, fixed[best_cap])
        holds = {"plain_tokens_per_ms": plain_rate, "packed_with_holds_tokens_per_ms": held_rate,
                 "packed_with_holds_vs_best": held_rate / best, "packed_vs_best": packed / best,
                 "held_step_share": held / steps, "drafting_holds": holding.hold.holds,
                 "drafting_judgements_reversed": holding.reversals,
                 "packed_with_holds_kept_vs_best": kept_rate / best, "held_step_share_kept": kept_held / steps}
    return {**holds, "hard_fraction": hard_fraction, "persistence": persistence, "fixed_tokens_per_ms": fixed,
            "whole_blocks_tokens_per_ms": fixed[k], "best_fixed_cap": best_cap, "packed_tokens_per_ms": packed,
            "packed_vs_best_fixed": packed / fixed[best_cap], "packed_vs_whole_blocks": packed / fixed[k],
            "mean_columns": float(np.mean(columns_chosen[steps // 4:])),
            "packed_without_history_vs_best_fixed": packed_alone / fixed[best_cap],
            "mean_columns_without_history": float(np.mean(columns_alone[steps // 4:])),
            "survival_correction": [round(float(r), 4) for r in scheduler.correction.ratio],
            "survival_fit": scheduler.correction.fitted(),
            "survival_skill_per_position": scheduler.correction.skill.per_position(),
            "survival_skill_per_position_without_history": alone.correction.skill.per_position()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-costs", required=True, help="a StepCostTable JSON (dspark bench --profile-steps)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-draft-len", type=int, default=7)
    parser.add_argument("--hard-fractions", default="0.2,0.5,0.8")
    parser.add_argument("--head-noise", type=float, default=0.7)
    parser.add_argument("--persistence", type=float, default=0.0, help="the chance a request keeps its kind from one "
                        "step to the next (default 0: every step independent)")
    parser.add_argument("--temperatures", help="comma-separated, one per position (default: 1)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--packed-overhead-ms", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-ms", type=float, help="a plain decode step at this batch (ms): simulate plain "
                        "decoding and the drafting holds too")
    parser.add_argument("--stale-steps", type=int, default=0, help="first, this many steps of one confident request "
                        "rejecting every draft (a fit of other requests; see stale())")
    parser.add_argument("--out")
    args = parser.parse_args()
    table = StepCostTable.load(args.step_costs)
    temperatures = [float(t) for t in args.temperatures.split(",")] if args.temperatures else None
    rows = []
    for fraction in (float(f) for f in args.hard_fractions.split(",")):
        rows.append(simulate(table, args.batch, args.max_draft_len, fraction, args.persistence, args.head_noise,
                             temperatures, args.steps, args.packed_overhead_ms, args.seed, args.plain_ms,
                             args.stale_steps))
        print(json.dumps({key: rows[-1][key] for key in ("hard_fraction", "best_fixed_cap", "packed_vs_best_fixed",
                                                          "packed_without_history_vs_best_fixed",
                                                          "packed_vs_whole_blocks", "mean_columns", "packed_vs_best",
                                                          "packed_with_holds_vs_best", "held_step_share",
                                                          "packed_with_holds_kept_vs_best", "held_step_share_kept")
                          if key in rows[-1]}), flush=True)
    record = {"benchmark": "packed_schedule_sim", "kind": "CPU simulation (synthetic drafts, measured step costs)",
              "date": date.today().isoformat(), "host": platform.node(), "command": " ".join(["python3", *sys.argv]),
              "step_costs": args.step_costs, "batch": args.batch, "max_draft_len": args.max_draft_len,
              "head_noise": args.head_noise, "persistence": args.persistence, "temperatures": temperatures,
              "steps": args.steps,
              "packed_overhead_ms": args.packed_overhead_ms, "seed": args.seed, "plain_ms": args.plain_ms,
              "stale_steps": args.stale_steps,
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
