"""A `run.py` job in the background, for tests that signal, kill and resume real jobs.

`Job` starts `python run.py ...` in a session of its own, waits for a line of its output (the
end of epoch 1, say), sees its whole process tree (launchers, workers, in whatever session they
put themselves) from /proc, and checks afterwards that none of those processes is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

from accelexp.processes import runs_worker

HANG_GUARD_S = 240  # a job that takes longer than this is stuck (not a speed assertion)


def children() -> dict[int, list[int]]:
    """ppid -> pids of every live process."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] not in "ZX":
                tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a test's own folder)."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and text in " ".join(argv(int(p.name))) and alive(int(p.name))
    ]


class Job:
    def __init__(self, folder: Path, *args: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.log = folder / "console.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "run.py", *args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.seen: set[int] = set()

    @property
    def output(self) -> str:
        return self.log.read_text()

    def wait_for(self, text: str, count: int = 1) -> None:
        """Until `text` appeared `count` times in the output; records the process tree."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.output.count(text) < count:
            assert self.process.poll() is None, f"the job ended before {text!r}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} after {HANG_GUARD_S}s"
            self.seen.update(descendants(self.process.pid))
            time.sleep(0.1)
        self.seen.update(descendants(self.process.pid))

    def workers(self) -> list[int]:
        return [p for p in descendants(self.process.pid) if runs_worker(argv(p))]

    def signal(self, signum: int) -> None:
        self.seen.update(descendants(self.process.pid))
        os.kill(self.process.pid, signum)

    def signal_pid(self, pid: int, signum: int) -> None:
        """Signal one process of the job (a worker, say)."""
        self.seen.update(descendants(self.process.pid))
        os.kill(pid, signum)

    def finish(self) -> int:
        """The job's exit code, once it and every process it started have gone."""
        code = self.process.wait(timeout=HANG_GUARD_S)
        deadline = time.monotonic() + 10  # init reaps orphans' zombies asynchronously
        while any(alive(p) for p in self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(p, argv(p)) for p in self.seen if alive(p)]
        left += [(p, argv(p)) for p in processes_mentioning(str(self.folder))]
        assert not left, f"processes outlived the job: {left}"
        return code

    def kill_everything(self) -> None:
        """Clean-up after a failed test: nothing of it may outlive the test either."""
        for pid in [*self.seen, *descendants(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
