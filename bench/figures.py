"""The ratios ``dspark bench`` derives once its engines are measured: per concurrency (speedups, each engine against
the ones measured beside it, device time against device time), over the mixed workload, and end to end."""

from __future__ import annotations

from bench.measure import agreement
from bench.stats import (BESIDE_SINGLE_PROCESS, CONFIDENCE_MAX, SINGLE, against_single_process, confidence_bounds,
                         confidence_predicted_gain, fixed_schedules_spread, mixed_against_tuned, mixed_noise_floor,
                         piecewise_ratios, prefill_apart_ratios, row_against_tuned)


def derive_figures(record: dict, rows: dict, args, alternate: bool) -> None:
    """Add the derived ratios to ``record`` and to each row of ``rows`` (concurrency -> row), in place.
    ``alternate``: the engines were measured in alternating rounds (paired ratios exist)."""
    mixed_runs = record.get("mixed_workload", {})
    if "confidence" in mixed_runs and "tuned" in mixed_runs:  # measured in alternating rounds, median each
        record.update(mixed_against_tuned(mixed_runs, "confidence", alternate))
        # below saturation both keep up with the arrivals (tokens/s near equal): then the time per token differs
        record["mixed_confidence_vs_tuned_tpot"] = \
            mixed_runs["confidence"]["mean_tpot_ms"] / mixed_runs["tuned"]["mean_tpot_ms"]
        record.update(mixed_noise_floor(record, list(rows.values()), max(args.concurrency)))
    if CONFIDENCE_MAX in mixed_runs and "tuned" in mixed_runs:
        record.update(mixed_against_tuned(mixed_runs, CONFIDENCE_MAX, alternate))
    record.update(prefill_apart_ratios(mixed_runs))
    record.update(piecewise_ratios(mixed_runs))
    for row in rows.values():
        row.update(row_figures(row, record, alternate))
        if args.projected_tau is not None:
            row["projected_speedup"] = args.projected_tau * row["ar_step_ms"] / row["dspark_step_ms"]
    if args.projected_tau is not None:
        record["projected_tau"] = {"tau": args.projected_tau, "source": args.projected_tau_source}


def row_figures(row: dict, record: dict, alternate: bool) -> dict:
    """One concurrency's ratios, from the figures its row holds."""
    out = {"dspark_step_vs_ar": row["dspark_step_ms"] / row["ar_step_ms"]}
    if "tuned_tokens_per_s" in row:
        out["tuned_speedup"] = row["tuned_tokens_per_s"] / row["ar_tokens_per_s"]
    if "confidence_tokens_per_s" in row:
        out["confidence_speedup"] = row["confidence_tokens_per_s"] / row["ar_tokens_per_s"]
        out["confidence_vs_dspark"] = row["confidence_tokens_per_s"] / row["dspark_tokens_per_s"]
        if "tuned_tokens_per_s" in row:  # both measured in this run, the scheduler inside the tuned schedule
            out.update(row_against_tuned(row, "confidence", alternate))
        out.update(confidence_bounds(row, record))
        out.update(confidence_predicted_gain(row))
    if f"{CONFIDENCE_MAX}_tokens_per_s" in row and "tuned_tokens_per_s" in row:
        out.update(row_against_tuned(row, CONFIDENCE_MAX, alternate))
    if "tuned_tokens_per_s" in row:
        out.update(fixed_schedules_spread(row, record, alternate))
    out["speedup"] = row["dspark_tokens_per_s"] / row["ar_tokens_per_s"]
    if "colocated_tokens_per_s" in row:  # a separate drafter against the same replica with it colocated
        out["throughput_vs_colocated"] = row["dspark_tokens_per_s"] / row["colocated_tokens_per_s"]
        out["step_vs_colocated"] = row["dspark_step_ms"] / row["colocated_step_ms"]
    for kind in BESIDE_SINGLE_PROCESS:  # a replica engine against its one-process twin, measured in the same run
        if f"{SINGLE}{kind}_step_ms" in row:
            out.update(against_single_process(row, kind))
    if "serial_tokens_per_s" in row:  # pipelined against the same separate drafter without the pipeline
        out["throughput_vs_serial"] = row["dspark_tokens_per_s"] / row["serial_tokens_per_s"]
    if "verify_step_ms" in row and "ar_forward_ms" in row:  # device time against device time
        out["verify_vs_ar_forward"] = row["verify_step_ms"] / row["ar_forward_ms"]
    if row.get("ar_moe_experts_woken"):  # what a K+1-token verify wakes against one token per request
        out["verify_experts_vs_decode"] = row["dspark_moe_experts_woken"] / row["ar_moe_experts_woken"]
    return out


def end_to_end_figures(rows: dict, args, e2e: dict, prompts: int) -> dict:
    """``--e2e-prompts``: the prompts decoded one at a time by each engine (``e2e``: kind -> its tokens, seconds,
    outputs and acceptance) -> the record's ``end_to_end``: the speedup against what the first concurrency's step
    times allow at the measured tau, and how the greedy outputs agree."""
    first = rows[min(rows)]
    ar, ds = e2e["ar"], e2e["dspark"]
    speedup = ar["seconds"] / ds["seconds"]
    tau = ds["mean_acceptance_length"]
    expected = tau / first["dspark_step_vs_ar"] if tau else None  # what the step times allow at this tau
    out = {"prompts": prompts, "max_tokens": args.e2e_tokens, "concurrency": 1, "temperature": 0.0,
           "prompt_source": args.prompts or f"random token ids ({args.prompt_len} per prompt)",
           "ar_tokens_per_s": ar["tokens"] / ar["seconds"], "dspark_tokens_per_s": ds["tokens"] / ds["seconds"],
           "speedup": speedup, "mean_acceptance_length": tau, "speedup_allowed_by_steps": expected,
           "efficiency": speedup / expected if expected else None, **agreement(ar["outputs"], ds["outputs"])}
    if all(SINGLE + kind in e2e for kind in BESIDE_SINGLE_PROCESS):  # --beside-single-process: the same prompts
        # through the replica and through one process, greedy: in bf16 a layout's sums (TP's all-reduces) may part a
        # near-tie, so the share identical and where each first differs (fp32 equality: tests/gpu)
        out["replica_vs_single_process"] = {
            kind: agreement(e2e[kind]["outputs"], e2e[SINGLE + kind]["outputs"]) for kind in BESIDE_SINGLE_PROCESS}
    return out
