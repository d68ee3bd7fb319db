"""The tensor-parallel ranks' sums: NCCL's all-reduce, or a one-shot all-reduce over PyTorch symmetric memory.

A decode step of a TP=N replica sums two partial rows per layer (attention's and the MLP's output projections),
72 all-reduces of a few KiB each on the Qwen3-8B shape: every one a latency, none a bandwidth. NCCL's ring costs
its protocol's hops and a launch of its own kernel even inside a CUDA graph. The one-shot all-reduce
(``ParallelConfig.allreduce_strategy='ONESHOT'``, as TensorRT-LLM's strategy of that name) is one kernel: each
rank owns a buffer of PyTorch's symmetric memory (``torch.distributed._symmetric_memory``) that every peer of its
group maps over NVLink; ``torch.ops.symm_mem.one_shot_all_reduce_copy`` writes this rank's partial into its
buffer, waits for the peers' signals and sums every peer's buffer from its own SMs. It is captured in CUDA graphs
like any kernel, and uses no NVLink multicast (NVLS stays off). Messages past the buffer (long prompt chunks: a
bandwidth, not a latency) still go through NCCL, as do tensors of another dtype.

Every rank of a group must sum the same way at every call (their kernels pair up), so the choice is made once at
startup, together (``choose_reducer``): all ranks on one host, CUDA, the operator present, the buffers rendezvoused
on every rank; otherwise ``ONESHOT`` is an error naming the rank and the cause, and ``AUTO`` takes NCCL on every
rank and says why (``Worker.info()["allreduce"]``).
"""

from __future__ import annotations

import logging
import os
import socket
import warnings

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ONESHOT_MAX_BYTES = 8 << 20  # the symmetric buffer: past this a message is bandwidth-bound, NCCL's ring is better
ALIGNMENT_BYTES = 16  # the kernel moves 16-byte vectors


class OneShotAllReduce:
    """Sums a tensor over the group in one kernel, out of place, through this rank's symmetric buffer. Built by
    ``choose_reducer``, once every rank found the operator and the devices it needs (``_local_problem``)."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = ONESHOT_MAX_BYTES):
        # the one-shot kernel reads peers over NVLink's unicast mappings: no multicast object is made for its buffer
        # (the shared GPU hosts must never create one; elsewhere it would only cost memory). torch reads this once.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name, self.dtype = group.group_name, dtype
        enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
        if enabled is not None and not enabled(self.group_name):  # (older torch needs it; newer ones warn it is moot)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)  # [capacity]
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank of the group maps every buffer
        self.capacity = self.buffer.numel()

    def serves(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the symmetric buffer (its dtype, contiguous, within the buffer, aligned)."""
        return x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.capacity \
            and (x.numel() * x.element_size()) % ALIGNMENT_BYTES == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The group's sum of ``x``, a new tensor of its shape (``x`` is left as it was)."""
        flat = x.view(-1)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[:flat.numel()], flat, "sum", self.group_name)
        return out.view_as(x)


def choose_reducer(strategy: str, group, device: torch.device, dtype: torch.dtype,
                   where: str) -> tuple[OneShotAllReduce | None, str]:
    """Every rank of ``group`` calls this at startup, with the same ``strategy`` (``NCCL``, ``ONESHOT`` or ``AUTO``)
    -> (the one-shot reducer, or None for NCCL's all-reduce; what the ranks chose, for ``info()``). The ranks agree:
    either all use the one-shot kernel or none does. ``ONESHOT`` that cannot run is a ``RuntimeError`` naming
    ``where`` (this rank) and the cause."""
    if strategy == "NCCL":
        return None, "NCCL"
    problem = _local_problem(device, group)
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if problem is None and len(set(hosts)) > 1:
        problem = f"the tensor-parallel ranks span hosts {sorted(set(hosts))} (one-shot reads every peer over NVLink)"
    reducer = None
    if _everyone_ok(problem is None, group, device):
        try:
            reducer = OneShotAllReduce(group, device, dtype)
        except Exception as exc:  # noqa: BLE001 - agreed on below; ONESHOT re-raises it naming the rank
            problem = f"symmetric memory: {exc}"
    if not _everyone_ok(reducer is not None, group, device):
        problem = problem or "another rank of the group could not set it up"
        if strategy == "ONESHOT":
            raise RuntimeError(f"{where}: allreduce_strategy='ONESHOT' cannot run: {problem}")
        log.warning("dspark: %s: allreduce_strategy='AUTO' takes NCCL: ONESHOT cannot run: %s", where, problem)
        return None, f"NCCL (AUTO: ONESHOT cannot run: {problem})"
    return reducer, "ONESHOT"


def _local_problem(device: torch.device, group) -> str | None:
    if device.type != "cuda":
        return f"it needs CUDA devices, this rank runs on {device}"
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"it needs the nccl process group, this one is {backend}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory cannot be imported ({exc})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy operator"
    return None


def _everyone_ok(ok: bool, group, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (a MIN all-reduce of one flag)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
