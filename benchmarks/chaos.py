"""Chaos: real jobs killed, cut short and starved at random moments, then checked.

A bounded sweep of tiny real jobs (`python run.py ...`: single, DDP, Horovod, FSDP, hybrid),
at most two at a time, during which this script sends SIGKILL, SIGTERM or SIGINT to run.py, to a
worker or to a launcher at moments drawn from a seeded RNG (`--seed`: the same seed replays the
same draws), truncates a checkpoint before `resume=auto`, and runs jobs on a full disk (a tmpfs it
mounts and unmounts itself where it is root; skipped, with the reason, otherwise). Some jobs track
into a real `mlflow server` through `http://chaos:<secret>@127.0.0.1:PORT`. Then it checks:

- status: each job's exit code and its runs' MLflow statuses are what happened to it
  (`expect_*` below says what that is, event by event);
- orphans: no process of a job (found by a tag in its environment, or its folder in the command
  line) is alive 30 s after the job ended;
- resumes: every resumed run ends with the parameters and optimizer state (`torch.equal`) and
  the metrics of its uninterrupted twin (FSDP's: its workers' shards, torch.distributed.checkpoint,
  read whole; its run.py SIGKILLed at any moment, a save of shards included);
- secrets: the password is in no file of the jobs' folders, the stores, the server's artifacts
  or the captured output (nor in a job process's command line, seen while it ran);
- runs left RUNNING: none at the end (a later run.py on the experiment heals one a SIGKILL or
  a full store left: the scenarios run one where that can happen).

It prints the counts (jobs by strategy x event, each check, wall and CPU time) and exits 1 when
any check failed. A job's console output, its run folder and the stores stay in `--keep DIR`.

    python benchmarks/chaos.py                  # the default size: 32-35 jobs, ~460 CPU-s
    python benchmarks/chaos.py --seed 7         # other random moments; the same seed replays
    python benchmarks/chaos.py --quick          # one sweep of 2-3 jobs, stopped (the test's)
    python benchmarks/chaos.py --keep /tmp/chaos --untouched 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelexp.processes import runs_worker  # noqa: E402

TINY = (
    "data=synthetic",
    "data.image_size=16",
    "data.num_train=320",
    "data.num_test=64",
    "data.batch_size=32",
    "model=mlp",
    "epochs=4",
    "max_steps_per_epoch=4",
    "threads=1",
    "progress=false",
)
# each training batch of a job to be interrupted arrives this late: 3 epochs of 4 batches after
# epoch 1 is logged last at least 2.4 s, so a moment drawn in TRAINING_WINDOW_S lands in training;
# the uninterrupted twins are not slowed (debug.* changes no result, and a resume may change it)
SLOW = ("debug.input_delay_ms=200",)
TRAINING_WINDOW_S = 2.0
STRATEGIES = {
    "single": (),
    "ddp": ("parallelism=ddp", "parallelism.nprocs=2"),
    "horovod": ("parallelism=horovod", "parallelism.nprocs=2"),
    "fsdp": ("parallelism=fsdp", "parallelism.nprocs=2"),
    "hybrid": ("parallelism=hybrid", "parallelism.nprocs=2"),
    # 2 pipelines of 2 ranks, each stage sharded over the two (FSDP2): 4 workers on 2 cores
    "pipeline": (
        "parallelism=pipeline", "parallelism.nprocs=4", "parallelism.pp=2",
        "parallelism.dp_shard=true", "parallelism.oversubscribe=true",
    ),
}  # fmt: skip
HANG_S = 240.0  # a job still running after this is stuck: killed and counted as a hang
SETTLE_S = 30.0  # a job's processes still alive this long after it ended are orphans
TAG = "ACCELEXP_CHAOS"  # in the environment of every process a job starts: <bench>/<job>
DISK_MB = 16
EPOCH_METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")
FINAL_METRICS = ("best_val_acc", "test_loss", "test_acc")


# --- processes ---------------------------------------------------------------------------


def _stat_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat[stat.rindex(")") + 2]


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def live_processes(tag: str, folder: Path | None = None) -> list[int]:
    """Live processes whose environment carries `TAG=tag` (`TAG=tag/...` too, when `tag` ends
    with "/"), or whose command line names `folder`."""
    marker, found = f"{TAG}={tag}".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        tagged = any(v == marker or (tag.endswith("/") and v.startswith(marker)) for v in env)
        named = folder is not None and f"{folder}/" in " ".join(argv(pid))
        if (tagged or named) and _stat_state(pid) not in "ZX":
            found.append(pid)
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class Job:
    """One `python run.py ...` in a session of its own; its output in `folder/console.txt`."""

    def __init__(self, bench: Bench, name: str, folder: Path, args: list[str]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.bench, self.name, self.folder = bench, name, folder
        self.tag = f"{bench.id}/{name}"
        self.log = folder / "console.txt"
        args = [a.replace("@SWEEP", str(folder / "sweep")) for a in args]
        given = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
        self.run_dir = Path(given[0]) if given else folder / "run"
        if not given and "-m" not in args:
            args.append(f"hydra.run.dir={self.run_dir}")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
        env[TAG] = self.tag
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "run.py", *args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()
        self.code: int | None = None
        self.hung = False
        self.orphans: list[str] = []
        self.wall_s = self.cpu_s = 0.0

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def processes(self) -> list[int]:
        found = live_processes(self.tag, self.folder)
        self.bench.watch_command_lines(self, found)
        return found

    def workers(self) -> list[int]:
        return sorted(p for p in self.processes() if runs_worker(argv(p)))

    def launchers(self) -> list[int]:
        """torchrun or horovodrun: the process run.py started."""
        return [p for p in self.processes() if _parent(p) == self.process.pid]

    def wait_for(self, text: str, count: int = 1) -> bool:
        """Until `text` appeared `count` times in the output; False when the job ended first."""
        return self.until(lambda: self.output.count(text) >= count)

    def wait_for_workers(self, n: int = 2) -> bool:
        return self.until(lambda: len(self.workers()) >= n)

    def until(self, done: Callable[[], bool]) -> bool:
        while not done():
            if not self.running() or time.monotonic() - self.started > HANG_S:
                return False
            self.processes()
            time.sleep(0.1)
        return True

    def send(self, pid: int, signum: int) -> bool:
        """Signal one process of the job; False when it had already gone."""
        self.processes()
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True

    def running(self) -> bool:
        """Whether run.py still runs; once it ended, its exit code (`code`, as Popen's) and the
        CPU time of it and of every process it waited for (`cpu_s`) are recorded."""
        if self.process.returncode is not None:
            return False
        pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
        if pid == 0:
            return True
        self.process.returncode = self.code = os.waitstatus_to_exitcode(status)
        self.cpu_s = usage.ru_utime + usage.ru_stime
        return False

    def finish(self) -> int | None:
        """The exit code (None: a hang, killed), once the job's processes settled; records the
        orphans (alive SETTLE_S after the job ended, then killed)."""
        while self.running() and time.monotonic() - self.started < HANG_S:
            self.processes()
            time.sleep(0.2)
        if self.running():
            self.hung = True
            kill_all([*self.processes(), self.process.pid])
            self.process.wait()
            self.code = None
        self.wall_s = time.monotonic() - self.started
        settled_by = time.monotonic() + SETTLE_S
        while (left := self.processes()) and time.monotonic() < settled_by:
            time.sleep(0.2)
        self.orphans = [f"{pid} {' '.join(argv(pid))[:160]}" for pid in left]
        kill_all(left)
        return self.code


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


# --- the MLflow stores -----------------------------------------------------------------------


@dataclass
class Store:
    """Where jobs track: `uri` on their command line (with the password for the server),
    `reader` for this script."""

    name: str
    uri: str
    reader: str
    secret: bool = False

    def runs(self, experiment: str) -> list:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.reader)
        found = client.get_experiment_by_name(experiment)
        return client.search_runs([found.experiment_id]) if found else []

    def history(self, run_id: str, key: str) -> dict[int, float]:
        """step -> value, the last logged at that step (an epoch redone after a resume)."""
        from mlflow import MlflowClient

        metrics = MlflowClient(tracking_uri=self.reader).get_metric_history(run_id, key)
        return {m.step: m.value for m in sorted(metrics, key=lambda m: m.timestamp)}


def migrated_template(folder: Path) -> Path:
    """An empty MLflow SQLite store with every migration run (copied for each new store)."""
    from mlflow import MlflowClient

    path = folder / "template.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def start_server(folder: Path, template: Path, secret: str) -> tuple[subprocess.Popen, Store]:
    """A real `mlflow server` on 127.0.0.1 (it ignores basic auth: the URI's password is only
    there to be kept out of everything)."""
    from accelexp.parallel.world import free_port

    folder.mkdir(parents=True)
    shutil.copyfile(template, folder / "mlflow.db")
    port = free_port()
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    with open(folder / "server.log", "w") as log:
        process = subprocess.Popen(
            [mlflow, "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--artifacts-destination", str(folder / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no huey
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    secret_uri = base.replace("http://", f"http://chaos:{secret}@")
    return process, Store("server", secret_uri, base, secret=True)


def wait_until_up(process: subprocess.Popen, base: str) -> None:
    for _ in range(240):
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{base}/health", timeout=2):
            return
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server ended with {process.returncode}")
        time.sleep(0.5)
    raise RuntimeError("mlflow server did not answer /health in 120 s")


# --- the small disk --------------------------------------------------------------------------


class SmallDisk:
    """A DISK_MB tmpfs mounted at `path` (root only), filled on demand to leave a few bytes."""

    def __init__(self, path: Path) -> None:
        self.path, self.mounted, self.reason = path, False, ""
        path.mkdir(parents=True)
        if os.geteuid() != 0:
            self.reason = "not root: cannot mount a tmpfs"
            return
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "chaos-disk", str(path)],
            capture_output=True,
            text=True,
        )
        self.mounted = done.returncode == 0
        self.reason = "" if self.mounted else f"mount failed: {done.stderr.strip()}"

    def fill(self, name: str, leave_bytes: int) -> Path:
        """A file taking all but `leave_bytes` of what is free."""
        stat = os.statvfs(self.path)
        filler = self.path / f"{name}.filler"
        with open(filler, "wb") as out:
            out.truncate(0)
            out.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave_bytes))
        return filler

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "--lazy", str(self.path)], check=False)
            self.mounted = False


# --- what is expected, event by event ------------------------------------------------------


def _status(run) -> str:
    return run.info.status


def _children(runs: list) -> list:
    return [r for r in runs if r.data.tags.get("accelexp.sweep") != "true"]


def _parents(runs: list) -> list:
    return [r for r in runs if r.data.tags.get("accelexp.sweep") == "true"]


def _finished_whole(run) -> bool:
    return run.info.status == "FINISHED" and "test_acc" in run.data.metrics


def expect_untouched(code: int | None, runs: list, jobs: int) -> list[str]:
    """Exit 0; every run FINISHED with its test metrics; a sweep's parent FINISHED."""
    wrong = [] if code == 0 else [f"exit {code}, expected 0"]
    if len(_children(runs)) != jobs:
        wrong.append(f"{len(_children(runs))} runs, expected {jobs}")
    wrong += [f"run {r.info.run_name} {_status(r)}" for r in _children(runs)
              if not _finished_whole(r)]  # fmt: skip
    wrong += [f"sweep's parent {_status(r)}" for r in _parents(runs) if _status(r) != "FINISHED"]
    return wrong


def expect_stopped(code: int | None, runs: list, signum: int) -> list[str]:
    """SIGINT/SIGTERM to run.py: exit 128 + signal (or death by it, before run.py installed its
    handler, when no run exists yet); the run it was training KILLED; runs already done
    FINISHED; a sweep's parent KILLED (FINISHED only once every job was)."""
    wrong = []
    if code != 128 + signum and not (code == -signum and not runs):
        wrong.append(f"exit {code}, expected {128 + signum}")
    for run in _children(runs):
        if not (_finished_whole(run) or _status(run) == "KILLED"):
            wrong.append(f"run {run.info.run_name} {_status(run)}, expected KILLED")
    for parent in _parents(runs):
        everything_done = all(_finished_whole(r) for r in _children(runs))
        if not (_status(parent) == "KILLED" or (everything_done and _status(parent) == "FINISHED")):
            wrong.append(f"sweep's parent {_status(parent)}, expected KILLED")
    return wrong


def expect_job_failed(code: int | None, runs: list) -> list[str]:
    """A worker or launcher killed (SIGKILL, or SIGTERM to one worker alone: the job did not
    ask to stop, a part of it died): exit 2 with the workers' error, the run FAILED."""
    wrong = [] if code == 2 else [f"exit {code}, expected 2"]
    wrong += [f"run {_status(r)}, expected FAILED" for r in runs if _status(r) != "FAILED"]
    return wrong


def expect_run_py_killed(code: int | None, runs: list, workers: bool) -> list[str]:
    """SIGKILL to run.py, before any healing: death by SIGKILL; a single process's run left
    RUNNING (nothing could close it); a launcher's workers got SIGTERM (PDEATHSIG), so rank 0
    closed its run KILLED (or RUNNING, when rank 0 was killed before it could)."""
    wrong = [] if code == -signal.SIGKILL else [f"exit {code}, expected -9 (SIGKILL)"]
    allowed = {"RUNNING", "KILLED"} if workers else {"RUNNING"}
    for run in runs:
        if not (_status(run) in allowed or _finished_whole(run)):
            wrong.append(f"run {_status(run)}, expected {' or '.join(sorted(allowed))}")
    return wrong


def expect_healed(before: list, after: list, output: str) -> list[str]:
    """After a later run.py opened the experiment: no run RUNNING; each run left RUNNING before
    marked FAILED with the tag accelexp.ended, which run.py said (a resume that continued it
    since has dropped the tag: it carries resumed_after_epoch instead)."""
    wrong = [f"run {r.info.run_name} still RUNNING after a later run.py opened the store"
             for r in after if _status(r) == "RUNNING"]  # fmt: skip
    left = {r.info.run_id for r in before if _status(r) == "RUNNING"}
    healed = {r.info.run_id for r in after
              if {"accelexp.ended", "resumed_after_epoch"} & r.data.tags.keys()}  # fmt: skip
    if left - healed:
        wrong.append("a run left RUNNING has no tag accelexp.ended")
    if left and f"Marked {len(left)} run(s) FAILED" not in output:
        wrong.append("the later run.py did not say it marked the run FAILED")
    return wrong


def expect_truncated(code: int | None, output: str, runs: list) -> list[str]:
    """resume=auto on a cut checkpoint: exit 2, one message naming previous.pt, run FAILED."""
    wrong = [] if code == 2 else [f"exit {code}, expected 2"]
    if output.count("cannot be read") != 1 or "previous.pt" not in output:
        wrong.append("not one message naming the cut checkpoint and previous.pt")
    if "Traceback" in output:
        wrong.append("a traceback")
    wrong += [f"run {_status(r)}, expected FAILED" for r in runs if _status(r) != "FAILED"]
    return wrong


def expect_resumed(code: int | None, output: str, runs: list, interrupted: str | None):
    """resume=...: exit 0; the interrupted run continued (same run, FINISHED) when it left a
    checkpoint, else a new run FINISHED."""
    wrong = [] if code == 0 else [f"exit {code}, expected 0"]
    continued = "Resuming after epoch" in output
    if continued:
        mine = [r for r in runs if r.info.run_id == interrupted]
        if not mine or not _finished_whole(mine[0]):
            wrong.append("the interrupted run did not end FINISHED")
    elif not any(_finished_whole(r) for r in runs):
        wrong.append("no run FINISHED")
    return wrong


def expect_full_disk(code: int | None, runs: list) -> list[str]:
    """A run folder or store on a full disk: an end within the hang guard, non-zero (or 0 and
    FINISHED when it all fit); its run FAILED, or left RUNNING when even the store could not
    take its end (healed later)."""
    if code == 0:
        return [f"run {_status(r)}" for r in runs if not _finished_whole(r)]
    wrong = [] if code is not None else ["a hang"]
    wrong += [f"run {_status(r)}" for r in runs if _status(r) not in ("FAILED", "RUNNING")]
    return wrong


# --- the benchmark ---------------------------------------------------------------------------


@dataclass
class Record:
    """One job: what was done to it, and what went wrong."""

    name: str  # scenario/step
    strategy: str
    event: str
    jobs: int  # training jobs: each job of a sweep counts
    wrong: list[str]
    orphans: list[str]
    code: int | None
    secret: bool  # its tracking URI carried the password
    wall_s: float
    cpu_s: float  # run.py and every process it waited for (launcher, workers)

    @property
    def scenario(self) -> str:
        return self.name.split("/")[0]


@dataclass
class Twin:
    """A resumed run (its run folder and store) and the uninterrupted one it must equal."""

    name: str
    folder: Path
    store: Store
    twin_folder: Path
    twin_store: Store


@dataclass
class Bench:
    """What the scenarios share: the folder, the draws, the stores, and what they recorded."""

    root: Path
    seed: int
    id: str = field(default_factory=lambda: secrets.token_hex(4))
    secret: str = field(default_factory=lambda: "pw-" + secrets.token_hex(8))
    stores: dict[str, Store] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    twins: list[Twin] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    secret_commands: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def rng(self, scenario: str) -> random.Random:
        """The scenario's own draws: the same whichever thread runs it, and when."""
        return random.Random(f"{self.seed}/{scenario}")

    def job(self, scenario: str, step: str, args: list[str]) -> Job:
        """run.py with `args`; its console in jobs/<scenario>/<step>/, its run folder `run/`
        there (`Job.run_dir`), its sweep folder `sweep/`."""
        return Job(self, f"{scenario}/{step}", self.root / "jobs" / scenario / step, args)

    def watch_command_lines(self, job: Job, pids: list[int]) -> None:
        """The processes a job started (not run.py: its command line is the one typed) must not
        show the password to `ps`: each one that does is noted with the word that holds it."""
        for pid in pids:
            words = argv(pid)
            if pid != job.process.pid and self.secret in " ".join(words):
                holder = next(w for w in " ".join(words).split() if self.secret in w)
                holder = holder.replace(self.secret, "<password>")
                with self.lock:
                    self.secret_commands.add(f"{job.name}: {Path(words[0]).name} ... {holder}")

    def record(self, job: Job, strategy: str, event: str, wrong: list[str], jobs: int = 1):
        carried = self.secret in " ".join(job.process.args)
        with self.lock:
            self.records.append(
                Record(job.name, strategy, event, jobs, wrong, job.orphans, job.code, carried,
                       job.wall_s, job.cpu_s)
            )  # fmt: skip


def tracked(store: Store, experiment: str, *more: str) -> list[str]:
    return [*TINY, *more, f"mlflow.tracking_uri={store.uri}", f"mlflow.experiment={experiment}"]


def land_in_training(job: Job, rng: random.Random, epoch: int = 1, count: int = 1) -> bool:
    """Wait until `epoch` is logged (the `count`-th time), then a drawn part of the window."""
    if not job.wait_for(f"epoch {epoch}/", count):
        return False
    time.sleep(rng.uniform(0.0, TRAINING_WINDOW_S))
    return True


def land_anywhere(job: Job, rng: random.Random) -> bool:
    """A moment drawn from the job's start-up (imports, composing, launcher, workers' start-up)
    or from its training: half the time each."""
    if rng.random() < 0.5:
        time.sleep(rng.uniform(0.5, 8.0))
        return job.running()
    return land_in_training(job, rng)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# --- the scenarios: each runs its jobs one after the other and records each ---------------


def untouched_sweep(bench: Bench, name: str, store: Store, seeds: list[int]) -> None:
    """One run.py -m over seeds, left alone: every job FINISHED (the single runs' twins)."""
    sweep = f"seed={','.join(map(str, seeds))}"
    job = bench.job(name, "all", ["-m", *tracked(store, name, sweep), "hydra.sweep.dir=@SWEEP"])
    job.finish()
    wrong = expect_untouched(job.code, store.runs(name), len(seeds))
    bench.record(job, "single", "none", wrong, jobs=len(seeds))


def twin_in_sweep(bench: Bench, sweep: str, store: Store, seeds: list[int], seed: int) -> tuple:
    """(run folder, store) of the untouched sweep's job of `seed`."""
    return bench.root / "jobs" / sweep / "all" / "sweep" / str(seeds.index(seed)), store


def stopped_sweep(bench: Bench, name: str, store: Store, seeds: list[int]) -> None:
    """run.py -m stopped by SIGINT or SIGTERM at a random moment of one of its jobs."""
    rng = bench.rng(name)
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    sweep = f"seed={','.join(map(str, seeds))}"
    args = ["-m", *tracked(store, name, *SLOW, sweep), "hydra.sweep.dir=@SWEEP"]
    job = bench.job(name, "all", args)
    if land_in_training(job, rng, count=rng.randint(1, len(seeds) - 1)):
        job.send(job.process.pid, signum)
    job.finish()
    runs = store.runs(name)
    wrong = expect_stopped(job.code, runs, signum)
    done = sum(_finished_whole(r) for r in _children(runs))  # before the signal
    if done:
        bench.record(job, "single", "none", [], done)
    bench.record(job, "single", f"{signal_name(signum)} run.py", wrong, jobs=1)


def untouched(bench: Bench, name: str, store: Store, strategy: str, seed: int) -> tuple:
    """One run left alone; returns it as a twin: (run folder, store)."""
    experiment = f"{name}-twin"
    job = bench.job(name, "twin", tracked(store, experiment, *STRATEGIES[strategy], f"seed={seed}"))
    job.finish()
    bench.record(job, strategy, "none", expect_untouched(job.code, store.runs(experiment), 1))
    return job.run_dir, store


def stop_and_resume(bench, name: str, store: Store, strategy: str, seed: int, twin) -> None:
    """SIGINT/SIGTERM to run.py mid-training, then resume=auto: it continues the same run and
    ends as its twin (`untouched`'s)."""
    rng = bench.rng(name)
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    extra = (*STRATEGIES[strategy], f"seed={seed}")
    job = bench.job(name, "stop", tracked(store, name, *extra, *SLOW))
    if land_in_training(job, rng):
        job.send(job.process.pid, signum)
    job.finish()
    runs = store.runs(name)
    wrong = expect_stopped(job.code, runs, signum)
    bench.record(job, strategy, f"{signal_name(signum)} run.py", wrong)
    resume(bench, name, store, strategy, extra, runs, twin)


def resume(bench, name, store, strategy, extra, runs, twin, how="auto") -> None:
    """resume=`how` after `runs` (the experiment's runs until then): it continues the one
    interrupted run (healing it first when it was left RUNNING); compared with `twin` at the
    end."""
    step = "resume" if how == "auto" else "resume-previous"
    job = bench.job(name, step, tracked(store, name, *extra, *SLOW, f"resume={how}"))
    job.finish()
    after = store.runs(name)
    interrupted = runs[0].info.run_id if len(runs) == 1 else None
    wrong = expect_resumed(job.code, job.output, after, interrupted)
    wrong += expect_healed(runs, after, job.output)
    event = "resume=auto" if how == "auto" else "resume=previous.pt"
    bench.record(job, strategy, event, wrong)
    bench.twins.append(Twin(name, job.run_dir, store, *twin))


def truncated_checkpoint(bench: Bench, name: str, store: Store, seed: int, twin) -> None:
    """Stopped after epoch 2, its last.pt cut at a random byte: resume=auto fails in one message
    naming previous.pt, the run FAILED; resume=<previous.pt> then ends as the twin."""
    rng = bench.rng(name)
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    extra = (f"seed={seed}",)
    job = bench.job(name, "stop", tracked(store, name, *extra, *SLOW))
    kept = job.run_dir / "checkpoints" / "previous.pt.json"  # written once epoch 2 is saved
    if job.wait_for("epoch 2/") and job.until(kept.is_file):
        time.sleep(rng.uniform(0.0, TRAINING_WINDOW_S / 2))  # in epoch 3
        job.send(job.process.pid, signum)
    job.finish()
    bench.record(job, "single", f"{signal_name(signum)} run.py",
                 expect_stopped(job.code, store.runs(name), signum))  # fmt: skip
    last, previous = (job.run_dir / "checkpoints" / f for f in ("last.pt", "previous.pt"))
    if not previous.is_file():
        bench.skipped.append(f"{name}: stopped before epoch 2 was saved, no previous.pt")
        return
    with open(last, "r+b") as file:
        file.truncate(rng.randint(1, last.stat().st_size - 1))
    cut = bench.job(name, "cut", tracked(store, name, *extra, *SLOW, "resume=auto"))
    cut.finish()
    bench.record(cut, "single", "cut last.pt, resume=auto",
                 expect_truncated(cut.code, cut.output, store.runs(name)))  # fmt: skip
    resume(bench, name, store, "single", extra, store.runs(name), twin, str(previous))


def sigkill_run_py(bench: Bench, name: str, store: Store, strategy: str, seed: int, twin):
    """SIGKILL to run.py at a random moment: a single process's run is left RUNNING, a
    launcher's workers are stopped (PDEATHSIG); a later run.py heals what was left RUNNING:
    resume=auto, compared with `twin`, or (without a twin) a plain later run, when one was."""
    rng = bench.rng(name)
    extra = (*STRATEGIES[strategy], f"seed={seed}")
    job = bench.job(name, "kill", tracked(store, name, *extra, *SLOW))
    # a single process: in training, so that there is a run to leave RUNNING
    landed = land_in_training(job, rng) if strategy == "single" else land_anywhere(job, rng)
    if landed:
        job.send(job.process.pid, signal.SIGKILL)
    job.finish()
    runs = store.runs(name)
    wrong = expect_run_py_killed(job.code, runs, workers=strategy != "single")
    bench.record(job, strategy, "SIGKILL run.py", wrong)
    if twin is not None:
        resume(bench, name, store, strategy, extra, runs, twin)
    elif any(_status(r) == "RUNNING" for r in runs):
        later_run(bench, name, store, runs)


def later_run(bench: Bench, name: str, store: Store, runs: list) -> None:
    """A later tiny run.py on the experiment: it heals what was left RUNNING, and FINISHES."""
    job = bench.job(name, "later", tracked(store, name, "epochs=1"))
    job.finish()
    after = store.runs(name)
    mine = [r for r in after if r.info.run_id not in {r.info.run_id for r in runs}]
    wrong = expect_untouched(job.code, mine, 1) + expect_healed(runs, after, job.output)
    bench.record(job, "single", "none (heals)", wrong)


def kill_a_worker(bench: Bench, name: str, store: Store, strategy: str, signum: int) -> None:
    """SIGKILL (or SIGTERM) to one worker drawn at random, at a moment drawn from the workers'
    start-up or their training."""
    rng = bench.rng(name)
    job = bench.job(name, "job", tracked(store, name, *STRATEGIES[strategy], *SLOW))
    if rng.random() < 0.5:
        ready = land_in_training(job, rng)
    else:
        ready = job.wait_for_workers()
        time.sleep(rng.uniform(0.0, 4.0))
    workers = job.workers()
    if ready and workers:
        job.send(rng.choice(workers), signum)
    job.finish()
    wrong = expect_job_failed(job.code, store.runs(name))
    bench.record(job, strategy, f"{signal_name(signum)} worker", wrong)


def kill_the_launcher(bench: Bench, name: str, store: Store, strategy: str) -> None:
    """SIGKILL to torchrun or horovodrun at a random moment once its workers run."""
    rng = bench.rng(name)
    job = bench.job(name, "job", tracked(store, name, *STRATEGIES[strategy], *SLOW))
    if job.wait_for_workers() and land_anywhere(job, rng):
        for launcher in job.launchers():
            job.send(launcher, signal.SIGKILL)
    job.finish()
    bench.record(job, strategy, "SIGKILL launcher", expect_job_failed(job.code, store.runs(name)))


def full_disk(bench: Bench, name: str, disk: SmallDisk, where: str, seed: int, twin) -> None:
    """The run folder (`where="folder"`) or the SQLite store (`"store"`) on the small disk,
    filled but for a drawn few bytes to KB; then the space is freed and, for the store, the run
    is resumed (which heals it when it was left RUNNING) and compared with its twin."""
    if not disk.mounted:
        bench.skipped.append(f"{name}: {disk.reason}")
        return
    rng = bench.rng(name)
    here = disk.path / name
    here.mkdir()
    store = bench.stores["local"]
    if where == "store":
        shutil.copyfile(bench.root / "template.db", here / "mlflow.db")
        store = Store(name, f"sqlite:///{here / 'mlflow.db'}", f"sqlite:///{here / 'mlflow.db'}")
        with bench.lock:
            bench.stores[name] = store
    extra = (f"seed={seed}",)
    args = tracked(store, name, *extra)
    if where == "folder":
        args.append(f"hydra.run.dir={here / 'run'}")
    # the store grows by ~100 KB a run; the folder gets 2.8 MB of checkpoints at epoch 1
    leave = rng.randint(0, 100_000) if where == "store" else rng.randint(0, 1_500_000)
    filler = disk.fill(name, leave)
    job = bench.job(name, "job", args)
    job.finish()
    filler.unlink()
    runs = store.runs(name)
    bench.record(job, "single", f"full disk ({where})",
                 expect_full_disk(job.code, runs))  # fmt: skip
    if where == "store":
        resume(bench, name, store, "single", extra, runs, twin)


# --- the checks at the end -----------------------------------------------------------------


def tensors(state: object, prefix: str = "") -> dict[str, object]:
    """Every tensor of a nested state (dicts, lists), by its path."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in
                tensors(value, f"{prefix}{key}.").items()}  # fmt: skip
    if isinstance(state, list | tuple):
        return {k: v for i, value in enumerate(state) for k, v in
                tensors(value, f"{prefix}{i}.").items()}  # fmt: skip
    return {prefix.rstrip("."): state} if hasattr(state, "dtype") else {}


def run_of(folder: Path, store: Store):
    from mlflow import MlflowClient

    run_id = (folder / "mlflow_run_id").read_text().strip()
    return MlflowClient(tracking_uri=store.reader).get_run(run_id)


def same_training(twin: Twin) -> list[str]:
    """The resumed run's final model and optimizer state (bitwise) and its metrics, epoch by
    epoch, against its twin's: [] when they are the same."""
    import torch

    from accelexp.checkpoint import CheckpointError, read_whole

    try:
        got, ref = (read_whole(folder / "checkpoints" / "last.pt")
                    for folder in (twin.folder, twin.twin_folder))  # fmt: skip
        mine, theirs = run_of(twin.folder, twin.store), run_of(twin.twin_folder, twin.twin_store)
    except (OSError, RuntimeError, CheckpointError) as error:
        return [f"{twin.name}: nothing to compare ({type(error).__name__}: {error})"]
    wrong = []
    for part in ("model", "optimizer"):
        a, b = tensors(got[part]), tensors(ref[part])
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            wrong.append(f"{twin.name}: final {part} state")
    for key in EPOCH_METRICS + FINAL_METRICS:
        if twin.store.history(mine.info.run_id, key) != twin.twin_store.history(
            theirs.info.run_id, key
        ):
            wrong.append(f"{twin.name}: metric {key}")
    return wrong


def files_with(text: str, *folders: Path) -> list[str]:
    """The files under `folders` that hold `text`."""
    paths = [path for folder in folders if folder.exists() for path in folder.rglob("*")]
    return [str(p) for p in paths if p.is_file() and text.encode() in p.read_bytes()]


def runs_left_running(bench: Bench) -> list[str]:
    """Runs RUNNING at the end in every store, once every job and its healing run have gone."""
    from mlflow import MlflowClient

    left = []
    for store in bench.stores.values():
        client = MlflowClient(tracking_uri=store.reader)
        ids = [e.experiment_id for e in client.search_experiments()]
        for run in client.search_runs(ids, filter_string="attributes.status = 'RUNNING'"):
            left.append(f"{store.name}: {run.info.run_name} ({run.info.run_id})")
    return left


# --- the plan and the report -----------------------------------------------------------------


def plan(bench: Bench, quick: bool, untouched_jobs: int, disk: SmallDisk) -> list[Callable]:
    """The scenarios, the longest chains first (two run at a time)."""
    local = bench.stores["local"]
    if quick:
        return [lambda: stopped_sweep(bench, "single-stop-sweep", local, [21, 22, 23])]
    server = bench.stores["server"]
    seeds = list(range(1, untouched_jobs + 1))

    def twin(seed: int) -> tuple:
        return twin_in_sweep(bench, "single-sweep", local, seeds, seed)

    def ddp_stop_resume() -> None:
        stop_and_resume(bench, "ddp-stop-resume", local, "ddp", 5,
                        untouched(bench, "ddp-stop-resume", local, "ddp", 5))  # fmt: skip

    def fsdp_kill_resume() -> None:  # its shards saved by every worker: resumed, then compared
        sigkill_run_py(bench, "fsdp-kill-run.py", local, "fsdp", 6,
                       untouched(bench, "fsdp-kill-run.py", local, "fsdp", 6))  # fmt: skip

    def pipeline_stop_resume() -> None:  # a schedule's sends in flight; its stages' shards
        stop_and_resume(bench, "pipeline-stop-resume", local, "pipeline", 8,
                        untouched(bench, "pipeline-stop-resume", local, "pipeline", 8))  # fmt: skip

    return [
        ddp_stop_resume,
        fsdp_kill_resume,
        pipeline_stop_resume,
        lambda: untouched_sweep(bench, "single-sweep", local, seeds),
        lambda: truncated_checkpoint(bench, "single-cut", local, 2, twin(2)),
        lambda: kill_a_worker(bench, "horovod-kill-worker", server, "horovod", signal.SIGKILL),
        lambda: stop_and_resume(bench, "single-stop-resume", server, "single", 1, twin(1)),
        lambda: sigkill_run_py(bench, "single-kill-run.py", local, "single", 3, twin(3)),
        lambda: full_disk(bench, "single-full-store", disk, "store", 4, twin(4)),
        lambda: kill_a_worker(bench, "ddp-term-worker", server, "ddp", signal.SIGTERM),
        lambda: kill_the_launcher(bench, "hybrid-kill-launcher", server, "hybrid"),
        lambda: stopped_sweep(bench, "single-stop-sweep", local, [21, 22, 23, 24]),
        lambda: full_disk(bench, "single-full-folder", disk, "folder", 7, None),
    ]


def run_plan(scenarios: list[Callable[[], None]]) -> list[str]:
    """Two at a time; a scenario that raised is an error of this script, said at the end."""
    errors: list[str] = []

    def guarded(scenario: Callable[[], None]) -> None:
        try:
            scenario()
        except Exception as error:
            errors.append("".join(traceback.format_exception(error)).strip())

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(guarded, scenarios))
    return errors


@contextlib.contextmanager
def workplace(keep: Path | None) -> Iterator[Path]:
    """`keep`, or a temporary folder removed at the end."""
    root = keep or Path(tempfile.mkdtemp(prefix="accelexp-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root.resolve()
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def cpu_s() -> float:
    """CPU seconds of this process and of every process it waited for (run.py, and through
    it the launchers and workers; the server)."""
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                            resource.RUSAGE_CHILDREN))  # fmt: skip
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Findings:
    """What the checks after the jobs found, besides each job's own status and orphans."""

    errors: list[str]
    mismatches: list[str]
    running: list[str]
    leaks: list[str]


def check_everything(bench: Bench, quick: bool, untouched_jobs: int) -> Findings:
    """Run the plan (with the server and the small disk set up and taken down), then compare
    the resumed runs with their twins and look for runs left RUNNING and for the secret."""
    root, server = bench.root, None
    local = f"sqlite:///{root / 'local.db'}"  # the first job makes it
    bench.stores["local"] = Store("local", local, local)
    if not quick:
        template = migrated_template(root)
        shutil.copyfile(template, root / "local.db")
        server, bench.stores["server"] = start_server(root / "server", template, bench.secret)
    disk = SmallDisk(root / "disk")
    if not quick and not disk.mounted:
        bench.skipped.append(f"the full disks: {disk.reason}")
    try:
        if server is not None:
            wait_until_up(server, bench.stores["server"].reader)
        errors = run_plan(plan(bench, quick, untouched_jobs, disk))
        mismatches = [wrong for twin in bench.twins for wrong in same_training(twin)]
        running = runs_left_running(bench)
        leaks = files_with(bench.secret, root)
    finally:
        disk.unmount()
        if server is not None:  # uvicorn and its workers too: the server's process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        kill_all(live_processes(f"{bench.id}/"))
    leaks += [f"command line of {line}" for line in sorted(bench.secret_commands)]
    return Findings(errors, mismatches, running, leaks)


def report(bench: Bench, found: Findings, wall_s: float) -> bool:
    """Print the counts; True when a check failed."""
    jobs: Counter = Counter()
    for r in bench.records:
        jobs[(r.strategy, r.event)] += r.jobs
    print(f"\n{'job':<34} {'event':<28} {'exit':>5} {'wall s':>7} {'CPU s':>6}")
    for r in sorted(bench.records, key=lambda r: r.name):
        print(f"{r.name:<34} {r.event:<28} {r.code!s:>5} {r.wall_s:>7.0f} {r.cpu_s:>6.0f}")
    print(f"\nChaos benchmark, seed {bench.seed}: {sum(jobs.values())} jobs")
    width = max((len(event) for _, event in jobs), default=0)
    for (strategy, event), n in sorted(jobs.items()):
        print(f"  {strategy:<8} {event:<{width}} {n:>3}")
    wrong = [f"{r.scenario}: {w}" for r in bench.records for w in r.wrong]
    orphans = [f"{r.scenario}: {o}" for r in bench.records for o in r.orphans]
    hangs = [r.scenario for r in bench.records if r.code is None]
    carriers = sum(r.jobs for r in bench.records if r.secret)
    rows = [
        ("wrong statuses", wrong),
        ("orphans", orphans),
        ("hangs", hangs),
        (f"resumed runs unlike their twin (of {len(bench.twins)})", found.mismatches),
        (f"secrets (jobs that carried one: {carriers})", found.leaks),
        ("runs left RUNNING at the end", found.running),
        ("errors of this script", found.errors),
    ]
    print()
    for label, details in rows:
        print(f"  {label:<48} {len(details)}")
        for detail in details:
            print(f"      {detail}")
    for reason in bench.skipped:
        print(f"  skipped: {reason}")
    print(f"  wall {wall_s:.0f} s, CPU {cpu_s():.0f} s (this script and every process it "
          f"waited for), {os.cpu_count()} cores")  # fmt: skip
    return any(details for _, details in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of the random draws")
    parser.add_argument("--quick", action="store_true", help="one sweep of 3 jobs, stopped")
    parser.add_argument("--untouched", type=int, default=12, help="jobs of the untouched sweep")
    parser.add_argument("--keep", type=Path, help="keep the jobs' folders and stores here")
    args = parser.parse_args()
    if not args.quick and args.untouched < 4:
        parser.error("--untouched must be at least 4: its jobs of seeds 1-4 are twins")
    started = time.perf_counter()
    with workplace(args.keep) as root:
        bench = Bench(root, args.seed)
        found = check_everything(bench, args.quick, args.untouched)
        failed = report(bench, found, time.perf_counter() - started)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
