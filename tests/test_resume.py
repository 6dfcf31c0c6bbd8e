"""Checkpoint and resume, with real jobs: a run killed mid-training and resumed ends exactly where
an uninterrupted run ends (bitwise on the CPU), in the same MLflow run, with the same metrics.

A world of workers resumes in the torchrun restart's test: an FSDP worker SIGKILLed under
`parallelism.max_restarts=1`, the world restarts and resumes by itself from the checkpoint, which
holds the whole state gathered from the shards (a DDP checkpoint is a plain state dict, the
single process's; a signal stopping every worker is tests/test_signals.py's; `resume=auto`
finding the killed run, the single-process case's). Also: the refusals of `resume`, and a reused
run folder that never adopts another run. (A joined world whose ranks run in different folders,
no shared filesystem: tests/test_parallel.py.)
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from conftest import compose_config, new_store, output_of, store_uri
from jobs import Job
from mlflow import MlflowClient

from accelexp.config import ConfigError
from accelexp.train import run

EPOCHS = 2  # the fewest a kill can land between: resumed after epoch 1, epoch 2 trained again
RUN = (
    "data=synthetic",
    "data.num_train=320",
    "data.num_test=128",
    "data.image_size=16",
    "data.batch_size=32",
    "data.augment=true",  # the loader's generator is part of the state
    f"epochs={EPOCHS}",
    "max_steps_per_epoch=4",
    "progress=false",
    "threads=1",
)
# The job is signalled as soon as it logs epoch 1: each training batch of a job that is killed
# (and of its resumption, whose config must be the same) arrives this late, so epoch 2 takes at
# least 4 x 0.6 s after that line, whatever the machine's load, and the signal lands in the
# middle of training. The uninterrupted references are not slowed: it changes no result.
SLOWED = (*RUN, "debug.input_delay_ms=600")
FSDP = ("parallelism=fsdp", "parallelism.nprocs=2")
EPOCH_METRICS = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")
FINAL_METRICS = ("best_val_acc", "test_loss", "test_acc")


def the_run(uri: str):
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])
    return run


def history(uri: str, run_id: str, key: str) -> dict[int, float]:
    """step -> value (the last logged at that step: an epoch redone after a kill logs it again)."""
    client = MlflowClient(tracking_uri=uri)
    ordered = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in ordered}


def assert_same_training(ref_dir: Path, ref_uri: str, dir_: Path, uri: str) -> None:
    """The same final state (bitwise) and the same metrics, epoch by epoch."""
    ref = torch.load(ref_dir / "checkpoints" / "last.pt", weights_only=True)
    got = torch.load(dir_ / "checkpoints" / "last.pt", weights_only=True)
    assert got["progress"]["epoch"] == ref["progress"]["epoch"] == EPOCHS
    for name, tensor in ref["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    ref_momentum = [s["momentum_buffer"] for s in ref["optimizer"]["state"].values()]
    got_momentum = [s["momentum_buffer"] for s in got["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(ref_momentum, got_momentum, strict=True))
    ref_run, got_run = the_run(ref_uri), the_run(uri)
    for key in EPOCH_METRICS + FINAL_METRICS:
        expected = history(ref_uri, ref_run.info.run_id, key)
        assert history(uri, got_run.info.run_id, key) == expected, key
    assert sorted(history(uri, got_run.info.run_id, "val_acc")) == list(range(1, EPOCHS + 1))


@pytest.fixture
def references(reference_folder):
    """`references(*overrides)` -> (run folder, tracking uri) of the uninterrupted run of RUN and
    the overrides, trained once per test session (`conftest.reference_folder`)."""

    def uninterrupted(*overrides: str) -> tuple[Path, str]:
        folder, _ = reference_folder(*RUN, *overrides)
        return folder / "out", store_uri(folder)

    return uninterrupted


def kill_and_resume(tmp_path, template, cli, signum, *overrides) -> tuple[Path, str, str]:
    """A run (a real process tree) stopped by `signum` during epoch 2, then
    `resume=auto` in a new folder (in this process: it is a run like any other).
    Returns (the resumed job's folder, the store, the interrupted run's id)."""
    uri = new_store(tmp_path, template)
    job = Job(
        tmp_path / "first",
        *SLOWED,
        *overrides,
        f"mlflow.tracking_uri={uri}",
        f"hydra.run.dir={tmp_path / 'first' / 'job'}",
    )
    try:
        job.wait_for(f"epoch 1/{EPOCHS}")
        job.signal(signum)
        assert job.finish() == 128 + signum, job.output
    finally:
        job.kill_everything()
    interrupted = the_run(uri)
    assert interrupted.info.status == "KILLED"
    result = cli(
        *SLOWED,
        *overrides,
        f"mlflow.tracking_uri={uri}",
        "resume=auto",
        tmp_path=tmp_path / "again",
    )
    assert result.returncode == 0, output_of(result)
    assert "Resuming after epoch" in output_of(result)
    return tmp_path / "again" / "job", uri, interrupted.info.run_id


@pytest.mark.slow
def test_a_killed_run_resumed_ends_as_an_uninterrupted_one(
    tmp_path, mlflow_template_db, cli, references
):
    resumed_dir, uri, run_id = kill_and_resume(tmp_path, mlflow_template_db, cli, signal.SIGTERM)
    run = the_run(uri)  # one run: the same one, continued
    assert run.info.run_id == run_id
    assert run.info.status == "FINISHED"
    assert int(run.data.tags["resumed_after_epoch"]) >= 1
    assert_same_training(*references(), resumed_dir, uri)


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_the_world_resumes(
    tmp_path, mlflow_template_db, references
):
    """FSDP's world: last.pt holds its whole state, gathered from the shards; the restarted
    workers reshard it."""
    uri = new_store(tmp_path, mlflow_template_db)
    job = Job(
        tmp_path,
        *SLOWED,
        *FSDP,
        "parallelism.max_restarts=1",
        f"mlflow.tracking_uri={uri}",
        f"hydra.run.dir={tmp_path / 'job'}",
    )
    try:
        job.wait_for(f"epoch 1/{EPOCHS}")
        victim = max(job.workers())
        job.signal_pid(victim, signal.SIGKILL)
        assert job.finish() == 0, job.output
    finally:
        job.kill_everything()
    assert "Resuming after epoch" in job.output
    assert "torchrun restarts the world (restart 1 of 1)" in job.output
    assert "Traceback" not in job.output  # the workers' are in their output file
    assert the_run(uri).info.status == "FINISHED"
    assert_same_training(*references(*FSDP), tmp_path / "job", uri)


def test_resume_refuses_a_checkpoint_of_another_config(compose_cfg, tmp_path):
    run(compose_cfg("epochs=1"), tmp_path / "first")
    with pytest.raises(ConfigError, match=r"another configuration \(optimizer.lr"):
        run(compose_cfg("epochs=1", "optimizer.lr=0.5", f"resume={tmp_path / 'first'}"), tmp_path)


def test_resume_says_where_it_looked(compose_cfg, tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint there"):
        run(compose_cfg(f"resume={tmp_path / 'nothing'}"), tmp_path / "out")
    with pytest.raises(ConfigError, match="no MLflow run with that id"):
        run(compose_cfg("resume=0123456789abcdef0123456789abcdef"), tmp_path / "out")


def test_resume_auto_without_an_unfinished_run_starts_afresh(compose_cfg, tmp_path):
    metrics = run(compose_cfg("resume=auto"), tmp_path / "out")
    assert "test_acc" in metrics


def test_resume_by_run_id_continues_that_run(tracking_uri, tmp_path):
    first = compose_config(tracking_uri, "epochs=1")
    run(first, tmp_path / "first")
    run_id = the_run(tracking_uri).info.run_id
    again = compose_config(tracking_uri, "epochs=1", f"resume={run_id}")
    run(again, tmp_path / "again")
    assert the_run(tracking_uri).info.run_id == run_id  # still one run


TINY = ("data=synthetic", "data.num_train=256", "data.num_test=64", "data.image_size=16")
TINY += ("epochs=1", "max_steps_per_epoch=2", "progress=false", "threads=1")


def test_a_reused_run_folder_never_adopts_the_run_recorded_there(tmp_path, tracking_uri, cli):
    tiny = (*TINY, f"mlflow.tracking_uri={tracking_uri}")
    assert cli(*tiny, tmp_path=tmp_path).returncode == 0
    failing = cli(*tiny, "debug.raise_on_rank=0", tmp_path=tmp_path)
    assert failing.returncode != 0
    client = MlflowClient(tracking_uri=tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]


def test_a_checkpoint_that_cannot_be_written_fails_the_run_with_one_message(
    tmp_path, tracking_uri, cli
):
    """A storage error (here: `checkpoints` is a file, not a folder) ends the run FAILED with
    one line that says what to do, and keeps what it logged."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "checkpoints").write_text("in the way")
    result = cli(*TINY, f"mlflow.tracking_uri={tracking_uri}", tmp_path=tmp_path)
    assert result.returncode == 2, output_of(result)
    assert "Traceback" not in output_of(result)
    assert "Could not write the checkpoint" in output_of(result)
    run_ = the_run(tracking_uri)
    assert run_.info.status == "FAILED"
    assert "train_loss" in run_.data.metrics
