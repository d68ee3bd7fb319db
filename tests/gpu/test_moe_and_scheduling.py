"""On CUDA: the MoE expert kernels against VANILLA (and under a CUDA graph), an MoE target's graphed steps against
its eager steps on each graph-safe backend, and confidence scheduling's ragged verify lengths through the padded
graphs (greedy output unchanged). Skipped without a GPU, flashinfer and triton."""

import pytest
import torch

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.kernels.moe import experts_grouped_gemm, experts_triton, experts_vanilla
from tests import builders

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

DEV = torch.device("cuda")
BF16 = torch.bfloat16
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [7] * 12, [250, 251]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="bfloat16", num_pages=256, page_size=16, kernel_backend="flashinfer", max_num_seqs=8)


def close(got, want, tol=2e-2):
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


def routing(tokens: int, experts: int, k: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(tokens, experts, device=DEV, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(BF16), ids


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])  # 300 x 8 pairs: the large-tile path
def test_expert_kernels_match_vanilla(tokens):
    experts, k, hidden, inter = 64, 8, 512, 384
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    w13 = (0.05 * torch.randn(experts, 2 * inter, hidden, device=DEV, generator=gen)).to(BF16)
    w2 = (0.05 * torch.randn(experts, hidden, inter, device=DEV, generator=gen)).to(BF16)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(BF16)
    weights, ids = routing(tokens, experts, k, tokens + 1)
    want = experts_vanilla(x, w13, w2, weights, ids)
    close(experts_triton(x, w13, w2, weights, ids), want)
    close(experts_grouped_gemm(x, w13, w2, weights, ids), want)


@pytest.mark.parametrize("tokens,k,experts,block_m", [(2, 8, 128, 16), (8, 8, 128, 16), (16, 8, 128, 16),
                                                      (5, 4, 8, 16), (3, 2, 4, 64)])
def test_the_one_program_layout_equals_the_sorted_layout(tokens, k, experts, block_m):
    from runtime.kernels.moe import tile_pairs_by_expert
    from runtime.kernels.triton_moe import tile_layout

    _, ids = routing(tokens, experts, k, tokens * k)
    got, want = tile_layout(ids, experts, block_m), tile_pairs_by_expert(ids, experts, block_m)
    assert torch.equal(got.tile_expert, want.tile_expert) and torch.equal(got.pairs, want.pairs)


def test_triton_experts_replay_from_a_cuda_graph_with_new_routings():
    experts, k, hidden, inter, tokens = 32, 4, 256, 128, 16
    w13 = (0.05 * torch.randn(experts, 2 * inter, hidden, device=DEV)).to(BF16)
    w2 = (0.05 * torch.randn(experts, hidden, inter, device=DEV)).to(BF16)
    x = torch.randn(tokens, hidden, device=DEV).to(BF16)
    weights, ids = routing(tokens, experts, k, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts_triton(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_triton(x, w13, w2, weights, ids)
    for seed in (1, 2, 3):
        new_weights, new_ids = routing(tokens, experts, k, seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, experts_triton(x, w13, w2, weights, ids), rtol=0, atol=0)


@pytest.fixture(scope="module")
def wide_moe_target(checkpoints):
    """qwen3_moe with head_dim 128 (FlashInfer), 8 experts, 2 per token on layers 0, 2, 3."""
    return builders.save_target(checkpoints / "wide-qwen3-moe", "qwen3_moe", seed=13, residual_scale=0.6,
                                hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                moe_intermediate_size=256, intermediate_size=1024)


@pytest.mark.parametrize("backend", ["TRITON", "DENSEGEMM"])
def test_an_moe_target_graphs_its_steps_on_each_graph_safe_backend(wide_moe_target, make_drafter, backend):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_moe_target, 4)))
    runs = {}
    for eager in (False, True):
        llm = LLM(str(wide_moe_target), speculative_config=spec, moe_backend=backend,
                  **{**ENGINE, "enforce_eager": eager})
        info = llm.rank_info()[0]
        assert info["moe_backend"] == backend and info["cuda_graphs"] == (not eager)
        runs[eager] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.get_metrics()["num_drafts"] > 0
    assert runs[False] == runs[True]
    vanilla = LLM(str(wide_moe_target), moe_backend="VANILLA", **ENGINE)
    plain = [o.token_ids for o in vanilla.generate(PROMPTS, GREEDY)]
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(runs[False], plain)]
    assert sum(same) >= 0.6 * sum(len(x) for x in plain), same  # bf16 near-ties may part


def scheduling_off_and_on(target, drafter, table, max_num_seqs: int = 32):
    """("off", LLM) with confidence scheduling off, then ("on", LLM) with it on under the cost table ``table``: the
    pair of engines a graphed-path test compares token for token."""
    for name, spec in (("off", {}), ("on", {"enable_confidence_scheduling": True,
                                            "confidence_cost_table_path": str(table)})):
        config = DSparkDecodingConfig(speculative_model=str(drafter), **spec)
        yield name, LLM(str(target), speculative_config=config, **{**ENGINE, "max_num_seqs": max_num_seqs})


@pytest.fixture(scope="module")
def wide_target(checkpoints):
    return builders.save_target(checkpoints / "wide-qwen3-sched", "qwen3", seed=11, residual_scale=0.6,
                                hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=128)


def test_confidence_scheduling_keeps_greedy_outputs_on_the_graphed_path(wide_target, make_drafter):
    """The scheduler's capped verify lengths replay graphs of every verify length (padded layout) and its eager
    twin's ragged ones run eagerly; the tokens equal scheduling off."""
    drafter = make_drafter(wide_target, 4, oracle=True)
    runs, replays, folds = {}, {}, []
    longer = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)  # decisions for a few folds
    for name, spec, eager in (("off", {}, False), ("on", {"enable_confidence_scheduling": True}, False),
                              ("on-eager", {"enable_confidence_scheduling": True}, True)):
        config = DSparkDecodingConfig(speculative_model=str(drafter), **spec)
        llm = LLM(str(wide_target), speculative_config=config, **{**ENGINE, "enforce_eager": eager})
        if name == "on":  # the survival fit's folds run as host work where a graphed step waits for the device
            correction = llm.engine.confidence.correction
            assert correction.defer_to is llm.engine.host_work
            fold = correction._deferred_fold
            correction._deferred_fold = lambda: (folds.append(1), fold())
        runs[name] = [o.token_ids for o in llm.generate(PROMPTS, longer)]
        replays[name] = llm.rank_info()[0]["graph_replays"]
        if name.startswith("on"):
            budgets = llm.get_metrics()["confidence_scheduling"]
            assert budgets["decisions"] > 0 and budgets["layout"] == ("ragged" if eager else "padded")
        if name == "on":  # a graph for every verify length 0..K: a capped step never pads past its length
            graphs = llm.engine.executor.worker.graphs
            assert sorted({q for _, q in graphs.graphs if q not in graphs.prefill_q_lens}) == [1, 2, 3, 4, 5]
    assert runs["on"] == runs["off"] == runs["on-eager"]
    assert replays["on"] > 0 and replays["on-eager"] == 0 and folds


def test_packed_verify_graphs_keep_greedy_outputs(tmp_path, wide_target, make_drafter):
    """Confidence scheduling's packed layout on the graphed path (steps of 9 requests and more replay packed graphs,
    smaller ones the padded graphs): the tokens equal scheduling off, and the packed graphs served steps whose
    requests verified different numbers of drafts (a cost table that makes verify tokens dear, and confidences
    spread by request, as the CPU test of the packed layout does)."""
    import dataclasses

    from tests.runtime.test_confidence_scheduling import flat_table

    drafter = make_drafter(wide_target, 4, oracle=True)
    table = tmp_path / "dear.json"
    flat_table(0.6).save(table)
    prompts = [[3 + i, 17, 33 + i, 2] for i in range(20)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for name, llm in scheduling_off_and_on(wide_target, drafter, table):
        if name == "on":
            info = llm.rank_info()[0]
            assert info["graph_packed_columns"] == [1, 2, 3] and info["graph_packed_from"] == 9
            assert llm.engine.confidence.layout == "packed"
            plan_of = llm.engine._packed_plan

            def spread(scheduled, plan_of=plan_of):  # the oracle drafter is as confident for every request
                plan = plan_of(scheduled)
                return plan if plan is None else dataclasses.replace(plan, confidences=[
                    [c * (0.4 if i % 2 else 1.0) for c in row] for i, row in enumerate(plan.confidences)])

            llm.engine._packed_plan = spread
            runner = llm.engine.executor.worker.engine_part
            drafted = runner._block_confidence  # what a packed step launched ahead ranks: spread alike

            def spread_ahead(proposal, drafted=drafted):
                confidence = drafted(proposal)
                return confidence * torch.tensor([1.0, 0.4], device=confidence.device).repeat(
                    (confidence.shape[0] + 1) // 2)[:confidence.shape[0], None]

            runner._block_confidence = spread_ahead
            verified = builders.record_packed_steps(llm)
        runs[name] = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert runs["on"] == runs["off"]
    info = llm.rank_info()[0]
    assert info["graph_packed_replays"] > 0 and info["graph_packed_run_ahead"] > 0 and verified
    assert any(len(set(counts)) > 1 for _, counts in verified)  # ragged: requests verified different counts


def test_packed_graphs_serve_steps_with_blocks_cut_at_their_token_limits(tmp_path, wide_target, make_drafter):
    """Requests of different token limits on the graphed packed layout: a step in which some blocks are cut at
    their token limit (to none at the last token) replays the packed graph all the same, the short blocks padded
    with drafts that propose nothing; no step is unpacked, no request verifies more drafts than it fed, and the
    tokens equal scheduling off."""
    from tests.runtime.test_confidence_scheduling import flat_table

    drafter = make_drafter(wide_target, 4, oracle=True)
    table = tmp_path / "dear.json"
    flat_table(0.6).save(table)
    prompts = [[3 + i, 17, 33 + i, 2] for i in range(20)]
    params = [SamplingParams(max_tokens=21 + 3 * (i % 7), temperature=0.0, ignore_eos=True) for i in range(20)]
    runs = {}
    for name, llm in scheduling_off_and_on(wide_target, drafter, table):
        if name == "on":
            steps, execute = [], llm.engine.executor.execute

            def spy(batch, execute=execute, steps=steps):  # (a step's device waits passed on to the engine)
                results = yield from execute(batch)
                if batch.packed is not None:
                    steps.append([(r.num_drafts, res.num_verified) for r, res in zip(batch.requests, results)])
                return results

            llm.engine.executor.execute = spy
        runs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["on"] == runs["off"]
    assert any(len({drafts for drafts, _ in step}) > 1 for step in steps)  # a packed step with a cut block
    assert all(verified <= drafts for step in steps for drafts, verified in step)
    assert llm.get_metrics()["confidence_scheduling"]["unpacked_steps"] == 0
    assert llm.rank_info()[0]["graph_packed_replays"] > 0


def test_packed_verify_graphs_of_shorter_blocks_keep_greedy_outputs(tmp_path, wide_target, make_drafter):
    """A packed step drafts one past the longest share a request took at its columns
    (``ConfidenceScheduler.packed_draft_len``): held at one column here, the blocks are drafted shorter than K, the
    packed graphs pad them (launched ahead padded too), and the tokens equal scheduling off."""
    from tests.runtime.test_confidence_scheduling import flat_table

    drafter = make_drafter(wide_target, 4, oracle=True)
    table = tmp_path / "dear.json"
    flat_table(0.6).save(table)
    prompts = [[3 + i, 17, 33 + i, 2] for i in range(20)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs, fed = {}, []
    for name, llm in scheduling_off_and_on(wide_target, drafter, table):
        if name == "on":
            assert llm.engine.confidence.layout == "packed"
            llm.engine.confidence._best = lambda expected, predicted: 1  # one column (and a cap of one)
            execute = llm.engine.executor.execute

            def recorded(batch, execute=execute):
                if batch.packed is not None:
                    fed.append(batch.requests[0].num_drafts)
                return execute(batch)

            llm.engine.executor.execute = recorded
        runs[name] = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert runs["on"] == runs["off"]
    info = llm.rank_info()[0]
    assert fed and min(fed) < 4 and info["graph_packed_replays"] > 0 and info["graph_packed_run_ahead"] > 0


def test_verify_steps_served_by_a_longer_graph_keep_greedy_outputs(wide_target, make_drafter):
    """A step of Q tokens a request replayed on a longer verify graph (``GraphedTargetForward.served_by``, chosen at
    capture where the longer graph replays faster; forced here): its blocks are padded, launched ahead padded, and
    the tokens equal those of each length on its own graph."""
    drafter = make_drafter(wide_target, 4, oracle=True)
    prompts = [[3 + i, 17, 33 + i, 2] for i in range(20)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for name in ("own", "longer"):
        # 20 requests draft 2 (Q = 3), served by the 5-token graph where forced
        config = DSparkDecodingConfig(speculative_model=str(drafter), draft_len_schedule={4: 4, 32: 2})
        llm = LLM(str(wide_target), speculative_config=config, **{**ENGINE, "max_num_seqs": 32})
        graphs = llm.engine.executor.worker.graphs
        assert isinstance(llm.rank_info()[0]["graph_served_by"], dict)  # what the capture-time timing chose
        graphs.served_by = {(b, 3): 5 for b in graphs.buckets if b >= 16} if name == "longer" else {}
        runs[name] = [o.token_ids for o in llm.generate(prompts, greedy)]
        if name == "longer":
            assert graphs.served_length(20, 3) == 5 and graphs.steps_run_ahead > 0
    assert runs["longer"] == runs["own"]


def test_decode_steps_that_draft_nothing_keep_the_drafters_context_in_their_graph(wide_target, make_drafter):
    """A ``draft_len_schedule`` that drafts nothing at 8 requests: the graphed plain decode steps append the
    drafter's context in the same graphed step, launched ahead like plain decoding; once 6 requests finish and the
    schedule drafts again, the 2 left draft what the eager engine drafts (its context appended eagerly). The outputs
    equal the eager engine's, and those decoded without drafts equal decoding without a drafter."""
    drafter = make_drafter(wide_target, 4)  # random: its drafts depend on the context the decode steps kept
    prompts = [[3 + i, 17, 33 + i, 2] for i in range(8)]
    params = [SamplingParams(max_tokens=20 if i < 6 else 60, temperature=0.0, ignore_eos=True) for i in range(8)]
    runs, drafts = {}, {}
    for name, eager in (("graphed", False), ("eager", True)):
        config = DSparkDecodingConfig(speculative_model=str(drafter), draft_len_schedule={2: 4})
        llm = LLM(str(wide_target), speculative_config=config, **{**ENGINE, "enforce_eager": eager})
        executor, proposed = llm.engine.executor, []

        def execute(batch, run=executor.execute, proposed=proposed):  # (a step's device waits passed on)
            results = yield from run(batch)
            proposed.extend((r.request_id, tuple(r.next_draft_ids)) for r in results if r.next_draft_ids)
            return results

        executor.execute = execute
        runs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        drafts[name] = proposed
        if not eager:
            graphs = llm.engine.executor.worker.graphs
            assert graphs.steps_run_ahead >= 10 and graphs.appends_context(8)
    plain = LLM(str(wide_target), **ENGINE)
    assert runs["graphed"] == runs["eager"]
    assert runs["graphed"][:6] == [o.token_ids for o in plain.generate(prompts, params)][:6]
    assert len(drafts["graphed"]) == len(drafts["eager"]) >= 10
    same = sum(a == b for a, b in zip(drafts["graphed"], drafts["eager"]))
    assert same >= 0.9 * len(drafts["eager"]), (same, len(drafts["eager"]))  # bf16 near-ties may part a few


def plain_cheap_runs(tmp_path, wide_target, make_drafter, reverse: bool = False):
    """The tokens with scheduling off and on under a cost table whose plain steps are far cheaper than any drafting
    step (``reverse``: every judgement that drafting does not pay reversed by the refit after it, forced) -> (the
    two runs' tokens, the scheduled engine)."""
    from tests.runtime.test_confidence_scheduling import flat_table, with_plain

    drafter = make_drafter(wide_target, 4)
    table = tmp_path / "plain-cheap.json"
    with_plain(flat_table(1.0, base=50.0), 1.0).save(table)
    runs = {}
    for name, llm in scheduling_off_and_on(wide_target, drafter, table, max_num_seqs=ENGINE["max_num_seqs"]):
        if name == "on" and reverse:
            llm.engine.confidence._pays_after_refit = lambda confidence, history: True
        runs[name] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return runs, llm


def test_drafting_holds_decode_plainly_on_the_graphed_path(tmp_path, wide_target, make_drafter):
    """A cost table whose plain steps are far cheaper than any drafting step: the confidence-scheduled engine holds
    the drafting off (plain decode steps replayed with the drafter's context graph, launched ahead), looks again
    after each hold, and its tokens equal scheduling off."""
    runs, llm = plain_cheap_runs(tmp_path, wide_target, make_drafter)
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["drafting_holds"] >= 1 and stats["drafting_off_steps"] >= 16
    assert llm.engine.executor.worker.graphs.steps_run_ahead >= 10
    assert runs["on"] == runs["off"]


def test_holds_the_refit_reverses_end_on_the_graphed_path(tmp_path, wide_target, make_drafter):
    """Every judgement that drafting does not pay reversed by the refit after its step (forced): each hold ends at
    once on the graphed path that launches steps ahead, and the tokens equal scheduling off."""
    runs, llm = plain_cheap_runs(tmp_path, wide_target, make_drafter, reverse=True)
    stats = llm.get_metrics()["confidence_scheduling"]
    assert stats["drafting_holds"] >= 1 and stats["drafting_judgements_reversed"] == stats["drafting_holds"]
    # (a hold costs the step it began at, or with a decision made a step ahead the next one too, not 16)
    assert stats["drafting_off_steps"] <= 2 * stats["drafting_holds"]
    assert runs["on"] == runs["off"]
