"""One incarnation of a lockstep sweep: every configuration's job as a fresh process of run.py,
all at once, taking turns (`Turns`); waited for, and all stopped on SIGINT/SIGTERM.

Each job is `python run.py <its overrides> hydra.run.dir=<sweep dir>/<job number>`: a run of its
own, composed by Hydra as any job of the sweep, made a child of the sweep's parent run by the
environment the sweep callback gives every job (`accelexp.callbacks.MlflowSweep`), and a fresh
process (a new address-space layout, new pages, new thread placement) for each incarnation.
The jobs run in sessions of their own and die with the sweeper (PR_SET_PDEATHSIG). On SIGINT or
SIGTERM each job gets SIGTERM (it closes its run KILLED and stops its workers) and `GRACE_S`
to end, then SIGKILL. A job that ended by a signal without closing its run has the run closed
FAILED here, so no run is left RUNNING.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from accelexp.lockstep.turns import Turns
from accelexp.processes import GRACE_S, die_with_parent
from accelexp.tracking.runs import FAILED, KILLED

log = logging.getLogger(__name__)

# A waiting job's OpenMP threads must sleep, not spin into the slice of the job that has the
# turn (measured: the spinning read +-13.6 % on an A/A; docs/statistics.md)
JOB_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass
class JobEnd:
    """How one job of an incarnation ended."""

    number: int  # the sweep's job number (its folder)
    overrides: list[str]
    returncode: int
    output_dir: Path


def run_incarnation(
    jobs: Sequence[Sequence[str]],
    first_number: int,
    sweep_dir: Path,
    environment: Mapping[str, str],
    names: Sequence[str],
    close_unclosed: Callable[[JobEnd, str], None],
) -> tuple[list[JobEnd], list[str]]:
    """Run `jobs` (overrides each) side by side in lockstep; their ends, and what `Turns` had
    to say (a job that failed while the others went on). A job that ended non-zero and left
    its run open has it closed (`close_unclosed(end, status)`): KILLED when the sweep was
    stopped, else FAILED."""
    turns = Turns(list(names))
    status = FAILED  # of a run a job left open
    processes: list[subprocess.Popen] = []
    ends: list[JobEnd] = []
    try:
        for index, overrides in enumerate(jobs):
            output_dir = sweep_dir / str(first_number + index)
            command = [sys.executable, sys.argv[0], *overrides, f"hydra.run.dir={output_dir}"]
            env = {**os.environ, **environment, **JOB_ENVIRONMENT, **turns.environment(index)}
            process = subprocess.Popen(
                command, env=env, start_new_session=True, preexec_fn=die_with_parent,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
            processes.append(process)
            ends.append(JobEnd(first_number + index, list(overrides), 0, output_dir))
        waiters = [
            threading.Thread(target=_wait, args=(turns, i, p), daemon=True)
            for i, p in enumerate(processes)
        ]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            while waiter.is_alive():  # joined in steps: a signal gets through between them
                waiter.join(0.5)
    except KeyboardInterrupt:
        _stop(processes)
        status = KILLED
        raise
    finally:
        for process in processes:  # nothing outlives the incarnation
            if process.poll() is None:
                process.kill()
            process.wait()
        turns.close()
        for end, process in zip(ends, processes, strict=False):
            end.returncode = process.returncode
            if end.returncode != 0:
                close_unclosed(end, status)
    return ends, turns.said


def _wait(turns: Turns, index: int, process: subprocess.Popen) -> None:
    turns.job_exited(index, process.wait())


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every job (each closes its run KILLED), SIGKILL to those still there after
    `GRACE_S`."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
