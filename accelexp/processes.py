"""Every process a job started, wherever it went: found by a token in its environment, stopped.

Launchers put their workers in process sessions and groups of their own (torchrun, horovodrun's
middlemen), and a worker whose launcher died is re-parented to PID 1, so neither the process
group nor the parent/child tree finds them all. The environment does: every process a job
starts inherits `ACCELEXP_JOB=<token>` (the launchers pass the environment on to their workers),
and `stop_job` signals each process that carries the job's token: SIGTERM to the workers, so
rank 0 can close its MLflow run, SIGKILL to the launchers and to whatever is left after `grace_s`.

A process is also told apart from a later one that reuses its pid by when it started
(`started_at`), and pids are only compared within one pid namespace (`pid_namespace`: two
containers of one host name each count from 1): `is_gone` says whether the process a run
recorded still lives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

JOB_ENV = "ACCELEXP_JOB"
# a lockstep sweep's pid, in the environment of every job it starts: its jobs' processes and the
# sweep itself hold CUDA contexts of their own, and the contention probe must not count them as
# a neighbour on the GPU (they wait, blocked, while a job has the turn)
SWEEP_ENV = "ACCELEXP_SWEEP"
PR_SET_PDEATHSIG = 1  # prctl(2)
GRACE_S = 20.0  # for workers to close their run after SIGTERM, before SIGKILL
# how far two readings of one process's start time may differ (the kernel counts in 1/100 s)
START_TOLERANCE_S = 1.0
WORKER_MODULE = "accelexp.worker"


def new_job_token() -> str:
    return uuid.uuid4().hex


def job_processes(token: str, name: str = JOB_ENV) -> list[int]:
    """Live processes (not this one) whose environment carries the job's token (or `name`'s
    value `token`)."""
    marker = f"{name}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone, or not ours to read
            if marker in (entry / "environ").read_bytes().split(b"\0") and _alive(entry):
                found.append(int(entry.name))
    return found


def started_at(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch; None when no such process lives
    (gone, or a zombie: it has exited, only its parent's wait is missing)."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.NoSuchProcess:
        return None


def pid_namespace() -> str:
    """This process's pid namespace, `pid:[4026531836]`; "" where there is none to read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def is_gone(pid: int, started: float) -> bool:
    """Whether the process `pid` that started at `started` has ended: no such pid, or a later
    process with its number. One this user may not inspect counts as alive."""
    import psutil

    try:
        now = started_at(pid)
    except psutil.Error:
        return False
    return now is None or abs(now - started) > START_TOLERANCE_S


def _alive(proc: Path) -> bool:
    """Not a zombie (a zombie has exited; only its parent's wait is missing)."""
    stat = (proc / "stat").read_text()
    return stat[stat.rindex(")") + 2] not in "ZX"


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def stop_job(token: str, grace_s: float = GRACE_S) -> None:
    """Stop every process of the job: the workers (`accelexp.worker`) get SIGTERM and
    `grace_s` to close their run; the launchers around them are killed at once, so they
    neither restart a worker nor print tracebacks of their own. Then SIGKILL to what is left."""
    processes = job_processes(token)
    workers = [pid for pid in processes if runs_worker(_argv(pid))]
    _signal([pid for pid in processes if pid not in workers], signal.SIGKILL)
    _signal(workers, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while job_processes(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_job(token)


def runs_worker(argv: list[str]) -> bool:
    """`python [options] -m accelexp.worker SPEC`. A launcher's command line holds the worker's
    too, after its own: `python -m torch.distributed.run ... -m accelexp.worker SPEC`,
    `python .../horovodrun ... python -m accelexp.worker SPEC`."""
    if "-m" not in argv[1:]:
        return False
    module = argv.index("-m", 1)
    return argv[module + 1 : module + 2] == [WORKER_MODULE] and all(
        arg.startswith("-") for arg in argv[1:module]
    )


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def kill_job(token: str) -> None:
    """SIGKILL every process of the job, until none is left (also those started meanwhile)."""
    for _ in range(50):
        left = job_processes(token)
        if not left:
            return
        _signal(left, signal.SIGKILL)
        time.sleep(0.1)


def die_with_parent() -> None:
    """In a child (`preexec_fn`), before it starts: SIGTERM it if this process dies, even by
    SIGKILL."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
