"""The job's side of lockstep: the gate the training loop passes before each slice of steps.

`Gate.turn()` hands back the turn this rank held (if any) and blocks until the job's next turn,
returning that turn's round. Every rank of a job has its own gate and the coordinator
(`accelexp.lockstep.turns.Turns`) grants a turn to all ranks of a job together, once each of them
asked for it, so the ranks of a multi-worker job take the turn as one. `close()` ends the job's
part: it holds the turn until then, so what a run does after its last step (the test set, the
final logging) runs in its turn too. A job outside lockstep gets `NoGate`, whose `turn` returns
at once and which asks for no slices (`slice_steps` is None).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path
from typing import Protocol

from accelexp.errors import AccelexpError
from accelexp.lockstep import LOCKSTEP_ENV
from accelexp.record import PROCESS_OWN

INCARNATION_ENV = "ACCELEXP_INCARNATION"  # how many processes of this job came before this one


class Reincarnation(BaseException):
    """This process has trained its share of the run (`lockstep.epochs_per_process`): the run
    goes on from its last checkpoint in a fresh process, the same job (`reincarnate`)."""


class LockstepGoneError(AccelexpError):
    """The sweep that hands the turns is gone: a job in lockstep cannot go on alone."""


class Gate(Protocol):
    """What the loop sees of lockstep: a gate before each slice of `slice_steps` steps."""

    slice_steps: int | None  # None: no slices (not in lockstep)
    epochs_per_process: int | None  # a fresh process every this many epochs; None: never
    incarnation: int  # how many processes of this job came before this one
    process: str  # record.PROCESS_OWN, or PROCESS_SHARED with the sweep's other jobs

    def turn(self) -> int:
        """Hand back the turn held, wait for the next; its round."""
        ...

    def close(self, again: bool = False, why: str = "") -> None:
        """The job's part ends (`again`: it goes on in a fresh process: `Reincarnation`; `why`:
        its run failed or was stopped, and why)."""
        ...

    def keep_record(self, path: Path, step_ends: list[float]) -> None:
        """At `close`, write the turns and `step_ends` (filled meanwhile) into `path`."""
        ...


class NoGate:
    """Not in lockstep: no slices, no waiting."""

    slice_steps: int | None = None
    epochs_per_process: int | None = None
    incarnation: int = 0
    process: str = PROCESS_OWN

    def turn(self) -> int:
        return 0

    def close(self, again: bool = False, why: str = "") -> None:
        pass

    def keep_record(self, path: Path, step_ends: list[float]) -> None:
        pass


class LockstepGate:
    """A rank's connection to the sweep's `Turns`. `turns` records (round, granted, handed back)
    on `time.monotonic`'s clock, which every process of the host shares; `keep_record` has them
    written, with the steps' ends, into the job's folder at `close` (`record.lockstep_file`)."""

    def __init__(self, address: str, job: int, authkey: bytes, rank: int, world_size: int,
                 slice_steps: int, epochs_per_process: int | None = None) -> None:  # fmt: skip
        self.slice_steps = slice_steps
        self.epochs_per_process = epochs_per_process
        self.process = PROCESS_OWN
        self.incarnation = int(os.environ.get(INCARNATION_ENV) or 0)
        self.job, self.rank = job, rank
        self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        self.conn.send(("hello", job, rank, world_size, os.getpid()))
        self.turns: list[tuple[int, float, float]] = []
        self._granted: tuple[int, float] | None = None
        self._record: tuple[Path, list[float]] | None = None

    def keep_record(self, path: Path, step_ends: list[float]) -> None:
        self._record = (path, step_ends)

    def turn(self) -> int:
        now = time.monotonic()
        if self._granted is not None:
            self.turns.append((*self._granted, now))
        try:
            self.conn.send(("ready",))
            message, round_ = self._receive()
        except (EOFError, OSError) as error:
            raise LockstepGoneError(
                "The sweep handing the lockstep turns is gone (its process ended), so this job "
                "stops: rerun the sweep."
            ) from error
        assert message == "go", message
        self._granted = (round_, time.monotonic())
        return round_

    def _receive(self) -> tuple[str, int]:
        return self.conn.recv()  # blocked in the kernel: no CPU spent waiting

    def close(self, again: bool = False, why: str = "") -> None:
        if self.conn.closed:
            return
        if self._granted is not None:
            self.turns.append((*self._granted, time.monotonic()))
            self._granted = None
        if self._record is not None:  # before the bye: the next job's turn follows it
            path, step_ends = self._record
            with contextlib.suppress(OSError):
                path.write_text(json.dumps({"turns": self.turns, "step_ends": step_ends}))
        with contextlib.suppress(OSError):
            self.conn.send(("again",) if again else ("bye", why))
            self.conn.close()


def from_environment(
    rank: int, world_size: int, slice_steps: int, epochs_per_process: int | None, launched: bool
) -> Gate:
    """The gate of a job the lockstep sweeper started (`LOCKSTEP_ENV`), else `NoGate`. Only a
    job that is one process (not `launched` as workers) is made anew every `epochs_per_process`
    epochs: a launcher's workers live as long as their launcher."""
    spec = os.environ.get(LOCKSTEP_ENV)
    if not spec:
        return NoGate()
    address, job, authkey = spec.split(" ")
    renewed = epochs_per_process if world_size == 1 and not launched else None
    return LockstepGate(
        address, int(job), bytes.fromhex(authkey), rank, world_size, slice_steps, renewed
    )


def reincarnate() -> None:
    """This process again, fresh (a new address space, heap, pages and threads: a new
    incarnation), as the same process to the sweep that waits for it; the run resumes from its
    own folder's last checkpoint (`checkpoint.restarted`, through `INCARNATION_ENV`)."""
    os.environ[INCARNATION_ENV] = str(int(os.environ.get(INCARNATION_ENV) or 0) + 1)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def reincarnated() -> bool:
    """Whether this process goes on with a run an earlier process of its job started."""
    return int(os.environ.get(INCARNATION_ENV) or 0) > 0


def in_lockstep() -> bool:
    """Whether this process is (a rank of) a job of a lockstep sweep."""
    return bool(os.environ.get(LOCKSTEP_ENV))
