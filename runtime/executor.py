"""Executors run a ``ScheduledBatch`` on models and return plain results.

``LocalExecutor`` holds the target (and drafter) in this process; the cluster layer provides one
that fans the batch out to Ray actors. The engine sees only this protocol.
"""

from __future__ import annotations

from typing import Protocol

from configs import LLMConfig
from runtime.devices import check_draft_attention_backend, kv_budget_bytes, resolve_device, resolve_dtype, \
    resolve_moe_backend
from runtime.kernels import get_backend
from runtime.loader import load_drafter, load_target
from runtime.runner import ModelRunner
from runtime.step_io import RequestStepResult, ScheduledBatch


class Executor(Protocol):
    num_pages: int

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]: ...

    def describe(self) -> list[dict]: ...

    def shutdown(self) -> None: ...


def pages_for_budget(budget: int, bytes_per_page: int, page_size: int) -> int:
    pages = budget // bytes_per_page
    if pages < 1:
        raise ValueError(f"kv_cache_memory={budget} bytes holds no KV page of {page_size} tokens "
                         f"({bytes_per_page} bytes each)")
    return int(pages)


class LocalExecutor:
    """The target and drafter in this process, on one device."""

    def __init__(self, config: LLMConfig):
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, self.device)
        spec = config.speculative_config
        kernels = get_backend(config.kernel_backend)
        target = load_target(config.model, kernels, dtype, self.device)
        self.moe_backend = resolve_moe_backend(config.moe_backend, self.device, target.has_moe_layers, "moe_backend")
        drafter = None
        if spec is not None:
            check_draft_attention_backend(spec)
            self.draft_moe_backend = resolve_moe_backend(spec.moe_backend or config.moe_backend, self.device, False,
                                                         "speculative_config.moe_backend")
            drafter = load_drafter(spec, target, kernels, dtype, self.device)
        bytes_per_page = ModelRunner.bytes_per_page(target, drafter, config.page_size, dtype)
        self.num_pages = config.num_pages or pages_for_budget(kv_budget_bytes(config, self.device), bytes_per_page,
                                                              config.page_size)
        self.runner = ModelRunner(target, drafter, spec, kernels, self.num_pages, config.page_size, dtype, self.device)
        self.has_drafter = drafter is not None

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        return self.runner.execute(batch)

    def describe(self) -> list[dict]:
        return [{"rank": 0, "role": "target", "device": str(self.device), "moe_backend": self.moe_backend,
                 "drafter": "colocated" if self.has_drafter else None}]

    def shutdown(self) -> None:
        self.runner = None
