"""Executors run a ``ScheduledBatch`` on models and return plain results.

``LocalExecutor`` holds the target (and drafter) in this process; the cluster layer provides one
that fans the batch out to Ray actors. The engine sees only this protocol.
"""

from __future__ import annotations

from typing import Protocol

from configs import LLMConfig
from runtime.engine.host_work import StepRun
from runtime.scheduling.step_io import ScheduledBatch
from runtime.worker.worker import Worker, WorkerPlan


class Executor(Protocol):
    """What runs the engine's steps: every member the engine reads (``ExecutorBase`` gives the optional ones their
    defaults)."""

    num_pages: int  # KV pages of every process of the replica
    plans_ahead: bool  # its workers plan a decode step's attention ahead (the engine allots pages a token ahead)
    runs_ahead: bool  # they launch a steady greedy decode step before the one ahead of it is read back
    verifies_ahead: bool  # and the next greedy verify of the blocks drafted now (ScheduledBatch.next_verify_len)
    pipelined_drafting: bool  # a separate drafter drafts one request group while the target verifies the other
    pipeline_min_batch: int  # the requests from which those steps are pipelined
    # its steps wait on a device: ``execute`` returns a generator that yields at each point where the host is about to
    # wait (``runtime.worker.transfer.DeviceWait``) and returns the results; the engine defers host work to those waits
    # (``runtime.engine.host_work``). Otherwise ``execute`` returns the results and the engine's work runs where it arises
    yields_device_waits: bool

    def execute(self, batch: ScheduledBatch) -> StepRun:
        """Run one step: the ``RequestStepResult`` of each of its requests, or (``yields_device_waits``) a generator
        of its device waits that returns them."""

    def arm(self) -> None:
        """Called first thing in every step, before it is timed (a parked Ray replica compiles its step graph)."""

    def take_late_drafts(self) -> dict[str, tuple[list[int], list[float] | None]]:
        """Pipelined drafting: the blocks the drafter made last step for the other group (request id -> drafts,
        confidences)."""

    def stats(self) -> dict:
        """Its own counters, which ``Engine.get_metrics`` reports beside the engine's."""

    def describe(self) -> list[dict]: ...

    def shutdown(self) -> None: ...


class ExecutorBase:
    """The defaults of an executor's optional members: no planning or launching ahead, no pipelined drafter, no
    device waits (the engine's deferrable work then runs where it arises), nothing to arm, no counters."""

    plans_ahead = False
    runs_ahead = False
    verifies_ahead = False
    pipelined_drafting = False
    pipeline_min_batch = 1
    yields_device_waits = False

    def arm(self) -> None:
        pass

    def take_late_drafts(self) -> dict[str, tuple[list[int], list[float] | None]]:
        return {}

    def stats(self) -> dict:
        return {}


def replica_pages(config: LLMConfig, capacities: list[int]) -> int:
    """The replica's page count: the config's, else what its most constrained process holds."""
    if config.num_pages is not None:
        return config.num_pages
    pages = min(capacities)
    if pages < 1:
        raise ValueError(f"the KV budget holds no page of {config.page_size} tokens on at least one process; "
                         "raise kv_cache_memory or lower page_size")
    return pages


def plans_ahead(infos: list[dict]) -> bool:
    """Whether every target rank (``Worker.info()`` of each) plans a decode step's attention ahead: the engine must
    then allot each request's pages a token ahead (``Scheduler.lookahead``), else a request crossing into a new page
    makes its rank plan again in the step (at 64 requests of 16-token pages, nearly every step)."""
    targets = [info for info in infos if info.get("role") == "target"]
    return bool(targets) and all(info.get("plan_ahead") for info in targets)


class LocalExecutor(ExecutorBase):
    """The target and the drafter in this process, on one device (TP 1, drafter colocated)."""

    def __init__(self, config: LLMConfig):
        drafter = "colocated" if config.speculative_config is not None else None
        self.worker = Worker(config, WorkerPlan(role="target", tp_rank=0, tp_size=1, drafter=drafter))
        self.num_pages = replica_pages(config, [self.worker.load()])
        self.worker.allocate(self.num_pages)
        # the graphs plan a decode step's attention ahead (the engine allots pages a token ahead for it), and launch a
        # steady greedy decode step ahead of its turn when the engine says so (ScheduledBatch.run_ahead)
        self.plans_ahead = plans_ahead([self.worker.info()])
        self.runs_ahead = self.verifies_ahead = self.plans_ahead
        self.yields_device_waits = True  # (where the runner waits for a step's read-back)

    def execute(self, batch: ScheduledBatch) -> StepRun:
        return self.worker.execute_steps(batch)

    def describe(self) -> list[dict]:
        return [self.worker.info()]

    def shutdown(self) -> None:
        self.worker.shutdown()
