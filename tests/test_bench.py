"""``dspark bench``'s model shapes load with random weights (load_format='dummy') and decode on the CPU."""

import json

import pytest

from bench import (MODEL_SHAPES, confidence_bounds, mixed_noise_floor, paired_ratio, piecewise_ratios,
                   prefill_apart_ratios, schedule_cap, write_shape)
from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams


def test_a_shape_pair_loads_with_dummy_weights_and_decodes(tmp_path):
    target, drafter = write_shape(tmp_path, "tiny", draft_layers=1, block_size=3)
    assert not list(target.glob("*.safetensors"))  # config.json only
    spec = DSparkDecodingConfig(speculative_model=str(drafter), load_format="dummy")
    llm = LLM(str(target), speculative_config=spec, load_format="dummy", dtype="float32", device="cpu",
              num_pages=32, page_size=16)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    plain = LLM(str(target), load_format="dummy", dtype="float32", device="cpu", num_pages=32, page_size=16)
    assert out.token_ids == plain.generate([[5, 6, 7, 8]], params)[0].token_ids  # same seed, same weights
    assert len(out.token_ids) == 10 and llm.get_metrics()["num_drafts"] > 0
    assert set(MODEL_SHAPES) >= {"qwen3-8b", "tiny"}


def test_bench_plot_draws_a_record_and_rejects_a_non_record(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    runs = [{"concurrency": c, "ar_tokens_per_s": 100.0 * c, "dspark_tokens_per_s": 180.0 * c, "speedup": 1.8,
             "projected_speedup": 2.5} for c in (1, 4, 16)]
    record = {"model": "qwen3-8b", "kind": "random-shape", "hardware": "NVIDIA H200", "date": "2026-11-30",
              "projected_tau": {"tau": 3.16, "source": "test"}, "runs": runs}
    source = tmp_path / "bench.json"
    source.write_text(json.dumps(record))
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench-plot", str(source)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "bench.png"
    assert proc.stdout.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "other.json").write_text('{"hello": 1}')
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "bench-plot", str(tmp_path / "other.json")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a dspark bench record" in bad.stderr


def test_end_to_end_decodes_each_prompt_alone_and_compares_outputs(tmp_path):
    """Each prompt alone on every engine, alternating, greedy outputs compared."""
    from bench import agreement, end_to_end

    target, drafter = write_shape(tmp_path, "tiny", draft_layers=1, block_size=3)
    engine = dict(load_format="dummy", dtype="float32", device="cpu", num_pages=64, page_size=16)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    spec = DSparkDecodingConfig(speculative_model=str(drafter), load_format="dummy")
    llms = {"ar": LLM(str(target), **engine), "dspark": LLM(str(target), speculative_config=spec, **engine)}
    calls = []
    for kind, llm in llms.items():  # record the order the prompts reach the engines
        llm.generate = (lambda original, kind: lambda prompts_, params: calls.append((kind, prompts_[0])) or
                        original(prompts_, params))(llm.generate, kind)
    results = end_to_end(llms, prompts, 6)
    plain, spark = results["ar"], results["dspark"]
    # each prompt on each engine in turn, the order flipped every prompt (after one untimed call each)
    assert calls[2:] == [("ar", prompts[0]), ("dspark", prompts[0]), ("dspark", prompts[1]), ("ar", prompts[1]),
                         ("ar", prompts[2]), ("dspark", prompts[2])]
    assert plain["tokens"] == spark["tokens"] == 18 and plain["mean_acceptance_length"] is None
    assert spark["mean_acceptance_length"] >= 1.0 and spark["seconds"] > 0
    assert agreement(plain["outputs"], spark["outputs"]) == {"identical_fraction": 1.0,
                                                             "first_difference": [None, None, None]}
    assert agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == {"identical_fraction": 0.5,
                                                                   "first_difference": [1, None]}


def test_an_moe_shape_decodes_and_counts_the_experts_a_step_wakes(tmp_path):
    from bench import expert_bytes, routing_stats, weight_bytes

    target, drafter = write_shape(tmp_path, "tiny-moe", draft_layers=1, block_size=3)
    engine = dict(load_format="dummy", dtype="float32", device="cpu", num_pages=64, page_size=16)
    # (every block verified: a random drafter accepts nothing, so the speculation guard would stop drafting)
    spec = DSparkDecodingConfig(speculative_model=str(drafter), load_format="dummy", speculation_guard=False)
    stats = {}
    for kind, speculative in (("ar", None), ("dspark", spec)):
        llm = LLM(str(target), speculative_config=speculative, **engine)
        assert llm.rank_info()[0]["moe_backend"] == "DENSEGEMM"
        for prompt in ([5, 6, 7, 8], [9, 10, 11]):
            llm.engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        for _ in range(3):  # prefill, then decoding steps
            llm.engine.step()
        stats[kind] = routing_stats(llm, steps=2)
        assert all(len(llm.engine.sequences[r].output_token_ids) > 1 for r in llm.engine.sequences)
        llm.engine.abort_all()
    assert stats["ar"]["moe_tokens_routed"] == 2 and stats["dspark"]["moe_tokens_routed"] == 2 * 4
    assert 2 <= stats["ar"]["moe_experts_woken"] <= 4 <= stats["dspark"]["moe_experts_woken"] <= 8
    total = sum(p.numel() * 4 for n, p in llm.engine.executor.worker.target.named_parameters() if "embed" not in n)
    assert weight_bytes(llm) + 8 * expert_bytes(llm) == total
    assert routing_stats(LLM(str(write_shape(tmp_path, "tiny", 1, 3)[0]), **engine)) == {}


def test_a_mixed_workload_submits_while_others_decode(tmp_path):
    from bench import mixed_workload

    target, drafter = write_shape(tmp_path, "tiny", draft_layers=1, block_size=3)
    spec = DSparkDecodingConfig(speculative_model=str(drafter), load_format="dummy")
    llm = LLM(str(target), speculative_config=spec, load_format="dummy", dtype="float32", device="cpu",
              num_pages=128, page_size=16, max_num_seqs=8)
    prompts = [[5 + i, 6, 7, 8] for i in range(12)]
    result = mixed_workload(llm, prompts, rate=400.0, max_tokens=8)
    assert result["requests"] == 12 and result["tokens_per_s"] > 0 and result["mean_ttft_ms"] > 0
    assert 0 < result["mixed_step_share"] <= 1 and not llm.engine.has_unfinished()
    # where a step's time went: the parts within the step, what a step fed; the engine's methods are its own again
    assert 0 < result["host_ms"]["execute"] < result["step_ms"] and result["host_ms"]["schedule"] > 0
    assert result["mean_batch"] >= 1 and result["mean_tokens_fed"] >= result["mean_batch"]
    assert result["rate_per_s"] == 400.0 and result["max_tokens"] == 8
    spread = result["step_spread"]  # where the run's time went: the steps' spread, idle time, the collector's pauses
    quantiles = spread["step_ms_quantiles"]
    assert 0 < quantiles["p10"] <= quantiles["p50"] <= quantiles["p90"] <= quantiles["p99"] <= quantiles["max"]
    assert len(spread["step_ms_quarters"]) == 4 and spread["idle_s"] >= 0 and 0 <= spread["slow_step_share"] < 1
    assert len(spread["gc"]["collections"]) == 3 and spread["gc"]["ms"] >= 0
    assert "step" not in vars(llm.engine.scheduler) and "schedule" not in vars(llm.engine.scheduler)
    kinds = []  # with prefill apart: no step feeds a prompt chunk beside a decode; the engine as built afterwards
    execute = llm.engine.executor.execute
    llm.engine.executor.execute = lambda batch: (kinds.append({len(e.token_ids) > 1 + e.num_drafts or not e.sample
                                                               for e in batch.requests}), execute(batch))[1]
    apart = mixed_workload(llm, prompts, rate=400.0, max_tokens=8, mixed_prefill=False)
    assert apart["requests"] == 12 and not llm.engine.has_unfinished() and llm.engine.scheduler.limits.mixed_prefill
    assert all(len(kind) == 1 for kind in kinds) and {True} in kinds and {False} in kinds
    # a CPU engine has no piecewise graphs: none of its steps went through them, and comparing against them is refused
    assert result["piecewise_steps"] == 0 and llm.rank_info()[0]["piecewise_graphs"] is None
    with pytest.raises(ValueError, match="--mixed-eager: this engine has no piecewise graphs"):
        mixed_workload(llm, prompts, rate=400.0, max_tokens=8, piecewise=False)
    assert not llm.engine.has_unfinished()


def test_the_step_spread_reads_quantiles_quarters_and_slow_steps_and_the_collector_pauses_are_counted():
    import gc

    from bench import AllocatorEvents, GcPauses, round_spread, step_spread

    spread = step_spread([0.001] * 6 + [0.002, 0.010])  # six 1-ms steps, then a 2-ms and a 10-ms one
    assert spread["step_ms_quantiles"]["p50"] == pytest.approx(1.0) and spread["step_ms_quantiles"]["max"] == 10.0
    assert spread["step_ms_quarters"] == pytest.approx([1.0, 1.0, 1.0, 6.0])
    assert spread["slow_step_share"] == 1 / 8  # only the 10-ms step is over twice the median
    assert step_spread([]) == {}
    with GcPauses() as pauses:
        gc.collect()
    assert pauses.summary()["collections"][2] >= 1 and pauses.summary()["ms"] > 0
    assert pauses._note not in gc.callbacks
    assert round_spread({"tokens_per_s": 5.0, "steps": 8, "step_ms": 2.0, "step_spread": {
        **spread, "gc": pauses.summary()}})["quarters_ms"] == pytest.approx([1.0, 1.0, 1.0, 6.0])
    with AllocatorEvents() as allocator:  # no CUDA device here: the allocator says nothing rather than zeros
        pass
    assert allocator.summary() == {}


def test_bench_refuses_a_transformers_peer_on_a_replica(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--tensor-parallel-size", "2", "--hf-tokens", "8"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--hf-tokens times transformers on one GPU" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--drafter", "separate", "--pipeline-drafter-min-batch", "8"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--pipeline-drafter-min-batch needs --pipeline-drafter" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--pipeline-drafter"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--pipeline-drafter needs --drafter separate" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--concurrency", "1,4", "--profile", "--profile-batches", "1,8"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--profile-batches 8 exceeds the largest --concurrency 4" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--tensor-parallel-size", "1", "--allreduce-strategy", "ONESHOT"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--allreduce-strategy ONESHOT needs --tensor-parallel-size 2" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--beside-single-process"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--beside-single-process needs --tensor-parallel-size" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--rounds", "2"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rounds must be an odd number >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--mixed-rounds", "4"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--mixed-rounds must be an odd number >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--mixed-eager", "--profile-mixed", "5"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--mixed-eager, --profile-mixed needs --mixed-rate" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--profile-batches", "0"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--profile-batches wants integers >= 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--ray-address", "local"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--ray-address needs --tensor-parallel-size" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--confidence-scheduling", "--confidence-draft-len", "max"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--confidence-draft-len needs --confidence-scheduling and --tune-schedule" in \
        proc.stderr
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--confidence-draft-len", "all"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--confidence-draft-len: invalid choice: 'all' (choose from 'tuned', 'max', 'both')" in \
        proc.stderr


def test_the_whole_single_process_bench_runs_on_the_cpu(tmp_path):
    """Every phase of ``dspark bench`` (sweep, confidence scheduler, mixed workload, end to end, tuning, profiles) in
    one CPU run of the tiny MoE shape: the record has each phase's fields and no GPU-only ones."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out, schedule = tmp_path / "bench.json", tmp_path / "schedule.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny-moe", "--device", "cpu",
                           "--concurrency", "1,2", "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2",
                           "--warmup", "1", "--kv-cache-memory", "50MiB", "--confidence-scheduling", "--tune-schedule",
                           str(schedule), "--no-speculation-guard",  # the schedules as set (on this CPU the guard
                           # may find that drafting never pays)
                           "--acceptance-per-position", "0.99,0.99,0.99", "--e2e-prompts", "2",
                           "--e2e-tokens", "8", "--mixed-rate", "200", "--mixed-requests", "4", "--mixed-prefill-apart",
                           "--mixed-rounds", "1", "--profile-mixed", "2",
                           "--profile", "--profile-batches", "1,2", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["replica"] == "single-process" and record["moe_backend"] == "DENSEGEMM" and "partial" not in record
    # every engine measured beside the ones it is compared with, in alternating rounds; the tuning candidates
    # against the DSpark engine
    assert record["measurement"] == "alternating rounds; the sweep measured again beside the tuned engines"
    assert record["rounds"] == 3 and record["speculation_guard"] is False
    # the rows' AR and DSpark figures come from the same rounds as the tuned and confidence engines' (measured
    # after tuning, minutes later than the first sweep: the host's speed drifts)
    assert record["measured_together"] == ["ar", "dspark", "tuned", "confidence"]
    assert record["mixed_warmup_requests"] == 4  # an untimed mixed run per engine first (at most --mixed-requests)
    # each engine's mixed workload run once, in the phase after tuning (the first phase's would be replaced unread)
    assert all(proc.stderr.count(f"dspark bench: {kind} mixed workload:") == 1 for kind in ("ar", "dspark", "tuned"))
    assert record["tuned_schedule"]["step_ms"].startswith("candidate / reference")
    assert record["step_outputs"] == "delta"
    # the tuned schedule swept as an engine, the confidence scheduler within it, both after tuning (a projected tau
    # near 4 keeps K=3 ahead of autoregressive decoding at one request however loaded this CPU is: a schedule must
    # start at max_draft_len)
    assert "schedule" in record["tuned_schedule"], record["tuned_schedule"]
    assert record["schedules"] == {"dspark": "fixed", "tuned": "tuned",
                                   "confidence": "confidence within the tuned schedule"}
    kinds = ("ar", "dspark", "tuned", "confidence")  # each also with prefill apart, in the same rounds
    assert set(record["mixed_workload"]) == {*kinds, *(f"{kind}-apart" for kind in kinds)}
    assert set(record["mixed_apart_vs_mixed"]) == set(kinds) and record["mixed_confidence_vs_tuned_apart"] > 0
    # the mixed workload in its own count of rounds (--mixed-rounds), the sweep in --rounds
    assert record["mixed_rounds"] == 1 and len(record["mixed_workload"]["confidence-apart"]["tokens_per_s_rounds"]) == 1
    # --profile-mixed: each variant's mixed workload once more, two of its steps profiled from its middle on
    for name in ("tuned", "confidence-apart"):
        profiled = record["mixed_workload"][name]["profile"]
        assert profiled["host_ms_per_step"] and "top_kernels" in profiled, profiled
    assert record["end_to_end"]["prompts"] == 2
    assert {b["draft_len"] for b in record["tuned_schedule"]["best"].values()} <= {0, 1, 2, 3}
    for row in record["runs"]:
        assert row["confidence_tokens_per_s"] > 0 and row["tuned_tokens_per_s"] > 0 and row["ar_moe_experts_woken"] > 0
        assert row["confidence_vs_tuned"] == row["confidence_tokens_per_s"] / row["tuned_tokens_per_s"]
        ratios = sorted(c / t for c, t in zip(row["confidence_tokens_per_s_rounds"], row["tuned_tokens_per_s_rounds"]))
        assert row["confidence_vs_tuned_paired"] == ratios[1]  # the median of the rounds taken back to back
        for kind in ("ar", "dspark", "tuned", "confidence"):  # alternating rounds, the median one recorded
            rounds = row[f"{kind}_tokens_per_s_rounds"]
            assert len(rounds) == 3 and row[f"{kind}_tokens_per_s"] == sorted(rounds)[1]
        assert "roofline_fraction" not in row and "ar_forward_ms" not in row
    assert len(record["mixed_workload"]["confidence"]["tokens_per_s_rounds"]) == 1
    assert [r["tokens_per_s"] for r in record["mixed_workload"]["confidence"]["rounds_spread"]] == record[
        "mixed_workload"]["confidence"]["tokens_per_s_rounds"]  # each round's spread beside its tokens/s
    chose = record["mixed_workload"]["confidence"]["scheduled"]  # what it chose under the mixed load (a loaded
    # CPU may find drafting never pays there: no decisions)
    assert chose["decisions"] >= 0 and 0 <= chose["verify_budget_per_request"] <= chose["offered_per_request"]
    assert chose["expected_tokens_per_request"] >= 0 and chose["whole_block_expected_tokens_per_request"] >= 0
    # the drafting judgement's plain step (the engine profiled plain steps at startup): priced, paid or not
    assert chose["judged_plain_step_ms"] is None if not chose["decisions"] else chose["judged_plain_step_ms"] > 0
    assert chose["drafting_paid_share"] is None or 0.0 <= chose["drafting_paid_share"] <= 1.0
    assert 0 <= chose["unpacked_steps"] <= chose["decisions"]
    assert "scheduled" not in record["mixed_workload"]["tuned"]
    mixed_trace = record["mixed_workload"]["confidence"]["confidence_trace"]  # the run's steps, one by one
    assert 0 < len(mixed_trace["steps"]) <= record["mixed_workload"]["confidence"]["steps"]
    assert sum(1 for step in mixed_trace["steps"] if step[mixed_trace["fields"].index("budget")] is not None) == \
        chose["decisions"]
    assert "confidence_trace" not in record["mixed_workload"]["tuned"]
    assert record["mixed_confidence_vs_tuned"] > 0 and record["mixed_confidence_vs_tuned_tpot"] > 0
    assert record["mixed_confidence_vs_tuned_paired"] > 0
    # the startup profile and the table as serving left it (its served cells at the contexts they were served at)
    startup, served = record["confidence_cost_table"], record["confidence_cost_table_served"]
    assert startup["token_counts"] == served["token_counts"]
    # (drafting on the CPU costs about what the tiny target does: it may not pay, and then the steps served are
    # plain decodes, learned in the plain steps' table)
    assert served["context_tokens"] != startup["context_tokens"] or \
        served["plain_steps"]["context_tokens"] != startup["plain_steps"]["context_tokens"]
    assert all(row["confidence_cost_ms_per_context_token"] >= 0 for row in record["runs"])
    # the mixed steps' own table (the sweep's prefills, the mixed workload), and what whole blocks were predicted
    assert record["confidence_mixed_step_costs_served"]["observations"] > 0
    for row in record["runs"]:
        # the tuned schedule's length here: its tuning is timed on this CPU, loaded by the other worker's tests, and
        # may find decoding without drafts fastest at 2 requests; the confidence engine then decides nothing there
        cap = schedule_cap(record["tuned_schedule"]["schedule"], row["concurrency"], 3)
        assert row["tuned_same_as_fixed"] == (cap == 3) and row["tuned_vs_dspark_paired"] > 0
        if cap == 0:
            assert row["confidence_whole_block_predicted_step_ms"] == 0
            continue
        assert row["confidence_whole_block_predicted_step_ms"] > 0 and len(row["confidence_survival_correction"]) == 3
        # the timed steps one by one (--steps 2), each with what it chose and predicted if the scheduler decided it
        trace = row["confidence_trace"]
        steps = [dict(zip(trace["fields"], step)) for step in trace["steps"]]
        assert len(steps) == 2 and all(s["requests"] == row["concurrency"] and s["ms"] > 0 for s in steps)
        assert sum(kind["steps"] for kind in trace["summary"].values()) == 2
        assert f"{row['concurrency']:>5} timed steps: " in proc.stdout + proc.stderr  # the summary's line of them
        # and the untimed steps before them (the prefill, --warmup 1), the step numbers running on into the window's
        untimed = row["confidence_trace_untimed"]
        assert untimed["steps"] and untimed["steps"][-1][0] < trace["steps"][0][0]
        assert sum(kind["steps"] for kind in untimed["summary"].values()) == len(untimed["steps"])
        assert untimed["steps"][0][untimed["fields"].index("prompt_tokens")] > 0  # the prefill: its prompt tokens
        for s in steps:
            assert s["budget"] is None or (0 <= s["budget"] <= s["offered"] and s["predicted_ms"] > 0)
        assert len(row["confidence_survival_skill_per_position"]) == 3  # this concurrency's (reset between them)
        believed = row["confidence_predicted_survival_per_position"]  # the blocks drafted (the tuned schedule's cap)
        assert 1 <= len(believed) <= 3 and all(1.0 >= a >= b >= 0.0 for a, b in zip(believed, believed[1:] + [0.0]))
        assert row["confidence_whole_block_expected_tokens_per_request"] >= row[
            "confidence_expected_tokens_per_request"] - 1e-9
        # what it drafted beside what it verified: never less, never past the block the schedule drafts
        assert row["confidence_verify_budget_per_request"] <= row["confidence_offered_per_request"] <= cap
        # the noise floor (above): the tuned engine against the fixed one, the same configuration where the schedule
        # says 3; what any schedule could gain here, priced on the startup table: the best cap is no worse than K
        assert row["confidence_oracle_bound"] > 0 and row["confidence_padded_bound"] >= 1.0
        assert 0 <= row["confidence_padded_bound_cap"] <= cap
        assert row["confidence_predicted_gain"] == pytest.approx(
            row["confidence_expected_tokens_per_request"] / row["confidence_predicted_step_ms"] /
            (row["confidence_whole_block_expected_tokens_per_request"] / row["confidence_whole_block_predicted_step_ms"]))
    # the printed summary sets the scheduler beside the tuned schedule, a line per concurrency, and the mixed workload
    assert "conf/tuned" in proc.stderr and "whole pred" in proc.stderr and "oracle" in proc.stderr
    assert "drafted" in proc.stderr
    assert "skill" in proc.stderr and "mixed workload: confidence / tuned" in proc.stderr
    # every engine profiled, and only after the last figure was taken (the confidence engine's sweep is the last):
    # a process the profiler has run in launches CUDA graphs slower
    keys = list(record)
    for kind in ("ar", "dspark", "tuned", "confidence"):
        for batch in (1, 2):
            assert record[f"{kind}_profile_batch{batch}"]["host_ms_per_step"], (kind, batch)
            assert keys.index(f"{kind}_profile_batch{batch}") > keys.index("confidence_rank_info"), (kind, batch)


def test_both_confidence_engines_are_measured_in_the_same_rounds_beside_the_tuned_schedule(tmp_path):
    """``--confidence-draft-len both``: the scheduler within the tuned schedule (``confidence``) and the scheduler
    choosing how much to draft up to max_draft_len (``confidence-max``), measured in the same alternating rounds as
    the tuned engine, each compared with it (rows and the mixed workload), the second's choices in its own fields
    and the summary."""
    import subprocess
    import sys
    from pathlib import Path

    from bench import schedule_cap

    out, schedule = tmp_path / "bench.json", tmp_path / "schedule.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--concurrency", "1,2", "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2",
                           "--warmup", "1", "--rounds", "1", "--kv-cache-memory", "50MiB", "--confidence-scheduling",
                           "--tune-schedule", str(schedule), "--confidence-draft-len", "both",
                           "--acceptance-per-position", "0.99,0.5,0.1", "--mixed-rate", "200", "--mixed-requests",
                           "4", "--e2e-prompts", "0", "--e2e-tokens", "8", "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["confidence_draft_len"] == "both"
    assert record["schedules"]["confidence"] == "confidence within the tuned schedule"
    assert record["schedules"]["confidence-max"] == "confidence within max_draft_len, beside the tuned schedule"
    assert record["measured_together"] == ["ar", "dspark", "tuned", "confidence", "confidence-max"]
    for row in record["runs"]:
        cap = schedule_cap(record["tuned_schedule"]["schedule"], row["concurrency"], 3)
        assert row["confidence_vs_tuned"] > 0 and row["confidence-max_vs_tuned"] == pytest.approx(
            row["confidence-max_tokens_per_s"] / row["tuned_tokens_per_s"])
        assert row["confidence-max_vs_tuned_paired"] == pytest.approx(row["confidence-max_vs_tuned"])  # (one round)
        assert row["confidence_offered_per_request"] <= cap  # within the tuned schedule; the other up to 3
        assert row["confidence-max_verify_budget_per_request"] <= row["confidence-max_offered_per_request"] <= 3
        # the guard's decisions so far beside each guarded engine's figures (AR has none)
        guard = row["dspark_speculation_guard"]
        assert guard["plain_steps"] + guard["drafting_steps"] > 0 and "ar_speculation_guard" not in row
    assert record["mixed_confidence-max_vs_tuned"] > 0 and record["mixed_confidence_vs_tuned"] > 0
    assert "max/tuned" in proc.stderr and "mixed workload: confidence-max / tuned" in proc.stderr


def test_a_schedule_tuned_before_is_measured_in_one_phase_beside_the_sweep(tmp_path):
    """``--schedule FILE`` (what an earlier ``--tune-schedule`` wrote): no tuning and no first phase; the sweep's
    engines, the schedule's and the confidence engine in the same alternating rounds, the mixed workload too."""
    import subprocess
    import sys
    from pathlib import Path

    out, schedule = tmp_path / "bench.json", tmp_path / "schedule.json"
    schedule.write_text(json.dumps({"engine": {"speculative_config": {"draft_len_schedule": {"1": 3, "2": 1}}}}))
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--concurrency", "1,2", "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2",
                           "--warmup", "1", "--rounds", "1", "--kv-cache-memory", "50MiB", "--confidence-scheduling",
                           "--schedule", str(schedule), "--confidence-draft-len", "max", "--mixed-rate", "200",
                           "--mixed-requests", "4", "--e2e-prompts", "0", "--e2e-tokens", "8", "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert "tune k=" not in proc.stderr and proc.stderr.count("dspark bench: ar concurrency 1:") == 1  # one phase
    assert record["tuned_schedule"] == {"schedule": {"1": 3, "2": 1}, "from": str(schedule)}
    assert record["measured_together"] == ["ar", "dspark", "tuned", "confidence"]
    assert "--schedule" in record["measurement"]
    for row in record["runs"]:
        assert row["confidence_vs_tuned"] > 0 and row["dspark_tokens_per_s"] > 0 and row["ar_tokens_per_s"] > 0
    assert record["mixed_confidence_vs_tuned"] > 0 and set(record["mixed_workload"]) == {
        "ar", "dspark", "tuned", "confidence"}


def test_a_schedule_file_is_read_in_either_form_and_a_bad_one_names_the_flag(tmp_path):
    from bench import read_schedule

    fragment, bare = tmp_path / "fragment.json", tmp_path / "bare.json"
    fragment.write_text(json.dumps({"engine": {"speculative_config": {"draft_len_schedule": {"64": 7, "256": 2}}}}))
    bare.write_text(json.dumps({"1": 3, "8": 0}))
    assert read_schedule(str(fragment), 7) == {64: 7, 256: 2} and read_schedule(str(bare), 3) == {1: 3, 8: 0}
    for text in ("{}", "[1, 2]", '{"engine": {}}', '{"4": 9}', '{"0": 1}', '{"x": 1}', "not json"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match="--schedule"):
            read_schedule(str(bad), 7)
    with pytest.raises(ValueError, match="--schedule .*readable"):
        read_schedule(str(tmp_path / "missing.json"), 7)


def test_tuning_a_sweep_of_one_request_keeps_max_draft_len(tmp_path):
    """A sweep of one request alone has nothing to tune (one request drafts max_draft_len, where every schedule
    starts): the tuned schedule is {1: K}; it built a candidate engine of schedule {1: k}, refused as invalid."""
    import subprocess
    import sys
    from pathlib import Path

    out, schedule = tmp_path / "bench.json", tmp_path / "schedule.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--concurrency", "1", "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2",
                           "--warmup", "1", "--rounds", "1", "--kv-cache-memory", "50MiB", "--tune-schedule", str(schedule),
                           "--acceptance-per-position", "0.99,0.5,0.1", "--e2e-prompts", "0", "--mixed-rate", "100",
                           "--mixed-rate", "0", "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["tuned_schedule"]["schedule"] == {"1": 3}
    assert "mixed_workload" not in record  # a later --mixed-rate 0 took the earlier one back


def test_the_confidence_engine_can_draft_max_draft_len_beside_the_tuned_schedule(tmp_path):
    """``--confidence-draft-len max``: the confidence-scheduled engine drafts max_draft_len at every concurrency (its
    believed survivals cover 3 positions wherever the tuned schedule drafts fewer) and is still compared with the
    tuned schedule; the record says which."""
    import subprocess
    import sys
    from pathlib import Path

    out, schedule = tmp_path / "bench.json", tmp_path / "schedule.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--concurrency", "1,2", "--max-draft-len", "3", "--prompt-len", "8", "--steps", "2",
                           "--warmup", "1", "--rounds", "1", "--kv-cache-memory", "50MiB", "--confidence-scheduling",
                           "--tune-schedule", str(schedule), "--confidence-draft-len", "max",
                           "--acceptance-per-position", "0.99,0.5,0.1", "--out", str(out)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["confidence_draft_len"] == "max"
    assert record["schedules"]["confidence"] == "confidence within max_draft_len, beside the tuned schedule"
    for row in record["runs"]:
        assert row["confidence_vs_tuned"] > 0
        # decided steps believe 3 positions; where drafting did not pay (a CPU drafter costs about what the tiny
        # target does) the engine may hold the drafting off for the whole timing, and decide nothing there
        positions = row["confidence_predicted_survival_per_position"]
        assert len(positions) == 3 or (not positions and row["confidence_drafting_off_steps"] > 0), row


def test_a_schedule_cap_reads_a_draft_len_schedule_as_the_engine_does():
    """Keys are upper bounds (JSON's string keys too); above the largest, 0; no schedule: max_draft_len. The
    engine's own reading (``DSparkDecodingConfig.draft_len_for_batch_size``) agrees on every batch size."""
    from configs import DSparkDecodingConfig

    schedule = {4: 7, 64: 5, 256: 3}
    config = DSparkDecodingConfig(speculative_model="x", max_draft_len=7, draft_len_schedule=schedule)
    for batch in (1, 4, 5, 64, 65, 256, 257):
        assert schedule_cap(schedule, batch, 7) == config.draft_len_for_batch_size(batch)
        assert schedule_cap({str(k): v for k, v in schedule.items()}, batch, 7) == config.draft_len_for_batch_size(batch)
    assert schedule_cap(None, 300, 7) == 7


def test_confidence_bounds_price_the_tuned_cap_on_the_startup_table():
    """The bounds take the fixed engine's acceptance up to the block the confidence engine drafts (the tuned
    schedule's length at that concurrency, or max_draft_len) and compare with the tuned length's whole blocks."""
    from runtime.spec.schedule_bounds import schedule_bounds
    from runtime.spec.step_costs import StepCostTable

    tokens = [64 * (q + 1) for q in range(4)]
    table = StepCostTable([64], tokens, [[10.0 + 0.01 * t for t in tokens]])
    row = {"concurrency": 64, "acceptance_per_position": [0.9, 0.3, 0.05]}
    record = {"confidence_cost_table": table.to_json(), "tuned_schedule": {"schedule": {"64": 2}}}
    got = confidence_bounds(row, record)
    want = schedule_bounds(64, [0.9, 0.3], table)
    assert got == {"confidence_oracle_bound": round(want["oracle_ragged"], 3),
                   "confidence_padded_bound": round(want["padded_best"], 3),
                   "confidence_padded_bound_cap": want["padded_best_cap"]}
    # --confidence-draft-len max: the oracle over the whole drafted block (3), against the tuned length's blocks (2)
    drafting_all = {**record, "confidence_draft_len": "max"}
    tuned_rate = (1 + 0.9 + 0.3) / (10.0 + 0.01 * 192)
    oracle_rate = (1 + 0.9 + 0.3 + 0.05) / (10.0 + 0.01 * 144)
    assert confidence_bounds(row, drafting_all)["confidence_oracle_bound"] == round(oracle_rate / tuned_rate, 3)
    assert confidence_bounds(row, {**record, "tuned_schedule": {"schedule": {"32": 2}}}) == {}  # cap 0: none
    assert confidence_bounds({"concurrency": 64}, record) == {}


def test_a_paired_ratio_is_the_median_of_the_rounds_ratios():
    assert paired_ratio([2.0, 3.0, 9.0], [1.0, 3.0, 3.0]) == 2.0  # ratios 2, 1, 3
    assert paired_ratio([1.0, 4.0], [1.0, 2.0]) == 1.5
    assert paired_ratio([1.0], [1.0, 2.0]) is None and paired_ratio([], []) is None


def test_the_mixed_noise_floor_is_reported_only_where_tuned_and_fixed_are_one_engine():
    """One run's figures: at 64 requests the tuned schedule drafts 7 everywhere, so tuned / fixed is the floor; with
    256 in the workload (the schedule drafts 4 there) they are two engines, and nothing is reported."""
    rows = [{"concurrency": 64, "acceptance_per_position": [0.9] * 7}]
    mixed = {"dspark": {"tokens_per_s": 21541.9, "tokens_per_s_rounds": [14361.8, 21542.2, 21541.9]},
             "tuned": {"tokens_per_s": 14914.8, "tokens_per_s_rounds": [14467.3, 14914.8, 18206.5]}}
    record = {"mixed_workload": mixed, "tuned_schedule": {"schedule": {"64": 7}}}
    floor = mixed_noise_floor(record, rows, 64)
    assert floor["mixed_tuned_vs_dspark"] == pytest.approx(14914.8 / 21541.9)
    assert floor["mixed_tuned_vs_dspark_paired"] == pytest.approx(paired_ratio(
        mixed["tuned"]["tokens_per_s_rounds"], mixed["dspark"]["tokens_per_s_rounds"]))
    assert mixed_noise_floor({**record, "tuned_schedule": {"schedule": {"64": 7, "256": 4}}}, rows, 256) == {}
    assert mixed_noise_floor({"mixed_workload": mixed}, rows, 64) == {}  # no tuned schedule


def variant_runs(suffix: str) -> dict:
    """The mixed workload's runs of two engines (100 and 105 tokens/s) and of a variant of each (150 and 160)."""
    def run(tokens_per_s):
        return {"tokens_per_s": tokens_per_s, "tokens_per_s_rounds": [tokens_per_s - 10, tokens_per_s,
                                                                       tokens_per_s + 10]}

    return {"tuned": run(100.0), "confidence": run(105.0), f"tuned{suffix}": run(150.0),
            f"confidence{suffix}": run(160.0)}


def test_prefill_apart_ratios_pair_each_engine_with_itself():
    runs = variant_runs("-apart")
    ratios = prefill_apart_ratios(runs)
    assert ratios["mixed_apart_vs_mixed"] == pytest.approx({"tuned": 1.5, "confidence": 160 / 105})
    assert ratios["mixed_apart_vs_mixed_paired"]["tuned"] == pytest.approx(1.5)
    assert ratios["mixed_confidence_vs_tuned_apart"] == pytest.approx(160 / 150)
    assert prefill_apart_ratios({"tuned": runs["tuned"]}) == {}


def test_piecewise_ratios_pair_each_engine_with_its_eager_self():
    runs = variant_runs("-eager")  # here the engines as built are the slower ones: ratios below 1
    ratios = piecewise_ratios(runs)
    assert ratios["mixed_piecewise_vs_eager"] == pytest.approx({"tuned": 100 / 150, "confidence": 105 / 160})
    assert ratios["mixed_piecewise_vs_eager_paired"]["tuned"] == pytest.approx(
        paired_ratio([90.0, 100.0, 110.0], [140.0, 150.0, 160.0]))
    assert ratios["mixed_confidence_vs_tuned_eager"] == pytest.approx(160 / 150)
    assert piecewise_ratios(variant_runs("-apart")) == {}


def test_a_step_window_profile_covers_its_steps_or_the_loops_end():
    from bench import StepWindowProfile

    def loop(window: StepWindowProfile, steps: int) -> None:
        import torch

        for i in range(steps):
            window.before(i)
            torch.ones(8).sum()
            window.after(last=i == steps - 1)

    window = StepWindowProfile(2, 3)
    loop(window, 10)
    assert window.summary is not None and window._profiled == 3
    short = StepWindowProfile(2, 30)  # the loop ends first: the window closes at its last step
    loop(short, 5)
    assert short.summary is not None and short._profiled == 3
    never = StepWindowProfile(8, 2)  # the loop never reaches the window
    loop(never, 5)
    assert never.summary is None
    with pytest.raises(ValueError, match="skip >= 0 and steps >= 1"):
        StepWindowProfile(0, 0)


def test_the_summary_reads_each_variants_ratios():
    from bench import variant_summary

    record = piecewise_ratios(variant_runs("-eager"))
    lines = variant_summary(record, "mixed_piecewise_vs_eager", "through piecewise graphs / eager",
                            "with those steps eager", "eager")
    assert lines[0].startswith("mixed workload through piecewise graphs / eager: tuned 0.667 (paired 0.")
    assert lines[1] == "  with those steps eager, confidence / tuned 1.067 (paired 1.067)"
    assert variant_summary(record, "mixed_apart_vs_mixed", "", "", "apart") == []


def test_gpu_gaps_sum_the_time_no_device_activity_covers():
    from runtime.kernels.profiling import gpu_gaps

    # two steps: a graph's kernels overlapping, a copy, then 30 us of nothing before the next step's kernel
    spans = [(0, 10, "gemm"), (5, 12, "norm"), (12, 15, "memcpy"), (45, 60, "gemm"), (70, 71, "argmax")]
    gaps = gpu_gaps(spans, steps=2)
    assert gaps["gpu_idle_ms_per_step"] == (30 + 10) / 2 / 1e3
    assert gaps["largest_gpu_gaps"][0] == {"us": 30, "after": "memcpy", "before": "gemm"}
    assert gaps["largest_gpu_gaps"][1] == {"us": 10, "after": "gemm", "before": "argmax"}
    assert gpu_gaps([], steps=1) == {"gpu_idle_ms_per_step": 0.0, "largest_gpu_gaps": []}


def test_sequential_measures_each_engine_alone(tmp_path):
    """``--sequential``: one engine alive at a time (a target too large for two), the tuning candidates timed alone,
    the tuned and confidence engines swept one after the other; the record says so."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out, schedule = tmp_path / "bench.json", tmp_path / "schedule.json"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--model-shape", "tiny", "--device", "cpu",
                           "--concurrency", "1,2", "--max-draft-len", "2", "--prompt-len", "8", "--steps", "2",
                           "--warmup", "1", "--kv-cache-memory", "50MiB", "--sequential", "--tune-schedule", str(schedule),
                           "--acceptance-per-position", "0.99,0.99", "--e2e-prompts", "2", "--e2e-tokens", "4",
                           "--confidence-scheduling", "--out", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["measurement"] == "sequential" and record["tuned_schedule"]["step_ms"] == "each candidate timed alone"
    assert record["end_to_end"]["prompts"] == 2
    for row in record["runs"]:
        assert row["ar_tokens_per_s"] > 0 and row["tuned_tokens_per_s"] > 0 and "ar_tokens_per_s_rounds" not in row
        assert row["confidence_tokens_per_s"] > 0 and "confidence_tokens_per_s_rounds" not in row  # one at a time


def test_a_profile_takes_decode_steps_after_every_prefill_chunk(tmp_path, monkeypatch):
    """``profile_step`` profiles decode steps only: with more prompt tokens than one step's budget the prefill takes
    several steps, and none of them may fall inside the profile (one run's batch-64 profiles were prefill steps)."""
    import contextlib

    import torch.profiler

    from bench import profile_step
    from runtime import LLM

    target, _ = write_shape(tmp_path, "tiny", draft_layers=1, block_size=3)
    llm = LLM(str(target), dtype="float32", device="cpu", load_format="dummy", max_num_seqs=8, max_model_len=512,
              max_num_batched_tokens=64, kv_cache_memory=64 << 20)
    profiling, steps = [False], []

    @contextlib.contextmanager
    def fake_profile(*args, **kwargs):
        profiling[0] = True
        yield None
        profiling[0] = False

    engine, step = llm.engine, llm.engine.step

    def recording_step():
        prefilling = any(not seq.output_token_ids for seq in engine.sequences.values())
        steps.append((profiling[0], prefilling))
        return step()

    monkeypatch.setattr(torch.profiler, "profile", fake_profile)
    monkeypatch.setattr("runtime.kernels.profiling.summarize", lambda prof, n, trace: {"steps": n})
    monkeypatch.setattr(engine, "step", recording_step)
    assert profile_step(llm, 8, 40, 500) == {"steps": 5}  # 8 prompts of 40 tokens: 5 steps of 64 to prefill
    assert sum(prefilling for _, prefilling in steps) >= 5
    profiled = [prefilling for inside, prefilling in steps if inside]
    assert len(profiled) == 5 and not any(profiled)


def test_drafter_kinds_measure_dspark_against_ar_on_pairs_of_known_worth(tmp_path):
    """``dspark bench --drafter-kinds``: every row names its kind and concurrency with both engines' tokens/s and
    the guard's counters; the oracle drafter's blocks are accepted, the random one's hardly ever; a kind not offered
    is refused naming the allowed ones."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "kinds.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--drafter-kinds", "good,untrained",
                           "--concurrency", "2", "--rounds", "1", "--kind-seconds", "0.2", "--kind-tokens", "12",
                           "--device", "cpu", "--out", str(out)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["command"].startswith("dspark bench --drafter-kinds good,untrained")
    rows = {row["drafter_kind"]: row for row in record["rows"]}
    assert set(rows) == {"good", "untrained"}
    for row in rows.values():
        assert row["concurrency"] == 2 and row["ar_tokens_per_s"] > 0 and row["dspark_tokens_per_s"] > 0
        assert {"plain_steps", "drafting_steps"} <= set(row["guard"])
    # (a request's 12 tokens cut its last block: 1 from the prompt, a whole block of 8, then what is left)
    assert rows["good"]["fixed_mean_acceptance_length"] > 4
    assert rows["untrained"]["fixed_mean_acceptance_length"] < 1.5
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "--drafter-kinds", "good,perfect"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "untrained, weak, good, mixed" in bad.stderr and "'good,perfect'" in bad.stderr


def test_a_one_process_bench_runs_where_ray_is_not_installed(tmp_path):
    """``dspark bench`` imports Ray only for a run on a Ray replica: with ``ray`` unimportable a one-process run
    finishes and writes its record (GPU hosts may have no Ray)."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "bench.json"
    script = ("import sys; sys.modules['ray'] = None\n"  # (import ray now raises ImportError)
              "from cluster.cli import main\n"
              f"sys.exit(main(['bench', '--model-shape', 'tiny', '--device', 'cpu', '--concurrency', '1', "
              f"'--max-draft-len', '2', '--prompt-len', '8', '--steps', '2', '--warmup', '1', '--kv-cache-memory', "
              f"'50MiB', '--out', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["replica"] == "single-process"


def test_the_steady_load_staggers_its_first_requests():
    """``SteadyLoad``'s first ``c`` requests ask for tokens / c, 2 tokens / c, ... tokens (so they finish one after
    another); a replacement asks for the load's full length."""
    from bench.drafter_kinds import SteadyLoad

    class Recorder:
        def __init__(self):
            self.lengths = []

        def add_request(self, prompt, params):
            self.lengths.append(params.max_tokens)
            return f"r{len(self.lengths)}"

    class Llm:
        engine = Recorder()

    load = SteadyLoad(Llm(), "untrained", 4, 64, [5, 6], [7, 8], seed=0)
    assert Llm.engine.lengths == [16, 32, 48, 64]
    load.add(0)
    assert Llm.engine.lengths[-1] == 64
