"""The speculation guard's own host work per step, without an engine: ``python benchmarks/guard_host.py``.

For each batch size a ``SpeculationGuard`` is taught prices and every request's acceptance (each verifies 7 drafts,
6 accepted: drafting pays, every block verified), then one step's work is timed: the plan (``plan``: gains ranked,
the best number of blocks chosen, or a choice that everyone verifies standing) and the bookkeeping of every
request's verify (``observe_verifies``, one call a step as the engine makes it),
median of ``--rounds`` rounds of ``--steps`` steps. A second guard is taught that nobody accepts a draft, and its
plan with the step's price (``observe_step``) is timed while the batch decodes plain (``plain_batch_us``: an engine
that launches no step ahead plans every plain step). On a GPU this work adds to every DSpark step whose host work is
not hidden behind the device's. Runs on any CPU; ``--tree DIR`` times another checkout's guard (before/after).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from datetime import date
from pathlib import Path


def taught(batch: int, accepted: int):
    """A guard priced at ``batch`` requests (drafting steps 3 ms, plain 1 ms) whose requests each verified 20 blocks
    accepting ``accepted`` of 7 drafts -> (guard, request ids)."""
    from runtime.spec.guard import SpeculationGuard

    guard = SpeculationGuard(7)
    ids = [f"r{i}" for i in range(batch)]
    for step in range(20):
        guard.plan(step, ids)
        for request_id in ids:
            guard.observe_verify(request_id, 7, accepted)
        guard.observe_step(batch, True, 7 * batch, 0.003)
    for _ in range(6):
        guard.observe_step(batch, False, 0, 0.001)
    return guard, ids


def measure(batch: int, steps: int) -> tuple[float, float]:
    guard, ids = taught(batch, 6)
    start = time.perf_counter()
    for step in range(100, 100 + steps):
        guard.plan(step, ids)
    plan_s = (time.perf_counter() - start) / steps
    outcomes = [(request_id, 7, 6) for request_id in ids]
    batched = getattr(guard, "observe_verifies", None)  # (one call a step; a checkout without it: one a request)
    start = time.perf_counter()
    for _ in range(steps):
        if batched is not None:
            batched(outcomes)
        else:
            for request_id in ids:
                guard.observe_verify(request_id, 7, 6)
    return plan_s, (time.perf_counter() - start) / steps


def measure_plain(batch: int, steps: int) -> float:
    """Seconds a plan and its step's price take while a batch nobody's drafts pay for decodes plain."""
    guard, ids = taught(batch, 0)
    start = time.perf_counter()
    for step in range(100, 100 + steps):
        plan = guard.plan(step, list(ids))  # (the engine passes a new list each step)
        guard.observe_step(batch, plan.drafts, 0, 0.003 if plan.drafts else 0.001)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="1,64,256")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the checkout to time")
    parser.add_argument("--out")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    rows = []
    for batch in (int(b) for b in args.requests.split(",")):
        runs = [measure(batch, args.steps) for _ in range(args.rounds)]
        plain = [measure_plain(batch, args.steps) for _ in range(args.rounds)]
        rows.append({"requests": batch, "plan_us": round(1e6 * statistics.median(r[0] for r in runs), 1),
                     "observe_verifies_us": round(1e6 * statistics.median(r[1] for r in runs), 1),
                     "plain_batch_us": round(1e6 * statistics.median(plain), 1)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_record(args.out, "guard_host", args.tree, rows)


def write_record(path: str, benchmark: str, tree: str, rows: list[dict]) -> None:
    """A CPU benchmark's JSON record: its rows, the command that made them (this script's name is ``benchmark``),
    the host and the checkout timed."""
    Path(path).write_text(json.dumps({
        "benchmark": benchmark, "date": str(date.today()), "hardware": f"cpu ({platform.processor() or 'x86'})",
        "host": platform.node(), "command": f"python3 benchmarks/{benchmark}.py " + shlex.join(sys.argv[1:]),
        "tree": tree, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
