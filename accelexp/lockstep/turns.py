"""The sweeper's side of lockstep: who has the turn.

`Turns` listens on a Unix socket (in a private folder, with a random key: only the jobs it
started can take part) and runs one thread that decides, from a queue of events — a rank said
hello, asked for a turn, said bye, its connection broke, a job's process ended — whose turn it
is. Round 0 starts once every job has all its ranks asking (a job that starts slower is waited
for, so no job's first slices run beside another's start-up); so does the first round after a
job said it goes on in a fresh process ("again": `gate.Reincarnation`) and that process asked.
In each round every live job gets one turn, in job order on even rounds and in reverse on odd
ones. A job whose ranks all said bye has finished; a job whose connection broke before its bye,
or whose process ended without one, has failed: it is left out from then on, the others go on
alone, and `said` says so (the sweeper logs it, the report pairs only the rounds both ran). A job
that holds its turn longer than `turn_timeout_s` (`lockstep.turn_timeout_s`) is hung — a
collective that never completes, a deadlock — and fails the same way; it is listed in `hung`
for the sweeper to stop (in one process with the others, all of them stop with it).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

from accelexp.lockstep import LOCKSTEP_ENV

log = logging.getLogger(__name__)
LIVE, FINISHED, FAILED = "live", "finished", "failed"


@dataclass
class _Job:
    name: str
    world: int | None = None  # ranks, once the first said hello
    conns: dict[int, Connection] = field(default_factory=dict)
    asking: set[int] = field(default_factory=set)  # ranks waiting for a turn
    byes: set[int] = field(default_factory=set)
    restarting: set[int] = field(default_factory=set)  # ranks becoming a fresh process
    state: str = LIVE

    @property
    def all_asking(self) -> bool:
        return self.world is not None and len(self.asking) == self.world

    @property
    def turn_over(self) -> bool:
        """Every rank asks for its next turn, or is on its way to a fresh process."""
        return self.world is not None and len(self.asking | self.restarting) == self.world


class Turns:
    """Hands turns among `names` (one per job, in job order) until every job has ended.
    `one_process`: the jobs share one process (`accelexp.lockstep.together`), so a hung one
    stops them all."""

    def __init__(
        self, names: list[str], turn_timeout_s: float = 600.0, one_process: bool = False
    ) -> None:
        self.jobs = [_Job(name) for name in names]
        self.turn_timeout_s = turn_timeout_s
        self.one_process = one_process
        self.hung: queue.SimpleQueue[int] = queue.SimpleQueue()  # jobs for the sweeper to stop
        self._granted = 0.0  # when the holder got its turn (time.monotonic)
        self.folder = tempfile.mkdtemp(prefix="accelexp-lockstep-")
        self.address = os.path.join(self.folder, "turns")
        self.authkey = os.urandom(16)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.rounds = 0  # rounds started
        self.said: list[str] = []  # what happened that the sweep should say (a job failed...)
        self._holder: int | None = None
        self._order: list[int] = []
        self._started = False
        self._stopping = False  # the sweep stops every job (SIGINT/SIGTERM): none goes on alone
        self._done = threading.Event()
        threading.Thread(target=self._accept, name="lockstep-accept", daemon=True).start()
        threading.Thread(target=self._decide, name="lockstep-turns", daemon=True).start()

    def environment(self, job: int) -> dict[str, str]:
        """What job `job`'s process (and its workers, who inherit it) needs to take turns."""
        return {LOCKSTEP_ENV: f"{self.address} {job} {self.authkey.hex()}"}

    def job_exited(self, job: int, returncode: int) -> None:
        """Job `job`'s process ended (the sweeper waits for it)."""
        self.events.put(("exit", job, returncode))

    def stopping(self) -> None:
        """The sweep is stopping every job: a job that stops now is not one that failed beside
        others going on."""
        self.events.put(("stopping", -1))

    def wait(self, timeout: float | None = None) -> bool:
        """Until every job has ended; False on `timeout`."""
        return self._done.wait(timeout)

    def close(self) -> None:
        self._done.set()
        self.events.put(("stop",))
        for job in self.jobs:
            for conn in job.conns.values():
                conn.close()
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # --- the threads ----------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._done.is_set():
            try:
                conn = self.listener.accept()
            except OSError:  # closed, or a stranger without the key
                if self._done.is_set():
                    return
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            _, job, rank, world, _pid = conn.recv()
        except (EOFError, OSError):
            return
        self.events.put(("hello", job, rank, world, conn))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self.events.put(("broken", job, rank))
                return
            self.events.put((message[0], job, rank, *message[1:]))
            if message[0] in ("bye", "again"):
                return

    def _decide(self) -> None:
        while True:
            try:
                event = self.events.get(timeout=self._patience())
            except queue.Empty:  # the holder kept its turn too long
                event = ("hung", self._holder)
            if event[0] == "stop":
                return
            self._take(event)
            self._advance()
            if all(job.state != LIVE for job in self.jobs):
                self._done.set()
                return

    def _patience(self) -> float | None:
        """Seconds until the holder's turn has lasted `turn_timeout_s`; None: no one holds it."""
        if self._holder is None:
            return None
        return max(0.0, self._granted + self.turn_timeout_s - time.monotonic())

    def _take(self, event: tuple[Any, ...]) -> None:
        kind, index, *rest = event
        if kind == "stopping":
            self._stopping = True
            return
        if kind == "hung":
            self._hung(index)
            return
        job = self.jobs[index]
        if kind == "hello":  # a rank's first, or its fresh process's after "again"
            rank, world, conn = rest
            job.world, job.conns[rank] = world, conn
            job.restarting.discard(rank)
        elif kind == "again":  # no turn to anyone until it is back and asking
            job.restarting.add(rest[0])
            job.asking.discard(rest[0])
            self._started = False
        elif kind == "ready":
            job.asking.add(rest[0])
        elif kind == "bye":
            rank, why = rest[0], rest[1] if len(rest) > 1 else ""
            job.byes.add(rank)
            if why:  # its run failed or was stopped
                self._fail(index, f"its rank {rank} stopped: {why}")
            elif job.world is not None and len(job.byes) == job.world and job.state == LIVE:
                job.state = FINISHED
        elif kind == "broken" and rest[0] not in job.byes | job.restarting:
            self._fail(index, f"its rank {rest[0]} went away")
        elif kind == "exit" and job.state == LIVE:
            returncode = rest[0]
            if returncode == 0:  # its bye may still be on its way (or it timed nothing)
                job.state = FINISHED
            else:
                self._fail(index, f"its process ended (exit code {returncode})")

    def _hung(self, index: int) -> None:
        """Job `index` held its turn over `turn_timeout_s`: failed, for the sweeper to stop."""
        why = (
            f"it held its turn over {self.turn_timeout_s:g} s without handing it back (hung? "
            f"lockstep.turn_timeout_s); it is stopped"
        )
        if self.one_process:  # the others wait in the same process: they stop with it
            why += ", and with it the jobs that share its process"
            self._stopping = True
        self._fail(index, why)
        for other in self.jobs if self.one_process else ():
            if other.state == LIVE:
                other.state = FAILED
        self._holder = None
        self.hung.put(index)

    def _fail(self, index: int, why: str) -> None:
        job = self.jobs[index]
        if job.state != LIVE:
            return
        job.state = FAILED
        others = [] if self._stopping else [j.name for j in self.jobs if j.state == LIVE]
        when = f"in round {self.rounds - 1}" if self._started else "before the first round"
        going_on = (
            f"; {', '.join(others)} go on alone (their rounds from here on are not paired with it)"
            if others
            else ""
        )
        message = f"lockstep: job {index} ({job.name}) stopped {when}: {why}{going_on}."
        self.said.append(message)
        log.warning("%s", message)

    def _advance(self) -> None:
        if self._holder is not None:
            holder = self.jobs[self._holder]
            if holder.state == LIVE and not holder.turn_over:
                return  # its slice is still running
            self._holder = None
        live = [i for i, job in enumerate(self.jobs) if job.state == LIVE]
        if not live:
            return
        # every job at its first gate (at the start, and after a job's fresh process started):
        # no start-up beside a slice
        if not self._started:
            if not all(self.jobs[i].all_asking for i in live):
                return
            self._started = True
        while True:
            while self._order and self.jobs[self._order[0]].state != LIVE:
                self._order.pop(0)
            if self._order:
                break
            self._order = live if self.rounds % 2 == 0 else live[::-1]
            self.rounds += 1
        index = self._order.pop(0)
        job = self.jobs[index]
        if not job.all_asking:  # a rank not back yet (cannot be, but never grant half a job)
            self._order.insert(0, index)
            return
        job.asking.clear()
        self._holder, self._granted = index, time.monotonic()
        for rank, conn in job.conns.items():
            try:
                conn.send(("go", self.rounds - 1))
            except OSError:
                self._fail(index, f"its rank {rank} went away")
                self._holder = None
                self._advance()
                return
