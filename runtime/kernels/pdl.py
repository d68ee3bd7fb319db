"""Programmatic dependent launch (PDL) for the engine's Triton kernels (Hopper and later).

A decode step is a chain of ~10 kernels a layer, most of them short (norms, RoPE, SiLU) or single-wave weight
streams (the skinny GEMMs); launched one after another, each starts only when the one before has drained, so a
step pays every kernel's launch and ramp on top of its bytes. With PDL a kernel launched with the programmatic
stream-serialization attribute may start while the kernel before it finishes: its programs first wait
(``griddepcontrol.wait``: the previous kernel has completed and its writes are visible) and then let the next
kernel launch (``griddepcontrol.launch_dependents``). Everything a kernel reads or writes comes after that wait,
so the order of memory effects is the plain launch's: outputs are bit-identical (PDL changes when a kernel is
resident, not what it computes). Because every PDL kernel waits unconditionally before it finishes, a kernel's
completion still implies all earlier kernels' (the ordering is transitive), whichever kernels (cuBLAS, FlashInfer,
which launches its own with PDL on sm_90) stand between. Inside CUDA graphs the attribute becomes a programmatic
edge. Measured on an H200 (``benchmarks/pdl_chain.py``): 52.0 -> 44.6 us a layer of [norm, GEMV, norm, GEMV].

Each kernel takes a ``PDL`` constexpr and calls ``wait_for_inputs(PDL)`` first thing; ``launch_options(tensor)``
gives the launch's keyword arguments: PDL on a CUDA device of compute capability 9 or more, never elsewhere (on
the CPU under Triton's interpreter, or on an older GPU, where the attribute does not exist)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (a CUDA device of compute capability >= 9)."""
    if device.type != "cuda":
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(tensor: torch.Tensor) -> dict:
    """Keyword arguments of a launch whose kernel takes ``PDL`` and runs on ``tensor``'s device."""
    return {"PDL": True, "launch_pdl": True} if supported(tensor.device) else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """First thing in a kernel launched with ``launch_options``: wait for the kernel before it (its writes
    visible), then let the next kernel launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
