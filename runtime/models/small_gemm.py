"""Small-batch GEMMs: per weight shape and row count, the faster of cuBLAS and the Triton skinny GEMM, measured.

A decode step multiplies each weight by one row per request, a verify by K+1: at up to 16 rows a linear layer only
streams its weight, and how close a kernel comes to the bandwidth depends on the shape (on an H200 cuBLAS reads the
Qwen3-8B shape's q/k/v and o projections at ~0.74 of the copy bandwidth, its MLP at ~0.9). ``install_small_gemms``
(the flashinfer backend's fast path, once per process and shape) times cuBLAS and every
``runtime.kernels.skinny_gemm.CANDIDATES`` config on the device for each weight shape at 1, 2, 4, 8 and 16 rows,
as a CUDA graph over all the model's weights of that shape replayed with a cold L2 (as a forward meets them), and
hands each linear the winners (``GemmChoice``). A config replaces cuBLAS only where it is at least ``MARGIN``
faster. An MLP's down projection is also timed with its SiLU-and-mul fused into the skinny GEMM's operand loads
(``skinny_matmul(..., swiglu=True)``, bit for bit the activation kernel's output) against the activation kernel
followed by the GEMM just chosen; where the fused kernel wins by ``MARGIN``, the MLP hands it gate/up directly
(``swiglu_linear``: one launch and no intermediate a layer fewer). Likewise the fused q/k/v and gate/up projections
(single-GPU linears) are timed with the residual add and RMSNorm before them fused into their operand loads
(``skinny_norm_matmul``) against the norm kernel followed by the GEMM just chosen, and where that wins the decoder
layer hands them the un-normed stream (``prenorm_linear``: two launches a layer fewer). The choice for M rows is the
one measured at the smallest bucket >= M, for eager steps and graphs alike.
Every Triton config is deterministic and computes each row independently of the others, but like cuBLAS's own
heuristics the choice follows the row count: a graph padded past a bucket (3 requests of a K=4 verify: 15 rows
eager, 20 in the graph of 4 requests) may run another kernel than the eager step of the same requests, and round
differently in the last bit. Weights with a bias, MoE experts (their own kernels) and small weights (launch-bound
either way) keep cuBLAS.

Many rows: cuBLAS's time is not monotone in the row count. On an H200 the 2.7B trained pair's verify at 64 requests
took 7.95 ms at 7 tokens a request against 6.63 at 8: 448 and 320 rows to every GEMM dearer than 512 and
384 (``benchmarks/gemm_rows.py`` times each shape at every multiple of 64 rows). So for the row counts the worker's
graphs feed (``rows`` of ``install_small_gemms``: past one tile of ``PAD_ROWS_TO``, not a multiple of it), each
shape is also timed with its rows padded up to the next multiple of ``PAD_ROWS_TO`` (zero rows, the pad copy
counted), and where that takes at most ``MARGIN`` of cuBLAS's own time the linear computes on the padded rows and
keeps its own (``GemmChoice.padded_rows``). Each row is computed from its own input row either way; like the choice
of a kernel, the padding may change how a row rounds in the last bit, never which rows it depends on.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels.timing import graph_device_us

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16)  # rows measured; M rows use the choice of the smallest bucket >= M
MARGIN = 0.97  # a Triton config (or padded rows) must take at most this share of cuBLAS's time to replace it
PAD_ROWS_TO = 128  # many-row GEMMs are timed padded to a multiple of this (a GEMM tile's rows)
# of a shape's weights, the most one padding measurement runs over (many rows: compute-bound), and its replays: at 8
# weights and 5 replays the 15 row counts of a 256-request K=7 worker's graphs took 24 s of the startup for the
# 2.7B trained pair's 5 shapes (2026-12-03); 2 and 3 cut the GEMM work 6x (the anomaly they look for was 1.6x)
PAD_TIMED_WEIGHTS = 2
PAD_TIMED_REPLAYS = 3
MIN_WEIGHT_ELEMENTS = 1 << 22  # smaller weights are launch-bound: cuBLAS stays
FLUSH_BYTES = 256 << 20  # written between timed replays so that no weight is still in L2 (50 MiB on an H200)
PRENORM_LINEARS = ("qkv_proj", "gate_up_proj")  # the fused projections a decoder layer feeds a norm's output


@dataclass
class GemmChoice:
    """For one weight shape, per ``ROW_BUCKETS`` entry the Triton config that beat cuBLAS (None: cuBLAS), for an
    MLP's down projection the config whose fused SiLU-and-mul beat the activation kernel plus the chosen GEMM
    (``swiglu_configs``; None: the two kernels), and for a projection that reads a norm's output (q/k/v, gate/up)
    the config whose fused residual add and RMSNorm beat that kernel plus the chosen GEMM (``norm_configs``)."""

    configs: tuple  # [len(ROW_BUCKETS)] SkinnyConfig | None
    matmul: Callable | None = None  # runtime.kernels.skinny_gemm.skinny_matmul (None when nothing uses it)
    swiglu_configs: tuple = (None,) * len(ROW_BUCKETS)  # [len(ROW_BUCKETS)] SkinnyConfig | None
    norm_configs: tuple = (None,) * len(ROW_BUCKETS)  # [len(ROW_BUCKETS)] SkinnyConfig | None
    norm_matmul: Callable | None = None  # runtime.kernels.skinny_gemm.skinny_norm_matmul (where a norm config won)
    padded_rows: dict[int, int] = field(default_factory=dict)  # rows -> the more rows cuBLAS computes them on

    @property
    def used(self) -> bool:
        """Whether anything differs from cuBLAS on the rows as given."""
        return self.matmul is not None or bool(self.padded_rows)

    def for_rows(self, rows: int):
        return self._of(self.configs, rows)

    def swiglu_for_rows(self, rows: int):
        return self._of(self.swiglu_configs, rows)

    def norm_for_rows(self, rows: int):
        return self._of(self.norm_configs, rows) if self.norm_matmul is not None else None

    def _of(self, configs: tuple, rows: int):
        if rows < 1 or rows > ROW_BUCKETS[-1] or self.matmul is None:
            return None
        return configs[bisect_left(ROW_BUCKETS, rows)]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, choice: GemmChoice | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the skinny GEMM where ``choice`` says so for x's row count, or on
    zero-padded rows where it measured cuBLAS faster on those (``GemmChoice.padded_rows``)."""
    if choice is not None and bias is None:
        rows = x.numel() // x.shape[-1]
        config = choice.for_rows(rows)
        if config is not None:
            return choice.matmul(x.reshape(rows, x.shape[-1]), weight, config).view(*x.shape[:-1], weight.shape[0])
        padded = choice.padded_rows.get(rows)
        if padded is not None:
            return padded_linear(x.reshape(rows, x.shape[-1]), weight, padded).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def padded_linear(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``F.linear(x, weight)`` of x [M, K] computed on ``rows`` >= M rows (zeros below x's): [M, N], contiguous."""
    return F.linear(F.pad(x, (0, 0, 0, rows - x.shape[0])), weight)[:x.shape[0]]


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, choice: GemmChoice | None,
                  silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``linear(silu_and_mul(gate_up), weight, bias, choice)``: gate_up [..., 2K] (gate half, up half); in one
    fused skinny GEMM where ``choice`` measured that faster for these rows, else the two kernels."""
    if choice is not None and bias is None:
        rows = gate_up.numel() // gate_up.shape[-1]
        config = choice.swiglu_for_rows(rows)
        if config is not None:
            out = choice.matmul(gate_up.reshape(rows, gate_up.shape[-1]), weight, config, swiglu=True)
            return out.view(*gate_up.shape[:-1], weight.shape[0])
    return linear(silu_and_mul(gate_up), weight, bias, choice)


def prenorm_linear(module: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   eps: float, kernels) -> tuple[torch.Tensor, torch.Tensor]:
    """``module(rms_norm(h + residual) * norm_weight)`` and the residual stream after the add (``residual`` None: no
    add, and the stream is ``h``): in one fused skinny GEMM where ``module`` is a ``SmallBatchLinear`` whose shape
    measured that faster for these rows, else ``kernels.add_rms_norm`` (or ``rms_norm``) and the linear, the same
    values either way. h, residual [..., K]."""
    choice = module.choice if isinstance(module, SmallBatchLinear) else None
    if choice is not None and module.bias is None:
        rows = h.numel() // h.shape[-1]
        config = choice.norm_for_rows(rows)
        if config is not None:
            flat = h.reshape(rows, h.shape[-1])
            out, summed = choice.norm_matmul(flat, residual.reshape(rows, h.shape[-1]) if residual is not None
                                             else None, norm_weight, eps, module.weight, config)
            return (out.view(*h.shape[:-1], module.out_features),
                    summed.view(h.shape) if summed is not None else h)
    x, residual = norm_stream(kernels, h, residual, norm_weight, eps)
    return module(x), residual


def norm_stream(kernels, h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + residual) * norm_weight, the residual stream after the add): ``kernels.add_rms_norm``, or with
    ``residual`` None (a first layer) ``kernels.rms_norm`` of h, the stream being h."""
    if residual is None:
        return kernels.rms_norm(h, norm_weight, eps), h
    return kernels.add_rms_norm(h, residual, norm_weight, eps)


class ChosenLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state-dict names) holding a measured ``choice`` of how to compute its
    few-row products; a subclass's ``forward`` follows it."""

    def __init__(self, base: nn.Linear, choice):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.choice = choice


class SmallBatchLinear(ChosenLinear):
    """A linear whose few-row products follow a ``GemmChoice`` (CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.choice)

    def swiglu_forward(self, gate_up: torch.Tensor, silu_and_mul: Callable) -> torch.Tensor:
        """``forward(silu_and_mul(gate_up))``, fused where measured faster (``swiglu_linear``)."""
        return swiglu_linear(gate_up, self.weight, self.bias, self.choice, silu_and_mul)


@dataclass
class SmallGemmReport:
    """What the measurement chose: per weight shape ``"NxK"`` and row bucket, the device time of cuBLAS and of the
    best Triton config over all of the model's weights of that shape (microseconds) and the winner."""

    shapes: dict[str, dict[str, dict]] = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"calibration_s": round(self.seconds, 2), "shapes": self.shapes}


_MEASURED: dict[tuple, tuple[GemmChoice, dict]] = {}  # (device, dtype, N, K, swiglu, norm) -> choice, report
# (device, dtype, N, K, rows) -> padded rows (None: as given), report
_PADDED: dict[tuple, tuple[int | None, dict]] = {}


def _targets(modules: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, linear) for every linear the dispatch may serve: bias-free, large, not an MoE expert."""
    from runtime.models.moe import SparseMoeBlock
    from runtime.models.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    kinds = (nn.Linear, ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    return module_targets(modules, lambda m: isinstance(m, kinds) and not isinstance(m, SmallBatchLinear),
                          lambda m: getattr(m, "bias", None) is None and m.weight.numel() >= MIN_WEIGHT_ELEMENTS
                          and m.weight.stride(1) == 1, skip=(SparseMoeBlock,))


def module_targets(modules: list[nn.Module], leaf: Callable[[nn.Module], bool], takes: Callable[[nn.Module], bool],
                   skip: tuple[type, ...] = ()) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) for every ``leaf`` module under ``modules`` that ``takes`` accepts, each once (a
    tied head shares its embedding's weight, not its module); a leaf's children and a ``skip`` module's subtree are
    not visited."""
    found, seen = [], set()

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, skip):
                continue
            if leaf(child):
                if id(child) not in seen and takes(child):
                    seen.add(id(child))
                    found.append((parent, name, child))
                continue
            visit(child)

    for module in modules:
        visit(module)
    return found


def _measure(weights: list[torch.Tensor], flush: torch.Tensor, silu_and_mul: Callable | None = None,
             add_rms_norm: Callable | None = None) -> tuple[GemmChoice, dict]:
    """The choice for one weight shape (``weights``: the model's weights of it), each row bucket timed as a graph
    over all of them. ``silu_and_mul`` (the shape is an MLP's down projection): also the fused SiLU-and-mul GEMM
    against that kernel followed by the GEMM just chosen; ``add_rms_norm`` (the shape reads a norm's output): also
    the fused residual add and RMSNorm against that kernel followed by the GEMM just chosen."""
    from runtime.kernels.skinny_gemm import CANDIDATES, skinny_matmul, skinny_norm_matmul

    n, k = weights[0].shape
    configs, swiglu_configs, norm_configs, rows_report = [], [], [], {}
    if not any(config.fits(n, k) for config in CANDIDATES):  # nothing measured: cuBLAS
        return GemmChoice((None,) * len(ROW_BUCKETS)), {str(rows): {"chosen": "cublas", "triton_config": None}
                                                        for rows in ROW_BUCKETS}
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, k, dtype=weights[0].dtype, device=weights[0].device)
        cublas = graph_device_us(lambda: [F.linear(x, w) for w in weights], flush)
        best, best_us = _fastest(n, k, lambda c: graph_device_us(lambda: [skinny_matmul(x, w, c) for w in weights],
                                                                  flush))
        chosen = best if best is not None and best_us <= MARGIN * cublas else None
        configs.append(chosen)
        rows_report[str(rows)] = {"cublas_us": round(cublas, 1), "triton_us": round(best_us, 1),
                                  "triton_config": best.label if best is not None else None,
                                  "chosen": chosen.label if chosen is not None else "cublas"}
        gemm = (lambda a, w: skinny_matmul(a, w, chosen)) if chosen is not None else F.linear
        swiglu = normed = None
        if silu_and_mul is not None:
            gate_up = torch.randn(rows, 2 * k, dtype=x.dtype, device=x.device)
            swiglu = _fused_choice(
                n, k, graph_device_us(lambda: [gemm(silu_and_mul(gate_up), w) for w in weights], flush),
                lambda c: graph_device_us(lambda: [skinny_matmul(gate_up, w, c, swiglu=True) for w in weights],
                                          flush), rows_report[str(rows)], "swiglu")
        swiglu_configs.append(swiglu)
        if add_rms_norm is not None:
            h, residual = torch.randn_like(x), torch.randn_like(x)
            norm_weight = torch.ones(k, dtype=x.dtype, device=x.device)
            normed = _fused_choice(
                n, k, graph_device_us(
                    lambda: [gemm(add_rms_norm(h, residual, norm_weight, 1e-6)[0], w) for w in weights], flush),
                lambda c: graph_device_us(
                    lambda: [skinny_norm_matmul(h, residual, norm_weight, 1e-6, w, c) for w in weights], flush),
                rows_report[str(rows)], "norm")
        norm_configs.append(normed)
    uses_triton = any(c is not None for c in configs + swiglu_configs)
    uses_norm = any(c is not None for c in norm_configs)
    return GemmChoice(tuple(configs), skinny_matmul if uses_triton or uses_norm else None, tuple(swiglu_configs),
                      tuple(norm_configs), skinny_norm_matmul if uses_norm else None), rows_report


def pad_candidates(rows) -> list[int]:
    """The row counts among ``rows`` that padding could serve: past one ``PAD_ROWS_TO`` tile (below, one tile of
    rows is computed anyway and the weight read is the cost), not a multiple of it."""
    return sorted({r for r in rows if r > PAD_ROWS_TO and r % PAD_ROWS_TO})


def _measure_padding(weights: list[torch.Tensor], flush: torch.Tensor, rows: list[int]) -> tuple[dict[int, int], dict]:
    """For one weight shape (``weights``: the model's weights of it) and each of ``rows`` (``pad_candidates``),
    cuBLAS on those rows against cuBLAS on them padded to the next multiple of ``PAD_ROWS_TO``, each a graph over
    up to ``PAD_TIMED_WEIGHTS`` of the weights, ``PAD_TIMED_REPLAYS`` replays: ({rows: padded rows} where padding
    takes at most ``MARGIN`` of the time, {rows: report})."""
    n, k = weights[0].shape
    chosen, report = {}, {}
    weights = weights[:PAD_TIMED_WEIGHTS]
    for count in rows:
        padded = -(-count // PAD_ROWS_TO) * PAD_ROWS_TO
        x = torch.randn(count, k, dtype=weights[0].dtype, device=weights[0].device)
        plain = graph_device_us(lambda: [F.linear(x, w) for w in weights], flush, PAD_TIMED_REPLAYS)
        pad = graph_device_us(lambda: [padded_linear(x, w, padded) for w in weights], flush, PAD_TIMED_REPLAYS)
        if pad <= MARGIN * plain:
            chosen[count] = padded
        report[str(count)] = {"cublas_us": round(plain, 1), f"padded_to_{padded}_us": round(pad, 1),
                              "chosen": f"padded_to_{padded}" if count in chosen else "cublas"}
    return chosen, report


def _fused_choice(n: int, k: int, separate_us: float, fused_us_of: Callable, report: dict, name: str):
    """The fastest candidate of a fused variant (``fused_us_of(config)``: its device time) if it takes at most
    ``MARGIN`` of ``separate_us`` (the kernels it fuses, run apart), else None; ``report`` gets ``{name}_separate_us``,
    ``{name}_fused_us`` and ``{name}_chosen``."""
    fused, fused_us = _fastest(n, k, fused_us_of)
    chosen = fused if fused is not None and fused_us <= MARGIN * separate_us else None
    report.update({f"{name}_separate_us": round(separate_us, 1), f"{name}_fused_us": round(fused_us, 1),
                   f"{name}_chosen": chosen.label if chosen is not None else "separate"})
    return chosen


def _fastest(n: int, k: int, device_us: Callable) -> tuple:
    """(the candidate config serving an [n, k] weight with the least ``device_us(config)``, its time); (None, inf)
    when none serves it."""
    from runtime.kernels.skinny_gemm import CANDIDATES

    best, best_us = None, float("inf")
    for config in CANDIDATES:
        if config.fits(n, k):
            us = device_us(config)
            if us < best_us:
                best, best_us = config, us
    return best, best_us


def install_small_gemms(modules: list[nn.Module], device: torch.device, dtype: torch.dtype,
                        rows=()) -> SmallGemmReport:
    """Measure and install the small-batch GEMM choice of every eligible linear in ``modules`` (in place: an
    ``nn.Linear`` becomes a ``SmallBatchLinear``, a tensor-parallel linear gets its ``small_gemm``), and the padded
    row counts among ``rows`` (those the worker's graphs feed; ``pad_candidates``). Call after the weights are
    loaded and fused, before anything keeps a reference to a linear; needs a CUDA device, a half dtype and
    triton."""
    candidates = pad_candidates(rows)
    start = time.perf_counter()
    report = SmallGemmReport()
    targets = _targets(modules)
    groups: dict[tuple[int, int], list[tuple[nn.Module, str, nn.Module]]] = {}
    for parent, name, child in targets:
        groups.setdefault(tuple(child.weight.shape), []).append((parent, name, child))
    flush = None
    for (n, k), members in groups.items():
        # an MLP's down projection (its gate/up fused) may take the activation into its GEMM, and the fused q/k/v
        # and gate/up projections (single-GPU linears) the norm before them: measured too
        act = next((parent.kernels.silu_and_mul for parent, name, _ in members if name == "down_proj"
                    and getattr(parent, "gate_up_proj", None) is not None), None)
        norm = next((parent.kernels.add_rms_norm for parent, name, child in members if name in PRENORM_LINEARS
                     and type(child) is nn.Linear), None)
        key = (str(device), dtype, n, k, act is not None, norm is not None)
        weights = [child.weight for _, _, child in members]
        shape = (str(device), dtype, n, k)  # + a row count: the key of _PADDED
        missing = [r for r in candidates if (*shape, r) not in _PADDED]
        if flush is None and (key not in _MEASURED or missing):
            flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        if key not in _MEASURED:
            _MEASURED[key] = _measure(weights, flush, act, norm)
        if missing:  # each row count measured once a process (engines of other graph shapes share them)
            padded, padded_report = _measure_padding(weights, flush, missing)
            for r in missing:
                _PADDED[(*shape, r)] = padded.get(r), padded_report[str(r)]
        base, rows_report = _MEASURED[key]
        padding = {r: _PADDED[(*shape, r)] for r in candidates}
        choice = replace(base, padded_rows={r: to for r, (to, _) in padding.items() if to is not None})
        rows_report = {**rows_report, **{str(r): entry for r, (_, entry) in padding.items()}}
        report.shapes[f"{n}x{k}"] = {"weights": len(members), "rows": rows_report}
        if not choice.used:
            continue
        for parent, name, child in members:
            if type(child) is nn.Linear:
                setattr(parent, name, SmallBatchLinear(child, choice))
            else:
                child.small_gemm = choice
    report.seconds = time.perf_counter() - start
    chosen = {shape: [r["chosen"] + (f"+{r['swiglu_chosen']}" if "swiglu_chosen" in r else "")
                      + (f"+norm:{r['norm_chosen']}" if "norm_chosen" in r else "")
                      for r in entry["rows"].values()] for shape, entry in report.shapes.items()}
    log.info("dspark: small-batch GEMMs (rows %s, padding tried at %s) measured in %.1f s: %s", list(ROW_BUCKETS),
             candidates, report.seconds, chosen)
    return report
