"""``dspark bench --tune-schedule``: the fastest draft length per concurrency, timed against the sweep's DSpark engine, and
the schedule it writes (``read_schedule`` reads one back)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from bench.measure import time_steps
from bench.stats import alternating_rounds, median_round


def tune(args, engine_class, target: Path, spec: dict, common: dict, rows: dict, vocab: int, shape: bool,
         prompts: list[list[int]] | None = None, reference=None) -> dict:
    """``--tune-schedule``: DSpark step times at every shorter draft length k (an engine whose schedule drafts k above
    one request), the fastest length per concurrency (``bench.schedule_tuning``), the schedule written to
    ``args.tune_schedule`` as a config fragment ``dspark serve --config`` reads. -> the record's ``tuned_schedule``.

    With ``reference`` (the sweep's DSpark engine, still alive) each candidate is timed against it in alternating
    rounds and its step read in the sweep's terms: the median over rounds of candidate / reference step time, times
    the sweep's ``dspark_step_ms``, so the candidates of different lengths, timed minutes apart, compare as if timed
    together (the host's speed drifts). Without it, each candidate's own step time."""
    import torch

    from bench.schedule_tuning import Candidate, accepted_schedule, best_draft_lengths, projected_tau
    from runtime.engine.heap import freeze_long_lived, unfreeze_long_lived

    top = args.max_draft_len
    accept = args.acceptance_per_position

    def tau(c: int, k: int, measured: float | None) -> float:
        if k == 0:
            return 1.0
        return projected_tau(accept, k) if shape else measured

    candidates = []
    for c, row in rows.items():
        candidates += [Candidate(c, 0, row["ar_step_ms"], 1.0),
                       Candidate(c, top, row["dspark_step_ms"], tau(c, top, row["mean_acceptance_length"]))]
    top_c = max(rows)
    # (a sweep of one request alone has nothing to tune: one request drafts max_draft_len, the schedule's start)
    for k in range(1, top) if top_c > 1 else ():
        llm = engine_class(str(target), speculative_config={**spec, "draft_len_schedule": {1: top, top_c: k}},
                           **common)
        freeze_long_lived(f"bench engine k={k}")
        for c in sorted(rows):
            if c == 1:
                continue  # one request drafts max_draft_len: the engine's schedule starts there
            def measure(llm_):
                return time_steps(llm_, c, args.prompt_len, args.steps, args.warmup, vocab, seed=c, prompts=prompts)

            if reference is None:
                timing = measure(llm)
                step = timing["step_ms"]
            else:
                rounds = {"candidate": [], "reference": []}
                for kind, result in alternating_rounds({"candidate": llm, "reference": reference}, measure,
                                                       args.rounds):
                    rounds[kind].append(result)
                ratios = sorted(a["step_ms"] / b["step_ms"] for a, b in zip(rounds["candidate"], rounds["reference"]))
                step = ratios[len(ratios) // 2] * rows[c]["dspark_step_ms"]
                timing = median_round(rounds["candidate"])
            candidates.append(Candidate(c, k, step, tau(c, k, timing["mean_acceptance_length"])))
            print(f"dspark bench: tune k={k} concurrency {c}: {step:.2f} ms", file=sys.stderr, flush=True)
        llm.shutdown()
        del llm
        unfreeze_long_lived()
        gc.collect()  # engines hold reference cycles (graphs, caches): free their memory before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    best = best_draft_lengths(candidates)
    result = {"tau": "projected from --acceptance-per-position" if shape else "measured",
              "step_ms": "candidate / reference in alternating rounds x the sweep's dspark_step_ms"
              if reference is not None else "each candidate timed alone",
              "acceptance_per_position": accept if shape else None,
              "candidates": [{"concurrency": c.concurrency, "draft_len": c.draft_len, "step_ms": c.step_ms,
                              "tau": c.tau, "tokens_per_s": c.tokens_per_s} for c in candidates],
              "best": {c: {"draft_len": b.draft_len, "tokens_per_s": b.tokens_per_s,
                           "vs_autoregressive": b.tokens_per_s / next(
                               x.tokens_per_s for x in candidates if x.concurrency == c and x.draft_len == 0)}
                       for c, b in best.items()}}
    schedule, finding = accepted_schedule(best, candidates, top)
    if finding is not None:  # the best schedule the engine accepts, with what its first entry costs
        result["finding"] = finding
        print(f"dspark bench: --tune-schedule: {finding}", file=sys.stderr)
    speculative = {"max_draft_len": top, "draft_len_schedule": schedule}
    engine = {"speculative_config": speculative}
    if not shape:
        engine = {"model": str(target), "speculative_config": {**speculative, "speculative_model": spec[
            "speculative_model"]}}
    Path(args.tune_schedule).write_text(json.dumps({"engine": engine}, indent=1) + "\n")
    result["schedule"] = schedule
    print(f"dspark bench: draft_len_schedule {schedule} -> {args.tune_schedule}", file=sys.stderr)
    return result


def read_schedule(path: str, max_draft_len: int) -> dict[int, int]:
    """``--schedule FILE``: the ``draft_len_schedule`` of a config fragment ``--tune-schedule`` wrote (``{"engine":
    {"speculative_config": {"draft_len_schedule": {batch size: draft length}}}}``) or of a bare ``{batch size: draft
    length}`` -> {int: int}; anything else is a ValueError naming the flag and what it needs."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"--schedule {path}: not a readable JSON file ({error})") from error
    if isinstance(data, dict) and "engine" in data:
        data = (data["engine"].get("speculative_config") or {}).get("draft_len_schedule") \
            if isinstance(data["engine"], dict) else None
    try:
        schedule = {int(batch): int(length) for batch, length in data.items()}
    except (AttributeError, TypeError, ValueError):
        schedule = None
    if not schedule or any(batch < 1 or not 0 <= length <= max_draft_len for batch, length in schedule.items()):
        raise ValueError(f"--schedule {path}: needs a draft_len_schedule of batch sizes >= 1 to draft lengths 0.."
                         f"{max_draft_len} (max_draft_len), as --tune-schedule writes it; got {data!r}")
    return schedule
