"""What a CUDA graph launch costs the host, by the number of kernels in the graph, and when the device starts on
it: does launching a forward as several smaller graphs let the device start sooner (piecewise launch)?

For graphs of N small kernels (N = 50 .. 1000): host microseconds of ``CUDAGraph.replay()`` with the device idle,
and the delay from the call until the graph's first kernel starts (a CUDA event recorded on the host clock
reference before the call, and one captured as the graph's first node).

usage: python3 benchmarks/graph_launch.py [--out FILE.json]
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
    graph = capture(nodes, x, first)
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
        start_delay.append(1e3 * before.elapsed_time(first))
        device.append(1e3 * first.elapsed_time(end))
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"kernels": nodes, "host_launch_us": med(launch), "first_kernel_after_call_us": med(start_delay),
            "device_us": med(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args()
    points = []
    for nodes in (50, 125, 250, 500, 1000):
        points.append(measure(nodes))
        print(json.dumps(points[-1]), flush=True)
    record = {"hardware": torch.cuda.get_device_name(), "date": str(date.today()), "torch": torch.__version__,
              "command": "python3 benchmarks/graph_launch.py " + " ".join(sys.argv[1:]), "points": points}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
