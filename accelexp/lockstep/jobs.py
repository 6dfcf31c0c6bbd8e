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

from omegaconf import DictConfig

from accelexp.lockstep import LOCKSTEP_ENV, together
from accelexp.lockstep.turns import Turns
from accelexp.processes import GRACE_S, SWEEP_ENV, die_with_parent
from accelexp.record import FAILED, KILLED

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
    configs: Sequence[DictConfig] | None = None,
    turn_timeout_s: float = 600.0,
) -> tuple[list[JobEnd], list[str]]:
    """Run `jobs` (overrides each) side by side in lockstep; their ends, and what `Turns` had
    to say (a job that failed while the others went on). With their `configs` (as the sweep
    composed them), all in one process (`accelexp.lockstep.together`), else each in its own.
    A job that ended non-zero and left its run open has it closed (`close_unclosed(end,
    status)`): KILLED when the sweep was stopped, else FAILED. A job that holds its turn over
    `turn_timeout_s` is hung: its process is killed (with the jobs that share it) and its run
    closed FAILED."""
    turns = Turns(list(names), turn_timeout_s, one_process=configs is not None)
    status = FAILED  # of a run a job left open
    processes: list[subprocess.Popen] = []
    ends = [
        JobEnd(first_number + i, list(overrides), 0, sweep_dir / str(first_number + i))
        for i, overrides in enumerate(jobs)
    ]
    shared = sweep_dir / f"lockstep{first_number}"  # one process's jobs (`together`)
    try:
        if configs is None:
            for index, end in enumerate(ends):
                command = [
                    sys.executable, sys.argv[0], *end.overrides, f"hydra.run.dir={end.output_dir}"
                ]  # fmt: skip
                processes.append(_start(command, {**environment, **turns.environment(index)}))
            waiters = [
                threading.Thread(target=_wait, args=(turns, {i: e.number}, p), daemon=True)
                for i, (e, p) in enumerate(zip(ends, processes, strict=True))
            ]
        else:
            together.write_spec(
                shared,
                [
                    {
                        "number": end.number,
                        "config": cfg,
                        "output_dir": str(end.output_dir),
                        "overrides": end.overrides,
                        "lockstep": turns.environment(index)[LOCKSTEP_ENV],
                    }
                    for index, (end, cfg) in enumerate(zip(ends, configs, strict=True))
                ],
            )
            command = [sys.executable, "-m", "accelexp.lockstep_process", str(shared)]
            processes.append(_start(command, environment))
            everyone = {i: end.number for i, end in enumerate(ends)}
            waiters = [
                threading.Thread(
                    target=_wait, args=(turns, everyone, processes[0], shared), daemon=True
                )
            ]
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            while waiter.is_alive():  # joined in steps: a signal gets through between them
                waiter.join(0.5)
                _kill_hung(turns, processes)
    except KeyboardInterrupt:
        turns.stopping()
        _stop(processes)
        status = KILLED
        raise
    finally:
        for process in processes:  # nothing outlives the incarnation
            if process.poll() is None:
                process.kill()
            process.wait()
        turns.close()
        own = together.read_ends(shared) if configs is not None else {}
        for index, end in enumerate(ends):
            which = 0 if configs is not None else index  # the process that ran it
            returncode = processes[which].returncode if which < len(processes) else 1
            end.returncode = own.get(end.number, returncode)
            if end.returncode != 0:
                close_unclosed(end, status)
    return ends, turns.said


def _start(command: list[str], environment: Mapping[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, env={**os.environ, **environment, **JOB_ENVIRONMENT, SWEEP_ENV: str(os.getpid())},
        start_new_session=True,
        preexec_fn=die_with_parent, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def _wait(
    turns: Turns, numbers: dict[int, int], process: subprocess.Popen, shared: Path | None = None
) -> None:
    """Tell `turns` when the process of the jobs `numbers` (index: job number) ended, and each
    one's exit code (a process of several jobs wrote theirs: `together.read_ends`)."""
    returncode = process.wait()
    own = together.read_ends(shared) if shared is not None else {}
    for index, number in numbers.items():
        turns.job_exited(index, own.get(number, returncode))


def _kill_hung(turns: Turns, processes: Sequence[subprocess.Popen]) -> None:
    """SIGKILL the process group of each job `turns` found hung (one process holding every job:
    that one): it may not answer a signal it would handle (blocked in a collective), and its
    run, left open, is closed FAILED (`close_unclosed`)."""
    while not turns.hung.empty():
        index = turns.hung.get()
        process = processes[0] if turns.one_process else processes[index]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


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
