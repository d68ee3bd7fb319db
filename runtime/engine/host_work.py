"""Host work that waits for the device: the engine's deferrable tasks, run where a step would block on the device.

An executor whose steps wait on a device (``Executor.yields_device_waits``) returns each step as a generator that
yields at every point where the host is about to wait for the device: right before a step's read-back, or before
planning the next verify while the drafter drafts; never between reading the verdicts and launching a step ahead.
What it yields is a ``DeviceWait``: None, or a callable saying whether the device has already finished what the host
is about to wait for. The engine drives the generator (``run_step``) and runs its queued tasks (``HostWork``) at each
wait, so while the device still computes they cost no step time; the worker never calls engine code.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from typing import Generator, Union

from runtime.scheduling.step_io import RequestStepResult
from runtime.worker.transfer import DeviceWait

# a step as an executor returns it: its results, or a generator of its device waits that returns them
StepRun = Union[list, Generator[DeviceWait, None, list]]

QUEUED_MOST = 16  # tasks past this many run whether the device is done or not (HostWork.run)


class HostWork:
    """Tasks queued between steps (``add``) that run in order, once, at the next device wait (``run``). They run in
    the engine's thread, between its own steps' work; the engine queues only work no decision needs before it runs
    (the survival fit's folds: the fit lags a few steps anyway). On a CPU device the forward has already run by the
    wait: the tasks still leave the scheduling path, but nothing overlaps them.

    ``budget_s`` bounds the host time one ``run`` spends (None: no bound): once it is spent no further task starts,
    and the rest wait for the next step's. While the host works the device has at most a step to compute, so the
    engine sets it to a share of its last step (``runtime.engine.core.HOST_WORK_SHARE``): a task longer than what the
    device leaves delays the step launched ahead of it (a whole survival refit took 1.3-4.3 ms on a 2-core host,
    against 3-ms steps at four requests), so long work is queued in slices (``SurvivalCorrection._advance_refit``).
    A call runs one task at least, unless told the device is done (``run``'s ``done``)."""

    def __init__(self):
        self._tasks: deque = deque()
        self.budget_s: float | None = None

    def add(self, task) -> None:
        """Queue ``task`` (a callable of no arguments)."""
        self._tasks.append(task)

    def run(self, done: DeviceWait = None) -> None:
        """Run the queued tasks, oldest first, while the budget lasts (tasks a task adds run too; after one that
        raised, the rest stay queued). ``done``: the wait's callable saying whether the device has finished what the
        host is about to wait for (a step not launched ahead: its read-back has landed); once it says so no task
        starts (the device would wait for it: the rest wait for a step that leaves room), unless more than
        ``QUEUED_MOST`` are queued (then they run as without it: the queue never grows without bound)."""
        budget, start = self.budget_s, time.perf_counter()
        while self._tasks:
            if done is not None and len(self._tasks) <= QUEUED_MOST and done():
                break
            self._tasks.popleft()()
            if budget is not None and time.perf_counter() - start >= budget:
                break

    def __len__(self) -> int:
        return len(self._tasks)


def run_step(run: StepRun, host_work: HostWork | None) -> list[RequestStepResult]:
    """Drive one executed step to its results, running ``host_work`` (if any) at each of its device waits. A task
    that raises fails the step (a bug, never swallowed), but only once the step has finished: the device work it
    launched is read back and nothing is left in flight."""
    if not inspect.isgenerator(run):
        return run
    failed = None
    while True:
        try:
            done = next(run)
        except StopIteration as stop:
            results = stop.value
            break
        if host_work is not None and failed is None:
            try:
                host_work.run(done=done)
            except Exception as exc:  # noqa: BLE001 - re-raised once the step has finished
                failed = exc
    if failed is not None:
        raise failed
    return results
