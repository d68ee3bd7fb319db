"""A replica on a local Ray cluster (CPU, gloo): TP=2 with a colocated or a separate drafter gives the
single-process engine's outputs and counters; failures are clear and the replica recovers; nothing leaks."""

import json

import pytest
import ray

from cluster import LLM, ReplicaFailure
from configs import DSparkDecodingConfig
from runtime import LLM as LocalLLM
from runtime import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51))]
ENGINE = dict(dtype="float32", device="cpu", num_pages=96, page_size=4)
PARAM_SETS = {
    "greedy": [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 3,
    "seeded": [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=s, ignore_eos=True) for s in range(3)],
    # the bad words' row bans cross the step's wire (single letters: banned at every row; pairs: where they end)
    "bad_words": [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                 bad_words=["a", "e", "t", "in", "th", "er"])] * 3,
}


@pytest.fixture(scope="module")
def drafter(near_bigram_target, make_drafter):
    return make_drafter(near_bigram_target, 3, "gated", oracle=True)


def free_cpus_return(total=4.0):
    """No placement group left and every CPU free again (actors killed, bundles returned)."""
    import time

    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) != total and time.monotonic() < deadline:
        time.sleep(0.1)  # the resource view lags the removal by a heartbeat
    assert ray.available_resources().get("CPU", 0) == total


@pytest.mark.parametrize("mode", ["colocated", "separate"])
@pytest.mark.parametrize("rejection", [False, True], ids=["exact-match", "rejection"])
def test_tp2_matches_the_single_process_engine(ray_cluster, near_bigram_target, drafter, mode, rejection):
    spec = DSparkDecodingConfig(speculative_model=str(drafter), use_rejection_sampling=rejection,
                                speculation_guard=False)  # (the metrics compared: the guard learns from timings)
    local = LocalLLM(str(near_bigram_target), speculative_config=spec, **ENGINE)
    with LLM(str(near_bigram_target), speculative_config=spec, tensor_parallel_size=2, drafter=mode,
             **ENGINE) as llm:
        for name, params in PARAM_SETS.items():
            expected = [o.token_ids for o in local.generate(PROMPTS, params)]
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, name
        chats = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "weather?"}]]  # LLM.chat
        assert [o.token_ids for o in llm.chat(chats, PARAM_SETS["greedy"][0])] == \
            [o.token_ids for o in local.chat(chats, PARAM_SETS["greedy"][0])]
        assert llm.get_metrics() == {**local.get_metrics(), "num_kv_pages_used": 0,  # (+ the executor's own)
                                     "replica_idle_parks": llm.engine.executor.parks, "replica_parked": False}
        info = llm.rank_info()
        roles = [(i["rank"], i["role"], i["holds_drafter"]) for i in info]
        expected_roles = [(0, "target", True), (1, "target", False)] if mode == "colocated" else \
            [(0, "target", False), (1, "target", False), (2, "drafter", True)]
        assert roles == expected_roles
        assert all(i["moe_backend"] in ("none", None) and i["draft_moe_backend"] == "none" for i in info)
        # samples, logprobs and prompt logprobs through the replica: rank 0 reads them from the gathered rows
        params = SamplingParams(max_tokens=8, temperature=0.9, seed=4, n=2, logprobs=2, prompt_logprobs=2)
        want, got = local.generate(PROMPTS, params), llm.generate(PROMPTS, params)
        assert [(o.index, o.token_ids) for o in got] == [(o.index, o.token_ids) for o in want]
        for g, w in zip(got, want):
            assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)
            assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(g.prompt_token_ids)
            assert [(e.token_id, [t for t, _ in e.top]) for e in g.prompt_logprobs[1:]] == \
                [(e.token_id, [t for t, _ in e.top]) for e in w.prompt_logprobs[1:]]
            assert [e.logprob for e in g.prompt_logprobs[1:]] == \
                pytest.approx([e.logprob for e in w.prompt_logprobs[1:]], abs=1e-4)
    free_cpus_return()


def test_structured_outputs_over_tp2_with_a_separate_drafter_equal_one_process(ray_cluster, near_bigram_target,
                                                                                 drafter):
    """The grammar's row masks cross the step's wire to every rank and the separate drafter's replica (xgrammar,
    where installed)."""
    pytest.importorskip("xgrammar")
    from runtime import StructuredOutputs

    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(schema)))
    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    want = [o.token_ids for o in LocalLLM(str(near_bigram_target), speculative_config=spec, **ENGINE).generate(
        PROMPTS, params)]
    with LLM(str(near_bigram_target), speculative_config=spec, tensor_parallel_size=2, drafter="separate",
             **ENGINE) as llm:
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == want and all(o.finish_reason == "stop" for o in outs)
    free_cpus_return()


@pytest.mark.parametrize("backend", ["VANILLA", "DENSEGEMM"])
def test_tp2_moe_target_equals_transformers_and_every_rank_reports_its_backend(ray_cluster, moe_target,
                                                                               make_drafter, backend):
    from tests import builders

    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(moe_target, 4)))
    with LLM(str(moe_target), speculative_config=spec, tensor_parallel_size=2, moe_backend=backend,
             allreduce_strategy="AUTO", **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, PARAM_SETS["greedy"])
        assert [o.token_ids for o in outputs] == builders.hf_greedy(moe_target, PROMPTS, 16)
        info = llm.rank_info()
        assert [(i["tp_rank"], i["moe_backend"], i["draft_moe_backend"]) for i in info] == [
            (0, backend, "none"), (1, backend, "none")]
        # AUTO on CPU ranks: gloo's all-reduce on both, and why
        assert [i["allreduce"] for i in info] == ["NCCL (AUTO: ONESHOT cannot run: it needs CUDA devices, this "
                                                  "rank runs on cpu)"] * 2
        assert llm.get_metrics()["num_drafts"] > 0
    free_cpus_return()


def cpu_seconds(pid: int) -> float:
    """A local process's user + system CPU time so far (``/proc``)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_replica_parks_its_step_graph_and_the_next_step_arms_it_again(ray_cluster, near_bigram_target,
                                                                                 drafter):
    """While the compiled step graph is armed every actor spins in Ray's channel read (a core each, idle or not):
    after idle_park_s without a step it is torn down, the actors use (almost) no CPU, and the next step compiles it
    again and gives the same tokens; idle_park_s=None never parks."""
    import time

    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    greedy = PARAM_SETS["greedy"]
    with LLM(str(near_bigram_target), speculative_config=spec, tensor_parallel_size=2, idle_park_s=0.4,
             **ENGINE) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
        assert llm.get_metrics()["replica_parked"] is False
        deadline = time.monotonic() + 10
        while not llm.get_metrics()["replica_parked"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert llm.get_metrics()["replica_idle_parks"] == 1
        pids = [info["pid"] for info in llm.rank_info()]
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(1.0)
        used = [cpu_seconds(pid) - b for pid, b in zip(pids, before)]
        assert max(used) < 0.3, used  # armed, each spins ~1 s of CPU a second
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == first
        assert llm.get_metrics()["replica_parked"] is False
    with LLM(str(near_bigram_target), tensor_parallel_size=2, idle_park_s=None, **ENGINE) as llm:
        llm.generate(PROMPTS[:1], greedy[:1])
        time.sleep(0.6)
        assert llm.get_metrics()["replica_idle_parks"] == 0 and not llm.get_metrics()["replica_parked"]
    free_cpus_return()


def test_tp2_over_one_kv_head_replicates_it_and_matches_transformers(ray_cluster, checkpoints):
    from tests import builders

    target = builders.save_target(checkpoints / "one-kv-head", "qwen3", seed=9, residual_scale=0.7,
                                  num_key_value_heads=1)
    greedy = PARAM_SETS["greedy"]
    with LLM(str(target), tensor_parallel_size=2, **ENGINE) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == builders.hf_greedy(target, PROMPTS, 16)
    free_cpus_return()


def test_a_killed_shard_fails_in_flight_requests_then_the_replica_recovers(ray_cluster, near_bigram_target, drafter):
    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    greedy = PARAM_SETS["greedy"]
    expected = [o.token_ids for o in LocalLLM(str(near_bigram_target), speculative_config=spec,
                                               **ENGINE).generate(PROMPTS, greedy)]
    llm = LLM(str(near_bigram_target), speculative_config=spec, tensor_parallel_size=2, step_timeout_s=60, **ENGINE)
    try:
        llm.engine.add_request(PROMPTS[0], greedy[0])
        llm.engine.step()  # one request in flight
        ray.kill(llm.engine.executor.actors[1])
        with pytest.raises(ReplicaFailure, match=r"actor failed during 'execute'.*2 in-flight request\(s\) failed"):
            llm.generate(PROMPTS[1:2], greedy[:1])
        assert not llm.engine.has_unfinished()
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == expected  # rebuilt and serving
    finally:
        llm.shutdown()
    free_cpus_return()


def test_probe_and_resolution_run_once_in_the_driver(ray_cluster, near_bigram_target, drafter, tmp_path):
    """After the driver resolved the config, make the checkpoint lie: a bin index with mtp.* keys would flip the
    probe to 'embedded' (which the engine refuses) and a changed block_size would break loading. Actors get the
    resolved config and never look, so the replica still serves."""
    import shutil

    copy = tmp_path / "drafter"
    shutil.copytree(drafter, copy)
    spec = DSparkDecodingConfig(speculative_model=str(copy))
    assert not spec.draft_is_embedded_in_target and spec.max_draft_len == 3
    (copy / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"mtp.0.fc.weight": "x.bin"}}))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "block_size": 6}))
    assert DSparkDecodingConfig(speculative_model=str(copy)).draft_is_embedded_in_target  # a fresh probe would
    with LLM(str(near_bigram_target), speculative_config=spec, drafter="separate", **ENGINE) as llm:
        out = llm.generate(PROMPTS[:1], PARAM_SETS["greedy"][:1])[0]
        assert len(out.token_ids) == 16 and llm.get_metrics()["num_draft_tokens"] > 0
    free_cpus_return()


def test_a_backend_a_rank_cannot_run_names_the_rank(ray_cluster, near_bigram_target, drafter):
    with pytest.raises(ValueError, match=r"rank \d \(target\): moe_backend='CUTLASS': the model has no MoE layers"):
        LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter)}, tensor_parallel_size=2,
            moe_backend="CUTLASS", **ENGINE)
    with pytest.raises(ValueError, match=r"allreduce_strategy='ONESHOT' runs on CUDA devices"):
        LLM(str(near_bigram_target), tensor_parallel_size=2, allreduce_strategy="ONESHOT", **ENGINE)
    free_cpus_return()


def test_placement_that_cannot_fit_is_refused(ray_cluster, near_bigram_target, drafter):
    from cluster.placement.plan import PlacementError

    with pytest.raises(PlacementError, match="needs 5 CPUs; the cluster has 4"):
        LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter)}, tensor_parallel_size=4,
            drafter="separate", **ENGINE)
    free_cpus_return()


def test_regenerate_shards_the_target_over_ray_and_writes_the_same_answers(ray_cluster, near_bigram_target, tmp_path):
    from cluster.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [3 + i, 40 + i, 7]}) + "\n" for i in range(4)))
    common = ["--target", str(near_bigram_target), "--prompts", str(prompts), "--max-tokens", "8",
              "--temperature", "1.0", "--seed", "5", "--device", "cpu", "--dtype", "float32"]
    assert main(["regenerate", *common, "--out", str(tmp_path / "tp1.jsonl")]) == 0
    assert main(["regenerate", *common, "--out", str(tmp_path / "tp2.jsonl"), "--tensor-parallel-size", "2"]) == 0
    assert (tmp_path / "tp2.jsonl").read_text() == (tmp_path / "tp1.jsonl").read_text()  # seeded: same samples
    free_cpus_return()


def test_a_pipelined_separate_drafter_matches_the_single_process_engine(ray_cluster, near_bigram_target, drafter):
    """Two request groups taking turns, the drafter drafting one while the target verifies the other: every
    request's tokens and the speculative counters are the serial engine's (the same blocks from the same
    context, one step later); more prompts than one group so that both groups run."""
    spec = DSparkDecodingConfig(speculative_model=str(drafter), speculation_guard=False)  # (pipelined: no guard)
    local = LocalLLM(str(near_bigram_target), speculative_config=spec, **ENGINE)
    prompts = PROMPTS + [[9, 8, 7, 6], [44]]
    with LLM(str(near_bigram_target), speculative_config=spec, drafter="separate", pipeline_drafter=True,
             pipeline_drafter_min_batch=1, **ENGINE) as llm:
        assert llm.engine.pipelined
        scheduler, served = llm.engine.scheduler, []
        schedule = scheduler.schedule

        def spy(group=None, admit=True, kind=None, skip=frozenset()):
            entries = schedule(group, admit, kind, skip)
            served.append((group, {e.request_id for e in entries}))
            return entries

        scheduler.schedule = spy
        for name, params in PARAM_SETS.items():
            params = params + params[:2]
            expected = [o.token_ids for o in local.generate(prompts, params)]
            assert [o.token_ids for o in llm.generate(prompts, params)] == expected, name
        local_metrics, metrics = local.get_metrics(), llm.get_metrics()
        assert metrics["num_draft_tokens"] == local_metrics["num_draft_tokens"] > 0
        assert metrics["num_accepted_tokens_per_pos"] == local_metrics["num_accepted_tokens_per_pos"]
    by_group = {g: set().union(*(ids for gg, ids in served if gg == g)) for g in (0, 1)}
    assert [g for g, _ in served[:4]] == [0, 1, 0, 1] and by_group[0] and by_group[1]
    assert not by_group[0] & by_group[1]  # a request stays in its group
    free_cpus_return()


@pytest.mark.last
@pytest.mark.parametrize("target", ["near_bigram_target", "moe_target"])
def test_tp4_with_replicated_kv_heads_matches_the_single_process_engine(ray_cluster, request, make_drafter, target):
    """Four shards of a target with 2 key/value heads (each replicated on the two ranks whose query heads read
    it; the MoE target's experts cut four ways): the single-process engine's tokens, greedy and seeded. The code
    path of the 4-GPU runs, rehearsed on CPUs over gloo."""
    path = request.getfixturevalue(target)
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(path, 3)))
    local = LocalLLM(str(path), speculative_config=spec, **ENGINE)
    with LLM(str(path), speculative_config=spec, tensor_parallel_size=4, **ENGINE) as llm:
        assert [i["tp_rank"] for i in llm.rank_info()] == [0, 1, 2, 3]
        for name, params in PARAM_SETS.items():
            expected = [o.token_ids for o in local.generate(PROMPTS, params)]
            assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, name
        chats = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "weather?"}]]  # LLM.chat
        assert [o.token_ids for o in llm.chat(chats, PARAM_SETS["greedy"][0])] == \
            [o.token_ids for o in local.chat(chats, PARAM_SETS["greedy"][0])]
    free_cpus_return()


def test_a_pipelined_drafter_under_preemption_keeps_every_output(ray_cluster, near_bigram_target, drafter):
    """Too few KV pages for every request at once: requests are preempted and recomputed while their groups take
    turns, and a block drafted for a request that was preempted meanwhile is dropped; every output is still the
    single-process engine's."""
    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    engine = {**ENGINE, "num_pages": 28}
    prompts = PROMPTS + [[9, 8, 7, 6], [44, 45, 46]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LocalLLM(str(near_bigram_target), speculative_config=spec,
                                               **engine).generate(prompts, params)]
    with LLM(str(near_bigram_target), speculative_config=spec, drafter="separate", pipeline_drafter=True,
             pipeline_drafter_min_batch=1, **engine) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.get_metrics()["num_preemptions"] > 0
    free_cpus_return()


def test_a_pipelined_drafter_pipelines_only_while_enough_requests_run(ray_cluster, near_bigram_target, drafter):
    """pipeline_drafter_min_batch=4 over five prompts of different lengths: the steps are pipelined while four or
    more requests run or wait and drafted in the same step once fewer remain (a lone request advances every step),
    switching both ways as requests finish and arrive; every output is still the single-process engine's."""
    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    prompts = PROMPTS + [[9, 8, 7, 6], [44, 45, 46]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 30, 12, 24, 18)]
    local = LocalLLM(str(near_bigram_target), speculative_config=spec, **ENGINE)
    with LLM(str(near_bigram_target), speculative_config=spec, drafter="separate", pipeline_drafter=True,
             pipeline_drafter_min_batch=4, **ENGINE) as llm:
        executor, steps = llm.engine.executor, []
        execute = executor.execute

        def spy(batch):
            steps.append((batch.pipelined, len(batch.requests)))
            return execute(batch)

        executor.execute = spy
        for _ in range(2):  # the second round starts pipelined again after the first ended serial
            assert [o.token_ids for o in llm.generate(prompts, params)] == \
                [o.token_ids for o in local.generate(prompts, params)]
        lone = [pipelined for pipelined, n in steps if n == 1]
        assert lone and not any(lone)  # the last request alone: every step its own, drafted in the same step
        switches = sum(a != b for (a, _), (b, _) in zip(steps, steps[1:]))
        assert any(p for p, _ in steps) and switches >= 3, steps
        assert llm.get_metrics()["num_drafts"] > 0
        assert llm.get_metrics()["pipelined_steps"] == sum(p for p, _ in steps)
        from prometheus_client import CollectorRegistry, generate_latest

        from cluster.serve.metrics import EngineCollector

        registry = CollectorRegistry()
        registry.register(EngineCollector(lambda: llm.engine, llm.rank_info()))
        assert f"dspark:pipelined_steps_total {float(sum(p for p, _ in steps))}" in generate_latest(registry).decode()
    free_cpus_return()


def test_bench_profile_traces_one_step_on_every_rank(ray_cluster, near_bigram_target, drafter, tmp_path):
    """``dspark bench --profile`` on a replica: each rank profiles the same batch-1 steps in its own process and
    returns its summary (the driver only dispatches), and leaves its timeline where asked, named by rank."""
    from bench import profile_step

    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    with LLM(str(near_bigram_target), speculative_config=spec, tensor_parallel_size=2, drafter="separate",
             **ENGINE) as llm:
        summary = profile_step(llm, 1, 8, 128, str(tmp_path / "dspark-batch1.trace.json.gz"))
        assert [(r["rank"], r["role"]) for r in summary["ranks"]] == [(0, "target"), (1, "target"), (2, "drafter")]
        for rank in summary["ranks"]:
            assert "unfinished" not in rank and rank["kernels_per_step"] == 0  # a CPU: no CUDA kernels
        for rank in summary["ranks"][:2]:  # every target rank runs the forward; rank 0 alone verifies
            assert rank["host_ms_per_step"]["dspark.forward"] > 0
        assert "dspark.verify" in summary["ranks"][0]["host_ms_per_step"]
        assert sorted(p.name for p in tmp_path.glob("*.trace.json.gz")) == [
            f"dspark-batch1.rank{r}.trace.json.gz" for r in range(3)]
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], PARAM_SETS["greedy"][:1])]  # serving goes on
    free_cpus_return()


@pytest.mark.last  # 5 s alone, 100-124 s each beside the other worker's tests: its actors' startup (a 2-core host)
@pytest.mark.parametrize("mode", ["colocated", "separate"])
def test_packed_verify_steps_cross_the_wire(ray_cluster, tmp_path, near_bigram_target, make_drafter, mode):
    """Confidence scheduling's packed layout (forced: these actors have no graphs) through a replica: the packed
    plan reaches the worker, the counts it verified come back, and the greedy outputs are the engine's without
    scheduling."""
    from tests import builders
    from tests.runtime.test_confidence_scheduling import flat_table

    path = tmp_path / "table.json"
    flat_table(0.6).save(path)
    drafter = str(make_drafter(near_bigram_target, 4, oracle=True))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    local = LocalLLM(str(near_bigram_target), speculative_config=DSparkDecodingConfig(speculative_model=drafter),
                     **ENGINE)
    expected = [o.token_ids for o in local.generate(PROMPTS, params)]
    spec = DSparkDecodingConfig(speculative_model=drafter, enable_confidence_scheduling=True,
                                confidence_cost_table_path=str(path))
    with LLM(str(near_bigram_target), speculative_config=spec, drafter=mode, **ENGINE) as llm:
        llm.engine.confidence.layout = "packed"
        # the survival fit folds while the actors compute a step (the engine's host work, at the step's device wait)
        assert llm.engine.executor.yields_device_waits
        assert llm.engine.confidence.correction.defer_to is llm.engine.host_work
        counts = builders.record_packed_steps(llm)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        assert counts and all(sum(verified) == budget for budget, verified in counts)
    free_cpus_return()
