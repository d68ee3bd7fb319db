"""The speculation guard's choices replayed offline on a real drafter's verify outcomes, at a GPU run's step prices.

``record``: a DSpark engine with every block verified (the guard off) answers the evaluation sets' first turns
(greedy, up to ``--max-tokens``); each verify's (drafts, accepted) is kept per request, in order. ``replay``: the
requests go through ``runtime.spec.guard.SpeculationGuard`` (the engine's own class, its default tuning unless
``--memory`` / ``--prior-verifies`` / ``--margin`` say otherwise) at a fixed batch size, a finished request replaced
by the next; a step costs the plain price, or the drafting price (the whole price when everyone verifies, the fit's
base plus its per-draft price otherwise), and a drafting step right after a plain one what the record's whole steps in
their turn cost over a run's (``whole_serial_ms``, where priced); ``--unsteady F`` prices a plain step right after a
drafting one at F times a plain step (it is not launched ahead). A request verifying a block at text position p
accepts what the recorded verify covering p accepted from there on (the recorded run verified at other positions when
the guard skips blocks). Prints and writes tokens per ms over AR's (batch / plain price) for fixed K and for the
guard.

usage: python benchmarks/guard_replay.py record --out outcomes.json [--prompts 6] [--device cpu] [--dtype bfloat16]
       python benchmarks/guard_replay.py replay outcomes.json --prices e2e-record.json [--batch 1,4]
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATASETS = ("gsm8k", "mt-bench", "humaneval", "mbpp")


def record(args) -> dict:
    from runtime import LLM, SamplingParams
    from runtime.training.prompt_sets import read_turns

    spec = {"speculative_model": args.drafter, "max_draft_len": args.max_draft_len, "speculation_guard": False}
    dtype = args.dtype if args.dtype != "auto" else "float32" if args.device == "cpu" else "auto"
    llm = LLM(args.model, speculative_config=spec, device=args.device, dtype=dtype, max_num_seqs=32,
              max_model_len=2048)
    engine, outcomes = llm.engine, {}
    commit = engine._commit_step

    def commit_and_note(scheduled, results):  # (each verify's outcome, as the engine commits it)
        for entry, result in zip(scheduled, results):
            if entry.num_drafts and result.error is None:
                outcomes.setdefault(entry.request_id, []).append((entry.num_drafts, result.num_accepted))
        return commit(scheduled, results)

    engine._commit_step = commit_and_note
    rows = [(name, turns[0]) for name in DATASETS
            for turns in read_turns(ROOT / "benchmarks" / "data" / "eval" / f"{name}.jsonl")[:args.prompts]]
    llm.chat([[{"role": "user", "content": text}] for _, text in rows],
             [SamplingParams(max_tokens=args.max_tokens, temperature=0.0) for _ in rows])
    return {"kind": "verify_outcomes", "model": args.model, "drafter": args.drafter,
            "max_draft_len": args.max_draft_len, "max_tokens": args.max_tokens, "prompts_per_set": args.prompts,
            "device": args.device, "dtype": dtype, "host": platform.node(), "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/guard_replay.py " + shlex.join(sys.argv[1:]),
            "requests": list(outcomes.values())}


class Stream:
    """One recorded request: verify start positions and accepted counts, and its length in tokens."""

    def __init__(self, verifies: list[list[int]]):
        self.starts, self.accepted, position = [], [], 0
        for _, accepted in verifies:
            self.starts.append(position)
            self.accepted.append(accepted)
            position += accepted + 1
        self.length = position

    def accepted_at(self, position: int) -> int:
        i = bisect.bisect_right(self.starts, position) - 1
        if i < 0:
            return 0
        return max(self.accepted[i] - (position - self.starts[i]), 0)


def replay(streams: list[Stream], batch: int, prices: dict, max_draft_len: int, tuning=None, guarded: bool = True,
           unsteady: float = 1.0, passes: int = 3) -> dict:
    """Tokens per ms of ``batch`` requests served from ``streams`` (``passes`` times over) -> stats."""
    from runtime.spec.guard import SpeculationGuard

    guard = SpeculationGuard(max_draft_len, tuning, runs_ahead=False)
    plain, drafting, whole, per_draft = prices["plain_ms"], prices["drafting_ms"], prices["whole_ms"], \
        prices["ms_per_verified_draft"]
    # a drafting step right after a plain one runs in its turn (not launched ahead): what such whole steps cost over
    # a run's, where the record priced both (``whole_serial_ms``)
    serial_extra = max(prices.get("whole_serial_ms") - whole, 0.0) if prices.get("whole_serial_ms") else 0.0
    served = 0

    def next_request():
        nonlocal served
        served += 1
        return [str(served), streams[served % len(streams)], 0]

    slots = [next_request() for _ in range(batch)]
    tokens, ms, step, last = 0, 0.0, 0, None  # last: (drafted, verifiers) of the step before
    while served < passes * len(streams):
        if guarded:
            plan = guard.plan(step, [s[0] for s in slots])
            drafts, verifiers = plan.drafts, plan.verifiers
        else:
            drafts, verifiers = True, None
        verified = 0
        for s in slots:
            got = 1
            if last is not None and last[0] and (last[1] is None or s[0] in last[1]):
                accepted = min(s[1].accepted_at(s[2]), max_draft_len)
                got, verified = got + accepted, verified + max_draft_len
                guard.observe_verify(s[0], max_draft_len, accepted)
            s[2] += got
            tokens += got
        everyone = last is not None and last[0] and last[1] is None
        if drafts:
            cost = whole if everyone else drafting + per_draft * verified
            cost += serial_extra if last is not None and not last[0] else 0.0
        else:
            cost = (plain + per_draft * verified) * (unsteady if last is not None and last[0] else 1.0)
        ms += cost
        guard.observe_step(batch, drafts, verified, cost / 1e3, True, False, everyone or verified == 0)
        last = (drafts, verifiers)
        slots = [s if s[2] < s[1].length else next_request() for s in slots]
        step += 1
    stats = guard.stats
    return {"over_ar": tokens / ms / (batch / plain), "steps": step,
            "drafting_share": stats.drafting_steps / max(stats.drafting_steps + stats.plain_steps, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="verify outcomes of a drafter with every block verified")
    rec.add_argument("--model", default="smollm2")
    rec.add_argument("--drafter", default="smollm2-dspark")
    rec.add_argument("--max-draft-len", type=int, default=7)
    rec.add_argument("--max-tokens", type=int, default=512)
    rec.add_argument("--prompts", type=int, default=6, help="first turns per evaluation set (default 6)")
    rec.add_argument("--device", default="cpu")
    rec.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                     help="the engine's dtype (default auto: float32 on the CPU, the engine's default elsewhere; a GPU "
                     "serves bfloat16, whose greedy answers and acceptance differ from float32's)")
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="the guard and fixed K on recorded outcomes at an e2e run's prices")
    rep.add_argument("outcomes")
    rep.add_argument("--prices", required=True, help="an e2e record (benchmarks/e2e_bench.py): the guard's prices "
                     "at each batch size, from the row of that concurrency (else the last row)")
    rep.add_argument("--batch", default="1,4")
    rep.add_argument("--unsteady", type=float, default=1.0)
    rep.add_argument("--memory", type=float)
    rep.add_argument("--prior-verifies", type=float)
    rep.add_argument("--margin", type=float)
    rep.add_argument("--out")
    args = parser.parse_args(argv)
    if args.command == "record":
        result = record(args)
        Path(args.out).write_text(json.dumps(result) + "\n")
        print(f"{len(result['requests'])} requests, {sum(len(r) for r in result['requests'])} verifies")
        return 0
    from runtime.spec.guard import GuardTuning

    outcomes = json.loads(Path(args.outcomes).read_text())
    streams = [Stream(r) for r in outcomes["requests"]]
    # each batch size priced as the guard had learned it when the run measured that concurrency (the tables drift:
    # a later level's drain passes through smaller batch sizes again)
    tables = {row["concurrency"]: row["speculation_guard"]["buckets"]
              for row in json.loads(Path(args.prices).read_text())["rows"]}
    overrides = {k: getattr(args, k) for k in ("memory", "prior_verifies", "margin") if getattr(args, k) is not None}
    tuning = GuardTuning(**overrides)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        prices = tables.get(batch, tables[max(tables)]).get(str(batch))
        if prices is None:
            parser.error(f"--prices: the record has no price at batch {batch}")
        if any(prices[k] is None for k in ("plain_ms", "drafting_ms", "whole_ms")):
            parser.error(f"--prices: the record has no full price at batch {batch}")
        fixed = replay(streams, batch, prices, outcomes["max_draft_len"], guarded=False, unsteady=args.unsteady)
        guard = replay(streams, batch, prices, outcomes["max_draft_len"], tuning, unsteady=args.unsteady)
        rows.append({"batch": batch, "prices": prices, "fixed_over_ar": round(fixed["over_ar"], 3),
                     "guard_over_ar": round(guard["over_ar"], 3), "guard_drafting_share": round(
                         guard["drafting_share"], 3), "steps": guard["steps"]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "prices"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "kind": "guard_replay", "outcomes": args.outcomes, "prices": args.prices, "tuning": overrides,
            "unsteady": args.unsteady, "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/guard_replay.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
