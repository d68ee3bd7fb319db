"""Named regions of a step for torch.profiler traces (``dspark bench --profile``), free when no profiler runs."""

from __future__ import annotations

from contextlib import nullcontext

from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

_NO_REGION = nullcontext()  # stateless: one instance serves every region


def region(name: str):
    """``record_function(name)`` while a torch profiler records, else a no-op context: a ``record_function`` costs
    ~6 us of host time even with no profiler running, and a DSpark step opens eight (0.05 ms a step, 7% of a
    small target's step)."""
    return record_function(name) if _profiler_enabled() else _NO_REGION


def gpu_gaps(intervals: list[tuple[float, float, str]], steps: int, largest: int = 8) -> dict:
    """Where the GPU idles: device activities (start us, end us, name; kernels, copies) of ``steps`` profiled steps
    -> the idle milliseconds per step between the first activity's start and the last one's end (``gpu_idle_ms_per_
    step``, time covered by no activity) and the ``largest`` gaps with the activities either side of each."""
    spans = sorted(intervals)
    gaps, reach, last = [], None, None
    for start, end, name in spans:
        if reach is not None and start > reach:
            gaps.append((start - reach, last, name))
        if reach is None or end > reach:
            reach, last = end, name
    top = sorted(gaps, key=lambda g: g[0], reverse=True)[:largest]
    return {"gpu_idle_ms_per_step": sum(g[0] for g in gaps) / steps / 1e3,
            "largest_gpu_gaps": [{"us": round(us, 1), "after": before[:60], "before": after[:60]}
                                 for us, before, after in top]}


def summarize(prof, steps: int, trace: str | None = None) -> dict:
    """A finished torch profile of ``steps`` engine steps -> CUDA kernels per step, GPU busy and idle time per step
    (the largest gaps), host milliseconds per step in each ``dspark.*`` region and CUDA runtime call, the top
    kernels; ``trace``: also the timeline as a gzip Chrome trace at that path."""
    import torch

    if trace:
        import gzip
        from pathlib import Path

        plain = Path(trace).with_suffix("")
        prof.export_chrome_trace(str(plain))
        with open(plain, "rb") as src, gzip.open(trace, "wb") as dst:
            dst.write(src.read())
        plain.unlink()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / steps / 1e3
    idle = gpu_gaps([(e.time_range.start, e.time_range.end, e.name) for e in kernels], steps=steps)
    averages = prof.key_averages()
    top = sorted(averages, key=lambda e: e.device_time_total, reverse=True)[:12]
    host = {e.key: round(e.cpu_time_total / steps / 1e3, 3) for e in averages
            if e.key.startswith(("dspark.", "cuda")) and e.cpu_time_total > 0}
    return {"kernels_per_step": len(kernels) / steps, "gpu_busy_ms_per_step": busy, **idle, "host_ms_per_step": host,
            "top_kernels": [{"name": e.key[:80], "ms_per_step": e.device_time_total / steps / 1e3,
                             "calls": e.count / steps} for e in top if e.device_time_total > 0]}


class StepProfiler:
    """A torch profile of the next ``steps`` steps a process runs (a replica rank's, asked for by the driver):
    ``start`` arms it; the profiler itself starts in ``before_step`` and stops in the ``after_step`` of the last
    step, both on the thread that runs the steps (a Ray actor runs them on its compiled graph's thread, not on the
    one that took the call: a profiler entered on one thread and left on another crashes the process). Once done,
    ``result`` holds ``summarize``'s dict."""

    def __init__(self):
        self._prof = None
        self._armed: tuple[int, str | None] | None = None
        self._left = 0
        self._steps = 0
        self._trace: str | None = None
        self.result: dict | None = None

    def start(self, steps: int, trace: str | None = None) -> None:
        if steps < 1:
            raise ValueError(f"profile: steps must be >= 1, got {steps}")
        self._armed, self.result = (steps, trace), None

    def before_step(self) -> None:
        if self._armed is None or self._prof is not None:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        (self._steps, self._trace), self._armed = self._armed, None
        self._left = self._steps
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def after_step(self) -> None:
        if self._prof is None:
            return
        self._left -= 1
        if self._left > 0:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.result = summarize(prof, self._steps, self._trace)
