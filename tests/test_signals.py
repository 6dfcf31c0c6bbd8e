"""SIGINT and SIGTERM to real jobs: every process stops, the run is KILLED, its metrics kept.

Each job trains long enough, each batch a little late (`debug.input_delay_ms`), that the
signal, sent as soon as the first epoch is logged, lands in the middle of training. The test
sees the job's whole process tree before the signal (run.py, the launcher, its workers, in
whatever process sessions they are) and checks that none of it is left afterwards, that the
exit code is 128 + the signal, that no traceback was printed, and what MLflow recorded.

SIGINT and SIGTERM take one path (`accelexp.signals.install` gives both the same handler, which
raises `Interrupted`; a launcher's workers get SIGTERM from `accelexp.processes.stop_job`
whichever signal the job got), and what differs is who catches it: run.py itself (single, and a
sweep's parent), or the launcher and its workers (torchrun for ddp, horovodrun for horovod). So
each is signalled once and each signal is sent at least once: DDP's run.py SIGTERM here; a
sweep of Horovod jobs SIGINT here (run.py as the sweep's parent, and horovodrun's workers);
a single process's run.py SIGTERM in tests/test_resume.py, which resumes what it stopped.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from conftest import new_store
from jobs import Job
from mlflow import MlflowClient

LONG = (
    "data=synthetic",
    "data.num_train=320",
    "data.num_test=64",
    "data.image_size=16",
    "data.batch_size=32",
    "epochs=40",
    "max_steps_per_epoch=4",
    "progress=false",
    "threads=1",
    "debug.input_delay_ms=50",  # 39 epochs of 4 batches: at least 7.8 s after epoch 1
)


def runs_of(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("accelexp")
    return client.search_runs([experiment.experiment_id])


def stop_after_epoch_1(
    job: Job, signum: int, workers: int = 0, epochs: int = 40, count: int = 1
) -> None:
    """Signal the job once epoch 1 is logged (the `count`-th time: a sweep's job); it must end
    by 128 + signum, without a traceback, leaving no process behind (`Job.finish`)."""
    try:
        job.wait_for(f"epoch 1/{epochs}", count)
        if workers:
            assert len(job.workers()) == workers, "the workers run when the signal is sent"
        job.signal(signum)
        code = job.finish()
    finally:
        job.kill_everything()
    assert code == 128 + signum, job.output
    assert "Traceback" not in job.output, job.output


@pytest.mark.slow
def test_a_signal_stops_every_process_and_the_run_is_killed(tmp_path, mlflow_template_db):
    """DDP's: SIGTERM to run.py, which stops torchrun and its workers; rank 0 closes the run."""
    signum = signal.SIGTERM
    uri = new_store(tmp_path, mlflow_template_db)
    run_dir = tmp_path / "run"
    job = Job(
        tmp_path,
        *LONG,
        "parallelism=ddp",
        "parallelism.nprocs=2",
        f"mlflow.tracking_uri={uri}",
        f"hydra.run.dir={run_dir}",
    )
    stop_after_epoch_1(job, signum, workers=2)
    assert f"Stopped by {signal.Signals(signum).name}" in job.output
    (run,) = runs_of(uri)
    assert run.info.status == "KILLED"
    assert "train_loss" in run.data.metrics, "the metrics logged before the signal are kept"
    assert (run_dir / "checkpoints" / "last.pt").is_file(), "its last epoch can be resumed"


# A sweep over Horovod's worker counts: the first job (1 worker) trains in run.py's process and
# ends; the second (2 workers, horovodrun) is signalled once its epoch 1 is logged, each of its
# batches this late: 2 epochs of 4 batches, at least 3.2 s, are left when the signal is sent
SWEEP_EPOCHS = 3
SWEEP = (
    *(o for o in LONG if not o.startswith(("epochs=", "debug.input_delay_ms="))),
    f"epochs={SWEEP_EPOCHS}",
    "debug.input_delay_ms=400",
)


@pytest.mark.slow
def test_a_signal_stops_a_sweep_of_horovod_worker_counts_and_its_parent_run_is_killed(
    tmp_path, mlflow_template_db
):
    """SIGINT to `run.py -m parallelism=horovod parallelism.nprocs=1,2` during its second job:
    run.py (the sweep's parent) catches it and stops horovodrun and its workers; rank 0 closes
    the job's run KILLED, the sweep closes its parent KILLED, the job done before stays
    FINISHED. And the sweep logged one run per job: each named by its worker count, its world
    size, Horovod's placement and sync. (A whole sweep over worker counts: the README's scaling
    sweep, DDP, tests/test_sweeps.py; Horovod's 2 workers to the end: tests/test_contract.py.)"""
    signum = signal.SIGINT  # Ctrl-C
    uri = new_store(tmp_path, mlflow_template_db)
    job = Job(
        tmp_path,
        "-m",
        *SWEEP,
        "parallelism=horovod",
        "parallelism.nprocs=1,2",
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    stop_after_epoch_1(job, signum, workers=2, epochs=SWEEP_EPOCHS, count=2)
    assert f"Stopped by {signal.Signals(signum).name}" in job.output
    runs = runs_of(uri)
    (parent,) = [r for r in runs if r.data.tags.get("accelexp.sweep") == "true"]
    assert parent.info.status == "KILLED", "the sweep's parent run"
    jobs = sorted((r for r in runs if r is not parent), key=lambda r: r.data.params["world_size"])
    assert [r.data.params["world_size"] for r in jobs] == ["1", "2"]
    assert [r.info.run_name for r in jobs] == ["np1 simple_cnn-horovod-fp32",
                                               "np2 simple_cnn-horovod-fp32"]  # fmt: skip
    for run in jobs:
        assert run.data.tags["parallelism"] == "horovod"
        assert (run.data.tags["placement"], run.data.tags["sync"]) == ("one device", "horovod")
    done, stopped = jobs
    assert done.info.status == "FINISHED"
    assert {"samples_per_s", "samples_per_s_per_device", "test_acc"} <= done.data.metrics.keys()
    assert stopped.info.status == "KILLED", "the job that was running"
    assert "train_loss" in stopped.data.metrics, "the metrics logged before the signal are kept"
    last = tmp_path / "sweep" / "1" / "checkpoints" / "last.pt"
    assert last.is_file(), "its last epoch can be resumed"


CHECKPOINT_UNDER_SIGNAL = """
import os, signal, sys
from pathlib import Path
import torch
from accelexp import checkpoint, signals

signals.install()
real_save = torch.save

def save_while_signalled(obj, file):
    os.kill(os.getpid(), signal.SIGINT)  # the signal lands in the middle of the write
    real_save(obj, file)

torch.save = save_while_signalled
try:
    checkpoint.save(Path(sys.argv[1]), {"weights": torch.arange(1000)})
except signals.Interrupted as stop:
    sys.exit(stop.exit_code)
sys.exit(0)
"""


def test_a_signal_during_a_checkpoint_write_stops_the_job_after_the_write(tmp_path):
    """A signal inside torch.save once surfaced as a RuntimeError (a "storage error") and the
    checkpoint was lost: now the write completes, then the job stops as for any signal."""
    path = tmp_path / "last.pt"
    done = subprocess.run(
        [sys.executable, "-c", CHECKPOINT_UNDER_SIGNAL, str(path)], capture_output=True, text=True
    )
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert "Could not write" not in done.stderr
    assert torch.equal(torch.load(path)["weights"], torch.arange(1000))
