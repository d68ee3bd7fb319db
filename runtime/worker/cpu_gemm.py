"""Few-row GEMMs on the CPU: per weight shape and row count, the faster of two ways to call MKL, measured.

A decode step multiplies each weight by one row per request, a verify by K + 1 rows, a drafter's vocabulary head by
its K positions: products that only stream their weights from memory. ``F.linear`` (``x @ W^T``) at those row counts
runs a GEMV or a narrow GEMM that reads the weights far below the host's bandwidth, and unevenly in the row count:
on a 2-core AVX-512 host (torch 2.13, MKL 2024.2) SmolLM2-135M's 30 layers' linears took 37 ms at one row, 64 at two,
75 at three and 41 at eight, and its vocabulary head 34 ms at seven rows against 17 at eight. The same product with
the weight as the GEMM's left operand, ``(W @ x^T)^T`` (one row duplicated to two: MKL's GEMV is the slow path),
reads them at ~26 GB/s up to about eight rows: 16-20 ms for the layers at one to three rows, 7 ms for the head at
seven (``benchmarks/results/2026-12-07-cpu-gemm-smollm2.json`` has the engine's steps before and after).

``install_cpu_gemms`` times both on this host, for every linear shape whose weights together are large enough to be read
from memory (``MIN_GROUP_BYTES``), at each row count of ``ROWS``, the caches flushed before each pass over the shape's
weights as a forward meets them; where ``(W @ x^T)^T`` takes at most ``MARGIN`` of ``F.linear``'s time the linear
computes those row counts that way (``CpuLinear``); more rows take ``F.linear``. Both compute each output row from its
own input row, the same sums in an order MKL picks: like a GPU's kernel choice, the way may change how a value rounds in
the last bit, never what it depends on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.small_gemm import ChosenLinear, module_targets

log = logging.getLogger(__name__)

ROWS = tuple(range(1, 17))  # row counts measured, each apart (MKL's times are uneven in the row count); past, F.linear
MARGIN = 0.85  # (W @ x^T)^T must take at most this share of F.linear's time to replace it
MIN_WEIGHT_ELEMENTS = 1 << 18  # smaller linears keep F.linear
MIN_GROUP_BYTES = 32 << 20  # a shape's weights together smaller than this sit in a CPU's caches: F.linear stays
FLUSH_BYTES = 32 << 20  # written before each timed pass, so that little of a shape's weights is still cached
TIMED_PASSES = 2  # passes over a shape's weights per way and row count (the fastest counts)


@dataclass(frozen=True)
class CpuGemmChoice:
    """For one weight shape: the row counts (of ``ROWS``) at which ``(W @ x^T)^T`` measured faster."""

    transposed: frozenset[int]

    def transposes(self, rows: int) -> bool:
        """Whether ``rows`` rows take ``(W @ x^T)^T``."""
        return rows in self.transposed


def transposed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` of x [M, K] as ``(weight @ x^T)^T`` (one row duplicated to two): [M, N], contiguous."""
    rows = x.shape[0]
    operand = torch.cat([x, x]) if rows == 1 else x.contiguous()  # [max(M, 2), K]
    return (weight @ operand.T)[:, :rows].T.contiguous()


class CpuLinear(ChosenLinear):
    """A linear whose few-row products follow a ``CpuGemmChoice`` (CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.bias is None and self.choice.transposes(rows):
            flat = transposed_linear(x.reshape(rows, x.shape[-1]), self.weight)
            return flat.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


@dataclass
class CpuGemmReport:
    """What the measurement chose: per weight shape ``"NxK"`` and row count, the milliseconds of a pass over the
    shape's weights each way and the winner."""

    shapes: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"shapes": self.shapes, "seconds": round(self.seconds, 2)}


def install_cpu_gemms(modules: list[nn.Module]) -> CpuGemmReport:
    """Measure and install the few-row GEMM choice of every eligible linear in ``modules`` (in place: an
    ``nn.Linear`` becomes a ``CpuLinear`` where the transposed product measured faster at some row count). Call after
    the weights are loaded and fused, before anything keeps a reference to a linear; float32 or bfloat16 weights on
    the CPU."""
    start = time.perf_counter()
    report = CpuGemmReport()
    groups: dict[tuple, list[tuple[nn.Module, str, nn.Linear]]] = {}
    for parent, name, child in _targets(modules):
        groups.setdefault((*child.weight.shape, child.weight.dtype), []).append((parent, name, child))
    flush = None
    for (n, k, dtype), members in groups.items():
        weights = [child.weight for _, _, child in members]
        if sum(w.numel() * w.element_size() for w in weights) < MIN_GROUP_BYTES:
            continue
        key = (n, k, dtype)
        if key not in _MEASURED:
            if flush is None:
                flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
            _MEASURED[key] = _measure(weights, flush)
        choice, rows_report = _MEASURED[key]
        report.shapes[f"{n}x{k}"] = {"weights": len(members), "rows": rows_report}
        if not choice.transposed:
            continue
        for parent, name, child in members:
            setattr(parent, name, CpuLinear(child, choice))
    report.seconds = time.perf_counter() - start
    if report.shapes:
        log.info("dspark: CPU few-row GEMMs measured in %.1f s; (W @ x^T)^T at rows %s", report.seconds,
                 {shape: sorted(int(r) for r, e in entry["rows"].items() if e["chosen"] == "transposed")
                  for shape, entry in report.shapes.items()})
    return report


# (N, K, dtype) -> (choice, report): measured once a process (engines of one model share them)
_MEASURED: dict[tuple, tuple[CpuGemmChoice, dict]] = {}


def _targets(modules: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) for every plain ``nn.Linear`` large enough to be weight-streaming (each once:
    a tied head shares its embedding's weight, not its module)."""
    return module_targets(modules, lambda m: type(m) is nn.Linear,
                          lambda m: m.weight.numel() >= MIN_WEIGHT_ELEMENTS and m.weight.is_contiguous())


@torch.inference_mode()
def _measure(weights: list[torch.Tensor], flush: torch.Tensor) -> tuple[CpuGemmChoice, dict]:
    """Each way's fastest pass over ``weights`` at every row count of ``ROWS``, the caches flushed before each."""
    n, k = weights[0].shape
    transposed, rows_report = set(), {}
    for rows in ROWS:
        x = torch.randn(rows, k, dtype=weights[0].dtype)
        ways = {"linear": lambda w: F.linear(x, w), "transposed": lambda w: transposed_linear(x, w)}
        ms = {}
        for way, product in ways.items():
            product(weights[0])  # (warm: MKL's first call of a shape)
            times = []
            for _ in range(TIMED_PASSES):
                flush.fill_(1)
                began = time.perf_counter()
                for w in weights:
                    product(w)
                times.append(time.perf_counter() - began)
            ms[way] = 1e3 * min(times)
        chosen = "transposed" if ms["transposed"] <= MARGIN * ms["linear"] else "linear"
        if chosen == "transposed":
            transposed.add(rows)
        rows_report[str(rows)] = {"linear_ms": round(ms["linear"], 3), "transposed_ms": round(ms["transposed"], 3),
                                  "chosen": chosen}
    return CpuGemmChoice(frozenset(transposed)), rows_report
