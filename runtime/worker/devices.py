"""Devices, dtypes, KV budgets and per-device backend resolution (MoE, drafter attention)."""

from __future__ import annotations

import torch

from configs import DSparkDecodingConfig, LLMConfig
from runtime.kernels import KernelBackendUnavailable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_DEFAULT_BYTES = 1 << 30
CUDA_KV_FRACTION = 0.9


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


# CPU feature flags of instructions that multiply bfloat16 natively: x86's in /proc/cpuinfo's "flags", aarch64's in
# its "Features" (best first)
BFLOAT16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text, or "" where the platform has none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_bfloat16_flag(cpuinfo: str | None = None) -> str | None:
    """The flag of this CPU's instructions that multiply bfloat16 natively (``BFLOAT16_CPU_FLAGS``), or None where it
    has none or the platform does not say (``cpuinfo``: /proc/cpuinfo's text; read here when None, Linux only).

    There a product of a few rows reads half the bytes of float32's and multiplies as fast: on a 2-core AVX512-BF16
    host a step verifying SmolLM2's blocks of seven drafts cost 1.49x a plain step in bfloat16, 4.5x in float32
    (docs/performance.md, SmolLM2 on the CPU). Without such instructions torch converts bfloat16 to float32 to
    multiply it."""
    if cpuinfo is None:
        cpuinfo = read_cpuinfo()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return next((flag for flag in BFLOAT16_CPU_FLAGS if flag in flags), None)


def kv_budget_bytes(config: LLMConfig, device: torch.device) -> int:
    """Bytes this process may give to KV pages (called once the weights are loaded): the config's
    ``kv_cache_memory``; else what ``gpu_memory_utilization`` of the device's total leaves beside the memory already
    in use; else 90% of free CUDA memory, else 1 GiB."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if config.gpu_memory_utilization is not None:
        if device.type != "cuda":
            raise ValueError(f"gpu_memory_utilization needs a CUDA device, this process's is {device}; give "
                             "kv_cache_memory")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(config.gpu_memory_utilization * total) - (total - free)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization {config.gpu_memory_utilization:g} leaves no memory for KV "
                             f"pages: {device} already uses {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB "
                             "with the weights loaded; raise it, or give kv_cache_memory")
        return budget
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_FRACTION)
    return CPU_KV_DEFAULT_BYTES


MOE_BACKENDS_RUN = ("AUTO", "VANILLA", "DENSEGEMM", "TRITON")  # the expert kernels this build has

# Backends of the reference's list (configs.speculative.MoeBackend) this build has no expert kernel for: why.
MOE_BACKENDS_ELSEWHERE = {
    "CUTLASS": ("FlashInfer's CUTLASS fused MoE is not wired into this build: its sm90 module is built with nvcc on "
                "first use (every TensorRT-LLM MoE GEMM instantiation: tens of minutes); use TRITON or "
                "DENSEGEMM"),
    "CUTEDSL": "CuTe DSL grouped GEMMs are TensorRT-LLM's, for Blackwell (SM100) with NVFP4 experts",
    "CUTEDSL_FC12": "CuTe DSL grouped GEMMs are TensorRT-LLM's, for Blackwell (SM100) with NVFP4 experts",
    "TRTLLM": "trtllm-gen MoE kernels are TensorRT-LLM's, for Blackwell (SM100/SM103)",
    "DEEPGEMM": "DeepGEMM's grouped GEMMs need FP8 block-quantized experts; dspark loads unquantized weights",
    "MARLIN": "Marlin needs weight-only quantized (int4 GPTQ/AWQ) experts; dspark loads unquantized weights",
    "MEGAMOE_DEEPGEMM": "MegaMoE kernels are TensorRT-LLM's (expert parallel, FP8/FP4 experts)",
    "MEGAMOE_CUTEDSL": "MegaMoE kernels are TensorRT-LLM's (expert parallel, FP8/FP4 experts)",
}


def triton_moe_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the TRITON expert kernels cannot run on ``device`` in ``dtype``, or None when they can."""
    if device.type != "cuda":
        return f"it needs a CUDA device, this rank's is {device}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"its kernels take bfloat16 or float16, the model is {str(dtype).removeprefix('torch.')}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed on this rank"
    return None


def grouped_gemm_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch's grouped GEMM (DENSEGEMM) cannot run on ``device`` in ``dtype``, or None when it can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"torch's grouped GEMM does not run on {device.type}"
    if dtype != torch.bfloat16:
        return f"torch's CUDA grouped GEMM takes bfloat16 only, the model is {str(dtype).removeprefix('torch.')}"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "torch's CUDA grouped GEMM needs compute capability 9.0 or newer (Hopper)"
    return None


def resolve_moe_backend(requested: str | None, device: torch.device, dtype: torch.dtype, has_moe_layers: bool,
                        what: str, rank: str) -> str:
    """The MoE backend a model's MoE layers run with on this rank (``rank`` names it in errors).

    A dense model has none ("none"), and asking for one is an error. AUTO resolves from the device and dtype to
    the fastest backend that runs there: TRITON (CUDA in bf16/fp16 with triton installed; faster than DENSEGEMM
    graphed at 1 to 512 tokens on an H200), else DENSEGEMM (grouped GEMMs, CUDA-graph safe) where torch's grouped
    GEMM runs, else VANILLA (the per-expert loop, anywhere). A concrete backend this rank cannot run is an error
    naming the rank, the backend and why; nothing is substituted.
    """
    if not has_moe_layers:
        if requested not in (None, "AUTO"):
            raise ValueError(f"{what}={requested!r}: the model has no MoE layers; leave it AUTO")
        return "none"
    problem = grouped_gemm_problem(device, dtype)
    triton_problem = triton_moe_problem(device, dtype)
    if requested in (None, "AUTO"):  # the fastest that runs (benchmarks/results/*-moe-layer-h200.json)
        return "TRITON" if triton_problem is None else "DENSEGEMM" if problem is None else "VANILLA"
    if requested == "VANILLA":
        return "VANILLA"
    if requested == "DENSEGEMM" and problem is None:
        return "DENSEGEMM"
    if requested == "TRITON" and triton_problem is None:
        return "TRITON"
    reason = {"DENSEGEMM": problem, "TRITON": triton_problem}.get(
        requested, MOE_BACKENDS_ELSEWHERE.get(requested, "unknown backend"))
    if requested == "CUTLASS" and device.type != "cuda":
        reason = f"it needs a CUDA device, this rank's is {device}"
    runnable = ["VANILLA"] + ["DENSEGEMM"] * (problem is None) + ["TRITON"] * (triton_problem is None)
    raise ValueError(f"{what}={requested!r} cannot run on {rank} ({device}): {reason}; this rank can run "
                     f"{', '.join(runnable)} (or AUTO)")


def check_draft_attention_backend(spec: DSparkDecodingConfig) -> str:
    """The drafter's block-attention backend; AUTO and VANILLA use the engine's kernels."""
    backend = spec.attention_backend
    if backend == "TRTLLM":
        raise ValueError("speculative_config.attention_backend='TRTLLM' cannot run here: it needs FlashInfer's "
                         "trtllm-gen kernels on SM100/SM103; use AUTO or VANILLA")
    if backend == "CUTEDSL":
        raise ValueError("speculative_config.attention_backend='CUTEDSL' cannot run here: it is for MLA drafters "
                         "and this drafter is GQA; use AUTO or VANILLA")
    return backend


def resolve_kernel_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``flashinfer`` on CUDA in bf16/fp16 when flashinfer and triton import, else ``torch``; an
    explicit ``flashinfer`` that cannot run (not CUDA, float32) is an error naming why."""
    half = dtype in (torch.bfloat16, torch.float16)
    if name == "auto":
        if device.type != "cuda" or not half:
            return "torch"
        try:
            import flashinfer  # noqa: F401
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "flashinfer"
    if name == "flashinfer" and device.type != "cuda":
        raise KernelBackendUnavailable(f"kernel backend 'flashinfer' runs on CUDA devices only; this process's "
                                       f"device is {device} (use kernel_backend='torch' or 'auto')")
    if name == "flashinfer" and not half:
        raise KernelBackendUnavailable(f"kernel backend 'flashinfer' needs dtype bfloat16 or float16, got "
                                       f"{str(dtype).removeprefix('torch.')} (use kernel_backend='torch' for float32)")
    return name
