"""The benchmark scripts: the GPU recipe's argument plumbing and a CPU smoke run that chains, and CPU smoke runs of the
others (their records' fields)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "benchmarks" / "gpu_recipe.py"


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe():
    return load_benchmark("gpu_recipe")


def test_child_arguments_replace_and_drop_options_in_both_spellings():
    recipe = load_recipe()
    argv = ["--work", "/w", "--stages=target,eval", "--run-seconds", "500", "--gpus", "2", "--smoke"]
    assert recipe.child_argv(argv, drop=("--run-seconds",), stages="dspark", gpus=1) == [
        "--work", "/w", "--smoke", "--stages", "dspark", "--gpus", "1"]


def test_shard_names_its_form():
    recipe = load_recipe()
    assert recipe.shard("1/2") == (1, 2)
    with pytest.raises(Exception, match="I/N"):
        recipe.shard("2/2")


def test_target_size_flags_shape_the_target_and_a_bad_width_is_named(tmp_path):
    import argparse

    recipe = load_recipe()
    args = argparse.Namespace(corpus=None, corpus_mb=64, target_steps=10, target_seconds=5.0, target_lr=1e-3,
                              target_hidden=768, target_layers=12, target_batch=20, smoke=False)
    cfg = recipe.target_config(tmp_path, args)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.lr,
            cfg.batch_size) == (768, 12, 12, 6, 2304, 1e-3, 20)
    proc = subprocess.run([sys.executable, str(RECIPE), "--smoke", "--work", str(tmp_path / "w"), "--out",
                           str(tmp_path / "o.json"), "--target-hidden", "100"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "--target-hidden 100: a positive multiple of 64" in proc.stderr
    proc = subprocess.run([sys.executable, str(RECIPE), "--smoke", "--work", str(tmp_path / "w"), "--out",
                           str(tmp_path / "o.json"), "--target-batch", "0"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "--target-batch 0: a positive number of sequences" in proc.stderr


@pytest.mark.slow
def test_smoke_recipe_records_both_drafters_and_a_rerun_skips_finished_stages(tmp_path):
    def run(*flags):
        out = tmp_path / "record.json"
        subprocess.run([sys.executable, str(RECIPE), "--smoke", "--work", str(tmp_path / "work"), "--out", str(out),
                        "--distill-prompts", "4", "--eval-prompts", "2", "--draft-layers", "3", *flags], check=True,
                       cwd=ROOT, capture_output=True)
        return json.loads(out.read_text())

    first = run()
    assert set(first["results"]) == {"dspark", "dflash"}
    assert set(first["results"]["dspark"]) == {"t=0.0", "t=1.0", "training_files_t=0.0"}
    assert all(1.0 <= r["mean_acceptance_length"] <= 8.0 for d in first["results"].values() for r in d.values())
    assert {"target", "distill", "train-dspark", "train-dflash"} <= set(first["stages"])
    temperatures = json.loads((tmp_path / "work" / "dspark" / "config.json").read_text())["confidence_temperatures"]
    assert len(temperatures) == 7 and all(t > 0 for t in temperatures)  # calibrated on other held-out windows
    held = [json.loads(line)["prompt_ids"] for line in (tmp_path / "work" / "heldout-prompts.jsonl").open()]
    assert len(held) == 2 and all(len(ids) == 64 for ids in held)  # what dspark bench --prompts reads
    for name in ("dspark", "dflash"):  # --draft-layers reaches both drafters
        assert json.loads((tmp_path / "work" / name / "config.json").read_text())["num_hidden_layers"] == 3
    second = run("--gpus", "2")  # everything is found done: nothing retrains; eval runs one child per drafter
    assert second["stages"] == first["stages"]
    assert second["results"] == first["results"]  # seeded evaluation of the same checkpoints
    assert {"eval-dspark.log", "eval-dflash.log"} <= {p.name for p in (tmp_path / "work").iterdir()}


def test_moe_layer_benchmark_smoke(tmp_path):
    out = tmp_path / "moe.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), "--smoke", "--tokens", "1,8",
                    "--repeats", "2", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    record = json.loads(out.read_text())
    runs = {(r["tokens"], r["moe_backend"]): r for r in record["runs"]}
    assert set(runs) == {(t, b) for t in (1, 8) for b in ("VANILLA", "DENSEGEMM")}
    assert all(r["max_abs_diff_vs_vanilla"] < 1e-5 for r in runs.values())
    assert runs[(1, "VANILLA")]["experts_woken"] == 2 and "eager_vs_densegemm" in runs[(8, "VANILLA")]


def test_tp_scaling_ratios_pair_each_layout_with_its_reference_and_skip_what_the_host_cannot_hold():
    from benchmarks import tp_scaling

    names = [(name, need, flags is None) for name, flags, need in tp_scaling.layouts([1, 2, 4], True, gpus=2)]
    assert names == [("single-process", 1, False), ("ray-tp1", 1, False), ("ray-tp2", 2, False),
                     ("ray-tp2-oneshot", 2, False), ("ray-tp1-separate", 2, False), ("ray-tp4", 4, True),
                     ("ray-tp4-oneshot", 4, True)]
    assert [name for name, _, _ in tp_scaling.layouts([1, 2], False, gpus=2, oneshot=False)] == \
        ["single-process", "ray-tp1", "ray-tp2"]
    assert dict((n, f) for n, f, _ in tp_scaling.layouts([1, 2], False, 2))["ray-tp2-oneshot"][-2:] == \
        ["--allreduce-strategy", "ONESHOT"]
    agreeing = dict((n, f) for n, f, _ in tp_scaling.layouts([1, 2], False, 2, e2e_prompts=8))
    assert all(agreeing[name][-3:] == ["--beside-single-process", "--e2e-prompts", "8"]
               for name in ("ray-tp1", "ray-tp2", "ray-tp2-oneshot"))
    records = {
        "single-process": {"runs": [{"concurrency": 1, "ar_step_ms": 5.0, "dspark_step_ms": 6.0}]},
        "ray-tp1": {"runs": [{"concurrency": 1, "ar_step_ms": 5.5, "dspark_step_ms": 6.6}]},
        "ray-tp2": {"runs": [{"concurrency": 1, "ar_step_ms": 3.3, "dspark_step_ms": 4.4}]},
        "ray-tp2-oneshot": {"runs": [{"concurrency": 1, "ar_step_ms": 2.75, "dspark_step_ms": 3.3}]},
        "ray-tp1-separate": {"runs": [{"concurrency": 1, "step_vs_colocated": 1.02,
                                       "throughput_vs_colocated": 0.98}]},
    }
    assert "--beside-single-process" in dict((n, f) for n, f, _ in tp_scaling.layouts([1, 2], True, 2))["ray-tp1"]
    got = tp_scaling.ratios(records, [1, 2, 4])[1]
    assert got == {"tp2_vs_tp1_ar_step": 0.6, "tp2_vs_tp1_dspark_step": round(4.4 / 6.6, 4),
                   "tp2_oneshot_vs_tp1_ar_step": 0.5, "tp2_oneshot_vs_tp1_dspark_step": 0.5,
                   "ray_tp1_vs_single_process_ar_step": 1.1, "ray_tp1_vs_single_process_dspark_step": 1.1,
                   "ray_tp1_vs_single_process_from": "separate layouts",
                   "separate_step_vs_colocated": 1.02, "separate_throughput_vs_colocated": 0.98}
    # the TP=1 layout measured beside one process in alternating rounds: its paired ratios win over the layouts'
    records["ray-tp1"]["runs"][0].update(ray_vs_single_process_ar_step_paired=1.03,
                                         ray_vs_single_process_dspark_step_paired=1.04)
    got = tp_scaling.ratios(records, [1, 2, 4])[1]
    assert (got["ray_tp1_vs_single_process_ar_step"], got["ray_tp1_vs_single_process_dspark_step"]) == (1.03, 1.04)
    assert got["ray_tp1_vs_single_process_from"] == "alternating rounds in the ray-tp1 layout"


def test_schedule_bounds_price_the_best_cap_and_the_oracle_from_the_table(tmp_path):
    """benchmarks/schedule_bounds.py: on a table whose step costs 10 ms + 0.01 per token at 64 requests, with
    acceptance falling along the block, the best single cap is below whole blocks and the oracle feeds tau tokens."""
    module = load_benchmark("schedule_bounds")
    from runtime.spec.step_costs import StepCostTable

    tokens = [64 * (q + 1) for q in range(4)]
    table = StepCostTable([64], tokens, [[10.0 + 0.01 * t for t in tokens]])
    run = {"concurrency": 64, "acceptance_per_position": [0.9, 0.3, 0.05]}
    row = module.bounds(run, table)
    tau = 2.25
    whole = tau / (10.0 + 0.01 * 256)
    best = max((1 + sum([0.9, 0.3, 0.05][:q])) / (10.0 + 0.01 * 64 * (q + 1)) for q in range(4))
    assert row["padded_best_cap"] == 2 and row["padded_best"] == pytest.approx(best / whole, abs=1e-3)
    assert row["oracle_ragged"] == pytest.approx((10.0 + 2.56) / (10.0 + 0.01 * 144), abs=1e-3)
    bench, costs = tmp_path / "bench.json", tmp_path / "costs.json"
    bench.write_text(json.dumps({"runs": [run]}))
    table.save(costs)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "schedule_bounds.py"), str(bench), str(costs),
                          "--concurrency", "64"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [row]


def test_scheduler_host_benchmark_smoke(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scheduler_host.py"), "--batches", "1,32", "--steps", "3",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["batch"]) for r in rows] == [("padded", 1), ("padded", 32), ("ragged", 1), ("ragged", 32)]
    assert [r["chosen_by_default"] for r in rows] == ["python", "numpy"] * 2
    assert all(r[f"{path}_{kind}_us"] > 0 for r in rows for path in ("python", "numpy") for kind in ("after_step",
                                                                                                     "in_loop"))


def test_guard_host_benchmark_smoke(tmp_path):
    out = tmp_path / "guard.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "guard_host.py"), "--requests", "1,8", "--steps", "5",
                    "--rounds", "1", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["requests"] for r in rows] == [1, 8] and all(r["plan_us"] > 0 and r["observe_verifies_us"] > 0
                                                          for r in rows)


def test_train_step_benchmark_times_both_variants_on_one_batch(tmp_path, qwen3_target):
    """Both variants' steps and the target's forward over the same batch, and with --profile the top operators of
    one step of each."""
    out = tmp_path / "train-step.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--target", str(qwen3_target),
                    "--seq-len", "32", "--anchors", "4", "--steps", "1", "--rounds", "1", "--profile", "--out",
                    str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    record = json.loads(out.read_text())
    timed = {"dspark-1", "dflash-1", "target-forward"}
    assert set(record["step_ms"]) == timed and record["dspark_over_dflash"] > 0
    assert record["slots"] == 2 * 4 * 7 and "--target" in record["command"]
    assert set(record["profile"]) == timed and all(ops and ops[0]["self_ms"] > 0 for ops in record["profile"].values())


def test_train_step_benchmark_builds_a_random_target_of_smollm2s_shape(tmp_path):
    """--shape smollm2 times the step on a random-weight target of SmolLM2's architecture (no checkpoint read)."""
    out = tmp_path / "train-step.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--shape", "smollm2", "--batch", "1",
                    "--seq-len", "16", "--anchors", "2", "--steps", "1", "--rounds", "1", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["vocab_size"] == 49152 and record["target"] == "random weights, smollm2's shape"
    assert set(record["step_ms"]) == {"dspark-1", "dflash-1", "target-forward"}
    both = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--shape", "smollm2",
                           "--target", "smollm2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def test_confidence_host_path_benchmark_smoke(tmp_path):
    """The scheduler's work on a step's path is timed, and its folds run off the path (the executor's host work)."""
    out = tmp_path / "path.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "confidence_host_path.py"), "--batches", "4",
                    "--steps", "12", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    # on_path_ms is a difference of two engines' timings: its sign is noise on a busy host, so only its presence
    assert row["batch"] == 4 and isinstance(row["on_path_ms"], float) and row["confidence"]["_allot_verify_lengths"] > 0
    # 12 steps: a fold came due, and it ran in the device's wait (the executor's host work), not in the commit
    assert row["confidence"]["fold@wait"] > 0 and "fold_in_commit" not in row["confidence"]


def test_fan_out_children_share_the_hosts_threads(tmp_path, monkeypatch):
    """Each child of a fan-out gets its share of the host's cores as ``OMP_NUM_THREADS`` (two children each with a
    thread per core took 58 s for an evaluation that took 6 s so, on 2 cores); a value the caller set stands."""
    recipe = load_recipe()
    started = []

    class Child:
        def __init__(self, argv, stdout, stderr, env):
            started.append(env)

        def wait(self):
            return 0

    monkeypatch.setattr(recipe.subprocess, "Popen", Child)
    monkeypatch.setattr(recipe.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    recipe.fan_out([("a", []), ("b", [])], 2, tmp_path)
    assert [(env["OMP_NUM_THREADS"], env["CUDA_VISIBLE_DEVICES"]) for env in started] == [("4", "0"), ("4", "1")]
    started.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    recipe.fan_out([("a", []), ("b", []), ("c", [])], 2, tmp_path)
    assert [env["OMP_NUM_THREADS"] for env in started] == ["3"] * 3


def test_packed_schedule_sim_stays_whole_where_everything_is_accepted_and_packs_where_it_pays(tmp_path):
    """benchmarks/packed_schedule_sim.py over a table where a step costs 2 ms + 0.005 per token at 64 requests: with
    every request easy, whole blocks are best and the scheduler keeps them (1.00x); with most hard, it packs fewer
    columns and beats the best fixed cap."""
    from runtime.spec.step_costs import StepCostTable

    tokens = [64 * (q + 1) for q in range(8)]
    costs = tmp_path / "costs.json"
    StepCostTable([64], tokens, [[2.0 + 0.005 * t for t in tokens]]).save(costs)
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "packed_schedule_sim.py"), "--step-costs", str(costs),
                    "--batch", "64", "--hard-fractions", "0,0.9", "--steps", "60", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    easy, hard = json.loads(out.read_text())["rows"]
    assert easy["best_fixed_cap"] == 7 and easy["mean_columns"] == 7.0
    assert easy["packed_vs_best_fixed"] == pytest.approx(1.0)
    assert hard["mean_columns"] < 7 and hard["packed_vs_best_fixed"] > 1.0


def test_packed_schedule_sim_holds_the_drafting_off_only_where_plain_decoding_beats_it(tmp_path):
    """``--plain-ms``: against plain steps of 1.5 ms (a step of verifies costs 2.3 ms or more) the drafting pays when
    every request is easy (85 tokens a ms against 43: nothing held) and not when all are hard (the best fixed cap 36
    a ms: held, and as fast as plain decoding within a few percent)."""
    from runtime.spec.step_costs import StepCostTable

    tokens = [64 * (q + 1) for q in range(8)]
    costs = tmp_path / "costs.json"
    StepCostTable([64], tokens, [[2.0 + 0.005 * t for t in tokens]]).save(costs)
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "packed_schedule_sim.py"), "--step-costs", str(costs),
                    "--batch", "64", "--hard-fractions", "0,1", "--steps", "120", "--plain-ms", "1.5",
                    "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    easy, hard = json.loads(out.read_text())["rows"]
    assert easy["held_step_share"] == 0 and easy["packed_with_holds_vs_best"] > 0.97
    assert hard["held_step_share"] > 0.7 and hard["packed_with_holds_vs_best"] > 0.95
    # the holds a refit reverses kept (the engine before 2be9a17), beside: where the holds are right, alike
    assert hard["held_step_share_kept"] > 0.7 and hard["drafting_judgements_reversed"] <= hard["drafting_holds"]
    # --stale-steps: a fit of one confident request rejecting every draft first: the easy requests still draft
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "packed_schedule_sim.py"), "--step-costs", str(costs),
                    "--batch", "64", "--hard-fractions", "0", "--steps", "60", "--plain-ms", "1.5",
                    "--stale-steps", "20", "--out", str(out)], check=True, cwd=ROOT, capture_output=True, timeout=300)
    record = json.loads(out.read_text())
    assert record["stale_steps"] == 20 and record["rows"][0]["held_step_share"] < 0.5


def test_the_record_folder_is_made_before_any_stage_runs(tmp_path, monkeypatch):
    """One run trained a pair for ~4 minutes and lost its record: --out named a folder nobody had made."""
    recipe = load_recipe()
    out = tmp_path / "not" / "yet" / "gpu-recipe.json"
    monkeypatch.setattr("sys.argv", ["gpu_recipe.py", "--work", str(tmp_path / "w"), "--out", str(out),
                                     "--stages", "nonesuch"])
    with pytest.raises(SystemExit, match="--stages"):
        recipe.main()
    assert out.parent.is_dir()


def test_the_device_scripts_parse_and_refuse_an_unknown_step(tmp_path):
    """Every benchmarks/*.sh is valid bash; the step scripts name their steps when given one they do not have (before
    they install or run anything)."""
    import subprocess

    for script in sorted((ROOT / "benchmarks").glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script.name
    done = subprocess.run(["bash", "benchmarks/cluster_fast_path.sh", "bogus", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr and not any(tmp_path.iterdir())


def test_e2e_bench_pairs_our_two_engines_on_real_prompts_and_runs_our_ar_alone(tmp_path, make_drafter):
    from tests import builders

    module = load_benchmark("e2e_bench")
    target = builders.save_target(tmp_path / "target", "qwen3", seed=1, max_position_embeddings=4096)
    drafter = make_drafter(target, 3)
    common = ["--model", str(target), "--concurrency", "2", "--requests", "2", "--max-tokens", "6", "--rounds", "1",
              "--max-draft-len", "3", "--device", "cpu", "--kv-cache-gib", "0.1"]
    assert module.main([*common, "--drafter", str(drafter), "--profile-steps", "2", "--profile-concurrency", "2",
                        "--out", str(tmp_path / "pair.json")]) == 0
    record = json.loads((tmp_path / "pair.json").read_text())
    # both engines' decode steps profiled first (host regions and the step's median wall time), then measured
    assert [p["engine"] for p in record["profiles"]] == ["ar", "dspark"]
    assert all(p["steps"] == 2 and p["step_ms_median"] > 0 for p in record["profiles"])
    row = record["rows"][0]
    assert row["concurrency"] == 2 and row["ar_tokens_per_s"] > 0 and row["dspark_tokens_per_s"] > 0
    assert row["tau"] >= 1 and "plain_steps" in row["speculation_guard"]  # the guard's decisions at this level
    assert module.main([*common, "--drafter", "none", "--out", str(tmp_path / "ar.json")]) == 0
    alone = json.loads((tmp_path / "ar.json").read_text())
    assert alone["dspark_rank_info"] is None and "dspark_tokens_per_s" not in alone["rows"][0]


def test_e2e_bench_shares_a_gpu_kv_budget_among_the_engines_alive_together():
    module = load_benchmark("e2e_bench")
    assert module.default_kv_cache_gib(True, 4) == 1.0
    assert module.default_kv_cache_gib(False, 1) == module.default_kv_cache_gib(False, 2) == 16.0
    # AR, DSpark, fixed K and never drafting: 40 GiB among four, what fits an 80 GB GPU beside the weights
    assert module.default_kv_cache_gib(False, 4) == 10.0


def test_e2e_bench_times_dspark_that_never_drafts_and_fixed_k_beside_the_pair(tmp_path, make_drafter):
    """``--undrafted``: DSpark with a block of 0 every step (the guard's floor); ``--fixed``: every block verified (the
    guard off); both in the same rounds."""
    from tests import builders

    module = load_benchmark("e2e_bench")
    target = builders.save_target(tmp_path / "target", "qwen3", seed=1, max_position_embeddings=4096)
    drafter = make_drafter(target, 3)
    assert module.main(["--model", str(target), "--drafter", str(drafter), "--concurrency", "2", "--requests", "2",
                        "--max-tokens", "6", "--rounds", "1", "--max-draft-len", "3", "--device", "cpu",
                        "--kv-cache-gib", "0.1", "--undrafted", "--fixed", "--out", str(tmp_path / "floor.json")]) == 0
    row = json.loads((tmp_path / "floor.json").read_text())["rows"][0]
    assert row["undrafted_over_ar_paired"] > 0 and row["rounds"][0]["undrafted"]["tokens_per_s"] > 0
    assert row["fixed_over_ar_paired"] > 0 and row["rounds"][0]["fixed"]["tokens_per_s"] > 0


def test_guard_replay_records_each_verify_in_the_dtype_asked(tmp_path, make_drafter):
    from tests import builders

    module = load_benchmark("guard_replay")
    target = builders.save_target(tmp_path / "target", "qwen3", seed=1, max_position_embeddings=4096)
    drafter = make_drafter(target, 3)
    out = tmp_path / "outcomes.json"
    assert module.main(["record", "--model", str(target), "--drafter", str(drafter), "--max-draft-len", "3",
                        "--max-tokens", "6", "--prompts", "1", "--dtype", "bfloat16", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["dtype"] == "bfloat16" and len(record["requests"]) == 4  # a first turn of each evaluation set
    assert all(1 <= drafts <= 3 and 0 <= accepted <= drafts for r in record["requests"] for drafts, accepted in r)


def test_guard_replay_prices_fixed_k_and_the_guard_on_recorded_outcomes():
    """The offline replay drives the engine's own guard: where every draft is accepted it drafts as fixed K does;
    where none is, fixed K pays the drafting price for nothing and the guard decodes plain."""
    module = load_benchmark("guard_replay")
    prices = {"plain_ms": 1.0, "drafting_ms": 1.5, "whole_ms": 1.5, "ms_per_verified_draft": 0.0}
    accepting = [module.Stream([[7, 7]] * 20) for _ in range(8)]
    rejecting = [module.Stream([[7, 0]] * 80) for _ in range(8)]
    for batch in (1, 4):
        fixed = module.replay(accepting, batch, prices, 7, guarded=False)
        guard = module.replay(accepting, batch, prices, 7)
        assert fixed["over_ar"] > 4 and guard["over_ar"] > 0.9 * fixed["over_ar"] and guard["drafting_share"] > 0.9
        fixed = module.replay(rejecting, batch, prices, 7, guarded=False)
        guard = module.replay(rejecting, batch, prices, 7)
        assert fixed["over_ar"] < 0.7 and guard["over_ar"] > 0.95 and guard["drafting_share"] < 0.05
    assert module.Stream([[7, 3], [7, 0]]).accepted_at(1) == 2  # inside a verify's accepted run: what remains of it
    # a drafting step right after a plain one costs what the record's whole steps in their turn cost over a run's
    mixed = [module.Stream(([[7, 7]] * 3 + [[7, 0]] * 6) * 6) for _ in range(8)]
    serial = {**prices, "whole_serial_ms": 2.5}
    assert module.replay(mixed, 1, serial, 7)["over_ar"] < module.replay(mixed, 1, prices, 7)["over_ar"]
    assert module.replay(accepting, 1, serial, 7, guarded=False) == module.replay(accepting, 1, prices, 7,
                                                                                   guarded=False)


def test_the_smollm2_recipe_writes_only_the_prompts_a_chunk_answers(monkeypatch):
    """The prompts stage only places the prompts the target is to write (no engine: it takes no time); each answers
    chunk has its own written just before it is answered, in the places set, an unusable one dropped: a time-boxed
    answers stage spent over half its time writing prompts it never answered."""
    spec = importlib.util.spec_from_file_location("smollm2_drafter", ROOT / "benchmarks" / "smollm2_drafter.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "smollm2_drafter", recipe)  # (its dataclasses look their module up)
    spec.loader.exec_module(recipe)
    rows = recipe.conversations(recipe.SCALES["cpu"], seed=3)
    assert rows == recipe.conversations(recipe.SCALES["cpu"], seed=3)  # (the same places for the same seed)
    placed = [row for row in rows if "write" in row]
    assert len(placed) == sum(recipe.SCALES["cpu"].written.values()) and all("messages" not in r for r in placed)
    calls = []

    def write_prompts(llm, kinds):  # the target's writing, every kind in one call; every third comes out unusable
        calls.append(kinds)
        return {kind: [f"{kind} {seed} {i}" for i in range(count) if i % 3 != 2]
                for kind, (count, seed) in kinds.items()}

    monkeypatch.setattr("runtime.training.self_distill.write_prompts", write_prompts)
    chunk = rows[:64]
    out = recipe.written_in(object(), chunk, seed=10_000)
    wanted = {kind: sum(r.get("write") == kind for r in chunk) for kind in ("chat", "code", "math")}
    assert calls == [{kind: (n, 10_000 + 1000 * (k + 1)) for k, (kind, n) in enumerate(sorted(wanted.items()))}]
    expected, seen = [], {kind: 0 for kind in wanted}  # the j-th place of a kind holds its j-th usable prompt
    for row in chunk:
        if "write" not in row:
            expected.append(row)
            continue
        j, seen[row["write"]] = seen[row["write"]], seen[row["write"]] + 1
        if j < wanted[row["write"]] - wanted[row["write"]] // 3:
            expected.append({"source": row["source"], "messages": [{"role": "user", "content": None}]})
    assert [r["source"] for r in out] == [r["source"] for r in expected] and all("messages" in r for r in out)


def test_the_smollm2_recipe_holds_states_in_memory_only_where_asked(monkeypatch, tmp_path, capsys):
    """``--states-in-memory`` gives the GPU scale's trainer ``target_cache_in_memory``; the CPU scale keeps its folder
    cache and refuses the flag by name; without it the GPU scale runs the target live."""
    import runtime.training.drafter_trainer as trainer

    spec = importlib.util.spec_from_file_location("smollm2_drafter", ROOT / "benchmarks" / "smollm2_drafter.py")
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "smollm2_drafter", recipe)
    spec.loader.exec_module(recipe)
    configs = []
    monkeypatch.setattr(trainer, "train_drafter", lambda cfg: configs.append(cfg) or {"finished": True})
    recipe.train_variant("dspark-1", recipe.SCALES["gpu"], tmp_path, 100, 0, None, states_in_memory=True)
    recipe.train_variant("dspark-1", recipe.SCALES["gpu"], tmp_path, 100, 0, None)
    recipe.train_variant("dspark-1", recipe.SCALES["cpu"], tmp_path, 100, 0, None)
    assert [(c.target_cache_in_memory, c.target_cache) for c in configs] == [
        (True, None), (False, None), (False, str(tmp_path / "target-states"))]
    with pytest.raises(SystemExit):
        recipe.main(["--work", str(tmp_path), "--scale", "cpu", "--states-in-memory"])
    assert "--states-in-memory: the cpu scale keeps" in capsys.readouterr().err
