"""What a CUDA graph launch costs the host, by the number of kernels in the graph, and when the device starts on
it: does launching a forward as several smaller graphs let the device start sooner (piecewise launch)?

For graphs of N small kernels (N = 50 .. 1000): host microseconds of ``CUDAGraph.replay()`` with the device idle,
and the delay from the call until the graph's first kernel starts (a CUDA event recorded on the host clock
reference before the call, and one captured as the graph's first node).

Then (``--kinds``) the same for graphs of 36 launches of one kind of the engine's kernels (a cuBLAS GEMV, the
Triton skinny GEMM, the Triton RMSNorm, FlashInfer's decode attention): which kind makes a graph expensive to
launch; and (``--model-shape``) the engine's own batch-1 decode graph on that random-weight shape.

``--relaunch``: a graph launched again while it still runs, against another graph behind it.

``--readback``: why the run-ahead of 2026-12-01 (the next step launched before this one is read back) gained
nothing. Steps of a ~5 ms graph, each followed by ``--host-us`` of host work that needs the step's output (the
engine's commit and scheduling), three ways: serial (launch, read back, host work: the engine today); run-ahead
reading back with ``.tolist()`` (a pageable copy queued on the stream behind the step launched ahead, so it waits
for that step too: the hypothesis); run-ahead reading back through a pinned buffer copied right after the step
and an event (the copy is queued before the next step). Reports the step time of each.

usage: python3 benchmarks/graph_launch.py [--kinds] [--relaunch] [--readback] [--model-shape qwen3-8b]
       [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date

import torch


def capture(nodes: int, x: torch.Tensor, first: torch.cuda.Event) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first.record()
        for _ in range(nodes):
            x.mul_(1.0001)
    return graph


def measure(nodes: int, repeats: int = 30) -> dict:
    x = torch.ones(4096, device="cuda")
    first = torch.cuda.Event(enable_timing=True, external=True)  # external: recordable inside a capture
    return {"kernels": nodes, **launch_times(capture(nodes, x, first), first, repeats)}


def launch_times(graph: torch.cuda.CUDAGraph, first: torch.cuda.Event | None, repeats: int = 30) -> dict:
    """Host microseconds of ``graph.replay()`` on an idle device, the delay until ``first`` (captured as the
    graph's first node, if given) and the graph's device time: medians of ``repeats``."""
    graph.replay()
    torch.cuda.synchronize()
    launch, start_delay, device = [], [], []
    for _ in range(repeats):
        before, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        before.record()  # on an idle device: executes at once, marking the moment of the call
        t = time.perf_counter()
        graph.replay()
        launch.append(1e6 * (time.perf_counter() - t))
        end.record()
        end.synchronize()
        if first is not None:
            start_delay.append(1e3 * before.elapsed_time(first))
        device.append(1e3 * (first if first is not None else before).elapsed_time(end))
    med = lambda v: sorted(v)[len(v) // 2] if v else None  # noqa: E731
    return {"host_launch_us": med(launch), "first_kernel_after_call_us": med(start_delay), "device_us": med(device)}


def relaunch(nodes: int = 1000, repeats: int = 20) -> dict:
    """Host microseconds of launching a graph while it still runs (the same executable graph twice in a row),
    against launching another graph of the same kernels behind it: does the driver make the host wait?"""
    x = torch.ones(4096, device="cuda")
    # each graph records its event: the events must outlive the graphs (a destroyed event recorded by a replay is
    # undefined behaviour: a run on 2x H200 (2026-12-01) segfaulted here when they were temporaries)
    events = [torch.cuda.Event(external=True) for _ in range(2)]
    first, other = capture(nodes, x, events[0]), capture(nodes, x, events[1])
    first.replay()
    other.replay()
    torch.cuda.synchronize()
    out = {"kernels": nodes}
    for name, second in (("same_graph", first), ("other_graph", other)):
        launch, again = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            a = time.perf_counter()
            first.replay()
            b = time.perf_counter()
            second.replay()
            launch.append(1e6 * (b - a))
            again.append(1e6 * (time.perf_counter() - b))
        out[name] = {"first_launch_us": sorted(launch)[repeats // 2], "second_launch_us": sorted(again)[repeats // 2]}
    torch.cuda.synchronize()
    start = time.perf_counter()
    first.replay()
    torch.cuda.synchronize()
    out["graph_device_us"] = 1e6 * (time.perf_counter() - start)
    del first, other, events  # the graphs before the events they record
    print("relaunch", json.dumps(out), flush=True)
    return out


def readback(host_us: float = 250.0, steps: int = 40, kernels: int = 500) -> dict:
    """Step time (ms) of serial steps against two run-ahead read-backs (see the module doc)."""
    x = torch.ones(1 << 20, device="cuda")  # 4 MB: each of the graph's kernels streams it
    out = torch.zeros(8, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.mul_(1.0000001)
        out.add_(1)
    pinned = torch.zeros(2, 8, dtype=torch.int64, pin_memory=True)
    done = [torch.cuda.Event(), torch.cuda.Event()]

    def host_work() -> None:  # the engine's commit and next schedule: Python that needs the step's tokens
        end = time.perf_counter() + host_us / 1e6
        while time.perf_counter() < end:
            pass

    def serial() -> None:
        for _ in range(steps):
            graph.replay()
            out.tolist()
            host_work()

    def ahead_tolist() -> None:
        graph.replay()
        for _ in range(steps):
            graph.replay()  # the next step, launched before this one is read back
            out.tolist()  # queued behind it: returns once both ran
            host_work()

    def ahead_pinned() -> None:
        graph.replay()
        pinned[0].copy_(out, non_blocking=True)
        done[0].record()
        for i in range(steps):
            graph.replay()
            pinned[(i + 1) % 2].copy_(out, non_blocking=True)  # queued right behind the step it reads
            done[(i + 1) % 2].record()
            done[i % 2].synchronize()  # the previous step's tokens only
            pinned[i % 2].tolist()
            host_work()

    result = {"host_us": host_us, "kernels": kernels}
    for name, run in (("serial", serial), ("ahead_tolist", ahead_tolist), ("ahead_pinned", ahead_pinned)):
        run()  # warm
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        result[f"{name}_step_ms"] = 1e3 * (time.perf_counter() - start) / steps
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    result["graph_ms"] = 1e3 * (time.perf_counter() - start) / steps
    print("readback", json.dumps(result), flush=True)
    return result


def kind_graphs(layers: int = 36) -> dict:
    """Graphs of ``layers`` launches of one kernel kind each, on the Qwen3-8B o_proj shape (bf16, one row)."""
    from runtime.kernels import AttentionGeometry, HostLayout, PagedAttentionMeta, get_backend, triton_ops
    from runtime.kernels.skinny_gemm import SkinnyConfig, skinny_matmul

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1, 4096, device=dev, dtype=bf16)
    w = torch.randn(4096, 4096, device=dev, dtype=bf16)
    norm_w = torch.ones(4096, device=dev, dtype=bf16)
    fi = get_backend("flashinfer")
    page, hq, hkv, d = 16, 32, 8, 128
    k_cache, v_cache = (torch.randn(64, page, hkv, d, device=dev, dtype=bf16) for _ in range(2))
    wrapper = fi.graph_wrapper(dev, 1, 64, 1)
    meta = fi.plan_attention(PagedAttentionMeta(
        query_start_loc=torch.arange(2, device=dev), seq_lens=torch.tensor([538], device=dev),
        page_table=torch.arange(34, device=dev)[None], max_query_len=1, max_seq_len=538, causal=True, num_tokens=1,
        page_size=page, host=HostLayout([1], [538], [list(range(34))]), geometry=AttentionGeometry(hq, hkv, d, bf16,
                                                                                                    d ** -0.5)),
        wrapper)
    q = torch.randn(1, hq, d, device=dev, dtype=bf16)
    ops = {"cublas_gemv": lambda: torch.mm(x, w.t()),
           "triton_skinny_gemm": lambda: skinny_matmul(x, w, SkinnyConfig(64, 128, 1, 4, 4)),
           "triton_rms_norm": lambda: triton_ops.rms_norm(x, norm_w, 1e-6),
           "flashinfer_decode": lambda: fi.paged_attention(q, k_cache, v_cache, meta, d ** -0.5)}
    points = {}
    for name, op in ops.items():
        op()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(layers):
                op()
        points[name] = {"launches": layers, **launch_times(graph, None)}
        print(name, json.dumps(points[name]), flush=True)
    return points


def engine_graph(shape: str) -> dict:
    """The engine's batch-1 one-token decode graph on a random-weight ``shape`` (the bench's model)."""
    import tempfile
    from pathlib import Path

    from bench import write_shape
    from runtime import LLM

    target, _ = write_shape(Path(tempfile.mkdtemp(prefix="graph-launch-")), shape, 1, 8)
    llm = LLM(str(target), dtype="bfloat16", device="cuda", kernel_backend="flashinfer", load_format="dummy",
              max_num_seqs=16, max_model_len=2048, kv_cache_memory=4 * 2**30)
    graphs = llm.engine.executor.worker.graphs
    point = {"model_shape": shape, **launch_times(graphs.graphs[(1, 1)].graph, None)}
    print("engine", json.dumps(point), flush=True)
    return point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", action="store_true", help="also graphs of 36 launches of each kernel kind")
    parser.add_argument("--relaunch", action="store_true", help="also a graph launched again while it runs")
    parser.add_argument("--readback", action="store_true", help="also serial steps against two run-ahead read-backs")
    parser.add_argument("--host-us", type=float, default=250.0, help="with --readback: host work per step (us)")
    parser.add_argument("--model-shape", help="also the engine's batch-1 decode graph on this random-weight shape")
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    points = []
    for nodes in (50, 125, 250, 500, 1000):
        points.append(measure(nodes))
        print(json.dumps(points[-1]), flush=True)
    record = {"hardware": torch.cuda.get_device_name(), "date": str(date.today()), "torch": torch.__version__,
              "command": "python3 benchmarks/graph_launch.py " + " ".join(sys.argv[1:]), "points": points}
    if args.relaunch:
        record["relaunch"] = relaunch()
    if args.readback:
        record["readback"] = readback(args.host_us)
    if args.kinds:
        record["kinds"] = kind_graphs()
    if args.model_shape:
        record["engine"] = engine_graph(args.model_shape)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
