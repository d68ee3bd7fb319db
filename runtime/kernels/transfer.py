"""Host lists to device tensors without waiting for the device (the step's one sync is its result transfer), and
device results to the host without waiting for work launched after them (``PinnedReadBack``)."""

from __future__ import annotations

import numpy as np
import torch


def host_tensor(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the host, through numpy: from a Python list torch builds its tensor
    ~3x slower (1.8 ms against 0.56 ms for 33K ints, the page table of 256 requests of 2K tokens). Same dtypes as
    torch's inference (ints int64, floats float32, bools bool)."""
    array = np.array(values)
    if dtype is None and array.dtype == np.float64:
        dtype = torch.float32
    tensor = torch.from_numpy(array)
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list, nested lists) as a tensor on ``device``, without waiting for work already queued there.

    A plain ``torch.tensor(values, device="cuda")`` synchronizes the stream after its copy (302 us of host time
    per call behind a busy GPU on an H200, ``benchmarks/h2d_copy.py``); a non-blocking copy from the pageable
    host tensor returns once the driver has staged the bytes (27 us; pinning first costs 37 us), and the device
    reads them in stream order.
    """
    if device.type != "cuda":
        return host_tensor(values, dtype)
    return host_tensor(values, dtype).to(device, non_blocking=True)


class PinnedReadBack:
    """A device-to-host copy that the host waits for alone: ``queue`` copies a tensor into pinned memory (grown as
    needed) and records an event right behind the copy; ``wait`` waits for that event only. Work launched after
    ``queue`` (a step launched ahead) does not delay the wait, as it would a ``.tolist()`` queued behind it
    (``benchmarks/graph_launch.py --readback``). Pinned memory and the event are made on first use (CUDA only)."""

    def __init__(self, size: int = 0, dtype: torch.dtype = torch.int64):
        self._host = torch.empty(size, dtype=dtype, pin_memory=True) if size else None
        self._event = None
        self._view: torch.Tensor | None = None

    def queue(self, tensor: torch.Tensor) -> None:
        """Queue the copy of ``tensor`` (on the device) and the event behind it."""
        n = tensor.numel()
        if self._host is None or self._host.numel() < n or self._host.dtype != tensor.dtype:
            grown = 2 * self._host.numel() if self._host is not None and self._host.dtype == tensor.dtype else 0
            self._host = torch.empty(max(n, grown), dtype=tensor.dtype, pin_memory=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._view = self._host[:n].view(tensor.shape)
        self._view.copy_(tensor, non_blocking=True)
        self._event.record()

    def wait(self) -> torch.Tensor:
        """The last queued copy on the host, once it has landed (a view, valid until the next ``queue``)."""
        self._event.synchronize()
        return self._view

    def landed(self) -> bool:
        """Whether the last queued copy has landed (the device has finished everything queued before it)."""
        return self._event is None or self._event.query()
