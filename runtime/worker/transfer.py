"""What a step yields where the host is about to wait for the device (``DeviceWait``), and driving a step through
those waits (``finish``). Host-device copies that do not wait: ``runtime.kernels.transfer``."""

from __future__ import annotations

from typing import Any, Callable, Generator, Union

# A step's generator (``ModelRunner.execute``) yields one where the host is about to wait for the device, so that its
# caller may do host work while the device computes: None, or a callable saying whether the device has already
# finished what the host waits for (then no further work should start: it would delay the step)
DeviceWait = Union[Callable[[], bool], None]


def finish(run: Generator[DeviceWait, None, Any]) -> Any:
    """Drive a step's generator through its device waits, doing nothing at them (a process where no engine runs:
    a Ray actor); its return value (the step's results)."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value
