"""Always-on time accounting of the training steps: where each epoch's time went.

`StepClock` is told where each step's phases end — the batch has arrived (`INPUT`), forward and
loss (`FORWARD`), backward (`BACKWARD`), optimizer, scheduler and zero_grad (`OPTIMIZER`), the
loop's own bookkeeping (`OTHER`) — and adds up the host time of each, from `time.perf_counter`:
a few hundred nanoseconds per step, and no host sync.

Communication is timed by the strategy that does it (`CommTime`): the time the host waited for a
collective is moved out of the phase it was waited in (DDP: backward; Horovod: optimizer) into
`comm`, so the phases still add up to the epoch's wall time. Where a strategy also knows when
its collectives were in flight (DDP on Gloo: a timing comm hook), `comm_inflight` and the share
of it hidden behind compute (`comm_overlap`) are reported too.

On CUDA every phase end also records a CUDA event (from a pool, reused across epochs), read once
at the epoch's end, after the loop's own synchronisation. A CUDA event completes when the GPU
has finished the work queued before it, so between two phase ends the GPU was certainly busy
from the moment the host had queued the phase's work (its host time) until it finished it: the
sum of those stretches is `gpu_busy`, a lower bound of the GPU's busy time as a fraction of the
epoch. A GPU that only ever keeps up with the host (launch-bound, or starved of input) is near 0;
a GPU the host waits for is near 1. Kernel-level figures (idle time inside a step, overlap of
communication and compute on the GPU) are what `profile=true` and HTA add.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, fields

import torch

from accelexp.record import (
    TIME_COMM_INFLIGHT_S,
    TIME_COMM_OVERLAP,
    TIME_GPU_BUSY,
    TIME_PARTS,
    time_s,
)

INPUT, FORWARD, BACKWARD, OPTIMIZER, OTHER = range(5)
PHASES = ("input", "forward", "backward", "optimizer", "other")


@dataclass
class CommTime:
    """A strategy's communication of one epoch, as it measured it.

    `exposed`: seconds the host waited for collectives, per phase it waited in (moved out of
    that phase into `comm`). `inflight`: seconds some collective was in flight, hidden or not,
    or None when the strategy cannot tell.
    """

    exposed: dict[str, float] = field(default_factory=dict)
    inflight: float | None = None

    def wait(self, phase: str, seconds: float) -> None:
        self.exposed[phase] = self.exposed.get(phase, 0.0) + seconds

    def in_flight(self, seconds: float) -> None:
        self.inflight = (self.inflight or 0.0) + seconds


@dataclass
class Breakdown:
    """Seconds of one epoch's timed training steps, per phase (they add up to `wall`)."""

    input: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    comm: float = 0.0
    other: float = 0.0
    comm_inflight: float | None = None
    gpu_busy: float | None = None  # fraction of `wall`, a lower bound (CUDA only)

    PARTS = TIME_PARTS  # its fields above, each logged as the metric `time_s(part)`

    @property
    def wall(self) -> float:
        return sum(getattr(self, part) for part in self.PARTS)

    def share(self, part: str) -> float:
        wall = self.wall
        return getattr(self, part) / wall if wall > 0 else 0.0

    @property
    def comm_overlap(self) -> float | None:
        """The share of in-flight communication hidden behind compute."""
        if not self.comm_inflight:
            return None
        return max(0.0, 1.0 - self.comm / self.comm_inflight)

    def metrics(self) -> dict[str, float | None]:
        """MLflow metrics `time/<part>_s` (and the optional figures when known)."""
        metrics: dict[str, float | None] = {time_s(p): getattr(self, p) for p in self.PARTS}
        metrics[TIME_COMM_INFLIGHT_S] = self.comm_inflight
        metrics[TIME_COMM_OVERLAP] = self.comm_overlap
        metrics[TIME_GPU_BUSY] = self.gpu_busy
        return metrics

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        """Every field (None as NaN), for averaging over ranks in one collective."""
        values = [getattr(self, f.name) for f in fields(self)]
        nan = float("nan")
        return torch.tensor(
            [nan if v is None else float(v) for v in values], dtype=torch.float64, device=device
        )

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Breakdown:
        values = [None if v != v else v for v in tensor.tolist()]  # NaN: not known
        return cls(**{f.name: v for f, v in zip(fields(cls), values, strict=True)})


class _GpuMarks:
    """CUDA events recorded at phase ends, with the host time of each; read after a sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: list[torch.cuda.Event] = []
        self.used = 0
        self.host: list[float] = []

    def begin(self, host_now: float) -> None:
        """At the epoch's start, right after a device sync: the anchor of both clocks."""
        self.used = 0
        self.host.clear()
        self.mark(host_now)

    def mark(self, host_now: float) -> None:
        if self.used == len(self.pool):
            self.pool.append(torch.cuda.Event(enable_timing=True))
        self.pool[self.used].record()
        self.used += 1
        self.host.append(host_now)

    def busy_seconds(self) -> float:
        """GPU time that certainly was busy (see the module's docstring); after a sync."""
        anchor, t0 = self.pool[0], self.host[0]
        gpu_done = [t0 + anchor.elapsed_time(e) / 1e3 for e in self.pool[: self.used]]
        return sum(
            max(0.0, gpu_done[i] - max(gpu_done[i - 1], self.host[i])) for i in range(1, self.used)
        )


class StepClock:
    """Phase times of one epoch's training steps on this rank (see the module's docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds = [0.0] * len(PHASES)
        self.last = 0.0
        self.step_ends: list[float] = []  # when each timed step's last phase (OTHER) ended
        self.excluded = 0.0
        self._paused_at: float | None = None
        self.gpu = _GpuMarks(device) if device.type == "cuda" else None

    def start(self) -> None:
        """The epoch's timed part starts now (after a device sync)."""
        self.seconds = [0.0] * len(PHASES)
        self.last = time.perf_counter()
        self.step_ends = [self.last]
        self.excluded = 0.0  # seconds paused (another job's lockstep turn): no phase's
        self._paused_at: float | None = None
        if self.gpu is not None:
            self.gpu.begin(self.last)

    def pause(self) -> None:
        """From now until `resume` the clock stands still (the job waits for its turn)."""
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        assert self._paused_at is not None, "resume() without pause()"
        gap = time.perf_counter() - self._paused_at
        self.last += gap
        self.excluded += gap
        self._paused_at = None

    def mark(self, phase: int) -> None:
        """The `phase` of this step ends now."""
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now
        if phase == OTHER:  # on the clock that stood still while paused
            self.step_ends.append(now - self.excluded)
        if self.gpu is not None:
            self.gpu.mark(now)

    def step_seconds(self) -> list[float]:
        """The host time of each timed step since `start`, in order: a correlated series whose
        batch means give the throughput's interval (`accelexp.stats.rate`). On CUDA a step's host
        time is its queueing time, which the GPU paces once the queue is full: the batches' means
        follow the GPU's step time, single steps jitter."""
        ends = self.step_ends
        return [b - a for a, b in itertools.pairwise(ends)]

    def stop(self, comm: CommTime | None = None) -> Breakdown:
        """The epoch's breakdown (after the loop's final device sync)."""
        now = time.perf_counter()
        self.seconds[OTHER] += now - self.last
        parts = dict(zip(PHASES, self.seconds, strict=True))
        breakdown = Breakdown(**parts)
        if comm is not None:
            for phase, waited in comm.exposed.items():
                moved = min(waited, getattr(breakdown, phase))
                setattr(breakdown, phase, getattr(breakdown, phase) - moved)
                breakdown.comm += moved
            breakdown.comm_inflight = comm.inflight
        if self.gpu is not None and self.gpu.used > 1:
            wall = now - self.gpu.host[0] - self.excluded
            breakdown.gpu_busy = min(1.0, self.gpu.busy_seconds() / wall)
        return breakdown
