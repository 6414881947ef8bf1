"""The device's clock: where a step's data, compute and communication seconds are measured.

A GPU runs the work the host queued, later: the host's clock at a call tells when the work
was queued, not when it ran. Every timing site therefore takes a `mark()`, a point in the
device's queue of work (a CUDA event recorded on the current stream, which the GPU stamps
when it gets there; on the CPU, where kernels run as they are called, the host's clock), and
reads the seconds between two marks later, with `seconds(start, end)`. The training loop,
the strategies' exchanges (CommMeter) and the tests' fake event clock share this interface,
so each strategy's split of a step means the same on a GPU as on a CPU.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

Mark = Any  # what a clock's mark() returns: a float (host), a CUDA event, a fake's time


@runtime_checkable
class Clock(Protocol):
    #: marks to leave unread before reading the oldest (a GPU runs behind the host: reading a
    #: mark the device has not reached makes the host wait for it)
    lag: int
    #: its name in metrics.json (`compute.timing_clock`)
    kind: str

    def mark(self) -> Mark:
        """A point in the device's queue of work, as of now."""

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds the device spent from `start` to `end` (waits until it has reached `end`)."""

    def sleep(self, seconds: float) -> None:
        """`seconds` more on the device's timeline, after the work queued so far (a straggler's
        delay): a wait the device's marks see, not only the host."""


class HostClock:
    """The host's clock: right where kernels run as they are called (the CPU)."""

    lag = 0
    kind = "host"

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now

    def mark(self) -> float:
        return self.now()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class CudaClock:
    """CUDA events on the current stream; read a step late, so the host never waits for a step it queued."""

    lag = 1
    kind = "cuda_events"

    def mark(self):
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    def sleep(self, seconds: float) -> None:
        import torch

        # the host runs up to a step ahead of the GPU: a host sleep alone would overlap the work
        # still queued and vanish from the events. The GPU drains its queue, then idles.
        torch.cuda.current_stream().synchronize()
        time.sleep(seconds)


_thread = threading.local()  # a clock installed for this thread (dtstudy.emulation: a logical worker's)


def install_clock(clock: Clock | None) -> None:
    """Make `clock` what clock_for gives on this thread (None: the device's again).
    An emulated run's logical workers are threads, each on its own emulated clock."""
    _thread.clock = clock


def clock_for(device) -> Clock:
    """The clock that measures work on `device` (a torch.device), or this thread's installed one."""
    installed = getattr(_thread, "clock", None)
    if installed is not None:
        return installed
    return CudaClock() if device.type == "cuda" else HostClock()


class StepTimer:
    """One worker's steps timed on `clock`: data (from asking for the batch to its arrival on
    the device), step (forward, backward, update, exchange included) and the exchange's
    spans the strategy's CommMeter collected. Each step's figures go to its `record` callback
    (data_s, step_s, comm_s, bytes_sent, images) once `clock.lag` later steps were queued;
    `flush()` records the rest (before anything reads the log)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.pending: deque = deque()
        self._data = self._step = None

    def data_start(self) -> None:
        self._data = self.clock.mark()

    def step_start(self) -> None:
        self._step = self.clock.mark()
        # a clock that makes time rather than reading it (dtstudy.emulation's) adds the step's compute here
        begins = getattr(self.clock, "step_begins", None)
        if begins is not None:
            begins()

    def step_end(self, meter, images: int, record: Callable) -> None:
        end = self.clock.mark()
        self.pending.append((self._data, self._step, end, meter.take_pending(), images, record))
        while len(self.pending) > self.clock.lag:
            self._record(self.pending.popleft())

    def flush(self) -> None:
        while self.pending:
            self._record(self.pending.popleft())

    def _record(self, entry) -> None:
        data, step, end, exchange, images, record = entry
        record(
            self.clock.seconds(data, step),
            self.clock.seconds(step, end),
            exchange.comm_seconds(),
            exchange.bytes_sent,
            images,
        )


@dataclass
class PendingExchange:
    """A step's exchange as a CommMeter took it: spans of `clock`'s marks still to be read,
    seconds measured otherwise, and the bytes sent."""

    clock: Clock
    spans: list
    seconds: float
    bytes_sent: float

    def comm_seconds(self) -> float:
        return self.seconds + sum(self.clock.seconds(start, end) for start, end in self.spans)
