"""Why a job's workers failed, in one short message that names the first rank to die.

Two records meet here: each worker's own error (`<spec>/errors/rank<N>.txt`, written by
`accelexp.worker` as it fails, timed to the nanosecond) and the launcher's record of how each
worker ended (`accelexp.launch.exits`). A worker that died without a word — SIGKILL, the kernel's
out-of-memory killer, a segfault, an exit from native code — has only the second. It is the
cause: the survivors' "Connection reset by peer" and their SIGTERM from the launcher came after
it. So the first such rank is named first, with its signal; failing that, the earliest error.
The others follow in one line each, and the message names the file that holds every worker's
whole output (`accelexp.launch.output`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from accelexp.launch import exits
from accelexp.launch.output import OUTPUT_FILE

ERRORS = "errors"
LINE_CHARS = 200  # of a consequence's first line (a Gloo error's runs to thousands)
# what torch wraps around a collective's error, and where in its C++ sources it was raised
WRAPPING = re.compile(
    r"(?:Got the following error when running the callback: \w+: )+|\[[^\]]+\.cc:\d+\] "
)
LAUNCHER_STOPS = ("SIGTERM", "SIGINT")
# what a signal that killed a worker without a word says about its cause
SIGNAL_CAUSES = {
    "SIGKILL": "killed from outside (kill -9, a scheduler) or by the kernel's out-of-memory killer",
    "SIGSEGV": "a crash in native code (torch, a C extension)",
    "SIGBUS": "a crash in native code, or shared memory (/dev/shm) exhausted",
    "SIGABRT": "aborted by native code (a failed C++ check)",
    "SIGTERM": "stopped from outside before it could say why",
}


@dataclass(frozen=True)
class OomKills:
    """How many processes the kernel's out-of-memory killer has killed in this cgroup so far
    (cgroup v2 `memory.events`, v1 `memory.oom_control`), when the machine says."""

    count: int | None

    @classmethod
    def now(cls) -> OomKills:
        for path in _oom_counters():
            try:
                found = re.search(r"^oom_kill (\d+)$", path.read_text(), re.MULTILINE)
            except OSError:
                continue
            if found:
                return cls(int(found[1]))
        return cls(None)

    def since(self, before: OomKills) -> int:
        if self.count is None or before.count is None:
            return 0
        return self.count - before.count


def _oom_counters() -> list[Path]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified hierarchy
            found.append(Path(f"/sys/fs/cgroup{path}") / "memory.events")
        elif "memory" in controllers.split(","):
            found.append(Path(f"/sys/fs/cgroup/memory{path}") / "memory.oom_control")
    return found


def clear(spec: Path) -> None:
    """Before a job starts: no record of an earlier job's failure is left to be read as its."""
    (spec / ERRORS).mkdir(parents=True, exist_ok=True)
    for record in (spec / ERRORS).glob("rank*.txt"):
        record.unlink()
    (spec / exits.EXITS_FILE).unlink(missing_ok=True)


def failure_message(what: str, spec: Path, returncode: int, oom_kills: int = 0) -> str:
    """Why the workers of `what` ("2 ddp workers") failed: the first to die, then the others."""
    errors = _errors(spec)
    silent = [end for end in exits.read(spec) if end.rank not in errors]
    # a launcher stops the survivors with these: a rank still starting up dies of them silently
    causes = [end for end in silent if not (errors and end.signal in LAUNCHER_STOPS)]
    lines = [f"{what} failed (launcher exit code {returncode})."]
    if causes:
        first = causes[0]
        lines.append(
            f"First failure, rank{first.rank}: {first.describe()}, without an error of its "
            f"own: {_cause(first, oom_kills)}."
        )
        lines += [f"Then rank{e.rank}: {e.describe()}." for e in silent if e is not first]
        lines += [f"Then rank{rank}: {first_line(text)}" for rank, text in errors.items()]
    elif errors:
        (rank, text), *others = errors.items()
        lines.append(f"First failure, rank{rank}: {text.strip()}")
        lines += [f"Then rank{other}: {first_line(text)}" for other, text in others]
        lines += [f"Then rank{e.rank}: {e.describe()}." for e in silent]
    else:
        lines.append("No worker recorded an error: one was killed, or failed before starting.")
    lines.append(f"Every worker's whole output: {spec / OUTPUT_FILE}")
    return "\n".join(lines)


def _errors(spec: Path) -> dict[int, str]:
    """rank -> its error, the earliest first (each record is timed as its rank failed)."""
    records = sorted((spec / ERRORS).glob("rank*.txt"), key=lambda path: path.stat().st_mtime_ns)
    return {int(path.stem.removeprefix("rank")): path.read_text() for path in records}


def _cause(end: exits.WorkerExit, oom_kills: int) -> str:
    if end.signal == "SIGKILL" and oom_kills:
        return (
            f"the kernel's out-of-memory killer killed {oom_kills} process(es) in this job's "
            f"cgroup meanwhile: give the job less to hold (a smaller data.batch_size, fewer "
            f"workers or data.num_workers) or more memory"
        )
    if end.signal is not None:
        return SIGNAL_CAUSES.get(end.signal, f"the signal {end.signal}")
    return "an exit from native code or os._exit; its last output is in the file below"


def first_line(text: str) -> str:
    """An error's first line, without torch's wrapping, shortened to LINE_CHARS."""
    line = WRAPPING.sub("", text.strip().splitlines()[0]) if text.strip() else "(no message)"
    return line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 3] + "..."
