"""Checkpoint and resume, with real jobs: a run killed mid-training and resumed ends exactly where
an uninterrupted run ends (bitwise on the CPU), in the same MLflow run, with the same metrics.

A world of workers resumes in the torchrun restart's test: an FSDP worker SIGKILLed under
`parallelism.max_restarts=1`, the world restarts and resumes by itself from the checkpoint, whose
model and optimizer are shards each worker wrote (torch.distributed.checkpoint; a DDP checkpoint
is a plain state dict, the single process's; a signal stopping every worker is
tests/test_signals.py's; `resume=auto` finding the killed run, the single-process case's). FSDP's
shards resume on another number of workers: 1 -> 2 ends as the uninterrupted run (the batch split
in two), 2 -> 1 loads them exactly (and a checkpoint gathered into one file, as before shards)
and trains on (a pipeline's on another depth and sharding: tests/test_pipeline_ranks.py). Also:
the refusals of `resume`, and a reused run folder that never adopts another run. (A joined world
whose ranks run in different folders, no shared filesystem: tests/test_parallel.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import EXACT, compose_config, new_store, output_of, store_uri
from jobs import HANG_GUARD_S, Job, alive, argv, descendants, processes_mentioning
from mlflow import MlflowClient
from torch import Generator

from accelexp import checkpoint
from accelexp.config import ConfigError, typed
from accelexp.launch import launch
from accelexp.models import build_model
from accelexp.optim import build_optimizer, build_scheduler
from accelexp.parallel import connect
from accelexp.processes import runs_worker
from accelexp.train import restore, run

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


def final_state(run_dir: Path) -> dict:
    """A run's last.pt, whole: a sharded one's model and optimizer read from its shards."""
    return checkpoint.read_whole(run_dir / "checkpoints" / "last.pt")


def assert_same_state(got: dict, ref: dict, rtol: float | None = None) -> None:
    """The same model and SGD momentum, by parameter name: bitwise, or to `rtol`."""
    assert got["model"].keys() == ref["model"].keys()
    assert got["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    pairs = [(name, got["model"][name], tensor) for name, tensor in ref["model"].items()]
    pairs += [
        (f"{name} momentum", got["optimizer"]["state"][name]["momentum_buffer"], momentum)
        for name, momentum in (
            (n, s["momentum_buffer"]) for n, s in ref["optimizer"]["state"].items()
        )
    ]
    for name, a, b in pairs:
        if rtol is None:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol / 10, msg=name)


def assert_same_training(ref_dir: Path, ref_uri: str, dir_: Path, uri: str) -> None:
    """The same final state (bitwise) and the same metrics, epoch by epoch."""
    ref, got = final_state(ref_dir), final_state(dir_)
    assert got["progress"]["epoch"] == ref["progress"]["epoch"] == EPOCHS
    assert_same_state(got, ref)
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
    assert f"Stopped by {signal.Signals(signum).name}" in job.output
    assert "Traceback" not in job.output, job.output
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
    tmp_path, tracking_uri, capfd, references
):
    """FSDP's world: last.pt holds its whole state, gathered from the shards; the restarted
    workers reshard it. Started as run.py starts it (`accelexp.launch`: torchrun and its
    workers, real processes), from a thread of this process: run.py's own start-up would prove
    nothing more here (a signal to run.py is tests/test_signals.py's)."""
    run_dir = tmp_path / "job"
    output = run_dir / "workers" / "output.log"
    cfg = compose_config(tracking_uri, *SLOWED, *FSDP, "parallelism.max_restarts=1")
    ended: dict = {}

    def job() -> None:
        try:
            ended["metrics"] = launch(cfg, run_dir)
        except BaseException as error:  # said by the assertion below
            ended["error"] = error

    thread = threading.Thread(target=job)
    thread.start()
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (output.is_file() and f"epoch 1/{EPOCHS}" in output.read_text()):
            assert thread.is_alive(), ended
            assert time.monotonic() < deadline, f"no epoch 1 after {HANG_GUARD_S}s"
            time.sleep(0.1)
        seen.update(descendants(os.getpid()))
        workers = [p for p in seen if runs_worker(argv(p))]
        assert len(workers) == 2, "the workers run when one is killed"
        os.kill(max(workers), signal.SIGKILL)
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive(), f"the job still runs after {HANG_GUARD_S}s"
    finally:
        if thread.is_alive():  # a failed test: nothing of it outlives it
            for pid in [*seen, *descendants(os.getpid())]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        thread.join()
    assert "metrics" in ended, ended
    said = output.read_text()
    assert "Resuming after epoch" in said
    assert "torchrun restarts the world (restart 1 of 1)" in said
    assert "Traceback" not in "".join(capfd.readouterr())  # the console: the workers' records
    left = [p for p in seen if alive(p)] + processes_mentioning(str(run_dir))
    assert left == [], "processes outlived the job"
    assert the_run(tracking_uri).info.status == "FINISHED"
    assert_same_training(*references(*FSDP), run_dir, tracking_uri)


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


# 1 -> 2 workers, checked exactly: 2 FSDP workers with batch 32 train what one process trains
# with batch 64 (tests/test_contract.py), so a run resumed on 2 workers with the batch split in
# two ends where the uninterrupted run of one worker ends
ONE_WORKER = (
    *(o for o in EXACT if not o.startswith("epochs=")),
    *FSDP,
    "parallelism.nprocs=1",
    "data.batch_size=64",
    f"epochs={EPOCHS}",
    "max_steps_per_epoch=2",
)


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_one_worker_resumes_on_two(tmp_path, tracking_uri):
    """Its shards (torch.distributed.checkpoint) are resharded over the two workers: they go on
    with the saved model and momentum, and end as the uninterrupted run, in the same MLflow run."""
    run(compose_config(tracking_uri, *ONE_WORKER), tmp_path / "one")
    uninterrupted = the_run(tracking_uri)
    previous = tmp_path / "one" / "checkpoints" / "previous.pt"  # epoch 1's
    split = ("parallelism.nprocs=2", "data.batch_size=32", f"resume={previous}")
    launch(compose_config(tracking_uri, *ONE_WORKER, *split), tmp_path / "two")
    resumed = the_run(tracking_uri)
    assert resumed.info.run_id == uninterrupted.info.run_id
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags["resumed_after_epoch"] == "1"
    assert resumed.data.tags["resumed_world_size"] == "2"  # its params: the first world's, 1
    two = final_state(tmp_path / "two")
    assert two["shards"]["world_size"] == 2 and len(two["shards"]["files"]) == 3  # + .metadata
    assert_same_state(two, final_state(tmp_path / "one"), rtol=1e-4)


@pytest.mark.slow
def test_an_fsdp_checkpoint_of_two_workers_resumes_on_one(tmp_path, compose_cfg, references):
    """Epoch 1's checkpoint of the two FSDP workers the torchrun restart's test compares with:
    its shards, and the same state gathered into one file (as last.pt was before shards), load
    into one worker's model and optimizer exactly (train.restore, as a resume does); a run
    resumed from it on one worker trains epoch 2 in the same MLflow run."""
    folder, uri = references(*FSDP)
    previous = folder / "checkpoints" / "previous.pt"
    whole = checkpoint.read_whole(previous)
    assert whole["progress"]["epoch"] == 1 and whole["shards"]["world_size"] == 2
    gathered = tmp_path / "gathered.pt"
    torch.save({k: v for k, v in whole.items() if k != "shards"}, gathered)
    cfg = typed(compose_cfg(*RUN, *FSDP, "parallelism.nprocs=1"))
    strategy = connect(cfg)
    try:
        for source in (previous, gathered):
            model = strategy.wrap_model(build_model(cfg.model, 3, 10, 16))
            optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.optimizer.lr)
            scheduler = build_scheduler(cfg.scheduler, optimizer, 4, EPOCHS)
            restore(checkpoint.load(source), strategy, model, optimizer, scheduler, Generator())
            loaded = {
                "model": strategy.model_state_dict(model),
                "optimizer": strategy.optimizer_state_dict(model, optimizer),
            }
            assert_same_state(loaded, whole)
    finally:
        strategy.teardown()
    store = new_store(tmp_path / "store", Path(uri.removeprefix("sqlite:///")))
    overrides = (*RUN, *FSDP, "parallelism.nprocs=1", f"resume={previous}")
    run(compose_config(store, *overrides), tmp_path / "one")
    resumed = the_run(store)
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags["resumed_after_epoch"] == "1"
    assert resumed.data.tags["resumed_world_size"] == "1"
    assert final_state(tmp_path / "one")["progress"]["epoch"] == EPOCHS
