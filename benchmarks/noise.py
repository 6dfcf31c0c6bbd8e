"""Proved, not assumed: an A/A test of the repeats, the paired ratio and the contention probe.

Two identical configurations — the same training, told apart only by a tag — are one real sweep,
`python run.py -m +mlflow.tags.side=a,b repeats=5 threads=2 epochs=2 max_steps_per_epoch=120
target_accuracy=null progress=false ...` (simple_cnn on the real Fashion-MNIST, the default
data), which the sweeper runs round-robin (a b a b ...) into a throwaway SQLite MLflow store.
Their true ratio is 1: whatever the lab reports for b / a beyond it is its own noise. The sweep
runs twice:

1. quiet: nothing started beside it by this benchmark (the machine may still be shared);
2. hogged: while the jobs of the odd repeats (1, 3, ...) of both sides run, a CPU hog — one
   busy-loop process per `--hog-cores` (default 1 of the 2 cores) — started when the job's
   folder `<sweep dir>/<job number>/` appears (Hydra makes it as the job starts, before its
   `.hydra` files) and killed when the next job's does (or the sweep starts its report, or
   ends). The hog stops itself at a deadline and when its parent goes away, and is killed in a
   `finally` too. The even repeats stay hog-free on both sides, so pairs of clean runs remain
   when the flagged ones are set aside.

`threads=2` (all cores, torch's own default here): the realistic "someone shares your machine"
case is a run sized for the whole machine that a neighbour takes a core from; its intra-op
threads then wait for the one that shares a core. With threads=1 a one-core hog would sit on the
idle core, and only the probe's "no free core left" rule would tell.

Beside the jobs' own probe (`accelexp.diagnosis.noise`), the benchmark keeps an independent
account each second: the host's busy time (/proc/stat) less the CPU time of the sweep's processes,
of the hogs and of itself is what someone else used (`outside`, cores: mean over the job / peak
over 5 s). It tells a flag without a hog that was right (another tenant) from a false alarm.

For each condition it prints, from the store (`accelexp.tracking.query`): every run — side,
repeat, hogged, throughput with its 95 % batch-means interval (`accelexp.report.compare`), the
`noise` tag and the probe's per-epoch figures (`noise/*`), the job's wall and CPU time (the sweep
is one process: its CPU time read at each job's start), the hog's CPU time, the outside load;
the whole sweep's wall and CPU time (its rusage); the A/A ratio b / a paired by repeat index
(`accelexp.stats.ratio`), over all pairs and with the pairs where either side is flagged
contended set aside, whether each interval holds 1.00 and its half-width; the share of hogged
runs flagged and of un-hogged runs flagged; and the goals, PASS or FAIL: quiet, the reported
interval holds 1.00 and is within ±5 %; hogged, ≥ 90 % of the hogged runs flagged and the
reported ratio (contended set aside) holds 1.00.

    python benchmarks/noise.py                          # both conditions, 5 repeats (~10 min)
    python benchmarks/noise.py --repeats 2 --steps 30   # a quick check (~3 min)
    python benchmarks/noise.py --only hogged --keep     # keep the store: mlflow ui ...
    python benchmarks/noise.py --order b,a              # b first in each round: a position bias?
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from accelexp import stats
from accelexp.processes import JOB_ENV
from accelexp.record import (
    LOCKSTEP_CONTENDED,
    NOISE,
    NOISE_CONTENDED,
    NOISE_EVIDENCE,
    OUTPUT_DIR,
    REPEAT_INDEX,
    noise_metric,
)
from accelexp.report.compare import lockstep_pairs, measure_estimate
from accelexp.stats import Estimate
from accelexp.tracking import query
from accelexp.tracking.query import RunRecord

REPO = Path(__file__).resolve().parents[1]
SIDES = ("a", "b")
POLL_S = 0.05  # how often the sweep's folder is looked at for the next job
SAMPLE_S = 1.0  # how often the monitor samples who kept the host busy
PEAK_WINDOW_S = 5.0  # the outside load's peak: over windows of at least this
OUTSIDE_SEEN = 0.25  # cores of outside load that make a flag without a hog a true one
HOG_DEADLINE_S = 300.0  # a hog stops itself after this, whatever happens to the benchmark
HALFWIDTH_GOAL = 0.05  # quiet: the A/A interval within +-5 %
FLAGGED_GOAL = 0.90  # hogged: share of hogged runs flagged contended
PROBE = ("others_cores", "cpu_util", "step_spread", "steal")  # noise/* shown per epoch
# the hog: busy until its deadline, or until its parent (this benchmark) is gone
HOG_CODE = """
import os, sys, time
end, parent = time.monotonic() + float(sys.argv[1]), os.getppid()
while time.monotonic() < end and os.getppid() == parent:
    for _ in range(20000):
        pass
"""


def cpu_seconds(rusage: resource.struct_rusage) -> float:
    return rusage.ru_utime + rusage.ru_stime


@dataclass
class Hog:
    """The busy-loop processes beside one job; `stop` kills them and keeps their CPU time."""

    processes: list[subprocess.Popen] = field(default_factory=list)
    cpu_s: float = 0.0
    ended_early: bool = False  # a hog had stopped (its deadline) before it was killed

    @classmethod
    def start(cls, cores: int, deadline_s: float) -> Hog:
        env = {k: v for k, v in os.environ.items() if k != JOB_ENV}  # not one of the job's
        argv = [sys.executable, "-c", HOG_CODE, str(deadline_s)]
        return cls([subprocess.Popen(argv, env=env) for _ in range(cores)])

    def stop(self) -> None:
        for process in self.processes:
            if process.returncode is not None:
                continue
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            self.ended_early |= pid != 0
            if pid == 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_s += cpu_seconds(usage)

    def live_cpu(self) -> float:
        """CPU seconds of its processes so far (those stopped: as reaped)."""
        total = self.cpu_s
        for process in self.processes:
            if process.returncode is None:
                with contextlib.suppress(psutil.Error):
                    t = psutil.Process(process.pid).cpu_times()
                    total += t.user + t.system
        return total


@dataclass
class Job:
    number: int
    side: str
    repeat: int
    hogged: bool
    wall_s: float = 0.0
    cpu_s: float = 0.0
    outside_mean: float = math.nan  # cores others kept busy: mean over the job (`Monitor`)
    outside_peak: float = math.nan  # ... highest over any PEAK_WINDOW_S of it
    hog: Hog | None = None


@dataclass
class Sweep:
    jobs: list[Job]
    wall_s: float
    cpu_s: float  # the sweep process's, children's rusage
    exit_code: int
    log: Path


def sweep_command(args: argparse.Namespace, store: Path, condition: str) -> list[str]:
    return [
        sys.executable, "run.py", "-m", f"+mlflow.tags.side={','.join(args.order)}",
        f"repeats={args.repeats}", f"epochs={args.epochs}", f"max_steps_per_epoch={args.steps}",
        f"threads={args.threads}", "target_accuracy=null", "progress=false",
        f"mlflow.tracking_uri={uri(store)}", f"mlflow.experiment=aa-{condition}",
        f"hydra.sweep.dir={store / condition}",
    ]  # fmt: skip


def uri(store: Path) -> str:
    return f"sqlite:///{store / 'mlflow.db'}"


def run_sweep(args: argparse.Namespace, store: Path, condition: str) -> Sweep:
    """One sweep, its jobs watched: a job starts when Hydra makes its folder `<dir>/<number>`."""
    sweep_dir = store / condition
    # the sweeper's order: each round runs the sides as given (accelexp.sweeper.repeated)
    jobs = [
        Job(r * len(args.order) + i, side, r, condition == "hogged" and r % 2 == 1)
        for r in range(args.repeats)
        for i, side in enumerate(args.order)
    ]
    log = store / f"{condition}.log"
    command = sweep_command(args, store, condition)
    print(f"\n[{condition}] {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    with log.open("w") as out:
        sweep = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    monitor = Monitor(sweep.pid)
    monitor.sample()
    marks: list[int] = []  # the monitor's sample at each job's start, then at the jobs' end
    pid = 0
    try:
        while True:
            pid, status, usage = os.wait4(sweep.pid, os.WNOHANG)
            if pid != 0:
                break
            k = len(marks)
            if k < len(jobs) and (sweep_dir / str(k)).is_dir():  # job k started
                monitor.stop_hog()
                marks.append(monitor.sample())
                job = jobs[k]
                if job.hogged:
                    job.hog = monitor.start_hog(args.hog_cores, args.hog_deadline)
                print(f"  job {k}: side {job.side} repeat {job.repeat}"
                      + (" + hog" if job.hogged else ""), flush=True)  # fmt: skip
                continue
            if k == len(jobs) and (sweep_dir / "report").exists():  # the jobs are over
                monitor.stop_hog()
                marks.append(monitor.sample())
            elif time.perf_counter() - monitor.samples[-1][0] >= SAMPLE_S:
                monitor.sample()
            time.sleep(POLL_S)
    finally:
        monitor.stop_hog()
        if pid == 0:  # interrupted: the sweep is still running
            with contextlib.suppress(ProcessLookupError):
                sweep.send_signal(signal.SIGINT)  # let it close its runs
            try:
                sweep.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sweep.kill()
                sweep.wait()
    wall = time.perf_counter() - started
    sweep.returncode = code = os.waitstatus_to_exitcode(status)
    total_cpu = cpu_seconds(usage)
    if len(marks) <= len(jobs):  # no report seen: the last job's end is the sweep's exit
        marks.append(monitor.sample(sweep_cpu=total_cpu))
    for job, start, end in zip(jobs, marks, marks[1:], strict=False):
        monitor.describe(job, start, end)
    return Sweep(jobs, wall, total_cpu, code, log)


def host_busy() -> float:
    """CPU seconds the host's CPUs were busy since boot, as the probe counts (no idle, steal)."""
    user, nice, system, _, _, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def tree_cpu(process: psutil.Process) -> float:
    """CPU seconds of a process, its reaped children and its live descendants; NaN: gone."""
    try:
        tree = [process, *process.children(recursive=True)]
    except psutil.Error:
        return math.nan
    total = 0.0
    for member in tree:
        with contextlib.suppress(psutil.Error):
            t = member.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


class Monitor:
    """Who kept the host busy, sampled about each second, independently of the jobs' probe: the
    sweep's processes, the hogs, this benchmark, and the rest — `outside`, what neither this
    benchmark nor its sweep started (someone else sharing the machine)."""

    def __init__(self, sweep_pid: int) -> None:
        self.sweep = psutil.Process(sweep_pid)
        self.hog: Hog | None = None
        self.hogs_done = 0.0  # CPU seconds of the hogs stopped
        self.samples: list[tuple[float, float, float]] = []  # (wall, sweep CPU, outside CPU)

    def start_hog(self, cores: int, deadline_s: float) -> Hog:
        self.hog = Hog.start(cores, deadline_s)
        return self.hog

    def stop_hog(self) -> None:
        if self.hog is not None:
            self.hog.stop()
            self.hogs_done += self.hog.cpu_s
            self.hog = None

    def sample(self, sweep_cpu: float | None = None) -> int:
        """Take a sample (`sweep_cpu` given: the sweep has exited, its rusage); its index."""
        now, busy = time.perf_counter(), host_busy()
        sweep = tree_cpu(self.sweep) if sweep_cpu is None else sweep_cpu
        if math.isnan(sweep):  # gone between the poll and now: its last figure
            sweep = self.samples[-1][1] if self.samples else 0.0
        hogs = self.hogs_done + (self.hog.live_cpu() if self.hog is not None else 0.0)
        mine = sum(os.times()[:2])
        self.samples.append((now, sweep, busy - sweep - hogs - mine))
        return len(self.samples) - 1

    def describe(self, job: Job, start: int, end: int) -> None:
        """The job's wall and CPU time, and the outside load: its mean over the job, and its
        peak over any `PEAK_WINDOW_S` of it."""
        (t0, c0, o0), (t1, c1, o1) = self.samples[start], self.samples[end]
        job.wall_s, job.cpu_s = t1 - t0, c1 - c0
        job.outside_mean = (o1 - o0) / job.wall_s if job.wall_s > 0 else math.nan
        window, peaks = self.samples[start : end + 1], []
        for i, (ta, _, oa) in enumerate(window):
            later = [(tb, ob) for tb, _, ob in window[i + 1 :] if tb - ta >= PEAK_WINDOW_S]
            if later:
                tb, ob = later[0]
                peaks.append((ob - oa) / (tb - ta))
        job.outside_peak = max(peaks, default=job.outside_mean)


@dataclass
class Run:
    job: Job
    record: RunRecord
    estimate: Estimate | None
    why: str
    probe: dict[str, list[float]]

    @property
    def contended(self) -> bool:
        return self.record.tags.get(NOISE) == NOISE_CONTENDED


def read_runs(store: Path, condition: str, jobs: list[Job]) -> list[Run]:
    experiment = query.experiment_id(uri(store), f"aa-{condition}")
    records = query.experiment_runs(uri(store), experiment)
    by_job = {Path(r.tags.get(OUTPUT_DIR, "")).name: r for r in records}  # <sweep dir>/<k>
    runs = []
    for job in jobs:
        record = by_job.get(str(job.number))
        if record is None:
            print(f"  [{condition}] job {job.number} ({job.side} r{job.repeat}) logged no run")
            continue
        logged = record.tags.get("side"), record.tags.get(REPEAT_INDEX)
        if logged != (job.side, str(job.repeat)):  # the sweeper's order is not the one assumed
            expected = job.side, job.repeat
            raise SystemExit(f"job {job.number} ran (side, repeat) {logged}, not {expected}")
        estimate, why = measure_estimate(record)
        probe = {
            name: [
                v for _, v in query.metric_history(uri(store), record.run_id, noise_metric(name))
            ]
            for name in PROBE
        }
        runs.append(Run(job, record, estimate, why, probe))
    return runs


def per_epoch(values: list[float], fmt: str) -> str:
    return "/".join(fmt.format(v) for v in values) if values else "-"


def print_runs(runs: list[Run]) -> None:
    print(
        f"{'side':<5}{'rep':>4}{'hog':>5}  {'throughput img/s (95 %)':<26}{'±%':>6}  "
        f"{'noise':<10}{'others':>11}{'cpu_util':>11}{'spread':>11}{'steal':>11}"
        f"{'wall s':>8}{'cpu s':>8}{'hog cpu':>8}{'outside':>11}"
    )
    for run in runs:
        job, e = run.job, run.estimate
        text = stats.format_estimate(e, "{:.0f}") if e is not None else run.why[:26]
        half = e.relative_halfwidth() if e is not None else None
        hog_cpu = f"{job.hog.cpu_s:.1f}" if job.hog is not None else "-"
        print(
            f"{job.side:<5}{job.repeat:>4}{'yes' if job.hogged else 'no':>5}  {text:<26}"
            f"{100 * half if half is not None else float('nan'):>6.1f}  "
            f"{run.record.tags.get(NOISE, '?'):<10}"
            f"{per_epoch(run.probe['others_cores'], '{:.2f}'):>11}"
            f"{per_epoch(run.probe['cpu_util'], '{:.2f}'):>11}"
            f"{per_epoch(run.probe['step_spread'], '{:.1f}'):>11}"
            f"{per_epoch(run.probe['steal'], '{:.2f}'):>11}"
            f"{job.wall_s:>8.1f}{job.cpu_s:>8.1f}{hog_cpu:>8}"
            f"{per_epoch([max(0.0, job.outside_mean), max(0.0, job.outside_peak)], '{:.2f}'):>11}"
        )


def paired(runs: list[Run], keep_contended: bool) -> tuple[Estimate | None, list[int]]:
    """b / a paired by repeat index over the repeats where both sides measured (and, unless
    `keep_contended`, neither side was flagged); the repeats used."""
    by = {(r.job.side, r.job.repeat): r for r in runs if r.estimate is not None}
    repeats = sorted({repeat for _, repeat in by})
    used = [
        i
        for i in repeats
        if all((s, i) in by for s in SIDES)
        and (keep_contended or not any(by[s, i].contended for s in SIDES))
    ]
    if not used:
        return None, []
    num = [by["b", i].estimate for i in used]
    den = [by["a", i].estimate for i in used]
    return stats.ratio(num, den, paired=True), used


def describe(e: Estimate | None) -> str:
    if e is None:
        return "no pairs"
    half = e.relative_halfwidth()
    width = f"±{100 * half:.1f} %" if half is not None else "no interval"
    holds = "holds 1.00" if e.contains(1.0) else "EXCLUDES 1.00"
    return f"{stats.format_estimate(e, '{:.3f}', '×')}  {width}  {holds}  [{e.method or '-'}]"


def outsider(run: Run) -> bool:
    """Whether the benchmark's own monitor saw others keep the host busy during the job."""
    return run.job.outside_peak >= OUTSIDE_SEEN


def share(flags: list[bool]) -> tuple[float | None, str]:
    if not flags:
        return None, "no runs"
    return sum(flags) / len(flags), f"{sum(flags)}/{len(flags)} = {sum(flags) / len(flags):.0%}"


def report(condition: str, sweep: Sweep, runs: list[Run]) -> list[tuple[str, bool]]:
    """Print the condition's tables; its goals as (text, passed)."""
    print(f"\n=== {condition}: {len(runs)} runs read back of {len(sweep.jobs)} jobs ===")
    if sweep.exit_code != 0:
        print(f"  the sweep exited {sweep.exit_code}; its log: {sweep.log}")
    print_runs(runs)
    print(
        f"whole sweep: wall {sweep.wall_s:.1f} s, CPU {sweep.cpu_s:.1f} s (children's rusage: "
        f"{sweep.cpu_s / sweep.wall_s:.2f} cores); jobs' wall and CPU: from one job's start "
        f"to the next (job 0 includes importing torch)"
    )
    every, used_all = paired(runs, keep_contended=True)
    clean, used_clean = paired(runs, keep_contended=False)
    print(f"A/A b/a, all pairs          (repeats {used_all}): {describe(every)}")
    print(f"A/A b/a, contended set aside (repeats {used_clean}): {describe(clean)}")
    hogged = [r for r in runs if r.job.hogged]
    free = [r for r in runs if not r.job.hogged]
    if hogged and free:
        speed = [r for r in hogged if r.estimate is not None]
        base = [r for r in free if r.estimate is not None]
        if speed and base:
            slowdown = statistics.median(r.estimate.value for r in speed) / statistics.median(
                r.estimate.value for r in base
            )
            print(f"hogged / hog-free throughput (medians): {slowdown:.2f}")
    caught, caught_text = share([r.contended for r in hogged])
    _, alarms_text = share([r.contended for r in free])
    _, false_text = share([r.contended and not outsider(r) for r in free])
    if hogged:
        print(f"hogged runs flagged contended: {caught_text}")
    print(
        f"un-hogged runs flagged contended: {alarms_text}; false alarms (no outside load "
        f"≥ {OUTSIDE_SEEN} cores seen by this benchmark either): {false_text}"
    )
    for r in runs:
        if r.job.hog is not None and r.job.hog.ended_early:
            print(f"  {r.job.side} r{r.job.repeat}: its hog stopped at its deadline, early")
        if r.contended != r.job.hogged:
            if r.contended:
                what = "flagged without a hog" + (
                    f", outside load up to {r.job.outside_peak:.2f} cores"
                    if outsider(r)
                    else ", no outside load seen: a false alarm"
                )
            else:
                what = "hogged, not flagged"
            evidence = r.record.tags.get(NOISE_EVIDENCE, "")
            print(f"  {r.job.side} r{r.job.repeat}: {what}: {evidence}")
    goals = []
    if condition == "quiet":
        e = clean
        ok = (
            e is not None
            and e.contains(1.0)
            and (e.relative_halfwidth() or 1.0) <= HALFWIDTH_GOAL
            and len(runs) == len(sweep.jobs)
        )
        also = "" if every == clean else f" (all pairs: {describe(every)})"
        goals.append((f"quiet: reported A/A {describe(e)}; goal holds 1.00, ≤ ±5 %{also}", ok))
    else:
        ok = caught is not None and caught >= FLAGGED_GOAL
        goals.append((f"hogged: {caught_text} of hogged runs flagged; goal ≥ 90 %", ok))
        ok = clean is not None and clean.contains(1.0)
        goals.append((f"hogged: reported A/A (contended set aside) {describe(clean)}", ok))
    for text, ok in goals:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    return goals


# --- the two designs side by side: whole-run repeats and lockstep (--designs) --------------


@dataclass
class DesignTrial:
    """One A/A sweep of one design: its ratio b / a, cost, and (lockstep) slices set aside."""

    design: str
    trial: int
    estimate: Estimate | None
    wall_s: float
    cpu_s: float
    rounds: int = 0  # lockstep: paired rounds behind the ratio
    set_aside: int = 0  # lockstep: slices a neighbour shared; repeats: runs flagged contended
    hogged: bool = False
    repeats: int = 0  # repeats both sides completed
    incarnations: list[Estimate] = field(default_factory=list)  # lockstep: each alone
    exit_code: int = 0  # the sweep's


def flagged(record: RunRecord) -> bool:
    return record.tags.get(NOISE) == NOISE_CONTENDED


# the designs --designs can run: whole-run repeats, and lockstep with its jobs as threads of one
# process (lockstep.process=shared, what auto picks for these jobs) or a process each (own)
LOCKSTEP_DESIGNS = {"shared": "lockstep.process=shared", "own": "lockstep.process=own"}
SWEEPS_RAN = "every sweep ran to its end"  # the goal whose FAIL makes the exit code 1


def design_command(
    args: argparse.Namespace, store: Path, design: str, name: str, repeats: int | None = None
) -> list[str]:
    """The sweep of one trial: lockstep designs sample to `--precision-target` when given;
    whole-run repeats run `repeats` (the lockstep trial's count, for equal cost) or `--repeats`."""
    if design == "repeats":
        compare = ["compare=repeats", f"repeats={repeats or args.repeats}"]
    else:
        compare = ["compare=lockstep", LOCKSTEP_DESIGNS[design], f"repeats={args.repeats}"]
        if args.precision_target:
            compare += [f"precision_target={args.precision_target}",
                        f"max_repeats={args.max_repeats}"]  # fmt: skip
    return [
        sys.executable, "run.py", "-m", "+mlflow.tags.side=a,b", *compare,
        f"epochs={args.epochs}", f"max_steps_per_epoch={args.steps}",
        f"threads={args.threads}", f"lockstep.slice_steps={args.slice_steps}",
        *([f"lockstep.slice_s={args.slice_s}"] if args.slice_s else []),
        "target_accuracy=null", "progress=false", *args.run_args.split(),
        f"mlflow.tracking_uri={uri(store)}", f"mlflow.experiment={name}",
        f"hydra.sweep.dir={store / name}",
    ]  # fmt: skip


def run_design(
    args: argparse.Namespace,
    store: Path,
    design: str,
    trial: int,
    hog: bool,
    repeats: int | None = None,
):
    """One sweep of `design`, with a one-core hog from `--hog-after` s for `--hog-for` s when
    `hog`; its A/A ratio computed as the report computes it."""
    name = f"{design}-{trial}"
    command = design_command(args, store, design, name, repeats)
    print(f"  [{name}{' + hog' if hog else ''}] {' '.join(command[3:-3])}", flush=True)
    started = time.perf_counter()
    hogs: Hog | None = None
    with (store / f"{name}.log").open("w") as out:
        sweep = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            pid, status, usage = os.wait4(sweep.pid, os.WNOHANG)
            if pid != 0:
                break
            now = time.perf_counter() - started
            if hog and hogs is None and now >= args.hog_after:
                hogs = Hog.start(args.hog_cores, min(args.hog_for, args.hog_deadline))
            if hogs is not None and now >= args.hog_after + args.hog_for:
                hogs.stop()
            time.sleep(POLL_S)
    finally:
        if hogs is not None:
            hogs.stop()
        if sweep.poll() is None:
            sweep.send_signal(signal.SIGINT)
            sweep.wait()
    wall = time.perf_counter() - started
    result = DesignTrial(design, trial, None, wall, cpu_seconds(usage), hogged=hog)
    result.exit_code = os.waitstatus_to_exitcode(status)
    if result.exit_code != 0:
        print(f"    the sweep exited {result.exit_code}: {store / name}.log")
    try:
        measure_design(store, result)
    except query.QueryError as error:  # the sweep ended before it made its store
        print(f"    nothing to measure: {error}")
    print(f"    {row(result)}", flush=True)
    return result


def measure_design(store: Path, result: DesignTrial) -> DesignTrial:
    """`result`'s A/A ratio from its sweep's runs in `store`, as the report computes it."""
    design, name = result.design, f"{result.design}-{result.trial}"
    records = query.experiment_runs(uri(store), query.experiment_id(uri(store), name))
    by = {(r.tags.get("side"), r.tags.get(REPEAT_INDEX)): r for r in records}
    repeats = sorted({i for _, i in by if all((side, i) in by for side in SIDES)})
    result.repeats = len(repeats)
    if design in LOCKSTEP_DESIGNS:
        incarnations = []
        for i in repeats:
            for pairs in lockstep_pairs(by["b", i], by["a", i]):
                incarnations.append(pairs)
                result.incarnations.append(stats.lockstep_ratio([pairs]))
            result.set_aside += sum(
                1 for r in (by["a", i], by["b", i]) for _, v in r.history(LOCKSTEP_CONTENDED) if v
            )
        result.rounds = sum(len(pairs) for pairs in incarnations)
        if result.rounds:
            result.estimate = stats.lockstep_ratio(incarnations, shared=design == "shared")
    else:
        pairs = [(by["b", i], by["a", i]) for i in repeats]
        clean = [(b, a) for b, a in pairs if not flagged(a) and not flagged(b)]
        result.set_aside = len(pairs) - len(clean)
        measured = [(measure_estimate(b)[0], measure_estimate(a)[0]) for b, a in clean]
        measured = [(b, a) for b, a in measured if b is not None and a is not None]
        if measured:
            result.estimate = stats.ratio(
                [b for b, _ in measured], [a for _, a in measured], paired=True
            )
    return result


def row(t: DesignTrial) -> str:
    """One trial as a line of the table `designs` prints."""
    e = t.estimate
    text = stats.format_estimate(e, "{:.4f}") if e is not None else "no pairs"
    half = e.relative_halfwidth() if e is not None and e.has_interval else math.nan
    alone = " ".join(f"{x.value:.3f}±{100 * (x.relative_halfwidth() or 0):.1f}%"
                     for x in t.incarnations)  # fmt: skip
    return (
        f"{t.design:<10}{t.trial:>6}{'yes' if t.hogged else 'no':>5}  {text:<28}"
        f"{100 * half:>6.1f}{'yes' if e is not None and e.contains(1.0) else 'NO':>9}"
        f"{t.repeats:>5}{t.rounds:>8}{t.set_aside:>7}{t.wall_s:>8.0f}{t.cpu_s:>8.0f}  {alone}"
    )


def designs(args: argparse.Namespace, store: Path) -> list[tuple[str, bool]]:
    """`--trials` A/A trials of each design, alternating which goes first, each a sweep of
    fresh processes at the same size (so at about equal wall time); then the lockstep design
    `--hogged-trials` times with a one-core hog during part of it."""
    trials: list[DesignTrial] = []
    chosen = args.designs.split(",")
    lockstep = next((d for d in chosen if d in LOCKSTEP_DESIGNS), "shared")  # the hogged one
    first = args.first_trial
    for trial in range(first, first + args.trials):
        if args.precision_target:  # lockstep samples to the target; repeats then match its cost
            order = sorted(chosen, key=lambda d: d == "repeats")
        else:
            order = chosen if trial % 2 == 0 else chosen[::-1]
        matched: int | None = None
        for design in order:
            if design == "repeats" and trial - first >= args.repeats_trials:
                continue
            trials.append(run_design(args, store, design, trial, hog=False, repeats=matched))
            if args.precision_target and design in LOCKSTEP_DESIGNS:
                matched = trials[-1].repeats or None
    for trial in range(args.hogged_trials):
        trials.append(run_design(args, store, lockstep, first + args.trials + trial, hog=True))
    print(
        f"\n{'design':<10}{'trial':>6}{'hog':>5}  {'b / a (95 %)':<28}{'±%':>6}{'holds 1':>9}"
        f"{'reps':>5}{'rounds':>8}{'aside':>7}{'wall s':>8}{'cpu s':>8}  each incarnation alone"
    )
    for t in trials:
        print(row(t))
    goals = []
    for design in chosen:
        quiet = [t for t in trials if t.design == design and not t.hogged]
        if not quiet:  # --repeats-trials 0
            continue
        halves = [t.estimate.relative_halfwidth() for t in quiet if t.estimate is not None
                  and t.estimate.has_interval]  # fmt: skip
        held = sum(1 for t in quiet if t.estimate is not None and t.estimate.contains(1.0))
        walls = [t.wall_s for t in quiet]
        cpus = [t.cpu_s for t in quiet]
        median = statistics.median(halves) if halves else math.nan
        print(
            f"{design}: median half-width ±{100 * median:.1f} % over {len(halves)} trials; "
            f"{held}/{len(quiet)} intervals hold 1.00; median wall {statistics.median(walls):.0f} s"
            f", CPU {statistics.median(cpus):.0f} s"
        )
        if design == lockstep:
            goals.append((f"quiet lockstep ({design}) A/A median half-width "
                          f"±{100 * median:.1f} %; goal ≤ ±2 %", median <= 0.02))  # fmt: skip
            goals.append((f"lockstep calibrated: {held}/{len(quiet)} trials hold 1.00",
                          held == len(quiet) >= 5))  # fmt: skip
    failed = [f"{t.design}-{t.trial}" for t in trials if t.exit_code != 0]
    if failed:  # a sweep that did not run is no A/A: the caller (gpu_session.sh) must see it
        goals.append((f"{SWEEPS_RAN} (failed: {', '.join(failed)})", False))
    for t in (t for t in trials if t.hogged):
        e = t.estimate
        ok = e is not None and e.contains(1.0) and (e.relative_halfwidth() or 1) <= 0.04
        goals.append((f"hogged lockstep trial {t.trial}: {describe(e)}, {t.set_aside} slices "
                      f"set aside; goal holds 1.00 within ±4 %", ok))  # fmt: skip
    return goals


def main() -> int:
    """0, or 1 when a sweep did not run to its end (a FAIL of a measured goal is printed, not
    an exit code)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120, help="max_steps_per_epoch")
    parser.add_argument("--epochs", type=int, default=2, help="throughput: those after the 1st")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    parser.add_argument("--hog-cores", type=int, default=1, help="busy-loop processes")
    parser.add_argument("--hog-deadline", type=float, default=HOG_DEADLINE_S, help="seconds")
    parser.add_argument("--only", choices=("quiet", "hogged"))
    parser.add_argument("--order", default="a,b", help="the sides' order in each round")
    parser.add_argument("--keep", action="store_true", help="keep the MLflow store")
    parser.add_argument(
        "--designs",
        nargs="?",
        const="repeats,shared",
        help="designs side by side, of repeats, shared (lockstep in one process), own (lockstep, "
        "a process per job): default repeats,shared",
    )
    parser.add_argument("--trials", type=int, default=5, help="--designs: A/A trials of each")
    parser.add_argument("--hogged-trials", type=int, default=1, help="--designs: lockstep + hog")
    parser.add_argument("--slice-steps", type=int, default=8, help="--designs: lockstep turn")
    parser.add_argument(
        "--slice-s", type=float, help="--designs: lockstep turn in seconds (lockstep.slice_s)"
    )
    parser.add_argument("--hog-after", type=float, default=30.0, help="--designs: s into sweep")
    parser.add_argument("--hog-for", type=float, default=40.0, help="--designs: hog seconds")
    parser.add_argument(
        "--precision-target",
        type=float,
        help="--designs: lockstep adds repeats until this half-width (precision_target=); "
        "repeats then run as many repeats as lockstep took (equal cost) and go second",
    )
    parser.add_argument("--first-trial", type=int, default=0, help="--designs: number from")
    parser.add_argument("--max-repeats", type=int, default=10, help="--precision-target's budget")
    parser.add_argument(
        "--repeats-trials", type=int, help="--designs: trials of the repeats design (--trials)"
    )
    parser.add_argument(
        "--run-args",
        default="",
        help='--designs: more run.py overrides for both sides, e.g. "model=resnet50 '
        'data=synthetic" (a GPU A/A: scripts/gpu_session.sh)',
    )
    args = parser.parse_args()
    args.order = args.order.split(",")
    if args.repeats_trials is None:
        args.repeats_trials = args.trials
    if sorted(args.order) != sorted(SIDES):
        parser.error(f"--order: the sides {','.join(SIDES)} in some order")
    conditions = [args.only] if args.only else ["quiet", "hogged"]
    store = Path(tempfile.mkdtemp(prefix="accelexp-aa-"))
    cores = len(os.sched_getaffinity(0))
    print(
        f"A/A test: simple_cnn on Fashion-MNIST, epochs={args.epochs} steps/epoch={args.steps} "
        f"threads={args.threads} repeats={args.repeats}, {cores} cores, hog "
        f"{args.hog_cores} busy core(s) during the odd repeats, sides in the order "
        f"{','.join(args.order)}; store {store}"
    )
    results: dict[str, tuple[Sweep, list[Run]]] = {}
    goals: list[tuple[str, bool]] = []
    try:
        if args.designs:
            goals = designs(args, store)
            conditions = []
        for condition in conditions:
            sweep = run_sweep(args, store, condition)
            results[condition] = sweep, read_runs(store, condition, sweep.jobs)
        for condition, (sweep, runs) in results.items():
            goals += report(condition, sweep, runs)
        print("\nGoals:")
        for text, ok in goals:
            print(f"  {'PASS' if ok else 'FAIL'}  {text}")
        if results:  # --designs prints each sweep's wall and CPU time in its table
            total_wall = sum(s.wall_s for s, _ in results.values())
            total_cpu = sum(s.cpu_s for s, _ in results.values())
            hog_cpu = sum(j.hog.cpu_s for s, _ in results.values() for j in s.jobs if j.hog)
            print(
                f"Totals: sweeps' wall {total_wall:.1f} s, their CPU {total_cpu:.1f} s; "
                f"the hogs' CPU {hog_cpu:.1f} s"
            )
    finally:
        if args.keep:
            print(f"store kept: mlflow ui --backend-store-uri {uri(store)}")
        else:
            shutil.rmtree(store, ignore_errors=True)
    return 1 if any(text.startswith(SWEEPS_RAN) for text, _ in goals) else 0


if __name__ == "__main__":
    sys.exit(main())
