"""How each worker ended, as its launcher saw it: the exit records of a job's workers.

A launcher knows how every worker it started ended (its exit code, or the signal that killed it)
— also for a worker that died without a word (SIGKILL, the out-of-memory killer, a segfault),
which writes no error of its own. torchrun and horovodrun only print that, after the survivors'
tracebacks; their entry points here (`accelexp.launch.torchrun`, `accelexp.launch.horovodrun`)
write it to `<spec>/exits.json`, in the launcher's order (first the workers that failed before
it stopped the others), for the job's failure message (`accelexp.launch.failures`).

This module imports neither torch nor Horovod: the job reads what the launchers wrote.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

EXITS_FILE = "exits.json"


@dataclass(frozen=True)
class WorkerExit:
    """One worker's end: its exit code, or the signal that killed it (then `code` is None)."""

    rank: int
    code: int | None
    signal: str | None = None
    pid: int | None = None

    @classmethod
    def of_status(cls, rank: int, status: int, pid: int | None = None) -> WorkerExit:
        """From a `subprocess` return code: negative for a signal (`-9` is SIGKILL)."""
        if status < 0:
            return cls(rank, None, signal_name(-status), pid)
        return cls(rank, status, None, pid)

    @classmethod
    def of_shell_status(cls, rank: int, status: int) -> WorkerExit:
        """From a shell's exit status, which says a signal as 128 + its number (137: SIGKILL)."""
        if status > 128 and (name := signal_name(status - 128)) is not None:
            return cls(rank, None, name)
        return cls(rank, status)

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {self.signal}"
        return f"exited with code {self.code}"


def signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def write(spec: Path, exits: list[WorkerExit]) -> None:
    (spec / EXITS_FILE).write_text(json.dumps([asdict(e) for e in exits]))


def read(spec: Path) -> list[WorkerExit]:
    """What the launcher wrote; none when it wrote nothing (it succeeded, or died itself)."""
    try:
        return [WorkerExit(**entry) for entry in json.loads((spec / EXITS_FILE).read_text())]
    except (OSError, ValueError, TypeError):
        return []
