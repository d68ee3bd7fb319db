"""How long the host spends handing a small list to the GPU while the GPU is busy (one H200 run decides
``runtime.kernels.transfer.to_device``): plain ``torch.tensor(device=)``, pinned + non_blocking, pageable +
non_blocking.

usage: python3 benchmarks/h2d_copy.py   (prints microseconds per call, host side, GPU kept busy by a large matmul)
"""

from __future__ import annotations

import time

import torch


def main() -> None:
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    values = list(range(64))
    variants = {
        "tensor(device=cuda)": lambda: torch.tensor(values, device=dev),
        "pinned, non_blocking": lambda: torch.tensor(values, pin_memory=True).to(dev, non_blocking=True),
        "pageable, non_blocking": lambda: torch.tensor(values).to(dev, non_blocking=True),
    }
    for name, make in variants.items():
        for _ in range(20):
            make()
        torch.cuda.synchronize()
        for _ in range(20):  # ~20 ms of queued GPU work: a call that waits for it shows up as milliseconds
            a @ a
        start = time.perf_counter()
        for _ in range(100):
            make()
        host = (time.perf_counter() - start) / 100
        torch.cuda.synchronize()
        print(f"{name:>24}: {host * 1e6:8.1f} us per call on the host")


if __name__ == "__main__":
    main()
