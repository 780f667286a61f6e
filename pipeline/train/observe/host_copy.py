"""Device values read on the host without waiting for the work queued after them: a log line's sums and a
checkpoint's finite check, each copied behind its step while the next steps are queued."""

from __future__ import annotations

import time
from typing import Any

import torch


class HostCopy:
    """Device values copied into host memory behind the work queued so far, read without waiting for
    the work queued after them: on CUDA a non-blocking copy into pinned memory and an event recorded
    after it, so that `wait` waits for the device to reach that point and no further (a ``tolist`` of
    the device tensor would wait for every kernel queued before the read, the next step's included).
    On a device that runs each operation as it is called (CPU) the copy is made at once and the event is
    None; the code path is the same."""

    def __init__(self, values: torch.Tensor):
        pinned = values.device.type == "cuda"
        self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
        self.values.copy_(values, non_blocking=pinned)
        self.event = HostCopy.record_event(values.device)
        self.taken = time.perf_counter()

    @staticmethod
    def record_event(device: torch.device) -> Any:
        """An event recorded on ``device``'s current stream after the work queued so far (its
        ``synchronize`` waits for that work only); None on CPU, where that work is done already."""
        if device.type == "cpu":
            return None
        event = torch.Event(device=device)
        event.record()
        return event

    def wait(self) -> tuple[list[float], float]:
        """The values, and the instant the host saw the device reach them: when the event's wait
        returned, or, without an event, when the copy was taken."""
        if self.event is None:
            return self.values.tolist(), self.taken
        self.event.synchronize()
        return self.values.tolist(), time.perf_counter()
