"""Paired statistics: alternating rounds, medians and paired ratios, spreads, noise floors, and the bounds confidence
scheduling is judged against."""

from __future__ import annotations

from collections.abc import Iterator


def round_spread(result: dict) -> dict:
    """One mixed round's figures to set beside the others' (``mixed_workload``'s record): its tokens/s, steps, mean
    and median step ms, the mean step of each quarter, its garbage collector's milliseconds, and on a CUDA device its
    allocator's cudaMalloc calls and retries (None elsewhere)."""
    spread = result.get("step_spread", {})
    return {"tokens_per_s": result["tokens_per_s"], "steps": result["steps"], "step_ms": result.get("step_ms"),
            "p50_ms": spread.get("step_ms_quantiles", {}).get("p50"), "quarters_ms": spread.get("step_ms_quarters"),
            "gc_ms": spread.get("gc", {}).get("ms"),
            "alloc_retries": spread.get("allocator", {}).get("num_alloc_retries"),
            "device_allocs": spread.get("allocator", {}).get("num_device_alloc")}


def step_spread(step_s: list[float]) -> dict:
    """Step wall times (seconds, in run order) -> ms quantiles (p10, p50, p90, p99, max), the mean of each quarter
    of the run in order, and the share of steps over twice the median."""
    if not step_s:
        return {}
    ordered = sorted(step_s)

    def quantile(q: float) -> float:
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    quarters = [step_s[i * len(step_s) // 4:(i + 1) * len(step_s) // 4] for i in range(4)]
    median = ordered[len(ordered) // 2]
    return {"step_ms_quantiles": {name: quantile(q) for name, q in
                                  (("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))},
            "step_ms_quarters": [1e3 * sum(part) / len(part) for part in quarters if part],
            "slow_step_share": sum(1 for s in step_s if s > 2 * median) / len(step_s)}


CONFIDENCE_MAX = "confidence-max"  # --confidence-draft-len both: the engine drafting up to max_draft_len


PAIRED_ROUNDS = 3  # default alternating rounds per concurrency when engines are measured side by side (--rounds)


SINGLE = "single_"  # --beside-single-process: the one-process twin of a replica engine KIND is SINGLE + KIND


BESIDE_SINGLE_PROCESS = ("ar", "dspark")  # the replica engines measured beside their twins


def alternating_rounds(llms: dict, run, rounds: int = PAIRED_ROUNDS) -> Iterator[tuple[str, dict]]:
    """``run(llm)`` for each engine, ``rounds`` times, the engines' order flipped every round."""
    for r in range(rounds):
        for kind in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            yield kind, run(llms[kind])


def median_round(rounds: list[dict]) -> dict:
    """The round whose tokens/s is the median (an odd count: the middle one)."""
    return sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2]


def against_tuned(name: str, tokens_per_s: float, rounds: list[float], tuned_tokens_per_s: float,
                  tuned_rounds: list[float], alternate: bool) -> dict:
    """``NAME_vs_tuned``: an engine's tokens/s over the tuned engine's (the median rounds'), and measured in
    alternating rounds ``NAME_vs_tuned_paired``, the median of the per-round ratios."""
    return {f"{name}_vs_tuned": tokens_per_s / tuned_tokens_per_s,
            **({f"{name}_vs_tuned_paired": paired_ratio(rounds, tuned_rounds)} if alternate else {})}


def row_against_tuned(row: dict, kind: str, alternate: bool) -> dict:
    """``against_tuned`` on a sweep row's figures of ``kind``: ``KIND_vs_tuned[_paired]``."""
    return against_tuned(kind, row[f"{kind}_tokens_per_s"], row.get(f"{kind}_tokens_per_s_rounds", []),
                         row["tuned_tokens_per_s"], row.get("tuned_tokens_per_s_rounds", []), alternate)


def mixed_against_tuned(runs: dict, kind: str, alternate: bool) -> dict:
    """``against_tuned`` on the mixed workload's runs (``mixed_workload``): ``mixed_KIND_vs_tuned[_paired]``."""
    return against_tuned(f"mixed_{kind}", runs[kind]["tokens_per_s"], runs[kind]["tokens_per_s_rounds"],
                         runs["tuned"]["tokens_per_s"], runs["tuned"]["tokens_per_s_rounds"], alternate)


def paired_ratio(rounds: list[float], against: list[float]) -> float | None:
    """The median of ``rounds[i] / against[i]`` (round i of two engines measured back to back, so the host's
    drift between rounds cancels), or None where the rounds do not pair up."""
    if not rounds or len(rounds) != len(against):
        return None
    ratios = sorted(a / b for a, b in zip(rounds, against))
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def against_single_process(row: dict, kind: str) -> dict:
    """``--beside-single-process``: a replica engine's step over the same engine's in one process, both measured in
    alternating rounds on the same GPU: ``ray_vs_single_process_KIND_step`` from the median rounds, and
    ``..._paired``, the median of the per-round ratios (round i's two figures back to back, the host's drift between
    rounds cancelling). Every step commits the same tokens in both (the same requests and drafter), so the inverse of
    the tokens/s ratio is the step-time ratio."""
    single = f"{SINGLE}{kind}"
    paired = paired_ratio(row.get(f"{single}_tokens_per_s_rounds", []), row.get(f"{kind}_tokens_per_s_rounds", []))
    return {f"ray_vs_single_process_{kind}_step": row[f"{kind}_step_ms"] / row[f"{single}_step_ms"],
            f"ray_vs_single_process_{kind}_step_paired": paired}


def schedule_cap(schedule: dict | None, batch: int, max_draft_len: int) -> int:
    """The draft length a ``draft_len_schedule`` (a record's JSON keys are strings) gives ``batch`` requests, as the
    engine reads it (``configs.speculative.scheduled_draft_len``); ``max_draft_len`` without a schedule."""
    if schedule is None:
        return max_draft_len
    from configs.speculative import scheduled_draft_len

    return scheduled_draft_len({int(key): int(value) for key, value in schedule.items()}, batch)


def confidence_bounds(row: dict, record: dict) -> dict:
    """What any schedule could gain at this row's concurrency, priced on the confidence engine's startup table from
    the fixed engine's acceptance per position (``runtime.spec.schedule_bounds``), against whole blocks of the tuned
    schedule's length there (max_draft_len without tuning): ``confidence_oracle_bound`` (verifying just the drafts
    that will be accepted, of the block the confidence engine drafts: the tuned length, or max_draft_len under
    ``--confidence-draft-len max``) and ``confidence_padded_bound`` (the best single cap, ``_cap``); {} without the
    figures or where neither engine drafts."""
    acceptance, table = row.get("acceptance_per_position"), record.get("confidence_cost_table")
    if not acceptance or not table:
        return {}
    from runtime.spec.schedule_bounds import schedule_bounds
    from runtime.spec.step_costs import StepCostTable

    batch, k = int(row["concurrency"]), len(acceptance)
    tuned = record.get("tuned_schedule")
    tuned_cap = schedule_cap(tuned["schedule"] if tuned else None, batch, k)
    drafted = k if record.get("confidence_draft_len") == "max" else tuned_cap
    if drafted < 1:
        return {}
    costs = StepCostTable.from_json(table)
    bounds = schedule_bounds(batch, list(acceptance[:drafted]), costs)
    # committed tokens a request per ms: whole blocks of the tuned length (of one token where it drafts none)
    baseline = (1.0 + sum(acceptance[:tuned_cap])) / costs.predict_ms(batch, batch * (tuned_cap + 1))
    whole = bounds["tau"] / bounds["whole_block_step_ms"]  # of the drafted block
    oracle = bounds["tau"] / bounds["oracle_ragged_step_ms"]
    return {"confidence_oracle_bound": round(oracle / baseline, 3),
            "confidence_padded_bound": round(bounds["padded_best"] * whole / baseline, 3),
            "confidence_padded_bound_cap": bounds["padded_best_cap"]}


def confidence_predicted_gain(row: dict) -> dict:
    """What the scheduler's own model promised over whole blocks at the steps it decided: its expected tokens over its
    predicted step time against the same for whole blocks (``confidence_predicted_gain``; whole = every draft
    proposed, fewer than max_draft_len where the packed layout drafted a shorter block, ``packed_draft_len``). Beside
    the oracle bound it says how much of what was there its confidences could see (calibrated survivals that barely differ between
    requests promise little, however much the oracle could gain); {} without the figures."""
    names = ("confidence_expected_tokens_per_request", "confidence_predicted_step_ms",
             "confidence_whole_block_expected_tokens_per_request", "confidence_whole_block_predicted_step_ms")
    values = [row.get(name) for name in names]
    if any(not value for value in values):
        return {}
    expected, predicted, whole_expected, whole_predicted = values
    return {"confidence_predicted_gain": (expected / predicted) / (whole_expected / whole_predicted)}


def fixed_schedules_spread(row: dict, record: dict, alternate: bool) -> dict:
    """The tuned engine against the fixed one (``tuned_vs_dspark``, ``_paired`` in alternating rounds), and
    whether the two ran the same draft length here (``tuned_same_as_fixed``): then they are one configuration
    built twice, and their ratio is the run's noise floor, the size of a difference these rounds cannot resolve."""
    spread = {"tuned_vs_dspark": row["tuned_tokens_per_s"] / row["dspark_tokens_per_s"]}
    if alternate:
        spread["tuned_vs_dspark_paired"] = paired_ratio(row.get("tuned_tokens_per_s_rounds", []),
                                                        row.get("dspark_tokens_per_s_rounds", []))
    acceptance, tuned = row.get("acceptance_per_position"), record.get("tuned_schedule")
    if acceptance and tuned:
        k = len(acceptance)
        spread["tuned_same_as_fixed"] = schedule_cap(tuned["schedule"], int(row["concurrency"]), k) == k
    return spread


APART = "-apart"  # the mixed workload's name for an engine run with prefill apart (--mixed-prefill-apart)


EAGER = "-eager"  # ... and for one whose steps no whole-step graph serves ran eagerly (--mixed-eager)


def piecewise_ratios(runs: dict) -> dict:
    """--mixed-eager: each engine's tokens/s under the mixed workload through its piecewise graphs over the same
    engine's with those steps eager (``mixed_piecewise_vs_eager``, ``_paired`` where rounds pair up), and the
    confidence engine against the tuned one with them eager (``mixed_confidence_vs_tuned_eager``). {} without."""
    return variant_ratios(runs, EAGER, "mixed_piecewise_vs_eager", variant_over_engine=False)


def prefill_apart_ratios(runs: dict) -> dict:
    """--mixed-prefill-apart: each engine's tokens/s under the mixed workload with prefill apart over with mixed
    steps (``mixed_apart_vs_mixed``, and ``_paired`` where rounds pair up), and the confidence engine against the
    tuned one with prefill apart (``mixed_confidence_vs_tuned_apart``). {} without apart runs."""
    return variant_ratios(runs, APART, "mixed_apart_vs_mixed", variant_over_engine=True)


def variant_ratios(runs: dict, suffix: str, key: str, variant_over_engine: bool) -> dict:
    """The mixed workload's runs of each engine as built (``KIND``) and as a variant of it (``KIND`` + ``suffix``):
    ``key`` -> kind -> the variant's tokens/s over the engine's (``variant_over_engine``; else the engine's over the
    variant's), ``key`` + ``_paired`` where rounds pair up, and ``mixed_confidence_vs_tuned_<suffix>`` (and
    ``_paired``): the confidence engine against the tuned one, both as the variant. {} without variant runs."""
    ratios, paired = {}, {}
    for name, run in runs.items():
        kind = name.removesuffix(suffix)
        if name.endswith(suffix) and kind in runs:
            top, bottom = (run, runs[kind]) if variant_over_engine else (runs[kind], run)
            ratios[kind] = top["tokens_per_s"] / bottom["tokens_per_s"]
            pair = paired_ratio(top.get("tokens_per_s_rounds", []), bottom.get("tokens_per_s_rounds", []))
            if pair is not None:
                paired[kind] = pair
    if not ratios:
        return {}
    out = {key: ratios}
    if paired:
        out[f"{key}_paired"] = paired
    confidence, tuned = runs.get("confidence" + suffix), runs.get("tuned" + suffix)
    if confidence and tuned:
        name = "mixed_confidence_vs_tuned_" + suffix.removeprefix("-")
        out[name] = confidence["tokens_per_s"] / tuned["tokens_per_s"]
        pair = paired_ratio(confidence.get("tokens_per_s_rounds", []), tuned.get("tokens_per_s_rounds", []))
        if pair is not None:
            out[f"{name}_paired"] = pair
    return out


def mixed_noise_floor(record: dict, rows: list[dict], max_batch: int) -> dict:
    """Under the mixed workload, where the tuned schedule drafts ``max_draft_len`` at every batch size up to
    ``max_batch`` (the workload's batch; ``rows`` the sweep's, for the block length), the tuned and fixed engines are
    one configuration built twice: their ratio (``mixed_tuned_vs_dspark``, ``_paired``) is what the workload's rounds
    cannot resolve (one run at 64 requests: 0.69, paired 0.85; its eager mixed steps took 13.7 or 19.9 ms for the
    same work, round to round). {} where the two differ."""
    runs, tuned = record.get("mixed_workload", {}), record.get("tuned_schedule")
    rows = [row for row in rows if row.get("acceptance_per_position")]
    if "tuned" not in runs or "dspark" not in runs or not tuned or not rows:
        return {}
    k = len(rows[0]["acceptance_per_position"])
    if any(schedule_cap(tuned["schedule"], batch, k) != k for batch in range(1, max_batch + 1)):
        return {}
    floor = {"mixed_tuned_vs_dspark": runs["tuned"]["tokens_per_s"] / runs["dspark"]["tokens_per_s"]}
    if runs["tuned"].get("tokens_per_s_rounds") and runs["dspark"].get("tokens_per_s_rounds"):
        floor["mixed_tuned_vs_dspark_paired"] = paired_ratio(runs["tuned"]["tokens_per_s_rounds"],
                                                             runs["dspark"]["tokens_per_s_rounds"])
    return floor


def mean_skill(per_position: list[float | None] | None) -> float | None:
    """The mean of a row's Brier skill per position over the positions that have one (None: none has)."""
    values = [v for v in per_position or [] if v is not None]
    return sum(values) / len(values) if values else None
