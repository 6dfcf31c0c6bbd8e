"""The contention probe and its verdict: hand-made samples for every rule, and the real probe
beside a real busy loop of another process (contended) and of the job's own (not others)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from accelexp.diagnosis.noise import (
    OTHERS_CORES,
    ContentionProbe,
    NoiseSample,
    _Gpu,
    judge,
)
from accelexp.processes import JOB_ENV, SWEEP_ENV, kill_job, new_job_token

needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

QUIET = NoiseSample(
    wall_s=3.0,
    cpu_util=0.97,
    others_cores=0.05,
    host_cores=2,
    steal=0.0,
    load1=1.1,
    step_spread=1.1,
)


def test_a_quiet_sample_is_quiet() -> None:
    verdict = judge([QUIET, QUIET], "cpu", threads=1)
    assert not verdict.contended
    assert verdict.tags() == {"noise": "quiet", "noise_evidence": "none"}
    assert verdict.console() == "quiet machine"


@pytest.mark.parametrize(
    ("device", "changes", "figure"),
    [
        ("cpu", {"others_cores": 0.9}, "0.9 of 2 cores"),
        ("cpu", {"steal": 0.12}, "stole 12%"),
        ("cpu", {"cpu_util": 0.4, "others_cores": 0.3}, "40% of the 1 CPU threads"),
        ("cpu", {"step_spread": 2.5, "others_cores": 0.3}, "2.5x the median"),
        ("cuda", {"gpu_other_processes": 2}, "2 other processes used the GPU"),
        ("cuda", {"gpu_throttle": "sw_power_cap,hw_thermal"}, "throttled (hw_thermal,sw_power"),
        ("cuda", {"gpu_sm_clock_ratio": 0.6}, "SM clock ran at 60%"),
    ],
)
def test_each_rule_flags_with_its_figure(device: str, changes: dict, figure: str) -> None:
    verdict = judge([QUIET, replace(QUIET, **changes)], device, threads=1)
    assert verdict.contended
    assert figure in verdict.tags()["noise_evidence"]
    assert "(1 of 2 epochs)" in verdict.evidence[0]
    assert "1-minute load up to 1.1" in verdict.evidence[-1]
    assert verdict.tags()["noise"] == "contended"
    assert verdict.console().startswith(f"CONTENDED: {verdict.evidence[0]}")


@pytest.mark.parametrize(
    ("device", "changes"),
    [
        ("cpu", {"others_cores": 0.3}),  # too few cores of others
        ("cpu", {"others_cores": 0.6, "host_cores": 64}),  # others, but the host had room
        ("cpu", {"cpu_util": 0.4}),  # low utilisation, nobody else: waiting on input
        ("cuda", {"cpu_util": 0.1, "others_cores": 0.3}),  # a CUDA run's host thread waits
        ("cpu", {"step_spread": 3.0}),  # irregular steps, nobody else
        ("cpu", {"load1": 7.0}),  # the load includes the job's own threads
        ("cuda", {"gpu_throttle": "sw_power_cap"}),  # a busy GPU at its power limit
        # a lockstep slice of 5 ms: one 10-ms tick of others' CPU time reads as 2 cores
        ("cpu", {"wall_s": 0.005, "others_cores": 2.0, "cpu_util": 0.4, "step_spread": 3.0}),
    ],
)
def test_weak_evidence_alone_does_not_flag(device: str, changes: dict) -> None:
    assert not judge([replace(QUIET, **changes)], device, threads=1).contended


def test_the_tag_stays_within_mlflow_limits() -> None:
    verdict = judge([replace(QUIET, others_cores=1.0)] * 2000, "cpu", threads=1)
    verdict.evidence *= 200
    assert len(verdict.tags()["noise_evidence"]) <= 5000


def test_the_max_over_ranks_is_the_worst_of_each_field() -> None:
    a = replace(QUIET, cpu_util=0.5, others_cores=0.1, load1=None, gpu_sm_clock_ratio=0.9)
    b = replace(QUIET, wall_s=4.0, steal=0.02, step_spread=None, gpu_other_processes=1)
    b = replace(b, gpu_temp_c=81.0, host_cores=4, gpu_throttle="hw_thermal")
    reduced = torch.maximum(a.to_tensor(torch.device("cpu")), b.to_tensor(torch.device("cpu")))
    worst = NoiseSample.worst_of(reduced, template=b)
    # the longer wall, the lower CPU share and core count, the higher others/steal, the known
    # load and spread (None is no evidence), the GPU's worst; the template's throttle text
    assert worst == replace(
        QUIET, wall_s=4.0, cpu_util=0.5, others_cores=0.1, steal=0.02, gpu_other_processes=1,
        gpu_throttle="hw_thermal", gpu_temp_c=81.0, gpu_sm_clock_ratio=0.9,
    )  # fmt: skip
    assert NoiseSample.worst_of(QUIET.to_tensor(torch.device("cpu")), QUIET) == QUIET
    assert "noise/gpu_throttle" not in QUIET.metrics()
    assert QUIET.metrics()["noise/others_cores"] == 0.05


def _elsewhere(code: str, env: dict[str, str]) -> int:
    """The pid of a Python process running `code` outside this process tree (its launcher exits
    at once), with `env` added to its environment."""
    quiet = "stdout=s.DEVNULL, stderr=s.DEVNULL"  # else the launcher waits for its pipes
    command = f"[sys.executable, '-c', {code!r}]"
    launch = f"import subprocess as s, sys; print(s.Popen({command}, {quiet}).pid)"
    started = subprocess.run(
        [sys.executable, "-c", launch], env={**os.environ, **env},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(started.stdout)


def _busy_elsewhere(seconds: float, token: str) -> None:
    """A busy loop that ends by itself, outside this process tree, carrying `token` as its job;
    returns once it runs."""
    _elsewhere(f"import time\ne = time.time() + {seconds}\nwhile time.time() < e: pass",
               {JOB_ENV: token})  # fmt: skip
    time.sleep(0.3)  # its interpreter starts


def _probe_matmuls(probe: ContentionProbe, seconds: float = 1.0) -> NoiseSample:
    """The probe around `seconds` of matmuls on one torch thread, as an epoch's steps (a second:
    5x `WINDOW_MIN_S`, CPU time counted to 1 % of a core, where quiet and hogged read 0.4 of a
    core apart)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, steps = torch.randn(256, 256), []
        probe.start()
        end = time.perf_counter() + seconds
        while (t := time.perf_counter()) < end:
            for _ in range(10):
                x = torch.tanh(x @ x)
            steps.append(time.perf_counter() - t)
        return probe.stop(steps)
    finally:
        torch.set_num_threads(threads)


@needs_proc
def test_a_busy_process_outside_the_job_reads_as_contention() -> None:
    hog, job = new_job_token(), new_job_token()  # the hog is another job's
    try:
        _busy_elsewhere(6.0, hog)
        sample = _probe_matmuls(ContentionProbe(torch.device("cpu"), threads=1, job_token=job))
    finally:
        kill_job(hog)
    assert sample.others_cores is not None and sample.others_cores >= OTHERS_CORES, sample
    assert sample.step_spread is not None and sample.cpu_util is not None
    verdict = judge([sample], "cpu", threads=1)
    assert verdict.contended and "other processes used" in verdict.console(), verdict


@pytest.mark.alone  # reads other processes' CPU: no other test beside it
@needs_proc
@pytest.mark.parametrize("how", ["token", "child"])
def test_the_jobs_own_processes_are_not_others(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy process of the job: found by its token (outside this process tree), or as a
    child of this process (with no token at all)."""
    monkeypatch.delenv(JOB_ENV, raising=False)  # the child case: no token at all
    job, child = new_job_token(), None
    try:
        if how == "token":
            _busy_elsewhere(6.0, job)
        else:
            loop = "import time\ne = time.time() + 6\nwhile time.time() < e: pass"
            child = subprocess.Popen([sys.executable, "-c", loop])
            time.sleep(0.3)
        token = job if how == "token" else None
        sample = _probe_matmuls(ContentionProbe(torch.device("cpu"), threads=1, job_token=token))
    finally:
        kill_job(job)
        if child is not None:
            child.kill()
            child.wait()
    # the hog case reads ~1.0, a quiet machine ~0.0-0.05 (a shared one can add a little)
    assert sample.others_cores is not None and sample.others_cores < OTHERS_CORES, sample
    # the job's: the matmul thread's core and the busy process's (one alone: at most 1.0)
    assert sample.job_cores is not None and sample.job_cores >= 1.1, sample


@needs_proc
def test_a_lockstep_sweep_and_its_waiting_jobs_are_not_others_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the H200 every lockstep slice was set aside: NVML listed the sweep's process (its
    memory check had made a CUDA context) beside the job's. NVML is faked here (no GPU); the
    processes are real: the sweep, a job waiting for its turn (its environment names the sweep),
    and a stranger."""

    sleep = "import time; time.sleep(30)"
    sweep = _elsewhere(sleep, {})
    waiting = _elsewhere(sleep, {SWEEP_ENV: str(sweep)})
    stranger = _elsewhere(sleep, {})
    listed = [os.getpid(), sweep, waiting, stranger]

    class Nvml:  # what the probe asks of NVML; the rest raises, as a missing figure
        @staticmethod
        def nvmlDeviceGetComputeRunningProcesses(handle):
            return [type("Process", (), {"pid": pid}) for pid in listed]

    gpu = _Gpu.__new__(_Gpu)
    gpu.nvml, gpu.handle = Nvml, object()
    try:
        others = {}
        for env in ({}, {SWEEP_ENV: str(sweep)}):
            with monkeypatch.context() as m:
                m.delenv(SWEEP_ENV, raising=False)
                for name, value in env.items():
                    m.setenv(name, value)
                probe = ContentionProbe(torch.device("cpu"), threads=1, job_token="")
                probe.gpu = gpu
                probe.start()
                others[bool(env)] = probe.stop([0.01]).gpu_other_processes
    finally:
        for pid in (sweep, waiting, stranger):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert others == {False: 3, True: 1}  # alone: all three; a lockstep job: the stranger


@needs_proc
def test_a_run_beside_a_real_hog_is_tagged_contended_and_never_compute_bound(
    compose_cfg, tracking_uri, tmp_path
) -> None:
    """The whole path: a tiny real training while another process keeps a core busy."""
    from conftest import only_run
    from mlflow import MlflowClient

    from accelexp.report import compare
    from accelexp.tracking import query
    from accelexp.train import run

    # epochs long enough for CPU evidence (a window of 0.2 s or more: WINDOW_MIN_S)
    cfg = compose_cfg("threads=1", "epochs=2", "data.num_train=4096", "max_steps_per_epoch=128")
    hog = new_job_token()
    try:
        _busy_elsewhere(60.0, hog)  # bounded; stopped right after the run
        run(cfg, tmp_path / "out")
    finally:
        kill_job(hog)
    logged = only_run(tracking_uri)
    tags = logged.data.tags
    assert tags["noise"] == "contended" and "other processes used" in tags["noise_evidence"]
    assert tags["diagnosis"] == "contended"
    assert logged.data.metrics["noise/others_cores"] >= OTHERS_CORES
    client = MlflowClient(tracking_uri)
    local = client.download_artifacts(logged.info.run_id, "diagnosis.md", str(tmp_path))
    assert "**contended**" in Path(local).read_text()
    (row,) = compare([query.run_record(tracking_uri, logged.info.run_id, histories=True)])
    assert row.noise == "contended"
