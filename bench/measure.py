"""Measuring engines: step times, end-to-end and mixed workloads, weight and KV bytes, MoE routing, the copy bandwidth,
transformers as a peer."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from bench.profiling import AllocatorEvents, GcPauses, StepWindowProfile, device_times, host_times, local_worker, timed
from bench.stats import step_spread

HOST_TIMED_STEPS = 10  # steps after the timed ones whose host work is broken down (host_times)


ROUTING_STEPS = 2  # eager steps after those whose MoE routing is counted (routing_stats; MoE targets only)


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


def sync(llm) -> None:
    """Wait for the in-process engine's GPU work (a replica's step returns only once its actors are done)."""
    import torch

    worker = local_worker(llm)
    if worker is not None and getattr(worker, "device", None) is not None and worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)


def weight_bytes(llm) -> int:
    """Bytes of every weight matrix one decode step reads (the embedding reads only its rows: left out), MoE
    experts excluded: a step reads only the experts its tokens wake (``expert_bytes``)."""
    target = local_worker(llm).target
    return sum(p.numel() * p.element_size() for n, p in target.named_parameters()
               if "embed_tokens" not in n and ".w13" not in n and ".w2" not in n)


def moe_blocks(llm) -> list:
    from runtime.models.moe import SparseMoeBlock

    return [m for m in local_worker(llm).target.modules() if isinstance(m, SparseMoeBlock)]


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
    runner = local_worker(llm).engine_part
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
    target = local_worker(llm).target
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
    (``runtime.kernels.profiling.summarize``, in the record's ``profile``; the run's own figures then include its cost)."""
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


def hf_generate_tokens_per_s(target_dir: Path, shape: bool, tokens: int, device, compiled: bool = False) -> dict:
    """transformers ``generate`` at batch 1, greedy, on the same target: eager with its dynamic cache, or
    (``compiled``) as its documentation recommends: a static cache and ``CompileConfig(fullgraph=True,
    mode="reduce-overhead")`` (transformers' default ``fullgraph=False`` lets graph breaks split the forward into
    several CUDA graphs with Python between them), compiled by untimed generations of the same length first. ->
    tokens_per_s and the untimed warmup's seconds (the compile time, when compiled)."""
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
        options.update(cache_implementation="static",
                       compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
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


def end_to_end_prompts(args, prompts: list[list[int]] | None, vocab: int, count: int | None = None) -> list[list[int]]:
    """``count`` (default ``--e2e-prompts``) prompts: the first rows of ``--prompts`` (``prompts``, already
    tokenized), else random token ids of ``--prompt-len`` (seeded)."""
    import torch

    count = count or args.e2e_prompts
    if prompts:
        return prompts[:count]
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(count)]
