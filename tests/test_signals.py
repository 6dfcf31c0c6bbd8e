"""SIGINT and SIGTERM to real jobs: every process stops, the run is KILLED, its metrics kept.

Each job would train for 40 short epochs, each batch a little late (`debug.input_delay_ms`), so
the signal, sent as soon as the first epoch is logged, lands in the middle of training. The test
sees the job's whole process tree before the signal (run.py, the launcher, its workers, in
whatever process sessions they are) and checks that none of it is left afterwards, that the
exit code is 128 + the signal, that no traceback was printed, and what MLflow recorded.

SIGINT and SIGTERM take one path (`accelexp.signals.install` gives both the same handler, which
raises `Interrupted`; a launcher's workers get SIGTERM from `accelexp.processes.stop_job`
whichever signal the job got), and what differs by strategy is who catches it: run.py itself
(single, and a sweep's parent), or the launcher and its workers (torchrun for ddp, horovodrun for
horovod). So each strategy is signalled once and each signal is sent at least once here; the
other signal of single is sent in tests/test_resume.py, which resumes what it stopped.
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
STRATEGIES = {
    "single": (),
    "ddp": ("parallelism=ddp", "parallelism.nprocs=2"),
    "horovod": ("parallelism=horovod", "parallelism.nprocs=2"),
}


def runs_of(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("accelexp")
    return client.search_runs([experiment.experiment_id])


def stop_after_epoch_1(job: Job, signum: int, workers: int = 0) -> None:
    """Signal the job once epoch 1 is logged; it must end by 128 + signum, without a traceback,
    leaving no process behind (`Job.finish`)."""
    try:
        job.wait_for("epoch 1/40")
        if workers:
            assert len(job.workers()) == workers, "the workers run when the signal is sent"
        job.signal(signum)
        code = job.finish()
    finally:
        job.kill_everything()
    assert code == 128 + signum, job.output
    assert "Traceback" not in job.output, job.output


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, signum",
    [
        ("single", signal.SIGINT),  # SIGTERM: in test_resume.py
        ("ddp", signal.SIGTERM),
        ("horovod", signal.SIGINT),
    ],
)
def test_a_signal_stops_every_process_and_the_run_is_killed(
    strategy, signum, tmp_path, mlflow_template_db
):
    uri = new_store(tmp_path, mlflow_template_db)
    run_dir = tmp_path / "run"
    job = Job(
        tmp_path,
        *LONG,
        *STRATEGIES[strategy],
        f"mlflow.tracking_uri={uri}",
        f"hydra.run.dir={run_dir}",
    )
    stop_after_epoch_1(job, signum, workers=0 if strategy == "single" else 2)
    assert f"Stopped by {signal.Signals(signum).name}" in job.output
    (run,) = runs_of(uri)
    assert run.info.status == "KILLED"
    assert "train_loss" in run.data.metrics, "the metrics logged before the signal are kept"
    assert (run_dir / "checkpoints" / "last.pt").is_file(), "its last epoch can be resumed"


@pytest.mark.slow
def test_a_signal_stops_a_sweep_and_its_parent_run_is_killed(tmp_path, mlflow_template_db):
    signum = signal.SIGTERM  # as Slurm or Kubernetes stop it
    uri = new_store(tmp_path, mlflow_template_db)
    job = Job(
        tmp_path,
        "-m",
        *LONG,
        "precision=fp32,bf16",
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    stop_after_epoch_1(job, signum)
    runs = {run.data.tags.get("accelexp.sweep") == "true": run for run in runs_of(uri)}
    assert len(runs_of(uri)) == 2, "the parent and the first job's run: the second never started"
    assert runs[True].info.status == "KILLED", "the sweep's parent run"
    assert runs[False].info.status == "KILLED", "the job that was running"
    assert "train_loss" in runs[False].data.metrics


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
