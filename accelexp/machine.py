"""What this host has for a run, and what of it the run left idle: the facts "more devices" is
drawn from (`accelexp.parallel.base.Strategy.scale_out_advice`).

A `Machine` is built once, at a run's end (`accelexp.diagnosis.run`), from what the run measured
while its steps were timed (`accelexp.diagnosis.noise`: the cores the job's processes kept busy,
the cores other processes kept busy, the usable cores of the affinity mask), the threads each
worker computed with, and the CUDA GPUs this process sees (`visible_gpus`: the one place the
advice asks CUDA). `room(workers, devices_per_worker)` says how many workers — on a CPU, with how
many threads each — would put this host's idle devices to work, or None where there are none:

- On a CPU, more workers are more processes on the same cores. They are offered only where at
  least `IDLE_CORES_MIN` cores were idle while the run was timed — idle = usable cores − the
  job's busy cores − others' busy cores − the cores' time the hypervisor stole, in the epoch that
  left the fewest — and as workers × threads = the usable cores: each worker with as many threads
  as one of the run's workers kept busy (at most the threads it had), rounded down to a divisor
  of the cores. Never assumed from the config: a run with `threads=1` leaves a core of two idle
  only if it measurably did.
- On a GPU, only where this process sees more GPUs than the run's workers on this host use
  (workers × devices per worker): as many workers as the visible GPUs hold.

Calibration, on this 2-core shared VM, simple_cnn on Fashion-MNIST: `python run.py epochs=2
threads=null` (the default run: 2 threads) and `threads=1`, one pair of whole runs and three
alternated pairs with `max_steps_per_epoch=200`, the idle cores of each epoch from its `noise/*`
metrics. Default runs: 0.00-0.01 idle (the job 0.65-1.56 cores, the rest others' and the
hypervisor's: the machine was shared throughout; in the one epoch without other processes the
job kept 1.56 cores busy and the hypervisor stole 0.43). `threads=1`: 0.75-0.95 idle where
nobody else ran (the job 0.86-0.98 cores; the hypervisor stole 0.04-0.23), 0.09-0.14 beside
another process that kept the second core busy (others 0.67-0.84: that core was not idle, and
is not offered). `IDLE_CORES_MIN` 0.5 sits between them, at least 0.25 from each. A whole core
(1.0) would refuse every one-thread run measured: the steal and the interpreter's own work
leave at most 0.95. Counting the stolen time matters: without it a default run read up to 0.47
cores idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

IDLE_CORES_MIN = 0.5  # idle cores for more workers: default runs read <= 0.01, threads=1 >= 0.75


@dataclass(frozen=True)
class Room:
    """More workers that this host's idle devices hold, and why."""

    workers: int
    threads: int | None  # each worker's torch threads on a CPU (workers × threads = the cores)
    why: str


@dataclass(frozen=True)
class Machine:
    """This host, as a run found it while its steps were timed; None: not measured."""

    device_type: str  # cpu | cuda
    cores: int  # usable by this process (the affinity mask)
    threads: int = 1  # torch threads of each of the run's workers
    gpus: int = 0  # CUDA GPUs this process sees
    job_cores: float | None = None  # cores the job's processes kept busy
    others_cores: float | None = None  # cores other processes kept busy
    worker_cores: float | None = None  # cores one worker (its process tree) kept busy
    stolen_cores: float = 0.0  # cores' time the hypervisor gave to other machines

    @property
    def idle_cores(self) -> float | None:
        if self.job_cores is None or self.others_cores is None:
            return None
        return max(0.0, self.cores - self.job_cores - self.others_cores - self.stolen_cores)

    def room(self, workers: int, devices_per_worker: int = 1) -> Room | None:
        """More workers than the run's `workers` on this host that its idle devices hold (see
        the module's docstring); None: no idle devices, or no more workers fit them."""
        if self.device_type == "cuda":
            return self._gpu_room(workers, devices_per_worker)
        return self._cpu_room(workers)

    def _cpu_room(self, workers: int) -> Room | None:
        idle = self.idle_cores
        if idle is None or idle < IDLE_CORES_MIN:
            return None
        busy = self.worker_cores if self.worker_cores is not None else self.threads
        each = min(max(1, math.floor(busy + 0.5)), self.threads, self.cores)
        each = max(d for d in range(1, each + 1) if self.cores % d == 0)
        more = self.cores // each
        if more <= workers:
            return None
        why = (
            f"{more} workers × {each} thread{'s' if each > 1 else ''} on the {self.cores} "
            f"cores: {idle:.1f} of them idle while timed"
        )
        return Room(more, each, why)

    def _gpu_room(self, workers: int, devices_per_worker: int) -> Room | None:
        used = workers * devices_per_worker
        more = self.gpus // devices_per_worker
        if self.gpus <= used or more <= workers:
            return None
        each = f" of {devices_per_worker} GPUs each" if devices_per_worker > 1 else ""
        return Room(
            more, None, f"{more} workers{each} on the {self.gpus} GPUs visible here ({used} used)"
        )

    def evidence(self) -> str | None:
        """One line for a verdict's evidence: the cores busy and idle, or the GPUs seen."""
        if self.device_type == "cuda":
            return f"{self.gpus} GPU{'s' if self.gpus != 1 else ''} visible to this process"
        idle = self.idle_cores
        if idle is None:
            return None
        busy = f"busiest epoch: the job's {self.job_cores:.1f}, others' {self.others_cores:.1f}"
        if self.stolen_cores >= 0.05:
            busy += f", the hypervisor's {self.stolen_cores:.1f}"
        if idle < IDLE_CORES_MIN:
            return (
                f"all {self.cores} usable cores busy while timed ({busy}): more workers would "
                f"only share them"
            )
        return f"{idle:.1f} of the {self.cores} usable cores idle while timed ({busy})"


def visible_gpus(device_type: str) -> int:
    """The CUDA GPUs this process sees; 0 off CUDA."""
    if device_type != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()
