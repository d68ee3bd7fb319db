"""Where a step's time goes: host regions, graph replays alone, the torch profiler over a few steps, allocator events
and GC pauses."""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager


def local_worker(llm):
    """The engine's in-process worker (``runtime.LLM``), or None for a Ray replica (``cluster.LLM``): its models
    live on actors, so the breakdowns that read them (roofline bytes, graph replays, host timers, routing) are
    left out of replica runs."""
    return getattr(llm.engine.executor, "worker", None)


class StepWindowProfile:
    """A torch profile of ``steps`` consecutive steps of a loop, from its ``skip``-th step on: ``before(i)`` ahead of
    step i, ``after(i)`` behind it; ``summary`` the profile's (``runtime.kernels.profiling.summarize``), None until the window
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

            from runtime.kernels.profiling import summarize

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._profile.stop()
            self.summary = summarize(self._profile, self._profiled, None)
            self._profile = None


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


def replay_ms(graph, repeats: int = 20) -> float:
    """Device time of one replay of ``graph`` (a ``torch.cuda.CUDAGraph``), the median of ``repeats``
    (``runtime.worker.graph_buffers.replay_ms``; imported here when called: this module loads without torch)."""
    from runtime.worker.graph_buffers import replay_ms as device_replay_ms

    return device_replay_ms(graph, repeats)


@contextmanager
def timed(owner, name: str, totals: dict, key: str) -> Iterator[None]:
    """Within the block, ``owner.name`` adds the host seconds of each call to ``totals[key]``; a call that returns a
    generator (an executor's step with device waits) counts until the generator is done."""
    original = getattr(owner, name)

    def add(start: float) -> None:
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - start

    def finished(run, start: float):
        try:
            return (yield from run)
        finally:
            add(start)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        except BaseException:
            add(start)
            raise
        if inspect.isgenerator(result):
            return finished(result, start)
        add(start)
        return result

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
    (``runtime.kernels.profiling.summarize``: CUDA kernels launched per step, GPU busy and idle time per step, host time per
    region, the top kernels); ``trace``: also the timeline as a Chrome trace (gzip) there. A Ray replica's engine is
    profiled on every rank (``ranks``, one summary each: the driver only dispatches)."""
    import torch

    from runtime import SamplingParams
    from runtime.kernels.profiling import summarize

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
