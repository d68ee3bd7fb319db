"""Device time of a piece of GPU work, as the engine runs it: captured in a CUDA graph and replayed.

What the fast path measures to choose among kernels (``runtime.models.small_gemm``'s GEMMs, a graph's attention kernel):
the work is warmed up outside the graph (lazy initialization, Triton compilation), captured, and replayed
``reps`` times, each replay after ``flush`` is rewritten (a buffer larger than L2 evicts whatever the previous
replay left there), and the median replay time is taken.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_device_us(run: Callable[[], object], flush: torch.Tensor, reps: int = 5) -> float:
    """Median device time of ``run`` captured in a CUDA graph, each replay after ``flush`` evicted L2."""
    device = flush.device
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # compile and warm up outside the graph
        run()
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    events[-1][1].synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    del graph
    return 1e3 * times[len(times) // 2]
