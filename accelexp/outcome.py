"""How a job ends: its exit code, the status its runs close with, and no credentials in either.

Exit codes: `EXIT_OK` (0); `EXIT_FAILED` (1: a sweep with a failed job or a parent run it could
not close, a worker that failed, an error Hydra reports itself, a bug); `EXIT_BAD_INPUT` (2: an
`AccelexpError` said in one line, a folder that cannot be written, a value that does not resolve);
128 + the signal on SIGINT/SIGTERM (130/143, `accelexp.signals`). `exit_code` maps an error that
ends `python run.py` to its code; `exit_now` ends a process with its code (run.py, a worker).

Statuses (MLflow's, `accelexp.tracking.life`): `status_of` maps how a run's body ended to the
status it is closed with — FINISHED, KILLED for a signal or a `SystemExit` (submitit's requeue),
FAILED for any other error.

Credentials: `keep_credentials_out` is the one place the tracking URI's `user:password@` is moved
into the environment (MLflow's variables, libpq's for PostgreSQL) and taken out of what is recorded
and printed (the config, the command line's overrides, the files Hydra wrote before accelexp ran),
or refused where it cannot move; `accelexp.tracking.credentials` is how.

A sweep: the callback that opened its parent run (`accelexp.callbacks.MlflowSweep`) registers with
the `SweepState` of the `run_main` that runs it (`sweep_state`, `current_sweep_state`), so a signal
or an error between jobs closes that parent, and `run_main` exits 1 after a sweep with failed jobs.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from omegaconf import DictConfig

from accelexp import signals
from accelexp.record import FAILED, FINISHED, KILLED

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
# a lockstep job's process that hands its run on to a fresh one (`accelexp.lockstep.gate`):
# never seen outside, the process is replaced (exec), unless that fails
EXIT_REINCARNATE = 75

__all__ = [
    "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "FAILED", "FINISHED", "KILLED", "SweepState",
    "current_sweep_state", "exit_code", "exit_now", "keep_credentials_out", "status_of",
    "sweep_state",
]  # fmt: skip


def exit_now(code: int) -> NoReturn:
    """End this process with `code`, doing what the interpreter's exit does but its teardown.

    A Gloo process group's threads can still hold tensors of the last collectives when the
    interpreter is torn down; freeing them then takes the GIL of an interpreter that is gone,
    and the process aborts ("terminate called without an active exception", SIGABRT) after a run
    that succeeded: torchrun then fails the job (pytorch/pytorch#179291). So, in the order of
    Python's own exit: wait for the threads that are not daemons, collect the garbage (a DDP
    model, its reducer and their futures) while the interpreter is whole, run the exit handlers
    (MLflow's, logging's), flush the streams; then leave without the C++ teardown — or, for
    `EXIT_REINCARNATE`, become this process again, fresh (`accelexp.lockstep.gate.reincarnate`).
    A signal met on the way (SIGTERM from a sweeper stopping its jobs) ends the process as that
    signal does, never with a fresh incarnation that would train on until killed.
    """
    try:
        threading._shutdown()  # what Python's exit does first: join the non-daemon threads
        gc.collect()
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        stop = signals.stopped_by()  # raised here, or swallowed by an exit handler
        if code == EXIT_REINCARNATE and stop is not None:
            code = stop.exit_code
        if code == EXIT_REINCARNATE:
            from accelexp.lockstep.gate import reincarnate

            reincarnate()  # returns only if exec failed
        os._exit(code)


def status_of(error: BaseException | None) -> str:
    """The status of a run whose body ended with `error` (None: it returned)."""
    if error is None:
        return FINISHED
    return KILLED if isinstance(error, KeyboardInterrupt | SystemExit) else FAILED


def exit_code(error: BaseException) -> int:
    """The exit code of `python run.py` ended by `error` outside its job (a job's own
    `AccelexpError` is said in its line and exits `EXIT_BAD_INPUT` there)."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import InterpolationResolutionError

    if isinstance(error, KeyboardInterrupt):
        return signals.interruption(error).exit_code
    if isinstance(error, CompactHydraException):
        return EXIT_FAILED
    if isinstance(error, OSError | InterpolationResolutionError | ValueError):
        return EXIT_BAD_INPUT
    return EXIT_FAILED


def keep_credentials_out(
    mlflow_cfg: DictConfig, texts: Sequence[str], hydra_folder: str | Path | None = None
) -> list[str]:
    """Hide the passwords of `mlflow_cfg`'s URIs in the files Hydra wrote into `hydra_folder`,
    move the `user:password@` of its tracking URI into the environment its client reads (worker
    processes and a sweep's jobs inherit it), leave the URI without it, and return `texts`
    (overrides) without any. A password that cannot move (a MySQL store's, one in
    `artifact_location`) is refused: `credentials.PasswordInUriError`."""
    from accelexp.tracking import credentials

    typed_uri, artifact_location = mlflow_cfg.tracking_uri, mlflow_cfg.get("artifact_location")
    if hydra_folder is not None:
        credentials.scrub_hydra_files(hydra_folder, typed_uri, artifact_location)
    credentials.refuse_password("mlflow.artifact_location", artifact_location)
    mlflow_cfg.tracking_uri = credentials.use_uri_credentials(typed_uri)
    return [credentials.strip(text) for text in texts]


class Sweep(Protocol):
    """A sweep whose parent run is open: closed as `status` when the sweep stops early."""

    def abort(self, status: str) -> None: ...


@dataclass
class SweepState:
    """The sweep a `run_main` is running (its callback, while the jobs run) and, once it ended,
    how many of its jobs FAILED (1 also when its parent run could not be closed)."""

    running: Sweep | None = None
    failed: int = 0

    def started(self, sweep: Sweep) -> None:
        self.running = sweep

    def ended(self, failed: int) -> None:
        self.running, self.failed = None, failed

    def abort(self, status: str) -> None:
        """Close the running sweep's parent run as `status` (Hydra stops without ending it on a
        signal or an error); nothing when no sweep runs."""
        sweep, self.running = self.running, None
        if sweep is not None:
            sweep.abort(status)

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.failed else EXIT_OK


# The SweepState of the `run_main` in progress in this thread: Hydra instantiates the callback
# itself, so it looks up the state its caller made (`sweep_state`) instead of being handed it.
_state: ContextVar[SweepState] = ContextVar("accelexp_sweep_state")


@contextlib.contextmanager
def sweep_state() -> Iterator[SweepState]:
    """A fresh `SweepState` for one `run_main`, current for what Hydra runs inside the block."""
    state = SweepState()
    token = _state.set(state)
    try:
        yield state
    finally:
        _state.reset(token)


def current_sweep_state() -> SweepState:
    """The state of the `run_main` in progress; outside one (Hydra started otherwise, a test),
    a fresh state that no one reads."""
    return _state.get(None) or SweepState()
