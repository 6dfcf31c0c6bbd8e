"""Lockstep in one process: every job of an incarnation in one process, on one thread.

    python -m accelexp.lockstep_process SPEC_DIR      (started by `accelexp.lockstep.jobs`)

This module holds what the jobs share and how each keeps its own (the gate, `ProcessState`, the
spec); `accelexp.lockstep_process` is the process itself, which runs them (it alone imports
the training, which imports lockstep).

Two identical trainings in two processes taking turns run at different speeds for the whole
life of their processes (3-22 % on the 2-core VM, a different one faster each time:
`docs/statistics.md`); in one process that bias is gone, because whatever a process carries
(its heap and the pages behind it, its threads' placement) both sides then share and their ratio
cancels it. So where every job of a lockstep sweep is one process (no launched workers) that
does not compile, the jobs run here, taking turns exactly as separate processes do: each
connects to the sweep's `Turns` as its job (`SharedProcessGate`).

The jobs are greenlets of the main thread, not threads: every torch call then comes from the
same OS thread, so both sides run on the same OpenMP team (each OS thread that calls into torch
gets a team of its own, and two teams are two placements: jobs in two threads of one process read
a bias again, `docs/statistics.md`). A job runs until its gate waits for its next turn; the hub
(`main`) then waits on every waiting job's socket and resumes the job whose turn came.

What one process shares, and how each job still gets its own:

- set-up (data, model, optimizer, the run in MLflow) runs one job at a time, in job order, each
  until it first reaches its gate;
- the process-wide state a job sets — the RNGs (torch, CUDA, Python, NumPy), torch's intra-op
  threads, grad mode, the backend flags (cuDNN benchmark and TF32, float32 matmul precision,
  deterministic algorithms) — is captured when it hands the turn on and put back when it takes
  the turn again (`ProcessState`), so each job trains on its own random stream with its own
  switches, as it would alone;
- a crash that takes the process down (a segfault, SIGKILL, the OOM killer) ends every job of
  the incarnation; the sweep closes their runs (FAILED, or KILLED when stopped). An exception
  in a job ends that job only, as with processes: its run is closed FAILED, its gate says why,
  the others go on alone.

SIGINT/SIGTERM (the sweep stopping, or the user): every job still alive gets a KeyboardInterrupt
where it waits (or where it runs), closes its run KILLED; the process exits 128 + the signal.
SPEC_DIR/jobs.json names each job's config (resolved, as the sweep composed it), folder,
overrides and lockstep address; SPEC_DIR/ends.json gets each job's exit code.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import greenlet
from omegaconf import DictConfig, OmegaConf

from accelexp.lockstep.gate import LockstepGate
from accelexp.record import PROCESS_SHARED

SPEC = "jobs.json"
ENDS = "ends.json"


def why_not(configs: list[DictConfig]) -> str:
    """Why these jobs cannot share one process ("" when they can): a job of several workers
    (each a process of its launcher), one that compiles (torch.compile's caches and guards
    are the process's, not a job's), or jobs that want the heap set unlike (`accelexp.heap`).
    Keys of process-wide state, not an Affects kind (speed.heap affects speed only, speed.compile
    results and speed too)."""
    for cfg in configs:
        if cfg.parallelism.nprocs != 1:
            return f"parallelism.nprocs={cfg.parallelism.nprocs} starts workers of its own"
        if cfg.speed.compile != "off":
            return f"speed.compile={cfg.speed.compile} compiles in the process's own caches"
    heaps = sorted({str(cfg.speed.heap) for cfg in configs})
    if len(heaps) > 1:
        return f"speed.heap={','.join(heaps)}: the heap's thresholds are the process's"
    return ""


@dataclass
class ProcessState:
    """What one job sets that its process holds for every thread (see the module doc)."""

    rng: tuple[Any, ...]
    threads: int
    grad: bool
    backends: tuple[Any, ...]

    @classmethod
    def capture(cls) -> ProcessState:
        import numpy as np
        import torch

        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        rng = (torch.get_rng_state(), cuda, random.getstate(), np.random.get_state())
        return cls(rng, torch.get_num_threads(), torch.is_grad_enabled(), _backends())

    def restore(self) -> None:
        import numpy as np
        import torch

        cpu, cuda, python, numpy = self.rng
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        np.random.set_state(numpy)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_grad_enabled(self.grad)
        if _backends() != self.backends:
            benchmark, cudnn_tf32, matmul, deterministic, warn_only = self.backends
            torch.backends.cudnn.benchmark = benchmark
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
            torch.set_float32_matmul_precision(matmul)
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


def _backends() -> tuple[Any, ...]:
    import torch

    return (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


class SharedProcessGate(LockstepGate):
    """A job's gate when it shares its process with the other jobs of its incarnation: it waits
    for its turn by handing control to the hub (`main`), and keeps its process-wide state
    (`ProcessState`) across the other jobs' turns."""

    def __init__(self, spec: str, slice_steps: int, hub: greenlet.greenlet) -> None:
        address, job, authkey = spec.split(" ")
        super().__init__(address, int(job), bytes.fromhex(authkey), 0, 1, slice_steps)
        self.process = PROCESS_SHARED
        self.hub = hub

    def turn(self) -> int:
        state = ProcessState.capture()
        round_ = super().turn()
        state.restore()
        return round_

    def _receive(self) -> tuple[str, int]:
        self.hub.switch(self.conn)  # back here once the hub saw this job's turn come
        return self.conn.recv()


def write_spec(folder: Path, jobs: list[dict[str, Any]]) -> None:
    """`jobs`: each one's number, config (a DictConfig, saved resolved), output_dir, overrides
    and lockstep value; for `main` to read."""
    folder.mkdir(parents=True, exist_ok=True)
    listed = []
    for job in jobs:
        config = folder / f"config{job['number']}.yaml"
        OmegaConf.save(job["config"], config, resolve=True)
        listed.append({**job, "config": str(config)})
        hydra = Path(job["output_dir"]) / ".hydra"  # as Hydra keeps a job's, for its run
        hydra.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(job["config"], hydra / "config.yaml")
        OmegaConf.save(OmegaConf.create(list(job["overrides"])), hydra / "overrides.yaml")
    (folder / SPEC).write_text(json.dumps(listed))


def read_ends(folder: Path) -> dict[int, int]:
    """Each job's exit code, by number, as `main` wrote them (none if it never got there)."""
    try:
        return {int(k): v for k, v in json.loads((folder / ENDS).read_text()).items()}
    except (OSError, ValueError):
        return {}
