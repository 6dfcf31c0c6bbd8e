"""Was the machine shared while a run was timed? The evidence, and a `noise` tag for the run.

A speed measured on a machine that other work was using is a measurement of the sharing, not of
the run. While an epoch's training steps are timed, `ContentionProbe` reads what a shared machine
shows, on each rank: the CPU time of this process (and its children) against wall time × its
threads; the host's busy and stolen time from `/proc/stat`, over the CPUs this process may run on;
the CPU time of the job's own processes (`job_cores`: this tree, and every local process whose
environment carries the job's token, `accelexp.processes.JOB_ENV`), so that what the host was busy
with beyond the job is the `others_cores` (what neither kept busy was idle: `busiest`, for the
scale-out advice of `accelexp.machine`); the 1-minute load; the spread of the step times; on
CUDA, through NVML (`nvidia-ml-py`, optional), the processes on the GPU that are not the job's
(nor, in lockstep, its sweep's: the sweep and its waiting jobs hold CUDA contexts of their own),
its throttle reasons, temperature and SM clock. Ranks are combined by an elementwise MAX of
`NoiseSample.to_tensor` (arranged so that the max is the worst case of each field).

`judge` flags a run `noise=contended` when any epoch shows strong evidence:
- other processes kept at least `OTHERS_CORES` cores busy, and the job's threads plus the others
  left less than `FREE_CORES` core free (or the others took half the host). A whole free core is
  asked for because the job needs more than its compute threads (the interpreter, loader, kernel
  work) and because a hog on a "free" core still shares the caches, the memory bandwidth and the
  scheduler: on a 2-core host a 1-thread run beside a 1-core hog is contended;
- the hypervisor stole at least `STEAL_MAX` of the CPU time;
- on a CPU device, the process got less than `CPU_UTIL_MIN` of the threads it asked for while
  others were seen (`OTHERS_HINT` cores, or off Linux a load above the cores): low utilisation
  alone is also what a loop that waits for its input shows;
- the p90 step took `SPREAD_MAX` × the median while others were seen: the run's own causes
  (input stalls, allocator, autotuning) make irregular steps on a quiet machine too;
- on CUDA: another process on the GPU; a throttle reason in `THROTTLE_FLAGS` (not the software
  power cap, which a busy datacenter GPU hits all the time; its cost shows in the clock ratio);
  an SM clock below `CLOCK_RATIO_MIN` of the maximum while the GPU was busy.
The load is reported with the evidence but flags nothing: the job's own threads are in it.
A window shorter than `WINDOW_MIN_S` (a lockstep slice of a few tiny steps) gives no CPU
evidence: CPU time is counted in 10-ms ticks, and one tick over 5 ms reads as two cores.

Calibration, on a 2-core shared VM: the probe around 3 s of matmuls (tests/test_noise.py's
loop), quiet and beside a one-core busy loop of another process, 3-5 repeats each. One torch
thread: others_cores 0.00-0.05 quiet, 0.99-1.01 hogged (a busy child carrying the job's token:
0.00-0.07); cpu_util 0.97-1.00 either way. Two threads: others_cores 0.00 quiet, 0.70-0.75
hogged; cpu_util 1.00 quiet, 0.63-0.65 hogged; step spread 1.1-1.3 quiet, 3.2-4.2 hogged. So
`OTHERS_CORES` 0.5 and `CPU_UTIL_MIN` 0.75 sit between quiet and hogged with margin both sides.
Once, beside the job's own busy child, others read 0.33 with cpu_util 0.85 and spread 2.05:
some third process did take CPU from it, and the spread rule (`OTHERS_HINT` seen) flags that.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import psutil
import torch

from accelexp.processes import JOB_ENV, SWEEP_ENV, job_processes
from accelexp.record import NOISE, NOISE_CONTENDED, NOISE_EVIDENCE, NOISE_QUIET, noise_metric

OTHERS_CORES = 0.5  # cores others kept busy: quiet reads <= 0.07, a one-core hog >= 0.7
OTHERS_HINT = 0.25  # cores of others that corroborate low CPU utilisation or irregular steps
FREE_CORES = 1.0  # the job's threads plus the others must leave this much of the host free
OTHERS_SHARE = 0.5  # ... or the others took at least this share of the host's cores
STEAL_MAX = 0.05  # share of CPU time the hypervisor stole
CPU_UTIL_MIN = 0.75  # share of its asked threads a CPU run must get (hogged: 0.63)
SPREAD_MAX = 2.0  # p90 / p50 of the step times
SPREAD_MIN_STEPS = 8  # fewer steps give no p90 worth the name
WINDOW_MIN_S = 0.2  # CPU time is counted in ticks of 10 ms: a tick is 5 % of a core over 0.2 s
CLOCK_RATIO_MIN = 0.8  # SM clock / max SM clock, while the GPU is busy
GPU_BUSY_MIN = 50  # % utilisation (NVML) above which the GPU counts as busy
# NVML clock-event (throttle) reasons that slow clocks; idle and application clocks do not count
THROTTLE_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}
THROTTLE_FLAGS = {"hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
LOWER_IS_WORSE = {"cpu_util", "host_cores", "gpu_sm_clock_ratio"}  # negated in the tensor
TAG_MAX = 5000  # characters of an MLflow tag value


@dataclass
class NoiseSample:
    """One timed window (an epoch's timed steps) on one rank; None: not known."""

    wall_s: float
    cpu_util: float | None
    others_cores: float | None
    host_cores: int
    steal: float | None
    load1: float | None
    step_spread: float | None
    job_cores: float | None = None  # cores the job's processes kept busy (all of them, here)
    gpu_other_processes: int | None = None
    gpu_throttle: str | None = None
    gpu_temp_c: float | None = None
    gpu_sm_clock_ratio: float | None = None

    def metrics(self) -> dict[str, float | None]:
        """MLflow metrics `noise/<field>` (the numeric fields)."""
        return {noise_metric(name): getattr(self, name) for name in _numeric()}

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        """Numeric fields, negated where lower is worse, so a MAX over ranks is the worst case.
        None is -inf (it loses every max; under a max reduction NaN's fate is the backend's)."""
        values = []
        for name in _numeric():
            v = getattr(self, name)
            values.append(-math.inf if v is None else -v if name in LOWER_IS_WORSE else v)
        return torch.tensor(values, dtype=torch.float64, device=device)

    @classmethod
    def worst_of(cls, tensor: torch.Tensor, template: NoiseSample) -> NoiseSample:
        """Back from a max-reduced `to_tensor`; the string fields are the template's."""
        values = dict(zip(_numeric(), tensor.tolist(), strict=True))
        for name, v in values.items():
            values[name] = None if not math.isfinite(v) else -v if name in LOWER_IS_WORSE else v
        for name in ("host_cores", "gpu_other_processes"):
            values[name] = None if values[name] is None else round(values[name])
        values["host_cores"] = values["host_cores"] or template.host_cores
        return cls(**values, gpu_throttle=template.gpu_throttle)


def _numeric() -> list[str]:
    return [f.name for f in fields(NoiseSample) if f.name != "gpu_throttle"]


class ContentionProbe:
    """Samples one timed window: `start()` at its start, `stop(step_seconds)` at its end."""

    def __init__(self, device: torch.device, threads: int | None, job_token: str | None = None):
        self.threads = threads
        self.token = job_token if job_token is not None else os.environ.get(JOB_ENV)
        self.sweep = os.environ.get(SWEEP_ENV)  # a lockstep job: its sweep's pid
        self.linux = sys.platform.startswith("linux")
        self.cpus = os.sched_getaffinity(0) if self.linux else set(range(os.cpu_count() or 1))
        self.gpu = _Gpu(device) if device.type == "cuda" else None
        self._begin: tuple[float, float, float, tuple[float, float, float] | None] | None = None
        self._paused: tuple[float, float, float, tuple[float, float, float] | None] | None = None

    def start(self) -> None:
        self._begin, self._paused = self._reading(), None

    def pause(self) -> None:
        """What happens from now until `resume` is not the window's (lockstep: another job's
        turn, which is that job's CPU, not a neighbour's)."""
        self._paused = self._reading() if self._begin is not None else None

    def resume(self) -> None:
        if self._begin is None or self._paused is None:  # not started: nothing to take out
            return
        (t0, tree0, job0, host0), now = self._paused, self._reading()
        t1, tree1, job1, host1 = now
        b_t, b_tree, b_job, b_host = self._begin
        if b_host is not None and host0 is not None and host1 is not None:
            b_host = tuple(b + (z - a) for b, a, z in zip(b_host, host0, host1, strict=True))
        self._begin = (b_t + t1 - t0, b_tree + tree1 - tree0, b_job + job1 - job0, b_host)
        self._paused = None

    def _reading(self) -> tuple[float, float, float, tuple[float, float, float] | None]:
        tree_s, job_s, _ = self._cpu()
        return time.perf_counter(), tree_s, job_s, self._host()

    def stop(self, step_seconds: Sequence[float]) -> NoiseSample:
        assert self._begin is not None, "stop() without start()"
        t0, tree0, job0, host0 = self._begin
        tree_s, job_s, pids = self._cpu()
        host, wall = self._host(), max(time.perf_counter() - t0, 1e-9)
        others = steal = None
        job = max(0.0, job_s - job0)
        if host is not None and host0 is not None:
            busy, stolen, total = (b - a for a, b in zip(host0, host, strict=True))
            others = max(0.0, busy - job) / wall
            steal = stolen / total if total > 0 else None
        sample = NoiseSample(
            wall_s=wall,
            cpu_util=(tree_s - tree0) / (wall * self.threads) if self.threads else None,
            others_cores=others,
            host_cores=len(self.cpus),
            steal=steal,
            load1=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            step_spread=_spread(step_seconds),
            job_cores=job / wall,
        )
        if self.gpu is not None:
            self.gpu.read(sample, pids | self._sweep())
        return sample

    def _sweep(self) -> set[int]:
        """A lockstep sweep and every job it started (`SWEEP_ENV`): each holds a CUDA context
        of its own and waits, blocked, while this job has the turn: not a neighbour."""
        if not (self.sweep and self.sweep.isdigit() and self.linux):
            return set()
        return {int(self.sweep), *job_processes(self.sweep, SWEEP_ENV)}

    def _cpu(self) -> tuple[float, float, set[int]]:
        """CPU seconds of this process tree, of the whole job (each process once), its PIDs.
        A process's own time plus that of its reaped children: a child that exits moves from
        its own count to its parent's, so sums over the job stay continuous."""
        me = psutil.Process()
        tree = {me.pid: me} | {p.pid: p for p in me.children(recursive=True)}
        tree_s = sum(_cpu_seconds(p) for p in tree.values())
        token_pids = set(job_processes(self.token)) if self.token and self.linux else set()
        job_s = tree_s + sum(_cpu_seconds(pid) for pid in token_pids - set(tree))
        return tree_s, job_s, token_pids | set(tree)

    def _host(self) -> tuple[float, float, float] | None:
        """Seconds busy, stolen and in all, over this process's CPUs, from /proc/stat."""
        if not self.linux:
            return None
        busy = stolen = total = 0
        with contextlib.suppress(OSError, ValueError):
            for line in Path("/proc/stat").read_text().splitlines():
                name, *ticks = line.split()
                if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in self.cpus:
                    user, nice, system, idle, iowait, irq, softirq, steal = map(int, ticks[:8])
                    busy += user + nice + system + irq + softirq  # guest time is in user
                    stolen += steal
                    total += user + nice + system + idle + iowait + irq + softirq + steal
            hz = os.sysconf("SC_CLK_TCK")
            return busy / hz, stolen / hz, total / hz
        return None


def busiest(samples: Iterable[NoiseSample]) -> NoiseSample | None:
    """The sample that left the fewest cores idle (the job's and others' busy cores, and the
    stolen ones, the most); None when none measured both."""
    measured = [s for s in samples if s.job_cores is not None and s.others_cores is not None]
    return max(measured, key=lambda s: s.job_cores + s.others_cores + stolen_cores(s), default=None)


def stolen_cores(sample: NoiseSample) -> float:
    """The cores' time the hypervisor gave to other machines."""
    return (sample.steal or 0.0) * sample.host_cores


def _cpu_seconds(process: psutil.Process | int) -> float:
    try:
        times = (psutil.Process(process) if isinstance(process, int) else process).cpu_times()
    except psutil.Error:  # gone, or not ours to read
        return 0.0
    children = getattr(times, "children_user", 0.0) + getattr(times, "children_system", 0.0)
    return times.user + times.system + children


def _spread(step_seconds: Sequence[float]) -> float | None:
    if len(step_seconds) < SPREAD_MIN_STEPS:
        return None
    p50, p90 = np.percentile(np.asarray(step_seconds, dtype=float), [50, 90])
    return float(p90 / p50) if p50 > 0 else None


class _Gpu:
    """NVML figures of the run's GPU; none at all without `pynvml` or a working NVML."""

    def __init__(self, device: torch.device) -> None:
        self.nvml, self.handle = None, None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            if uuid is not None:  # CUDA's numbering is not NVML's under CUDA_VISIBLE_DEVICES
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(
                    f"GPU-{str(uuid).removeprefix('GPU-')}"
                )
            elif "CUDA_VISIBLE_DEVICES" not in os.environ:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.nvml = pynvml
        except Exception:  # not installed, no driver, no such device: no GPU figures
            self.handle = None

    def read(self, sample: NoiseSample, job_pids: set[int]) -> None:
        nvml, h = self.nvml, self.handle
        if nvml is None or h is None:
            return
        with contextlib.suppress(Exception):
            pids = {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}
            if pids & job_pids:  # else NVML sees another PID namespace: cannot tell who is who
                sample.gpu_other_processes = len(pids - job_pids)
        with contextlib.suppress(Exception):
            reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            mask = (reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)(h)
            names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
            sample.gpu_throttle = ",".join(names) or None
        with contextlib.suppress(Exception):
            sample.gpu_temp_c = float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        with contextlib.suppress(Exception):
            if nvml.nvmlDeviceGetUtilizationRates(h).gpu >= GPU_BUSY_MIN:  # else idle clocks
                sm = nvml.NVML_CLOCK_SM
                clock = nvml.nvmlDeviceGetClockInfo(h, sm)
                sample.gpu_sm_clock_ratio = clock / nvml.nvmlDeviceGetMaxClockInfo(h, sm)


@dataclass
class NoiseVerdict:
    contended: bool
    evidence: list[str]

    def tags(self) -> dict[str, str]:
        text = "; ".join(self.evidence) or "none"
        if len(text) > TAG_MAX:
            text = text[: TAG_MAX - 3] + "..."
        return {NOISE: NOISE_CONTENDED if self.contended else NOISE_QUIET, NOISE_EVIDENCE: text}

    def console(self) -> str:
        if not self.contended:
            return "quiet machine"
        more = f" (+{len(self.evidence) - 1} more)" if len(self.evidence) > 1 else ""
        return f"CONTENDED: {self.evidence[0]}{more} — its speed is not a clean measurement"

    def markdown(self) -> str:
        """The section `diagnosis.md` ends with."""
        if not self.contended:
            return "\n## The machine while it was timed\n\nQuiet: no sign of other work.\n"
        lines = ["", "## The machine while it was timed: **contended**", ""]
        lines += [f"- {line}" for line in self.evidence]
        lines += ["", "Its speed is left out of the report's ratios (speedup, AMP gain).", ""]
        return "\n".join(lines)


def _union(reasons: Iterable[str]) -> str:
    return ",".join(sorted({r for rs in reasons for r in rs.split(",")}))


SENTENCES = {  # figure: (the worst of several epochs', the evidence)
    "others_cores": (max, "other processes used {:.1f} of {host} cores while it was timed"),
    "steal": (max, "the hypervisor stole {:.0%} of the CPU time"),
    "cpu_util": (min, "it got {:.0%} of the {asked} CPU threads it asked for"),
    "step_spread": (max, "irregular steps: the p90 step took {:.1f}x the median"),
    "gpu_other_processes": (max, "{} other processes used the GPU"),
    "gpu_throttle": (_union, "the GPU's clocks were throttled ({})"),
    "gpu_sm_clock_ratio": (min, "the GPU's SM clock ran at {:.0%} of its maximum"),
}


def _strong(s: NoiseSample, cpu: bool, asked: int) -> set[str]:
    """The figures of one sample that are evidence of contention (see the module's docstring).
    A window shorter than `WINDOW_MIN_S` gives no CPU evidence: one tick of CPU time more or
    less over a few milliseconds reads as cores (a lockstep slice of one tiny step)."""
    if s.wall_s < WINDOW_MIN_S:
        s = replace(s, others_cores=None, steal=None, cpu_util=None, step_spread=None, load1=0.0)
    others = s.others_cores or 0.0
    seen = others >= OTHERS_HINT if s.others_cores is not None else (s.load1 or 0) > s.host_cores
    room = asked + others > s.host_cores - FREE_CORES or others >= OTHERS_SHARE * s.host_cores
    ratio = s.gpu_sm_clock_ratio
    checks = {
        "others_cores": others >= OTHERS_CORES and room,
        "steal": (s.steal or 0.0) >= STEAL_MAX,
        "cpu_util": cpu and s.cpu_util is not None and s.cpu_util < CPU_UTIL_MIN and seen,
        "step_spread": (s.step_spread or 0.0) >= SPREAD_MAX and seen,
        "gpu_other_processes": (s.gpu_other_processes or 0) >= 1,
        "gpu_throttle": bool(set((s.gpu_throttle or "").split(",")) & THROTTLE_FLAGS),
        "gpu_sm_clock_ratio": ratio is not None and ratio < CLOCK_RATIO_MIN,
    }
    return {name for name, hit in checks.items() if hit}


def judge(samples: Sequence[NoiseSample], device_type: str, threads: int | None) -> NoiseVerdict:
    """Contended if any epoch's sample shows strong evidence (see the module's docstring)."""
    asked, evidence = threads or 1, []
    found = [_strong(s, device_type == "cpu", asked) for s in samples]
    for name, (pick, sentence) in SENTENCES.items():
        hits = [s for s, strong in zip(samples, found, strict=True) if name in strong]
        if hits:
            worst = pick(getattr(s, name) for s in hits)
            text = sentence.format(worst, host=hits[0].host_cores, asked=asked)
            epochs = f" ({len(hits)} of {len(samples)} epochs)" if len(samples) > 1 else ""
            evidence.append(text + epochs)
    loads = [s.load1 for s in samples if s.load1 is not None]
    if evidence and loads:
        evidence.append(f"1-minute load up to {max(loads):.1f} on {samples[0].host_cores} cores")
    return NoiseVerdict(contended=bool(evidence), evidence=evidence)
