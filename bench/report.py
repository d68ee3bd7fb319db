"""The record's one-screen summary."""

from __future__ import annotations

from bench.stats import CONFIDENCE_MAX, mean_skill


def trace_line(summary: dict) -> str:
    """A confidence trace's summary (``runtime.spec.stats.trace_summary``) on one line: per kind its steps
    and mean ms (and how many fed prompt chunks), for decided ones against the predicted ms and the drafts allotted
    of those proposed, and how many the steps verified."""
    parts = []
    for kind in ("decided", "decided_serial", "held", "other"):
        part = summary.get(kind)
        if not part:
            continue
        text = f"{kind} {part['steps']} x {part['ms']:.2f} ms"
        if part.get("mixed"):
            text += f" ({part['mixed']} mixed)"
        if kind.startswith("decided"):
            verified = part.get("verified")
            text += (f" (predicted {part['predicted_ms']:.2f}, whole blocks {part['whole_predicted_ms']:.2f}; "
                     f"{part['budget']:.0f} of {part['offered']:.0f} drafts"
                     + (f", {verified:.0f} verified" if verified is not None else "")
                     + f"; drafting lost {part['drafting_lost']}, explored {part['explores']})")
        parts.append(text)
    return "; ".join(parts) or "none"


def summary(record: dict) -> str:
    bandwidth = record.get("copy_bandwidth_gbs")
    separate = any("throughput_vs_colocated" in r for r in record["runs"])
    layout = f"  {record.get('replica', 'single-process')} TP={record.get('tensor_parallel_size', 1)}, drafter " \
             f"{record.get('drafter', 'colocated')}"
    def cell(value, width: int, digits: int = 2) -> str:  # a figure an older record lacks: "-"
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    lines = [f"{record['hardware']}  {record['model']} ({record['kind']})" +
             (f"  copy bandwidth {bandwidth:.0f} GB/s" if bandwidth else "") + layout,
             f"{'conc':>5} {'AR ms':>8} {'roofline':>8} {'DSpark ms':>10} {'ratio':>6} {'AR tok/s':>9} "
             f"{'DSp tok/s':>9} {'speedup':>8}" + (f" {'vs coloc':>8}" if separate else "")]
    for r in record["runs"]:
        roofline = f"{r['roofline_fraction']:>8.3f}" if "roofline_fraction" in r else f"{'-':>8}"
        lines.append(f"{r['concurrency']:>5} {r['ar_step_ms']:>8.2f} {roofline} "
                     f"{r['dspark_step_ms']:>10.2f} {r['dspark_step_vs_ar']:>6.2f} {r['ar_tokens_per_s']:>9.1f} "
                     f"{r['dspark_tokens_per_s']:>9.1f} {r['speedup']:>8.2f}" +
                     (f" {r['throughput_vs_colocated']:>8.2f}" if "throughput_vs_colocated" in r else ""))
    for r in record["runs"]:
        if "ray_vs_single_process_ar_step" in r:  # --beside-single-process
            lines.append(f"{r['concurrency']:>5} replica / one process, step: AR "
                         f"{r['ray_vs_single_process_ar_step']:.3f}"
                         f" (paired {cell(r['ray_vs_single_process_ar_step_paired'], 0, 3)}), DSpark "
                         f"{r['ray_vs_single_process_dspark_step']:.3f} (paired "
                         f"{cell(r['ray_vs_single_process_dspark_step_paired'], 0, 3)})")
    e2e = record.get("end_to_end")
    if e2e:
        lines.append(f"end to end, {e2e['prompts']} prompts x {e2e['max_tokens']} tokens at concurrency 1: speedup "
                     f"{e2e['speedup']:.2f}, identical greedy outputs {e2e['identical_fraction']:.2f}")
    confident = [r for r in record["runs"] if "confidence_vs_tuned" in r]
    if confident:  # the confidence scheduler against the tuned schedule, and what it chose from which predictions
        lines.append(f"{'conc':>5} {'conf/tuned':>10} {'paired':>7} {'budget':>7} {'drafted':>7} {'pred ms':>8} "
                     f"{'meas ms':>8} "
                     f"{'whole pred':>10} {'tuned ms':>8} {'exp tok':>8} {'got tok':>8} {'whole exp':>9} "
                     f"{'model':>6} {'oracle':>6} {'noise':>6} {'skill':>6} {'held':>5}")
        for r in confident:
            lines.append(" ".join([
                f"{r['concurrency']:>5}", cell(r["confidence_vs_tuned"], 10, 3),
                cell(r.get("confidence_vs_tuned_paired"), 7, 3), cell(r["confidence_verify_budget_per_request"], 7),
                cell(r.get("confidence_offered_per_request"), 7), cell(r["confidence_predicted_step_ms"], 8),
                cell(r.get("confidence_measured_decided_step_ms", r["confidence_measured_step_ms"]), 8),
                cell(r.get("confidence_whole_block_predicted_step_ms"), 10), cell(r["tuned_step_ms"], 8),
                cell(r["confidence_expected_tokens_per_request"], 8),
                cell(r["confidence_committed_tokens_per_request"], 8),
                cell(r.get("confidence_whole_block_expected_tokens_per_request"), 9),
                cell(r.get("confidence_predicted_gain"), 6, 3), cell(r.get("confidence_oracle_bound"), 6, 3),
                # the same configuration built twice (tuned = fixed here): what these rounds cannot resolve
                cell(r.get("tuned_vs_dspark_paired") if r.get("tuned_same_as_fixed") else None, 6, 3),
                # how much the believed survivals told this concurrency's verified drafts apart (mean over positions)
                cell(mean_skill(r.get("confidence_survival_skill_per_position")), 6, 3),
                # steps that drafted nothing since drafting did not pay (drafting holds)
                cell(r.get("confidence_drafting_off_steps"), 5, 0)]))
        for r in confident:  # the timed steps by kind (ConfidenceStats.trace_summary): where the means come from
            if r.get("confidence_trace"):
                lines.append(f"  {r['concurrency']:>5} timed steps: {trace_line(r['confidence_trace']['summary'])}")
                if r.get("confidence_trace_untimed"):
                    lines.append(f"  {'':>5} untimed before: "
                                 f"{trace_line(r['confidence_trace_untimed']['summary'])}")
    both = [r for r in record["runs"] if f"{CONFIDENCE_MAX}_vs_tuned" in r]
    if both:  # --confidence-draft-len both: the scheduler drafting up to max_draft_len, in the same rounds
        lines.append(f"{'conc':>5} {'max/tuned':>10} {'paired':>7} {'budget':>7} {'drafted':>7} {'pred ms':>8} "
                     f"{'meas ms':>8} {'exp tok':>8} {'got tok':>8} {'held':>5}")
        for r in both:
            lines.append(" ".join([f"{r['concurrency']:>5}"] + [
                cell(r.get(f"{CONFIDENCE_MAX}_{name}"), width, digits) for name, width, digits in (
                    ("vs_tuned", 10, 3), ("vs_tuned_paired", 7, 3), ("verify_budget_per_request", 7, 2),
                    ("offered_per_request", 7, 2), ("predicted_step_ms", 8, 2), ("measured_decided_step_ms", 8, 2),
                    ("expected_tokens_per_request", 8, 2), ("committed_tokens_per_request", 8, 2),
                    ("drafting_off_steps", 5, 0))]))
    if f"mixed_{CONFIDENCE_MAX}_vs_tuned" in record:
        paired = record.get(f"mixed_{CONFIDENCE_MAX}_vs_tuned_paired")
        lines.append(f"mixed workload: {CONFIDENCE_MAX} / tuned {record[f'mixed_{CONFIDENCE_MAX}_vs_tuned']:.3f}" +
                     (f" (paired {paired:.3f})" if paired is not None else ""))
    if "mixed_confidence_vs_tuned" in record:
        paired = record.get("mixed_confidence_vs_tuned_paired")
        held = record.get("mixed_workload", {}).get("confidence", {}).get("drafting_off_step_share")
        lines.append(f"mixed workload: confidence / tuned {record['mixed_confidence_vs_tuned']:.3f}" +
                     (f" (paired {paired:.3f})" if paired is not None else "") +
                     (f", confidence drafting held off {held:.0%} of its steps" if held is not None else ""))
        if "mixed_tuned_vs_dspark" in record:  # (tuned = fixed K at every batch here: one engine built twice)
            lines.append(f"  noise floor: tuned / fixed K, the same engine, {record['mixed_tuned_vs_dspark']:.3f}" +
                         (f" (paired {record['mixed_tuned_vs_dspark_paired']:.3f})"
                          if "mixed_tuned_vs_dspark_paired" in record else ""))
        for kind, run in record.get("mixed_workload", {}).items():  # each confidence engine's choices
            chose = run.get("scheduled")
            if not chose:
                continue
            if run.get("confidence_trace"):
                lines.append(f"  {kind} steps: {trace_line(run['confidence_trace']['summary'])}")
            plain = chose.get("judged_plain_step_ms")
            lines.append(f"  {kind} verified {chose['verify_budget_per_request']:.2f} of "
                         f"{chose['offered_per_request']:.2f} drafts a deciding request, expected "
                         f"{chose.get('expected_tokens_per_request', float('nan')):.2f} tokens (whole blocks "
                         f"{chose.get('whole_block_expected_tokens_per_request', float('nan')):.2f}), committed "
                         f"{chose['committed_tokens_per_request']:.2f}; decided "
                         f"steps predicted {chose['predicted_step_ms']:.2f} ms, measured "
                         f"{chose['measured_decided_step_ms']:.2f}"
                         + (f"; drafting judged against plain steps priced {plain:.2f} ms, paid in "
                            f"{chose['drafting_paid_share']:.0%}" if plain is not None else "")
                         + (f"; {chose['unpacked_steps']} decided steps unpacked (whole blocks)"
                            if chose.get("unpacked_steps") else ""))
        # where a step's time went
        for kind, run in record.get("mixed_workload", {}).items():
            if "step_ms" in run:
                host = ", ".join(f"{key} {value:.2f}" for key, value in run["host_ms"].items())
                lines.append(f"  {kind}: {run['steps']} steps of {run['step_ms']:.2f} ms ({host}), "
                             f"{run['mean_batch']:.1f} requests and {run['mean_tokens_fed']:.0f} tokens a step"
                             + (f", {run['piecewise_steps']} through piecewise graphs"
                                if run.get("piecewise_steps") else ""))
                if run.get("profile"):  # --profile-mixed: where a step's time went, from the middle of the run
                    p = run["profile"]
                    lines.append(f"    profile: {p['kernels_per_step']:.0f} kernels, GPU busy "
                                 f"{p['gpu_busy_ms_per_step']:.2f} and idle {p.get('gpu_idle_ms_per_step', 0):.2f} ms "
                                 "a step; host " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                             sorted(p["host_ms_per_step"].items())[:6]))
                if run.get("rounds_spread"):  # each round: mean / median step, its quarters, the collector's pauses
                    lines.append("    rounds: " + "; ".join(
                        f"{r['step_ms']:.2f} / {r['p50_ms']:.2f} ms [" + " ".join(f"{q:.1f}" for q in r["quarters_ms"])
                        + f"] gc {r['gc_ms']:.0f} ms"
                        + (f", {r['device_allocs']} mallocs, {r['alloc_retries']} retries"
                           if r.get("device_allocs") is not None else "")
                        for r in run["rounds_spread"] if r.get("p50_ms") is not None))
    for key, what, variant, suffix in (("mixed_apart_vs_mixed", "with prefill apart / mixed steps", "with prefill apart",
                                        "apart"),
                                       ("mixed_piecewise_vs_eager", "through piecewise graphs / eager",
                                        "with those steps eager", "eager")):
        lines += variant_summary(record, key, what, variant, suffix)
    return "\n".join(lines)


def variant_summary(record: dict, key: str, what: str, variant: str, suffix: str) -> list[str]:
    """The summary's lines of ``variant_ratios``' figures (``key``; the confidence / tuned ratio of ``suffix``)."""
    if key not in record:
        return []
    paired = record.get(f"{key}_paired", {})
    lines = [f"mixed workload {what}: " + ", ".join(
        f"{kind} {ratio:.3f}" + (f" (paired {paired[kind]:.3f})" if kind in paired else "")
        for kind, ratio in record[key].items())]
    ratio = record.get(f"mixed_confidence_vs_tuned_{suffix}")
    if ratio is not None:
        pair = record.get(f"mixed_confidence_vs_tuned_{suffix}_paired")
        lines.append(f"  {variant}, confidence / tuned {ratio:.3f}" + (f" (paired {pair:.3f})" if pair is not None
                                                                        else ""))
    return lines
