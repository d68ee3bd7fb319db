"""``dspark bench``: our autoregressive baseline and DSpark side by side, same engine and kernels.

For each concurrency ``c`` of the sweep, ``c`` requests decode together and the engine's steps are timed
(host and device, what a client sees between tokens): ``ar_step_ms`` without a drafter, ``dspark_step_ms``
with one, their tokens/s, TTFT and TPOT, acceptance (mean and per position), and the decode step against the
bandwidth roofline (bytes the step must read: every weight once plus the cached keys and values, over the
device copy bandwidth measured in the same run). With CUDA graphs, the last step's graphs are also replayed
alone: the device time of the forward (``ar_forward_ms``; ``verify_step_ms`` with a drafter), of the drafter's
context append (``context_ms``) and of its draft block (``draft_ms``); the rest of a step is host work and eager
kernels (``ar_outside_forward_ms``). ``--model-shape qwen3-8b`` (or ``qwen3-30b-a3b``, an MoE target: each step
also counts the distinct experts its routers wake, ``moe_experts_woken``, and a K+1-token verify's against one
token's, ``verify_experts_vs_decode``; its roofline reads only the experts woken) builds random-weight models of
real shapes (``load_format="dummy"``): step times and roofline only, since random drafters accept nothing
(``--projected-tau`` adds a projected speedup from a trained pair's acceptance); a trained pair
(``--model``/``--speculative-model``) gives acceptance and end-to-end speedup. Peers: Hugging Face ``generate``
on the same target, eager and compiled (static cache).
``--tune-schedule FILE`` times every shorter draft length too, writes the fastest ``draft_len_schedule``
(``cluster.schedule_tuning``) and sweeps an engine with it (``tuned_*`` fields). ``--confidence-scheduling`` sweeps
an engine whose verify lengths the confidence scheduler chooses (``confidence_*`` fields; its startup profile is
``confidence_cost_table``, ``--profile-steps FILE`` saves it, and ``confidence_cost_table_served`` is the table as
the sweep left it, ``confidence_mixed_step_costs_served`` the mixed steps' excess over it
(``runtime.spec.mixed_step_costs``), from the sweep's ramps and prefills): within the tuned schedule when both are given (the schedule caps the block it
drafts; ``--confidence-draft-len max``: up to max_draft_len, as its scheduler chooses, beside the tuned schedule; ``both``: the two in the same rounds, the second's figures as ``confidence-max_*``; ``confidence_vs_tuned`` compares the two engines measured in this run, the median rounds' tokens/s, and
``confidence_vs_tuned_paired`` the median of the per-round ratios, each round's two figures taken back to back, so
the host's drift between rounds cancels), else within ``max_draft_len``. Beside them: what any schedule could gain
there over whole blocks, priced on the startup table from the fixed engine's acceptance (``confidence_oracle_bound``,
``confidence_padded_bound``: ``runtime.spec.schedule_bounds``), what the scheduler's own model promised at the steps it
decided (``confidence_predicted_gain``), and the tuned engine against the fixed one
(``tuned_vs_dspark_paired``): where the two ran the same draft length (``tuned_same_as_fixed``) they are one
configuration built twice, and that ratio is the run's noise floor. ``confidence_drafting_off_steps``: the timed steps
on which the confidence-scheduled engine drafted nothing because no verify beat plain decoding (its drafting holds;
the mixed workload's ``drafting_off_step_share``).
``--e2e-prompts N`` decodes N prompts one at a time through ``LLM.generate`` with both engines: the end-to-end
speedup against what the step times allow at the measured tau, and the share of prompts whose greedy outputs
are identical (bf16 verify batches reorder sums, so near-ties may part).
``--tensor-parallel-size N`` (and ``--drafter separate``) run every engine as a Ray replica through
``cluster.LLM`` (N target shards, a separate drafter on a GPU of its own), the same sweep in the same format
(``tensor_parallel_size``, ``drafter``; the separate layout also measures the colocated replica:
``throughput_vs_colocated``; with ``--pipeline-drafter`` also the separate drafter without the pipeline:
``throughput_vs_serial``); a replica's models live on its actors, so its record has step times, tokens/s and
acceptance but no roofline, graph replays or host breakdown. ``--beside-single-process`` measures the AR and DSpark
replicas each beside the same engine in this process on the same GPU, in alternating rounds (``single_ar_*``,
``single_dspark_*``): ``ray_vs_single_process_{ar,dspark}_step`` (and ``_paired``, the median of the per-round
ratios) is what the process boundary and the step's dispatch cost, free of the host's drift between separate runs;
with ``--e2e-prompts`` also how the replica's greedy outputs agree with one process's
(``end_to_end.replica_vs_single_process``: the share identical, where each first differs).
``--profile`` profiles every engine's batch-1 decode steps (``--profile-batches``: other batch sizes too, each once
every request has its first token; a replica's on every rank: ``*_profile_batch1.ranks``) after all the figures are
taken, on the engine built again: a process the
profiler has run in launches CUDA graphs several times slower.
On one process every engine compared is alive at once and measured in alternating rounds (``--rounds``, three per
concurrency, the order flipped each round, the median round kept; the end-to-end prompts alternate per prompt;
the tuning candidates are timed against the DSpark engine and read in its terms; with ``--tune-schedule`` the AR and
DSpark engines are measured again in one set of rounds with the tuned and confidence-scheduled engines, and those
rows replace the sweep's): the host's speed drifts by tens of percent over tens of seconds on a shared machine, so
figures timed minutes apart do not compare.
``--sequential`` (and every replica) measures each engine alone, one after another.
``--device cpu`` runs the plumbing on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path

from cluster.arg_types import SIZE_FORMS, device_name, gib, integer, memory_size, moe_backend, number
from cluster.bench_plot import plot, require_matplotlib

MODEL_SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 MoE layers of 128 experts, 8 per token (norm_topk_prob), 3.3B parameters read per token
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 tie_word_embeddings=False),
    "tiny-moe": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                     max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False),
}
DRAFT_LAYER_IDS = {"qwen3-8b": [1, 17, 33], "qwen3-30b-a3b": [1, 23, 45], "tiny": [0], "tiny-moe": [0]}
MOE_SHAPES = {"qwen3-30b-a3b", "tiny-moe"}  # written as qwen3_moe; their 1-layer-per-depth drafters stay dense
HOST_TIMED_STEPS = 10  # steps after the timed ones whose host work is broken down (host_times)
ROUTING_STEPS = 2  # eager steps after those whose MoE routing is counted (routing_stats; MoE targets only)


def write_shape(root: Path, shape: str, draft_layers: int, block_size: int) -> tuple[Path, Path]:
    """config.json-only target and drafter directories of ``shape`` (loaded with load_format='dummy')."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    fields = MODEL_SHAPES[shape]
    target = root / f"{shape}-target"
    family = Qwen3MoeConfig if shape in MOE_SHAPES else Qwen3Config
    family(**fields, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16").save_pretrained(str(target))
    drafter = root / f"{shape}-drafter"
    drafter.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="qwen3", num_experts=0)  # a dense Qwen3 drafter of the target's width
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=fields["num_hidden_layers"],
                  num_hidden_layers=draft_layers, block_size=block_size, mask_token_id=fields["vocab_size"] - 1,
                  target_layer_ids=DRAFT_LAYER_IDS[shape], markov_rank=256, markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True,
                  layer_types=["full_attention"] * draft_layers)
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


def copy_bandwidth(device, gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of 10."""
    import torch

    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[len(times[2:]) // 2]


def local_worker(llm):
    """The engine's in-process worker (``runtime.LLM``), or None for a Ray replica (``cluster.LLM``): its models
    live on actors, so the breakdowns that read them (roofline bytes, graph replays, host timers, routing) are
    left out of replica runs."""
    return getattr(llm.engine.executor, "worker", None)


def sync(llm) -> None:
    """Wait for the in-process engine's GPU work (a replica's step returns only once its actors are done)."""
    import torch

    worker = local_worker(llm)
    if worker is not None and getattr(worker, "device", None) is not None and worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)


def weight_bytes(llm) -> int:
    """Bytes of every weight matrix one decode step reads (the embedding reads only its rows: left out), MoE
    experts excluded: a step reads only the experts its tokens wake (``expert_bytes``)."""
    target = llm.engine.executor.worker.target
    return sum(p.numel() * p.element_size() for n, p in target.named_parameters()
               if "embed_tokens" not in n and ".w13" not in n and ".w2" not in n)


def moe_blocks(llm) -> list:
    from runtime.models.moe import SparseMoeBlock

    return [m for m in llm.engine.executor.worker.target.modules() if isinstance(m, SparseMoeBlock)]


def expert_bytes(llm) -> int:
    """Bytes of one expert of every MoE layer together (a step that wakes w experts per layer reads w times this)."""
    return sum((b.w13.numel() + b.w2.numel()) * b.w13.element_size() // b.num_experts for b in moe_blocks(llm))


def routing_stats(llm, steps: int = 2) -> dict:
    """For an MoE target, while requests decode: the distinct experts each MoE layer's router wakes per step
    (``moe_experts_woken``, averaged over layers and ``steps``) for the tokens the step feeds
    (``moe_tokens_routed``). The steps run eagerly (forward hooks do not fire inside a graph replay); {} for a
    dense target."""
    blocks = moe_blocks(llm) if local_worker(llm) is not None else []
    if not blocks:
        return {}
    woken, routed = [], []

    def record(block, args):
        ids = block.route(args[0])[1]
        woken.append(ids.unique().numel())
        routed.append(ids.shape[0])

    hooks = [b.register_forward_pre_hook(record) for b in blocks]
    runner = llm.engine.executor.worker.engine_part
    graphs, runner.graphs = runner.graphs, None
    try:
        for _ in range(steps):
            llm.engine.step()
    finally:
        runner.graphs = graphs
        for hook in hooks:
            hook.remove()
    return {"moe_experts_woken": sum(woken) / len(woken), "moe_tokens_routed": sum(routed) / len(routed),
            "moe_num_experts": blocks[0].num_experts, "moe_top_k": blocks[0].top_k}


def kv_bytes(llm, batch: int, context: int) -> int:
    target = llm.engine.executor.worker.target
    layer = target.model.layers[0].self_attn
    itemsize = next(target.parameters()).element_size()
    return batch * context * 2 * layer.kv_width * itemsize * len(target.model.layers)


def time_steps(llm, batch: int, prompt_len: int, steps: int, warmup: int, vocab: int, seed: int,
               prompts: list[list[int]] | None = None) -> dict:
    """Decode ``batch`` requests together; time ``steps`` engine steps after prefill and ``warmup`` steps.

    The requests' prompts are random token ids of ``prompt_len`` (random weights accept nothing anyway), or, for a
    trained pair, rows of ``prompts`` (from ``seed`` on, cycling, each cut to ``prompt_len``): acceptance is only
    meaningful on text the pair was trained for.

    ``ttft_ms``: from submitting the batch until every request has its first token (prefill steps);
    ``tpot_ms``: decode time over the tokens each request gained; then, while the graphs' buffers still hold
    this step's inputs, the device time of the forward (and draft) graphs alone (``device_times``)."""
    import torch

    from runtime import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    per_step = engine.spec.max_draft_len + 1 if engine.spec else 1
    # room for every step the first request decodes while the last one prefills (decodes share the token budget)
    chunks = -(-batch * prompt_len // max(engine.config.max_num_batched_tokens - batch, 1))
    max_tokens = (chunks + warmup + steps + HOST_TIMED_STEPS + ROUTING_STEPS + 4) * per_step
    if prompt_len + max_tokens > engine.max_model_len:
        raise ValueError(f"bench: {batch} requests of {prompt_len} tokens need max_model_len >= "
                         f"{prompt_len + max_tokens} to stay in the batch for the whole timing; lower --steps")
    # delta outputs, as the server streams them (cumulative ones copy every request's whole output each step)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
    if prompts:
        prompts = [prompts[(seed + i) % len(prompts)][:prompt_len] for i in range(batch)]
    else:
        prompts = [torch.randint(3, vocab - 1, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    sync(llm)
    submitted_step = engine.confidence_stats.steps  # the trace of the untimed steps (prefill, warm-up) from here
    submitted = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    while any(not engine.sequences[i].output_token_ids for i in ids if i in engine.sequences):
        engine.step()
    ttft = time.perf_counter() - submitted
    for _ in range(warmup):
        engine.step()
    sync(llm)
    before = sum(len(engine.sequences[i].output_token_ids) for i in ids)
    metrics_before = engine.metrics.as_dict()
    traced = engine.confidence_stats.steps  # a confidence-scheduled engine's step trace, from here
    graphs = getattr(local_worker(llm), "graphs", None)
    ahead_before = graphs.steps_run_ahead if graphs is not None else 0
    pipelined_before = engine.pipelined_steps
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(llm)
    elapsed = time.perf_counter() - start
    # what a confidence-scheduled engine chose and measured at each timed step (ConfidenceStats.trace_since), and
    # at the untimed ones before them: a drafting hold the window starts in began there
    trace = {"confidence_trace": engine.confidence_stats.trace_since(traced, engine.confidence_stats.steps),
             "confidence_trace_untimed": engine.confidence_stats.trace_since(submitted_step, traced)} \
        if engine.confidence is not None else {}
    # the timed steps launched before the engine scheduled them (decode or verify run-ahead), of one process's graphs
    ahead = {"steps_run_ahead_fraction": (graphs.steps_run_ahead - ahead_before) / steps} if graphs is not None else {}
    # a pipelined separate drafter: the timed steps that were pipelined (pipeline_drafter_min_batch decides)
    pipelined = {"pipelined_step_fraction": (engine.pipelined_steps - pipelined_before) / steps} \
        if engine.pipelined else {}
    committed = sum(len(engine.sequences[i].output_token_ids) for i in ids) - before
    metrics = engine.metrics.as_dict()
    drafts = metrics["num_drafts"] - metrics_before["num_drafts"]
    accepted = metrics["num_accepted_tokens"] - metrics_before["num_accepted_tokens"]
    per_pos = [(a - b) / drafts if drafts else None for a, b in zip(metrics["num_accepted_tokens_per_pos"],
                                                                    metrics_before["num_accepted_tokens_per_pos"])]
    context = prompt_len + (before + committed) // batch
    device = device_times(llm, batch, engine.draft_len() + 1)  # the block the last steps verified
    host = host_times(llm, steps=HOST_TIMED_STEPS)
    routing = routing_stats(llm, steps=ROUTING_STEPS)
    engine.abort_all()
    return {"step_ms": 1e3 * elapsed / steps, "tokens_per_s": committed / elapsed, "ttft_ms": 1e3 * ttft,
            "tpot_ms": 1e3 * elapsed * batch / committed, "mean_acceptance_length": (1 + accepted / drafts)
            if drafts else None, "acceptance_per_position": per_pos if drafts else None, "context": context,
            **ahead, **pipelined, **device, **host, **routing, **trace}


def end_to_end(llms: dict, prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """Each prompt alone (concurrency 1), greedy, through ``LLM.generate`` as a user calls it (prefill, decode,
    stop checks, detokenization), on every engine of ``llms`` ({kind: llm}) -> per kind: wall seconds, tokens, the
    outputs, and the acceptance over these requests. With several engines each prompt runs on each in turn, the
    order flipped every prompt, so a drift of the host's speed falls on all of them alike."""
    from runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    kinds = list(llms)
    before, seconds, outputs = {}, dict.fromkeys(kinds, 0.0), {kind: [] for kind in kinds}
    for kind, llm in llms.items():
        llm.generate([prompts[0]], params)  # untimed: first-call costs
        before[kind] = llm.get_metrics()
    for i, prompt in enumerate(prompts):
        for kind in (kinds if i % 2 == 0 else reversed(kinds)):
            llm = llms[kind]
            sync(llm)
            start = time.perf_counter()
            outputs[kind].append(llm.generate([prompt], params)[0].token_ids)
            sync(llm)
            seconds[kind] += time.perf_counter() - start
    results = {}
    for kind, llm in llms.items():
        metrics = llm.get_metrics()
        drafts = metrics["num_drafts"] - before[kind]["num_drafts"]
        accepted = metrics["num_accepted_tokens"] - before[kind]["num_accepted_tokens"]
        results[kind] = {"seconds": seconds[kind], "tokens": sum(len(o) for o in outputs[kind]),
                         "outputs": outputs[kind], "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    return results


def mixed_workload(llm, prompts: list[list[int]], rate: float, max_tokens: int, seed: int = 0,
                   mixed_prefill: bool = True, piecewise: bool = True,
                   profile: tuple[int, int] | None = None) -> dict:
    """Requests arriving while others decode (so steps mix prefill and decode): ``prompts`` submitted one by
    one at Poisson arrival times of ``rate`` per second (seeded), greedy, ``max_tokens`` each; the engine steps
    whenever it has work. -> output tokens/s over the whole run, mean TTFT and TPOT, steps, and the share of
    steps taken while some requests decoded and others waited or prefilled; where a step's time went
    (``step_ms``: ``engine.step``'s mean; ``host_ms``: of it, per step, scheduling, the executor's step (the device's
    work and its wait), committing, and a confidence-scheduled engine's decision; ``mean_batch`` /
    ``mean_tokens_fed``: what a step fed); a confidence-scheduled engine's choices over the run besides
    (``scheduled``: ``scheduled_since``); how the steps' times spread over the run (``step_spread``: quantiles,
    quarters, idle time, garbage-collector pauses, on a CUDA device the caching allocator's mallocs and retries;
    alternating rounds also keep each round's, ``rounds_spread``).
    ``mixed_prefill`` False: the engine's scheduler keeps prefill apart for
    this run (``LLMConfig.enable_mixed_prefill``), as built afterwards. ``piecewise`` False: the steps no whole-step
    graph serves run eagerly for this run, not through the engine's piecewise graphs (``runtime.worker.piecewise``; a
    single-process engine's). ``piecewise_steps``: the steps its piecewise graphs served in the run. ``profile``
    (skip, steps): a torch profile of the run's steps from its ``skip``-th on, ``steps`` of them
    (``runtime.engine.profiling.summarize``, in the record's ``profile``; the run's own figures then include its cost)."""
    import random

    from runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    for _ in prompts:
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    engine = llm.engine
    held_before = engine.confidence_stats.drafting_off_steps  # confidence scheduling's drafting holds
    stats_before = dataclasses.replace(engine.confidence_stats)
    totals: dict[str, float] = {}
    fed = [0, 0]  # requests and tokens scheduled, over the run
    schedule = engine.scheduler.schedule

    def counted_schedule(*args, **kwargs):
        scheduled = schedule(*args, **kwargs)
        fed[0] += len(scheduled)
        fed[1] += sum(len(e.token_ids) for e in scheduled)
        return scheduled

    with contextlib.ExitStack() as timers:
        engine.scheduler.schedule = counted_schedule
        timers.callback(delattr, engine.scheduler, "schedule")
        limits = engine.scheduler.limits
        engine.scheduler.limits = dataclasses.replace(limits, mixed_prefill=mixed_prefill)
        timers.callback(setattr, engine.scheduler, "limits", limits)
        runner = piecewise_runner(engine)
        replays_before = runner.piecewise.replays if runner is not None else 0
        if not piecewise:
            if runner is None:
                raise ValueError("--mixed-eager: this engine has no piecewise graphs to compare with (one process "
                                 "on a GPU with CUDA graphs and piecewise_cuda_graphs builds them)")
            runner.use_piecewise = False
            timers.callback(setattr, runner, "use_piecewise", True)
        for owner, name, key in ((engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
                                 (engine.executor, "execute", "execute"), (engine, "_commit_step", "commit"),
                                 (engine, "_allot_verify_lengths", "decision")):
            timers.enter_context(timed(owner, name, totals, key))
        profiler = StepWindowProfile(*profile) if profile is not None else None
        record = {"requests": len(prompts), "rate_per_s": rate, "max_tokens": max_tokens,
                  **_mixed_run(engine, prompts, arrivals, params, profiler)}
        if profiler is not None:
            record["profile"] = profiler.summary
    steps = record["steps"]
    record["step_ms"] = 1e3 * totals.pop("step", 0.0) / steps
    record["host_ms"] = {key: 1e3 * value / steps for key, value in totals.items()}
    record["mean_batch"], record["mean_tokens_fed"] = fed[0] / steps, fed[1] / steps
    record["drafting_off_step_share"] = (engine.confidence_stats.drafting_off_steps - held_before) / steps
    record["piecewise_steps"] = runner.piecewise.replays - replays_before if runner is not None else 0
    if engine.confidence is not None:
        record["scheduled"] = scheduled_since(stats_before, engine.confidence_stats)
        record["confidence_trace"] = engine.confidence_stats.trace_since(stats_before.steps)
    return record


def piecewise_runner(engine):
    """The model runner of a single-process engine whose target has piecewise graphs (``runtime.worker.piecewise``), else
    None (an engine on Ray actors, eager, or without them)."""
    worker = getattr(engine.executor, "worker", None)
    runner = getattr(worker, "engine_part", None)
    return runner if getattr(runner, "piecewise", None) is not None else None


class StepWindowProfile:
    """A torch profile of ``steps`` consecutive steps of a loop, from its ``skip``-th step on: ``before(i)`` ahead of
    step i, ``after(i)`` behind it; ``summary`` the profile's (``runtime.engine.profiling.summarize``), None until the window
    closed (a loop shorter than ``skip + steps`` closes it early, at its ``last`` step)."""

    def __init__(self, skip: int, steps: int):
        if skip < 0 or steps < 1:
            raise ValueError(f"a profile window needs skip >= 0 and steps >= 1, got {skip}, {steps}")
        self.skip, self.steps = skip, steps
        self.summary: dict | None = None
        self._profile = None
        self._profiled = 0

    def before(self, step: int) -> None:
        if step == self.skip and self.summary is None:
            self._profile = step_profiler()
            self._profile.start()

    def after(self, last: bool = False) -> None:
        if self._profile is None:
            return
        self._profiled += 1
        if self._profiled == self.steps or last:
            import torch

            from runtime.engine.profiling import summarize

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._profile.stop()
            self.summary = summarize(self._profile, self._profiled, None)
            self._profile = None


def _mixed_run(engine, prompts: list[list[int]], arrivals: list[float], params,
               profiler: StepWindowProfile | None = None) -> dict:
    """``mixed_workload``'s loop: submit each prompt at its arrival time, step while there is work. Besides the
    figures, where the run's time went (``step_spread``): the steps' wall-time quantiles, the mean step of each
    quarter of the run (a warm-up or a drift shows as a trend), the seconds spent idle waiting for arrivals, and the
    garbage collector's pauses (collections per generation and their milliseconds), and on a CUDA device the caching
    allocator's cudaMalloc / cudaFree calls and retries (every engine of a bench is alive on one device: near its
    memory's end a retry frees the cache and synchronizes): a run on one host can take 12 or 23 ms a step for the
    same work, and these say whether its host paused, drifted or its allocator struggled."""
    pauses, allocator = GcPauses(), AllocatorEvents()
    start = time.perf_counter()
    submitted, first_token, finished, steps, mixed, pending = {}, {}, {}, 0, 0, 0
    step_s, idle_s = [], 0.0
    with pauses, allocator:
        while len(finished) < len(prompts):
            now = time.perf_counter() - start
            while pending < len(prompts) and arrivals[pending] <= now:
                submitted[engine.add_request(prompts[pending], params)] = time.perf_counter()
                pending += 1
            if not engine.has_unfinished():
                wait = max(0.0, min(arrivals[pending] - now, 0.01))
                time.sleep(wait)
                idle_s += wait
                continue
            decoding = sum(1 for seq in engine.scheduler.running if seq.output_token_ids)
            prefilling = engine.num_waiting + engine.num_running - decoding
            if profiler is not None:
                profiler.before(steps)
            began = time.perf_counter()
            outputs = engine.step()
            stamp = time.perf_counter()
            step_s.append(stamp - began)
            mixed += int(decoding > 0 and prefilling > 0)
            for out in outputs:
                first_token.setdefault(out.request_id, stamp)
                if out.finish_reason is not None:
                    finished[out.request_id] = (stamp, len(out.token_ids))
            if profiler is not None:
                profiler.after(last=len(finished) == len(prompts))
            steps += 1
    seconds = time.perf_counter() - start
    tokens = sum(n for _, n in finished.values())
    ttft = [first_token[r] - submitted[r] for r in finished]
    tpot = [(end - first_token[r]) / (n - 1) for r, (end, n) in finished.items() if n > 1]
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "mean_ttft_ms": 1e3 * sum(ttft) / len(ttft),
            "mean_tpot_ms": 1e3 * sum(tpot) / max(len(tpot), 1), "steps": steps, "mixed_step_share": mixed / steps,
            "step_spread": {**step_spread(step_s), "idle_s": idle_s, "gc": pauses.summary(),
                            **({"allocator": events} if (events := allocator.summary()) else {})}}


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


class AllocatorEvents:
    """Within the block, what the CUDA caching allocator did beyond serving from its cache (``memory_stats``
    deltas): cudaMalloc and cudaFree calls, retries after a failed allocation (each frees the cache and synchronizes
    the device), out-of-memory errors, and the device memory free at the start (GiB). Empty off a CUDA device."""

    COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")

    def __init__(self):
        self._before: dict | None = None
        self._after: dict | None = None
        self._free_gib = 0.0

    @staticmethod
    def _active() -> bool:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _counters(self) -> dict:
        import torch

        stats = torch.cuda.memory_stats()
        return {name: int(stats.get(name, 0)) for name in self.COUNTERS}

    def __enter__(self):
        if self._active():
            import torch

            self._before = self._counters()
            self._free_gib = torch.cuda.mem_get_info()[0] / 2**30
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            self._after = self._counters()

    def summary(self) -> dict:
        if self._before is None or self._after is None:
            return {}
        return {**{name: self._after[name] - self._before[name] for name in self.COUNTERS},
                "free_gib_at_start": self._free_gib}


class GcPauses:
    """Within the block, the garbage collector's collections per generation and the milliseconds they took
    (``gc.callbacks``)."""

    def __init__(self):
        self.counts, self.seconds, self._began = [0, 0, 0], 0.0, 0.0

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.counts[min(int(info.get("generation", 0)), 2)] += 1

    def __enter__(self):
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._note)

    def summary(self) -> dict:
        return {"collections": list(self.counts), "ms": 1e3 * self.seconds}


def scheduled_since(before, after) -> dict:
    """What a confidence-scheduled engine chose between two snapshots of its ``ConfidenceStats``: the decisions, the
    drafts verified and proposed per deciding request, the tokens it expected them to commit and they committed
    (and what it expected of whole blocks), the decided steps' predicted and measured ms (their means), and the
    drafting judgement's plain step (its predicted ms, the share of judgements where drafting paid; None: none
    judged) and the packed layout's decided steps that verified whole blocks instead (``unpacked_steps``)."""
    decisions, requests = after.decisions - before.decisions, max(after.requests - before.requests, 1)
    decided = max(after.decided_steps - before.decided_steps, 1)
    judged = after.judged - before.judged
    return {"decisions": decisions, "verify_budget_per_request": (after.budget - before.budget) / requests,
            "offered_per_request": (after.offered - before.offered) / requests,
            "expected_tokens_per_request": (after.expected_tokens - before.expected_tokens) / requests,
            "whole_block_expected_tokens_per_request": (after.whole_expected_tokens - before.whole_expected_tokens)
            / requests,
            "committed_tokens_per_request": (after.committed_tokens - before.committed_tokens) / requests,
            "predicted_step_ms": (after.predicted_ms - before.predicted_ms) / max(decisions, 1),
            "measured_decided_step_ms": (after.decided_ms - before.decided_ms) / decided,
            "judged_plain_step_ms": (after.judged_plain_ms - before.judged_plain_ms) / judged if judged else None,
            "drafting_paid_share": (after.judged_paid - before.judged_paid) / judged if judged else None,
            "unpacked_steps": after.unpacked_steps - before.unpacked_steps}


def agreement(first: list[list[int]], second: list[list[int]]) -> dict:
    """How two runs' greedy outputs of the same prompts agree: the share identical token for token, and per prompt
    the index of the first differing token (None: identical)."""
    parts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x),
              len(y))) for x, y in zip(first, second)]
    return {"identical_fraction": sum(p is None for p in parts) / len(parts), "first_difference": parts}


def replay_ms(graph, repeats: int = 20) -> float:
    """Device time of one replay of ``graph`` (a ``torch.cuda.CUDAGraph``), the median of ``repeats``
    (``runtime.worker.graphs.replay_ms``; imported here when called: this module loads without torch)."""
    from runtime.worker.graphs import replay_ms as device_replay_ms

    return device_replay_ms(graph, repeats)


@contextmanager
def timed(owner, name: str, totals: dict, key: str) -> Iterator[None]:
    """Within the block, ``owner.name`` adds the host seconds of each call to ``totals[key]``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def host_times(llm, steps: int) -> dict:
    """Host milliseconds per step of the work around the graphed forward, over ``steps`` more steps (timed apart
    from the step times above, so the timers cannot change them): scheduling, committing, and inside the
    forward's ``run`` the graph inputs, FlashInfer's plan and the graph launch (``CUDAGraph.replay``, host side).
    A plain greedy decode step goes through ``decode_greedy`` instead (``host_decode_greedy_ms``: its inputs, plan
    and launches, the next step launched ahead included, and the wait for its own read-back). Empty without CUDA
    graphs."""
    import torch

    engine, worker = llm.engine, local_worker(llm)
    if worker is None or worker.graphs is None:
        return {}
    totals: dict[str, float] = {}
    with timed(engine.scheduler, "schedule", totals, "host_schedule_ms"), \
            timed(engine, "_commit_step", totals, "host_commit_ms"), \
            timed(worker.graphs, "run", totals, "host_forward_run_ms"), \
            timed(worker.graphs, "decode_greedy", totals, "host_decode_greedy_ms"), \
            timed(worker.graphs.backend, "plan_attention", totals, "host_attention_plan_ms"), \
            timed(torch.cuda.CUDAGraph, "replay", totals, "host_graph_launch_ms"):
        for _ in range(steps):
            engine.step()
    torch.cuda.synchronize()
    return {key: 1e3 * value / steps for key, value in totals.items()}


def device_times(llm, batch: int, tokens_per_request: int) -> dict:
    """The device time of the last step's graphs replayed alone: the target forward over ``tokens_per_request``
    tokens per request (``forward_ms``: the verify forward with a drafter), the drafter's context append
    (``context_ms``) and its block step (``draft_ms``). Their inputs are the last step's, still in the graphs'
    buffers; a replay rewrites the same cache slots with the same values. Empty without CUDA graphs."""
    worker = local_worker(llm)
    if worker is None or worker.graphs is None:
        return {}
    from runtime.worker.graph_layout import bucket_of

    graphs = worker.graphs
    bucket = bucket_of(graphs.buckets, batch)
    forward = graphs.graphs.get((bucket, tokens_per_request))
    if forward is None:
        return {}
    out = {"forward_ms": replay_ms(forward.graph)}
    if forward.context is not None:
        out["context_ms"] = replay_ms(forward.context)
    channel = getattr(worker.engine_part, "channel", None)
    draft_graphs = getattr(getattr(channel, "runner", None), "graphs", None)
    if draft_graphs is not None and (bucket, tokens_per_request - 1) in draft_graphs.graphs:
        out["draft_ms"] = replay_ms(draft_graphs.graphs[(bucket, tokens_per_request - 1)][0])
    return out


def hf_generate_tokens_per_s(target_dir: Path, shape: bool, tokens: int, device, compiled: bool = False) -> dict:
    """transformers ``generate`` at batch 1, greedy, on the same target: eager with its dynamic cache, or
    (``compiled``) with a static cache and ``torch.compile`` (its ``CompileConfig``, mode reduce-overhead),
    compiled by an untimed generation of the same length first. -> tokens_per_s and the untimed warmup's
    seconds (the compile time, when compiled)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    config = AutoConfig.from_pretrained(str(target_dir))
    if shape:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.bfloat16).to(device)
    model.eval()
    ids = torch.randint(3, config.vocab_size - 1, (1, 128), device=device)
    options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    if compiled:
        options.update(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    start = time.perf_counter()
    for _ in range(3 if compiled else 1):  # reduce-overhead records its CUDA graphs on the second call
        model.generate(ids, **options)
    torch.cuda.synchronize()
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, **options)
    torch.cuda.synchronize()
    rate = tokens / (time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    return {"tokens_per_s": rate, "warmup_s": warmup}


def step_profiler():
    """A torch profiler of the host and, where CUDA is, the device (not started), the device synchronized first so
    no earlier work lands in it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))


def profile_step(llm, batch: int, prompt_len: int, vocab: int, trace: str | None = None) -> dict:
    """torch.profiler over 5 decode steps of ``batch`` fresh requests, once each has its first token
    (``runtime.engine.profiling.summarize``: CUDA kernels launched per step, GPU busy and idle time per step, host time per
    region, the top kernels); ``trace``: also the timeline as a Chrome trace (gzip) there. A Ray replica's engine is
    profiled on every rank (``ranks``, one summary each: the driver only dispatches)."""
    import torch

    from runtime import SamplingParams
    from runtime.engine.profiling import summarize

    engine = llm.engine
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(3, vocab - 1, (prompt_len,)).tolist(), params) for _ in range(batch)]
    # the profiled steps are decode steps: past every prefill chunk (64 prompts of 548 tokens take several steps),
    # then a few more
    while any(not engine.sequences[i].output_token_ids for i in ids if i in engine.sequences):
        engine.step()
    for _ in range(2):
        engine.step()
    start_on_ranks = getattr(engine.executor, "start_profile", None)
    if start_on_ranks is not None:  # a replica: each rank profiles its next 5 steps (traces on the ranks' hosts)
        start_on_ranks(5, trace)
        for _ in range(5):
            engine.step()
        engine.abort_all()
        return {"ranks": engine.executor.profile_results()}
    with step_profiler() as prof:
        for _ in range(5):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    engine.abort_all()
    return summarize(prof, 5, trace)


def end_to_end_prompts(args, prompts: list[list[int]] | None, vocab: int, count: int | None = None) -> list[list[int]]:
    """``count`` (default ``--e2e-prompts``) prompts: the first rows of ``--prompts`` (``prompts``, already
    tokenized), else random token ids of ``--prompt-len`` (seeded)."""
    import torch

    count = count or args.e2e_prompts
    if prompts:
        return prompts[:count]
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(count)]


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


def trace_path(args, kind: str, batch: int) -> str | None:
    return str(Path(args.profile_trace) / f"{kind}-batch{batch}.trace.json.gz") if args.profile_trace else None


def run(args) -> dict:
    import torch
    from tqdm.auto import tqdm

    from runtime import LLM
    from runtime.engine.heap import freeze_long_lived, unfreeze_long_lived

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    replica = args.tensor_parallel_size is not None or args.drafter == "separate"
    tp = args.tensor_parallel_size or 1
    work = Path(tempfile.mkdtemp(prefix="dspark-bench-"))
    shape = args.model_shape is not None
    if shape:
        target, drafter = write_shape(work, args.model_shape, args.draft_layers, args.max_draft_len)
    else:
        target, drafter = Path(args.model), Path(args.speculative_model)
    from transformers import AutoConfig, AutoTokenizer

    from runtime.training.distill import dataset_prompts

    vocab = AutoConfig.from_pretrained(str(target)).vocab_size
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    common = dict(dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device,
                  kernel_backend=args.kernel_backend, enforce_eager=args.enforce_eager, moe_backend=args.moe_backend,
                  piecewise_cuda_graphs=args.piecewise_cuda_graphs,
                  max_num_seqs=max(args.concurrency), max_model_len=args.prompt_len + 2048,
                  kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=max(2048, args.prompt_len * 2),
                  load_format="dummy" if shape else "auto")
    if replica:  # through cluster.LLM: the target's shards (and a separate drafter) on Ray actors
        from cluster.llm import LLM as ReplicaLLM

        def engine_class(model, speculative_config=None, drafter=args.drafter, pipeline=args.pipeline_drafter,
                         single_process=False, **kwargs):
            if single_process:  # --beside-single-process: the same engine in this process, beside the replica's
                return LLM(model, speculative_config=speculative_config, **kwargs)
            place = drafter if speculative_config is not None else "colocated"  # AR: no drafter to place
            pipelined = bool(pipeline) and place == "separate"
            return ReplicaLLM(model, speculative_config, tensor_parallel_size=tp, drafter=place,
                              pipeline_drafter=pipelined, allreduce_strategy=args.allreduce_strategy,
                              ray_address=args.ray_address, **({"pipeline_drafter_min_batch": args.pipeline_drafter_min_batch}
                                                               if pipelined and args.pipeline_drafter_min_batch else {}),
                              **kwargs)
    else:
        engine_class = LLM
    spec = {"speculative_model": str(drafter), "max_draft_len": args.max_draft_len,
            "speculation_guard": args.speculation_guard, **({"load_format": "dummy"} if shape else {})}
    rows = {c: {"concurrency": c} for c in args.concurrency}
    command = "dspark bench " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "bench" \
        else shlex.join(sys.argv)
    record = {"hardware": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "command": command, "date": str(date.today()),
              "host": platform.node(), "torch": torch.__version__, "model": args.model_shape or str(target),
              "kind": "random-shape" if shape else "trained", "tensor_parallel_size": tp,
              "drafter": args.drafter, "pipeline_drafter": bool(args.pipeline_drafter) and args.drafter == "separate",
              "pipeline_min_batch": (args.pipeline_drafter_min_batch or _default_pipeline_min_batch())
              if args.pipeline_drafter else None,
              "allreduce_strategy": args.allreduce_strategy if replica else None,
              "replica": "ray" if replica else "single-process", "speculation_guard": args.speculation_guard,
              "copy_bandwidth_gbs": bandwidth / 1e9 if bandwidth else None,
              "step_outputs": "delta",  # the sweep's requests' output_kind (as the server streams; since 2026-12-01)
              "runs": []}
    sweep_prompts = dataset_prompts(args.prompts, AutoTokenizer.from_pretrained(str(target))) if args.prompts \
        else None  # the sweep's too: a trained pair's acceptance on its own kind of text
    e2e_prompts = end_to_end_prompts(args, sweep_prompts, vocab) if args.e2e_prompts else None
    e2e = {}
    engines = [("ar", None, {}), ("dspark", spec, {})]
    if replica and args.drafter == "separate":  # the same replica with its drafter colocated: what a GPU more buys
        engines.append(("colocated", spec, {"drafter": "colocated"}))
        if args.pipeline_drafter:  # and the separate drafter without the pipeline: what the overlap buys
            engines.append(("serial", spec, {"pipeline": False}))
    # with --tune-schedule the scheduler runs within the tuned schedule (its draft length cap), after it, beside a
    # sweep of that schedule alone: both measured in this run; without, within the fixed max_draft_len
    confidence_after_tuning = args.confidence_scheduling and bool(args.tune_schedule or args.schedule)
    if args.confidence_scheduling and not confidence_after_tuning:
        engines.append(("confidence", {**spec, "enable_confidence_scheduling": True}, {}))
    # single-process engines are measured side by side in alternating rounds (a host's speed drifts: on the H200
    # hosts measured by up to 1.6x over tens of seconds, benchmarks/draft_len_steps.py);
    # a replica's engines one after another (two replicas would need twice the GPUs), as with --sequential
    alternate = not replica and not args.sequential
    record["measurement"] = "alternating rounds" if alternate else "sequential"
    if args.beside_single_process:
        record["measurement"] = ("sequential; the AR and DSpark replicas each beside the same engine in one process "
                                 "(single_*), in alternating rounds")
    record["rounds"] = args.rounds  # also the paired tuned / confidence engines' under --sequential
    mixed_rounds = args.mixed_rounds or args.rounds  # the mixed workload's, in alternating rounds
    if args.mixed_rate and alternate:
        record["mixed_rounds"] = mixed_rounds
    record["schedules"] = {"dspark": "fixed" if spec.get("draft_len_schedule") is None else "tuned",
                           **({"confidence": "confidence"} if args.confidence_scheduling else {})}

    def build(kind: str, speculative: dict | None, layout: dict):
        """One engine of the run, its startup time and rank info recorded, first-call costs paid."""
        start = time.perf_counter()
        llm = engine_class(str(target), speculative_config=speculative, **common, **layout)
        record[f"{kind}_startup_s"] = time.perf_counter() - start
        record[f"{kind}_rank_info"] = llm.rank_info()
        if kind == "confidence":  # the step-time table it profiled at startup
            record["confidence_cost_table"] = llm.engine.confidence.costs.to_json()
            if args.profile_steps:
                llm.engine.confidence.costs.save(args.profile_steps)
        if kind == "ar":
            if local_worker(llm) is not None:  # a replica's weights are on its actors
                record["weight_bytes"] = weight_bytes(llm)
                record["expert_bytes"] = expert_bytes(llm)
            record["moe_backend"] = next(info.get("moe_backend") for info in llm.rank_info()
                                         if info.get("role") == "target")  # rank 0's (every target rank's alike)
        # untimed: first-call costs stay out of TTFT. On the sweep's prompts where it has them: a confidence-scheduled
        # engine learns from these steps (its survival fit, its drafting holds), and random tokens, which no drafter
        # predicts, teach a fit where nothing survives, which can start a hold (16 plain steps) that outlasts the
        # warm-up: the likely cause of one run's one-request sweep running a third of its steps plain while it
        # accepted every draft it verified (its step trace was not recorded yet)
        time_steps(llm, 1, args.prompt_len, 2, 1, vocab, seed=0, prompts=sweep_prompts)
        freeze_long_lived(f"bench engine {kind}")  # as a server does once started (runtime.engine.heap)
        return llm

    def reset_stats(kind: str, llm) -> None:
        if kind in ("confidence", CONFIDENCE_MAX):  # its figures per concurrency
            from runtime.spec.stats import ConfidenceStats

            llm.engine.confidence_stats = ConfidenceStats()
            llm.engine.confidence.correction.reset_skill()

    def measure(llm, c: int) -> dict:
        return time_steps(llm, c, args.prompt_len, args.steps, args.warmup, vocab, seed=c, prompts=sweep_prompts)

    def record_row(kind: str, llm, c: int, timing: dict) -> None:
        rows[c].update({f"{kind}_{name}": timing[name]
                        for name in ("step_ms", "tokens_per_s", "ttft_ms", "tpot_ms")})
        rows[c].update({f"{kind}_{name}": value for name, value in timing.items() if name.startswith("host_")})
        rows[c].update({f"{kind}_{name}": value for name, value in timing.items() if name.startswith("moe_")})
        if "pipelined_step_fraction" in timing:
            rows[c][f"{kind}_pipelined_step_fraction"] = timing["pipelined_step_fraction"]
        if kind == "ar" and bandwidth and "weight_bytes" in record:
            woken = timing.get("moe_experts_woken", 0.0) * record["expert_bytes"]  # MoE: the experts read
            floor = (record["weight_bytes"] + woken + kv_bytes(llm, c, timing["context"])) / bandwidth
            rows[c].update(roofline_ms=1e3 * floor, roofline_fraction=1e3 * floor / timing["step_ms"])
            if "forward_ms" in timing:  # the device time of the graphed forward; the rest is outside it
                rows[c].update(ar_forward_ms=timing["forward_ms"],
                               ar_outside_forward_ms=timing["step_ms"] - timing["forward_ms"])
        elif kind == "confidence":
            stats = llm.get_metrics()["confidence_scheduling"]
            rows[c].update(confidence_mean_acceptance_length=timing["mean_acceptance_length"],
                           confidence_acceptance_per_position=timing["acceptance_per_position"],
                           confidence_verify_budget_per_request=stats["mean_verify_budget_per_request"],
                           # the drafts each deciding request proposed: the block it drafted (padded and packed
                           # steps draft what the step verifying them can use, Engine.drafts_follow_cap / _columns)
                           confidence_offered_per_request=stats["mean_offered_per_request"],
                           confidence_predicted_step_ms=stats["mean_predicted_step_ms"],
                           confidence_measured_step_ms=stats["mean_measured_step_ms"],
                           # the decided steps alone: what confidence_predicted_step_ms predicted
                           confidence_measured_decided_step_ms=stats["mean_measured_decided_step_ms"],
                           confidence_expected_tokens_per_request=stats["mean_expected_tokens_per_request"],
                           confidence_committed_tokens_per_request=stats["mean_committed_tokens_per_request"],
                           confidence_cost_ms_per_context_token=stats["cost_table_ms_per_context_token"],
                           # what whole blocks were predicted at the same steps (the tuned engine measures them)
                           confidence_whole_block_expected_tokens_per_request=stats[
                               "mean_whole_block_expected_tokens_per_request"],
                           confidence_whole_block_predicted_step_ms=stats["mean_whole_block_predicted_step_ms"],
                           confidence_survival_correction=stats["survival_correction"],
                           # the online fit the survivals were ranked by (slope per position, bias per history class)
                           confidence_survival_fit=stats["survival_fit"],
                           # how much its survivals told this concurrency's drafts apart (Brier skill, per position)
                           confidence_survival_skill_per_position=stats["survival_skill_per_position"],
                           # against the tuned engine's acceptance per position (whole blocks: the true survival)
                           confidence_predicted_survival_per_position=stats["mean_predicted_survival_per_position"],
                           confidence_explored_decisions=stats["explored_decisions"],
                           confidence_unpacked_steps=stats["unpacked_steps"], confidence_layout=stats["layout"],
                           # steps that drafted nothing since drafting did not pay (point 6), holds since startup
                           confidence_drafting_off_steps=stats["drafting_off_steps"],
                           confidence_drafting_holds=stats["drafting_holds"],
                           # of the judgements that began them, those the refit after their step reversed
                           confidence_drafting_judgements_reversed=stats["drafting_judgements_reversed"],
                           # and the holds a mixed step began that the first decode step after them ended
                           confidence_drafting_mixed_holds_ended=stats["drafting_mixed_holds_ended"],
                           # timed steps not launched ahead (priced and learned with the serial excess)
                           confidence_serial_steps=stats["serial_steps"],
                           # the timed steps one by one (what each chose, predicted and measured), and by kind
                           confidence_trace=timing["confidence_trace"],
                           # the untimed steps before them (prefill, warm-up): where a hold the window shows began
                           confidence_trace_untimed=timing["confidence_trace_untimed"])
        elif kind == CONFIDENCE_MAX:  # (--confidence-draft-len both) what it chose, beside the engine above
            stats = llm.get_metrics()["confidence_scheduling"]
            rows[c].update({f"{kind}_{name}": value for name, value in (
                ("mean_acceptance_length", timing["mean_acceptance_length"]),
                ("verify_budget_per_request", stats["mean_verify_budget_per_request"]),
                ("offered_per_request", stats["mean_offered_per_request"]),
                ("expected_tokens_per_request", stats["mean_expected_tokens_per_request"]),
                ("committed_tokens_per_request", stats["mean_committed_tokens_per_request"]),
                ("predicted_step_ms", stats["mean_predicted_step_ms"]),
                ("measured_decided_step_ms", stats["mean_measured_decided_step_ms"]),
                ("drafting_off_steps", stats["drafting_off_steps"]))})
        elif kind == "tuned":
            rows[c].update(tuned_mean_acceptance_length=timing["mean_acceptance_length"])
        elif kind == "dspark":
            rows[c].update(mean_acceptance_length=timing["mean_acceptance_length"],
                           acceptance_per_position=timing["acceptance_per_position"])
            if "forward_ms" in timing:
                rows[c].update(verify_step_ms=timing["forward_ms"], draft_ms=timing.get("draft_ms"),
                               context_ms=timing.get("context_ms"))
        print(f"dspark bench: {kind} concurrency {c}: {timing}", file=sys.stderr, flush=True)

    def mixed(llm, mixed_prefill: bool = True, piecewise: bool = True, requests: int | None = None,
              profile: tuple[int, int] | None = None) -> dict:
        requests = requests or args.mixed_requests
        mixed_prompts = sweep_prompts or end_to_end_prompts(args, None, vocab, requests)
        return mixed_workload(llm, [mixed_prompts[i % len(mixed_prompts)][:args.prompt_len]
                                    for i in range(requests)], args.mixed_rate, args.e2e_tokens,
                              mixed_prefill=mixed_prefill, piecewise=piecewise, profile=profile)

    def profile_mixed(variants: dict) -> None:
        """--profile-mixed N: each variant's mixed workload once more, untimed, with a torch profile of N steps from
        the middle of its timed run's steps on (where the batch has ramped up) -> ``mixed_workload[NAME]["profile"]``
        (the kernels, the device's busy and idle time, the host's regions per step)."""
        if not args.profile_mixed:
            return
        for name, variant in variants.items():
            middle = record["mixed_workload"][name]["steps"] // 2
            profiled = mixed(*variant, profile=(middle, args.profile_mixed))
            record["mixed_workload"][name]["profile"] = profiled.get("profile")

    def warm_mixed(variants: dict) -> None:
        """``--mixed-warmup`` requests through each variant's mixed workload, untimed: the first run of an engine's
        eager mixed steps meets shapes the sweep never fed (kernel variants compiled or chosen for them, memory the
        allocator has not cached), first-use costs the first timed round would otherwise pay alone."""
        requests = min(args.mixed_warmup, args.mixed_requests)
        if requests:
            record["mixed_warmup_requests"] = requests
            for variant in variants.values():
                mixed(*variant, requests=requests)

    def mixed_variants(llms: dict) -> dict:
        """name -> (engine, mixed_prefill, piecewise): each engine as built, with --mixed-prefill-apart each one again
        with prefill apart (``KIND-apart``), with --mixed-eager each one again with the steps no whole-step graph
        serves eager (``KIND-eager``)."""
        variants = {kind: (llm, True, True) for kind, llm in llms.items()}
        if args.mixed_prefill_apart:
            variants.update({f"{kind}{APART}": (llm, False, True) for kind, llm in llms.items()})
        if args.mixed_eager:
            variants.update({f"{kind}{EAGER}": (llm, True, False) for kind, llm in llms.items()})
        return variants

    def report_e2e(results: dict) -> None:
        for kind, result in results.items():
            e2e[kind] = result
            print(f"dspark bench: {kind} end to end: {result['tokens']} tokens in {result['seconds']:.2f} s",
                  file=sys.stderr, flush=True)

    def finish(kind: str, llm, with_mixed: bool = True, with_e2e: bool = True) -> None:
        """The mixed workload and end to end where asked for, then the engine's memory freed (a confidence-
        scheduled engine's step-time table, as serving left it, recorded first)."""
        if kind == "confidence":  # the startup profile is confidence_cost_table; this one learned from the sweep
            record["confidence_cost_table_served"] = llm.engine.confidence.costs.to_json()
            # the mixed steps' excess over that table (prefill chunks beside the verifies), learned from them
            record["confidence_mixed_step_costs_served"] = llm.engine.confidence.mixed_costs.to_json()
        if args.mixed_rate and with_mixed:
            variants = mixed_variants({kind: llm})
            warm_mixed(variants)
            for name, variant in variants.items():
                record.setdefault("mixed_workload", {})[name] = mixed(*variant)
                confidence = getattr(getattr(variant[0], "engine", None), "confidence", None)
                if confidence is not None:  # what its mixed steps and their plain alternative cost, as learned
                    record["mixed_workload"][name]["mixed_step_costs"] = confidence.mixed_costs.to_json()
                    if confidence.plain_mixed is not None:
                        record["mixed_workload"][name]["plain_mixed_step_costs"] = confidence.plain_mixed.to_json()
                print(f"dspark bench: {name} mixed workload: {record['mixed_workload'][name]}", file=sys.stderr,
                      flush=True)
            profile_mixed(variants)
        if e2e_prompts is not None and with_e2e:
            report_e2e(end_to_end({kind: llm}, e2e_prompts, args.e2e_tokens))
        release(llm)

    def release(llm) -> None:
        """Shut an engine down and free its memory before the next one is built."""
        llm.engine.executor.shutdown()
        del llm
        unfreeze_long_lived()
        gc.collect()  # engines hold reference cycles (graphs, caches): free their memory before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save_partial(args, record, rows)

    # --profile: each engine's batch-1 steps, profiled once every figure of the run is taken, on the engine rebuilt.
    # torch.profiler leaves CUPTI attached to the process (and to a replica's actors) once it has run, and from
    # then on every CUDA graph launch costs the host several times more (Qwen3-8B shape on an H200, AR batch 1:
    # 0.13 ms of replay() a step in the run profiled first, 0.02 ms without), so a profile taken before a sweep
    # slows every figure after it.
    profiled: dict[str, tuple[dict | None, dict]] = {}  # kind -> how to build it again (each kind once)

    def profile_later(kind: str, speculative: dict | None, layout: dict) -> None:
        if args.profile and kind in ("ar", "dspark", "tuned", "confidence", CONFIDENCE_MAX):
            profiled[kind] = (speculative, layout)

    def profile_all() -> None:
        for kind, (speculative, layout) in profiled.items():
            llm = engine_class(str(target), speculative_config=speculative, **common, **layout)
            # first-call costs stay out of the profile (on the sweep's prompts, as the engines' builds warm up)
            time_steps(llm, 1, args.prompt_len, 2, 1, vocab, seed=0, prompts=sweep_prompts)
            for batch in args.profile_batches:
                record[f"{kind}_profile_batch{batch}"] = summary_ = profile_step(
                    llm, batch, args.prompt_len, vocab, trace_path(args, kind, batch))
                print(f"dspark bench: {kind} batch-{batch} profile: {json.dumps(summary_)}", file=sys.stderr,
                      flush=True)
            release(llm)

    def sweep(kind: str, speculative: dict | None, layout: dict) -> None:
        """Build one engine, run the concurrency sweep (and the mixed workload, end to end) on it."""
        llm = build(kind, speculative, layout)
        for c in tqdm(args.concurrency, desc=f"{kind} sweep", disable=None):
            reset_stats(kind, llm)
            record_row(kind, llm, c, measure(llm, c))
        finish(kind, llm)
        profile_later(kind, speculative, layout)

    def build_together(kind: str, speculative: dict | None, layout: dict):
        try:
            return build(kind, speculative, layout)
        except torch.cuda.OutOfMemoryError as exc:
            raise SystemExit(f"dspark bench: the {kind} engine does not fit beside the engines it is measured "
                             f"against ({exc}); pass --sequential to measure each engine alone, one after "
                             "another, or lower --kv-cache-memory") from None

    def paired(engines_: list[tuple[str, dict | None, dict]], with_e2e: bool = False,
               keep: frozenset = frozenset(), alive: dict | None = None, with_mixed: bool = True) -> dict:
        """Engines alive together, measured in alternating rounds (``--rounds`` per concurrency, the order
        flipped each round; the mixed workload too, and with ``with_e2e`` the end-to-end prompts, alternating per
        prompt): each figure is the round with the median tokens/s, so host drift and jitter fall on all alike.
        The record keeps every round's tokens/s. ``alive``: engines of ``engines_`` already built (kind -> engine;
        measured again, their rows replaced). ``with_mixed`` False: no mixed workload in this phase (a later one
        measures every engine's again). -> the engines named in ``keep``, still alive (the rest freed)."""
        alive = alive or {}
        llms = {kind: alive[kind] if kind in alive else build_together(kind, speculative, layout)
                for kind, speculative, layout in engines_}
        for c in tqdm(args.concurrency, desc="paired sweep", disable=None):
            timings = {kind: [] for kind in llms}
            for kind, llm in llms.items():
                reset_stats(kind, llm)
            for kind, result in alternating_rounds(llms, lambda llm: measure(llm, c), args.rounds):
                timings[kind].append(result)
            for kind, llm in llms.items():
                record_row(kind, llm, c, median_round(timings[kind]))
                rows[c][f"{kind}_tokens_per_s_rounds"] = [t["tokens_per_s"] for t in timings[kind]]
            save_partial(args, record, rows)  # the sweep's rows so far, and before the mixed workload (a run cut
            # there keeps them)
        if args.mixed_rate and with_mixed:
            variants = mixed_variants(llms)
            warm_mixed(variants)
            runs = {name: [] for name in variants}
            for name, result in alternating_rounds(variants, lambda variant: mixed(*variant), mixed_rounds):
                runs[name].append(result)
            for kind, results in runs.items():
                record.setdefault("mixed_workload", {})[kind] = {
                    **median_round(results), "tokens_per_s_rounds": [m["tokens_per_s"] for m in results],
                    "rounds_spread": [round_spread(m) for m in results]}
                print(f"dspark bench: {kind} mixed workload: {record['mixed_workload'][kind]}", file=sys.stderr,
                      flush=True)
            profile_mixed(variants)
        if with_e2e and e2e_prompts is not None:
            report_e2e(end_to_end(llms, e2e_prompts, args.e2e_tokens))
        kept = {}
        for kind, speculative, layout in engines_:
            profile_later(kind, speculative, layout)
            if kind in keep:
                kept[kind] = llms.pop(kind)
            else:
                finish(kind, llms.pop(kind), with_mixed=False, with_e2e=False)
        save_partial(args, record, rows)  # engines kept alive write nothing yet: a later phase may not fit beside them
        return kept

    kept = {}  # with --tune-schedule in alternating rounds: the sweep's engines, alive for the tuned ones' rounds
    if not alternate:
        for kind, speculative, layout in engines:
            if args.beside_single_process and kind in BESIDE_SINGLE_PROCESS:  # paired with its one-process twin
                paired([(kind, speculative, layout), (SINGLE + kind, speculative, {"single_process": True})],
                       with_e2e=True)
            else:
                sweep(kind, speculative, layout)
    elif not args.schedule:  # every engine of the sweep alive at once, in alternating rounds (with --schedule, a
        # schedule tuned before: no first phase, the sweep's engines measured beside the schedule's below)
        # (with --tune-schedule the second phase measures every engine's mixed workload again, beside the tuned
        # ones: this phase's would be replaced unread, ~1.5 minutes of one run's ten)
        kept = paired(engines, with_e2e=True, keep=frozenset(kind for kind, _, _ in engines)
                      if args.tune_schedule else frozenset(), with_mixed=not args.tune_schedule)
    if args.tune_schedule or args.schedule:
        if args.schedule:
            tuned = {"schedule": read_schedule(args.schedule, args.max_draft_len), "from": args.schedule}
        else:
            tuned = tune(args, engine_class, target, spec, common, rows, vocab, shape, sweep_prompts,
                         kept.get("dspark"))
        record["tuned_schedule"] = tuned
        capped = {"draft_len_schedule": tuned["schedule"]}
        after = [("tuned", {**spec, **capped}, {})]  # the tuned schedule as an engine
        record["schedules"]["tuned"] = "tuned"
        if confidence_after_tuning:  # beside the scheduler within it (or, asked, drafting max_draft_len; or both)
            within = {} if args.confidence_draft_len == "max" else capped
            record["confidence_draft_len"] = args.confidence_draft_len
            after.append(("confidence", {**spec, **within, "enable_confidence_scheduling": True}, {}))
            record["schedules"]["confidence"] = ("confidence within the tuned schedule" if within else
                                                 "confidence within max_draft_len, beside the tuned schedule")
            if args.confidence_draft_len == "both":  # the scheduler alone choosing how much to draft, beside
                after.append((CONFIDENCE_MAX, {**spec, "enable_confidence_scheduling": True}, {}))
                record["schedules"][CONFIDENCE_MAX] = "confidence within max_draft_len, beside the tuned schedule"
        if alternate and args.schedule:  # one phase: every engine of the sweep beside the schedule's
            paired(engines + after, with_e2e=True)
            record["measurement"] = "alternating rounds; the sweep beside a schedule tuned before (--schedule)"
            record["measured_together"] = [kind for kind, _, _ in engines + after]
        elif alternate:  # in alternating rounds with the sweep's engines again: every schedule and the AR baseline
            # measured together (the sweep's figures, minutes earlier, are replaced; the host's speed drifts)
            paired([(kind, speculative, layout) for kind, speculative, layout in engines if kind in kept] + after,
                   alive=kept)
            record["measurement"] = "alternating rounds; the sweep measured again beside the tuned engines"
            record["measured_together"] = [kind for kind, _, _ in engines if kind in kept] + [k for k, _, _ in after]
        else:  # one at a time: two replicas would need twice the GPUs, and --sequential said two do not fit
            for kind, speculative, layout in after:
                sweep(kind, speculative, layout)
    profile_all()
    mixed_runs = record.get("mixed_workload", {})
    if "confidence" in mixed_runs and "tuned" in mixed_runs:  # measured in alternating rounds, median each
        record.update(mixed_against_tuned(mixed_runs, "confidence", alternate))
        # below saturation both keep up with the arrivals (tokens/s near equal): then the time per token differs
        record["mixed_confidence_vs_tuned_tpot"] = mixed_runs["confidence"]["mean_tpot_ms"] / mixed_runs["tuned"][
            "mean_tpot_ms"]
        record.update(mixed_noise_floor(record, list(rows.values()), max(args.concurrency)))
    if CONFIDENCE_MAX in mixed_runs and "tuned" in mixed_runs:
        record.update(mixed_against_tuned(mixed_runs, CONFIDENCE_MAX, alternate))
    record.update(prefill_apart_ratios(record.get("mixed_workload", {})))
    record.update(piecewise_ratios(record.get("mixed_workload", {})))
    for row in rows.values():
        row["dspark_step_vs_ar"] = row["dspark_step_ms"] / row["ar_step_ms"]
        if "tuned_tokens_per_s" in row:
            row["tuned_speedup"] = row["tuned_tokens_per_s"] / row["ar_tokens_per_s"]
        if "confidence_tokens_per_s" in row:
            row["confidence_speedup"] = row["confidence_tokens_per_s"] / row["ar_tokens_per_s"]
            row["confidence_vs_dspark"] = row["confidence_tokens_per_s"] / row["dspark_tokens_per_s"]
            if "tuned_tokens_per_s" in row:  # both measured in this run, the scheduler inside the tuned schedule
                row.update(row_against_tuned(row, "confidence", alternate))
            row.update(confidence_bounds(row, record))
            row.update(confidence_predicted_gain(row))
        if f"{CONFIDENCE_MAX}_tokens_per_s" in row and "tuned_tokens_per_s" in row:
            row.update(row_against_tuned(row, CONFIDENCE_MAX, alternate))
        if "tuned_tokens_per_s" in row:
            row.update(fixed_schedules_spread(row, record, alternate))
        row["speedup"] = row["dspark_tokens_per_s"] / row["ar_tokens_per_s"]
        if "colocated_tokens_per_s" in row:  # a separate drafter against the same replica with it colocated
            row["throughput_vs_colocated"] = row["dspark_tokens_per_s"] / row["colocated_tokens_per_s"]
            row["step_vs_colocated"] = row["dspark_step_ms"] / row["colocated_step_ms"]
        for kind in BESIDE_SINGLE_PROCESS:  # a replica engine against its one-process twin, measured in the same run
            if f"{SINGLE}{kind}_step_ms" in row:
                row.update(against_single_process(row, kind))
        if "serial_tokens_per_s" in row:  # pipelined against the same separate drafter without the pipeline
            row["throughput_vs_serial"] = row["dspark_tokens_per_s"] / row["serial_tokens_per_s"]
        if "verify_step_ms" in row and "ar_forward_ms" in row:  # device time against device time
            row["verify_vs_ar_forward"] = row["verify_step_ms"] / row["ar_forward_ms"]
        if row.get("ar_moe_experts_woken"):  # what a K+1-token verify wakes against one token per request
            row["verify_experts_vs_decode"] = row["dspark_moe_experts_woken"] / row["ar_moe_experts_woken"]
    first = rows[min(rows)]
    if e2e:
        ar, ds = e2e["ar"], e2e["dspark"]
        speedup = ar["seconds"] / ds["seconds"]
        tau = ds["mean_acceptance_length"]
        expected = tau / first["dspark_step_vs_ar"] if tau else None  # what the step times allow at this tau
        record["end_to_end"] = {
            "prompts": len(e2e_prompts), "max_tokens": args.e2e_tokens, "concurrency": 1, "temperature": 0.0,
            "prompt_source": args.prompts or f"random token ids ({args.prompt_len} per prompt)",
            "ar_tokens_per_s": ar["tokens"] / ar["seconds"], "dspark_tokens_per_s": ds["tokens"] / ds["seconds"],
            "speedup": speedup, "mean_acceptance_length": tau, "speedup_allowed_by_steps": expected,
            "efficiency": speedup / expected if expected else None, **agreement(ar["outputs"], ds["outputs"])}
        if all(SINGLE + kind in e2e for kind in BESIDE_SINGLE_PROCESS):  # --beside-single-process: the same prompts
            # through the replica and through one process, greedy: in bf16 a layout's sums (TP's all-reduces) may
            # part a near-tie, so the share identical and where each first differs (fp32 equality: tests/gpu)
            record["end_to_end"]["replica_vs_single_process"] = {
                kind: agreement(e2e[kind]["outputs"], e2e[SINGLE + kind]["outputs"]) for kind in BESIDE_SINGLE_PROCESS}
    if args.projected_tau is not None:
        for row in rows.values():
            row["projected_speedup"] = args.projected_tau * row["ar_step_ms"] / row["dspark_step_ms"]
        record["projected_tau"] = {"tau": args.projected_tau, "source": args.projected_tau_source}
    if args.hf_tokens:
        for peer, compiled in (("hf_generate", False), ("hf_compiled", True)):
            result = hf_generate_tokens_per_s(target, shape, args.hf_tokens, device, compiled)
            first[f"{peer}_tokens_per_s"] = result["tokens_per_s"]
            first[f"ar_vs_{peer}"] = first["ar_tokens_per_s"] / result["tokens_per_s"]
            record[f"{peer}_warmup_s"] = result["warmup_s"]
            print(f"dspark bench: {peer}: {result}", file=sys.stderr, flush=True)
    record["runs"] = list(rows.values())
    return record


def _default_pipeline_min_batch() -> int:
    from configs.cluster import ParallelConfig

    return ParallelConfig.model_fields["pipeline_drafter_min_batch"].default


def save_partial(args, record: dict, rows: dict) -> None:
    """Write what is measured so far to ``--out`` (marked ``partial``), so a run cut short keeps its figures; the
    finished record replaces it."""
    if args.out:
        Path(args.out).write_text(json.dumps({**record, "runs": list(rows.values()), "partial": True}, indent=1) + "\n")


def tune(args, engine_class, target: Path, spec: dict, common: dict, rows: dict, vocab: int, shape: bool,
         prompts: list[list[int]] | None = None, reference=None) -> dict:
    """``--tune-schedule``: DSpark step times at every shorter draft length k (an engine whose schedule drafts k above
    one request), the fastest length per concurrency (``cluster.schedule_tuning``), the schedule written to
    ``args.tune_schedule`` as a config fragment ``dspark serve --config`` reads. -> the record's ``tuned_schedule``.

    With ``reference`` (the sweep's DSpark engine, still alive) each candidate is timed against it in alternating
    rounds and its step read in the sweep's terms: the median over rounds of candidate / reference step time, times
    the sweep's ``dspark_step_ms``, so the candidates of different lengths, timed minutes apart, compare as if timed
    together (the host's speed drifts). Without it, each candidate's own step time."""
    import torch

    from cluster.schedule_tuning import Candidate, accepted_schedule, best_draft_lengths, projected_tau
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
        llm.engine.executor.shutdown()
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


def mean_skill(per_position: list[float | None] | None) -> float | None:
    """The mean of a row's Brier skill per position over the positions that have one (None: none has)."""
    values = [v for v in per_position or [] if v is not None]
    return sum(values) / len(values) if values else None


def batch_list(flag: str):
    """An argparse type: ``flag``'s comma-separated integers >= 1 -> sorted, distinct."""
    def parse(text: str) -> list[int]:
        import argparse

        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} wants integers >= 1 separated by commas, got {text!r}")
        return sorted(set(values))
    return parse


concurrency_list = batch_list("--concurrency")


def acceptance_list(text: str) -> list[float]:
    import argparse

    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 0.0 <= v <= 1.0 for v in values) or any(b > a for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"--acceptance-per-position wants non-increasing rates in [0, 1] separated by "
                                         f"commas, got {text!r}")
    return values


def add_parser(commands) -> None:
    import argparse

    bench = commands.add_parser("bench", help="our AR baseline and DSpark side by side (JSON record)",
                                description=__doc__)
    which = bench.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), help="random weights of this shape")
    which.add_argument("--model", help="a trained target (needs --speculative-model)")
    bench.add_argument("--speculative-model", help="the trained drafter of --model")
    bench.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16, 64, 256],
                       help="comma-separated request counts, each >= 1 (default 1,4,16,64,256)")
    bench.add_argument("--max-draft-len", type=integer(1), default=7, help="K (default 7)")
    bench.add_argument("--draft-layers", type=integer(1), default=1, help="draft layers of a --model-shape drafter")
    bench.add_argument("--prompt-len", type=integer(1), default=512, help="prompt tokens per request (default 512)")
    bench.add_argument("--steps", type=integer(1), default=30, help="timed steps per point (default 30)")
    bench.add_argument("--warmup", type=integer(0), default=5, help="untimed steps first (default 5)")
    bench.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "flashinfer"],
                       help="kernels of both engines (default auto: flashinfer on a GPU where it imports)")
    bench.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    bench.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                       help="the engines' piecewise graphs of the steps no whole-step graph serves (default on; "
                       "LLMConfig.piecewise_cuda_graphs)")
    bench.add_argument("--speculation-guard", action=argparse.BooleanOptionalAction, default=True,
                       help="the DSpark engines' speculation guard (default on, the engine's default: drafting only "
                       "where it pays, learned online); --no-speculation-guard measures the schedules as set")
    bench.add_argument("--confidence-scheduling", action="store_true", help="also sweep DSpark with "
                       "enable_confidence_scheduling (its step-time table profiled at startup, in the record): "
                       "confidence_tokens_per_s beside the fixed schedule's dspark_tokens_per_s; with "
                       "--tune-schedule it runs within the tuned schedule, beside a sweep of that schedule alone "
                       "(confidence_vs_tuned)")
    bench.add_argument("--confidence-draft-len", choices=("tuned", "max", "both"), default="tuned",
                       help="with --confidence-scheduling and --tune-schedule: the block the confidence-scheduled "
                       "engine drafts: the tuned schedule's length at each concurrency (tuned, the default), or "
                       "up to max_draft_len everywhere (max: the scheduler alone chooses how much to draft and "
                       "verify: a graphed step drafts one past the cap or the packed columns it chose, and where "
                       "the tuned schedule drafts fewer it may still verify a whole block for a request whose "
                       "drafts it trusts); either way it is compared with the tuned schedule; both: the two "
                       "engines in the same rounds, the second's figures as confidence-max_* (one engine more alive "
                       "at once: a smaller --kv-cache-memory may be needed)")
    bench.add_argument("--profile-steps", metavar="FILE", help="with --confidence-scheduling: also write the "
                       "profiled step-time table to FILE (a confidence_cost_table_path)")
    bench.add_argument("--moe-backend", default="AUTO", type=moe_backend, metavar="{AUTO,VANILLA,DENSEGEMM,TRITON}",
                       help="expert kernels of an MoE target (default AUTO; recorded as moe_backend)")
    budget = bench.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", type=memory_size, metavar="SIZE", default=40 << 30,
                        help=f"KV cache per engine: {SIZE_FORMS} (default 40GiB)")
    budget.add_argument("--kv-cache-gib", type=gib, dest="kv_cache_memory", help=argparse.SUPPRESS)  # older spelling
    bench.add_argument("--device", default="cuda", type=device_name, help="cuda (default; the figures), cuda:N, "
                       "auto, or cpu: float32 torch kernels, a run of the plumbing whose times mean nothing (no "
                       "roofline, peers or profiles)")
    bench.add_argument("--tensor-parallel-size", type=integer(1), help="run every engine as a Ray replica "
                       "(cluster.LLM) of this many target shards, one GPU each; the record says tensor_parallel_size "
                       "and drafter (default: one process, runtime.LLM, with its CUDA graphs and host breakdowns)")
    bench.add_argument("--allreduce-strategy", choices=["NCCL", "ONESHOT", "AUTO"], default="NCCL", help="with "
                       "--tensor-parallel-size: how the target ranks sum (parallel.allreduce_strategy; default NCCL); "
                       "each rank's choice is in *_rank_info")
    bench.add_argument("--beside-single-process", action="store_true", help="with --tensor-parallel-size: measure "
                       "the AR and DSpark replicas each beside the same engine in this process on the same GPU, in "
                       "alternating rounds (single_ar_*, single_dspark_*; ray_vs_single_process_{ar,dspark}_step and "
                       "its _paired median of per-round ratios: what the process boundary and the dispatch cost)")
    bench.add_argument("--ray-address", help="with --tensor-parallel-size: the Ray cluster the replicas join "
                       "(default: a running one, else a new local one; 'local' always starts a new one)")
    bench.add_argument("--drafter", default="colocated", choices=["colocated", "separate"], help="where a "
                       "replica's drafter runs: colocated (TP rank 0's process) or separate (its own actor and GPU, "
                       "implies a replica); separate also measures the colocated replica in the same run "
                       "(throughput_vs_colocated, step_vs_colocated)")
    bench.add_argument("--pipeline-drafter", action="store_true", help="with --drafter separate: the separate "
                       "drafter drafts one request group while the target verifies the other (pipeline_drafter); "
                       "the run also measures the separate drafter without the pipeline (throughput_vs_serial)")
    bench.add_argument("--pipeline-drafter-min-batch", type=integer(1), metavar="N", help="with --pipeline-drafter: "
                       "parallel.pipeline_drafter_min_batch, the requests from which steps are pipelined (default "
                       "64; 1: always)")
    bench.add_argument("--pipeline-min-batch", type=integer(1), dest="pipeline_drafter_min_batch",
                       help=argparse.SUPPRESS)  # (the older spelling)
    bench.add_argument("--hf-tokens", type=integer(0), default=0, help="also time transformers generate for N "
                       "tokens at batch 1, eager and compiled with a static cache (peers)")
    bench.add_argument("--projected-tau", type=float, help="a trained pair's mean acceptance length: adds "
                       "projected_speedup = tau x AR step / DSpark step to every point (for --model-shape)")
    bench.add_argument("--projected-tau-source", default="", help="where --projected-tau was measured (recorded)")
    bench.add_argument("--schedule", metavar="FILE", help="a draft_len_schedule tuned before on this pair (the "
                       "FILE an earlier --tune-schedule wrote): the tuned engine runs it, no tuning, in one phase "
                       "beside the sweep's engines (and with --confidence-scheduling the confidence engine, as after "
                       "--tune-schedule): a second measurement of a pair, e.g. its mixed workload, in less time")
    bench.add_argument("--tune-schedule", metavar="FILE", help="also time every shorter draft length and write the "
                       "draft_len_schedule with the most tokens/s at each concurrency to FILE (a config fragment for "
                       "dspark serve --config; a length other than max_draft_len only where it measured more than "
                       "2%% faster; at the smallest concurrency max_draft_len, as the engine requires, "
                       "the record saying what that costs where a shorter length is faster); the sweep must "
                       "include concurrency 1")
    bench.add_argument("--acceptance-per-position", type=acceptance_list, help="a trained pair's acceptance per "
                       "draft position (comma-separated, max_draft_len values): --tune-schedule on a --model-shape "
                       "projects tau from it")
    bench.add_argument("--e2e-prompts", type=integer(0), default=0, help="also decode N prompts one at a time through "
                       "LLM.generate with each engine: end-to-end speedup and the share of identical greedy outputs")
    bench.add_argument("--e2e-tokens", type=integer(1), default=128, help="tokens per --e2e-prompts (and --mixed-rate) "
                       "request (default 128)")
    bench.add_argument("--mixed-rate", type=number(0), help="also run a mixed workload with every "
                       "engine: requests arriving at this Poisson rate per second while others decode (steps mix "
                       "prefill and decode); each engine's record says where its steps' time went (0: none, as "
                       "without the flag: a later --mixed-rate 0 takes back an earlier one, e.g. a script's default)")
    bench.add_argument("--mixed-requests", type=integer(1), default=256, help="requests of --mixed-rate (default 256)")
    bench.add_argument("--mixed-warmup", type=integer(0), default=64, help="requests of an untimed mixed workload "
                       "each engine runs first (its eager mixed steps' first shapes; default 64, at most "
                       "--mixed-requests; 0: none)")
    bench.add_argument("--mixed-prefill-apart", action="store_true", help="with --mixed-rate: run the mixed workload "
                       "on every engine twice, as built (a step may feed prompt chunks beside decodes) and with "
                       "prefill apart (enable_mixed_prefill=False: prefill steps and decode steps, each graphed), in "
                       "the same alternating rounds; records mixed_workload[KIND-apart] and mixed_apart_vs_mixed")
    bench.add_argument("--mixed-eager", action="store_true", help="with --mixed-rate: run the mixed workload on every "
                       "engine twice, through its piecewise CUDA graphs (as built) and with the steps no whole-step "
                       "graph serves eager, in the same alternating rounds; records mixed_workload[KIND-eager] and "
                       "mixed_piecewise_vs_eager (one process on a GPU)")
    bench.add_argument("--profile-mixed", type=integer(0), default=0, metavar="STEPS", help="with --mixed-rate: "
                       "after the timed rounds, each engine's mixed workload once more, untimed, with a torch profile "
                       "of STEPS steps from the middle of its timed run on -> mixed_workload[KIND].profile (default "
                       "0: none)")
    bench.add_argument("--prompts", help="JSONL prompts (prompt, messages or prompt_ids rows) for the sweep (cut "
                       "to --prompt-len; a trained pair's acceptance needs its kind of text) and --e2e-prompts; "
                       "default: random token ids")
    bench.add_argument("--plot", help="also draw speedup and tokens/s against concurrency into this PNG "
                       "(needs matplotlib: pip install 'dspark[bench]')")
    bench.add_argument("--sequential", action="store_true", help="measure each engine alone, one after another, "
                       "instead of all of them alive together in alternating rounds (the default on one process: "
                       "the host's speed drifts between engines timed apart); for targets too large to hold two "
                       "engines at once. A replica's engines are always measured one after another")
    bench.add_argument("--rounds", type=integer(1), default=PAIRED_ROUNDS, help="alternating rounds per concurrency "
                       f"(and per tuning candidate) when engines are measured side by side; the median round is "
                       f"kept (default {PAIRED_ROUNDS}; odd)")
    bench.add_argument("--mixed-rounds", type=integer(1), help="alternating rounds of the mixed workload (default: "
                       "--rounds; odd): its rounds spread far more than the sweep's (the same engine 7.2K to "
                       "12.3K tokens/s), so it may need more of them than the sweep does")
    bench.add_argument("--profile", action="store_true", help="torch.profiler summary of batch-1 decode steps of "
                       "each engine (AR, DSpark, and the tuned and confidence-scheduled ones where swept): kernels "
                       "per step, GPU busy and idle time per step, the largest GPU gaps, host time per region; a "
                       "replica's on every rank (its record's *_profile_batch1.ranks); taken after every figure of the run, on the "
                       "engines built again (a profiled process launches CUDA graphs slower)")
    bench.add_argument("--profile-batches", type=batch_list("--profile-batches"), default=[1],
                       help="with --profile: the batch sizes profiled (default 1; each at most the largest "
                       "--concurrency), one record field *_profile_batch{N} each")
    bench.add_argument("--profile-trace", help="with --profile: also write each profile's timeline (Chrome trace, "
                       "gzip) into this folder")
    bench.add_argument("--out", help="write the JSON record here (default: print it)")
    bench.set_defaults(handler=main)


def main(args) -> int:
    if args.model is not None and args.speculative_model is None:
        print("dspark bench: --model needs --speculative-model", file=sys.stderr)
        return 2
    if args.profile_steps and not args.confidence_scheduling:
        print("dspark bench: --profile-steps needs --confidence-scheduling (it writes that engine's table)",
              file=sys.stderr)
        return 2
    if args.ray_address is not None and args.tensor_parallel_size is None:
        print("dspark bench: --ray-address needs --tensor-parallel-size (one process joins no Ray cluster)",
              file=sys.stderr)
        return 2
    if args.confidence_draft_len != "tuned" and not (args.confidence_scheduling
                                                     and (args.tune_schedule or args.schedule)):
        print("dspark bench: --confidence-draft-len needs --confidence-scheduling and --tune-schedule or --schedule "
              "(without a tuned schedule the confidence engine drafts max_draft_len already)", file=sys.stderr)
        return 2
    if args.schedule:
        problem = "--schedule and --tune-schedule: give one (a schedule tuned before, or one tuned now)" \
            if args.tune_schedule else None
        try:
            problem = problem or (read_schedule(args.schedule, args.max_draft_len) and None)
        except ValueError as error:
            problem = str(error)
        if problem:
            print(f"dspark bench: {problem}", file=sys.stderr)
            return 2
    if args.projected_tau is not None and not 1.0 <= args.projected_tau <= args.max_draft_len + 1:
        print(f"dspark bench: --projected-tau must be in [1, max_draft_len + 1 = {args.max_draft_len + 1}], got "
              f"{args.projected_tau}", file=sys.stderr)
        return 2
    if args.allreduce_strategy != "NCCL" and (args.tensor_parallel_size or 1) < 2:
        print(f"dspark bench: --allreduce-strategy {args.allreduce_strategy} needs --tensor-parallel-size 2 or more "
              "(one rank sums nothing)", file=sys.stderr)
        return 2
    if args.beside_single_process and args.tensor_parallel_size is None:
        print("dspark bench: --beside-single-process needs --tensor-parallel-size (it pairs a replica with one "
              "process)", file=sys.stderr)
        return 2
    if args.pipeline_drafter_min_batch is not None and not args.pipeline_drafter:
        print("dspark bench: --pipeline-drafter-min-batch needs --pipeline-drafter (it says when the pipeline runs)",
              file=sys.stderr)
        return 2
    if args.pipeline_drafter and args.drafter != "separate":
        print("dspark bench: --pipeline-drafter needs --drafter separate", file=sys.stderr)
        return 2
    replica = args.tensor_parallel_size is not None or args.drafter == "separate"
    if replica and args.hf_tokens:
        print("dspark bench: --hf-tokens times transformers on one GPU; leave it out with --tensor-parallel-size or "
              "--drafter separate", file=sys.stderr)
        return 2
    for flag, rounds in (("--rounds", args.rounds), ("--mixed-rounds", args.mixed_rounds)):
        if rounds is not None and (rounds < 1 or rounds % 2 == 0):
            print(f"dspark bench: {flag} must be an odd number >= 1 (the median round is kept), got {rounds}",
                  file=sys.stderr)
            return 2
    needs_mixed = [flag for flag, given in (("--mixed-prefill-apart", args.mixed_prefill_apart),
                                            ("--mixed-eager", args.mixed_eager), ("--profile-mixed", args.profile_mixed))
                   if given]
    if needs_mixed and not args.mixed_rate:
        print(f"dspark bench: {', '.join(needs_mixed)} needs --mixed-rate (the mixed workload they run)",
              file=sys.stderr)
        return 2
    if args.profile and max(args.profile_batches) > max(args.concurrency):
        print(f"dspark bench: --profile-batches {max(args.profile_batches)} exceeds the largest --concurrency "
              f"{max(args.concurrency)} (the engines hold that many requests)", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.hf_tokens:
        print("dspark bench: --hf-tokens needs --device cuda (the peers' figures are GPU figures)", file=sys.stderr)
        return 2
    if args.plot:
        require_matplotlib("--plot")
    if args.tune_schedule:
        problem = None
        if 1 not in args.concurrency:
            problem = "--tune-schedule needs concurrency 1 in the sweep (the schedule starts at max_draft_len there)"
        elif args.model_shape is not None and (args.acceptance_per_position is None
                                               or len(args.acceptance_per_position) != args.max_draft_len):
            problem = (f"--tune-schedule on a --model-shape needs --acceptance-per-position with max_draft_len = "
                       f"{args.max_draft_len} values (random drafters accept nothing)")
        if problem:
            print(f"dspark bench: {problem}", file=sys.stderr)
            return 2
    record = run(args)
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    print(summary(record), file=sys.stderr)
    if args.plot:
        print(f"dspark bench: plot {plot(record, args.plot)}", file=sys.stderr)
    return 0
