"""What a run leaves in MLflow, read back from its SQLite store with a fresh MlflowClient."""

from __future__ import annotations

import errno
import itertools
import json
import math
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import yaml
from conftest import compose_config, new_store, only_run, run_here
from mlflow import MlflowClient
from omegaconf import OmegaConf

from accelexp.config import typed
from accelexp.config.catalog import flatten
from accelexp.data import build_data
from accelexp.engine import Trainer
from accelexp.models import build_model
from accelexp.tracking import Tracker
from accelexp.tracking.runs import significant
from accelexp.tracking.store import MAX_PARAM_VALUE
from accelexp.train import run

EPOCH_METRICS = (
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "lr",
    "epoch_time_s",
    "samples_per_s",
    "samples_per_s_per_device",
    "timed_steps",
    "peak_mem_mb",
)
OVERRIDES = ["epochs=2", "target_accuracy=0.05", "mlflow.log_checkpoint=true"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, mlflow_template_db):
    """Two uncapped epochs on 460 synthetic images, a low target and the checkpoint logged."""
    home = tmp_path_factory.mktemp("tracked")
    uri = new_store(home, mlflow_template_db)
    cfg = compose_config(uri, "data.num_train=512", "max_steps_per_epoch=null", *OVERRIDES)
    metrics = run(cfg, home / "out", OVERRIDES)
    client = MlflowClient(tracking_uri=uri)
    return cfg, metrics, client, only_run(uri)


def test_run_finishes_with_the_default_name(tracked):
    _, _, _, mlrun = tracked
    assert mlrun.info.status == "FINISHED"
    assert mlrun.info.run_name == "simple_cnn-single-fp32"
    assert mlrun.info.end_time is not None


def test_params_are_the_flattened_config_and_the_world(tracked):
    cfg, _, _, mlrun = tracked
    params = mlrun.data.params
    assert params["optimizer.lr"] == "0.1"
    assert params["data.batch_size"] == "32"
    assert params["model.channels"] == "[32, 64]"
    assert params["epochs"] == "2"
    assert params["world_size"] == "1"
    assert params["device_type"] == "cpu"
    assert params["torch_version"] == torch.__version__
    resolved = flatten(OmegaConf.to_container(cfg, resolve=True), empty=False)
    as_logged = {k: str(v)[:MAX_PARAM_VALUE] for k, v in resolved.items()}
    assert {k: params.get(k) for k in resolved} == as_logged  # every config key, as logged


def test_tags_say_what_was_compared(tracked):
    _, _, _, mlrun = tracked
    tags = mlrun.data.tags
    assert tags["parallelism"] == "single"
    assert tags["precision"] == "fp32"
    assert tags["model"] == "simple_cnn"
    assert tags["data"] == "synthetic"
    assert tags["overrides"] == " ".join(OVERRIDES)
    assert tags["device"] == "cpu"  # the report's plot titles name it


def test_the_training_set_is_a_run_input(tracked):
    """The MLflow UI's Dataset column: the set's name, a digest of what identifies it, its
    source, used for training."""
    cfg, _, _, mlrun = tracked
    (logged,) = mlrun.inputs.dataset_inputs
    assert logged.dataset.name == "synthetic"
    assert len(logged.dataset.digest) == 8
    assert logged.dataset.source_type == "code"  # generated in memory
    source = json.loads(logged.dataset.source)["tags"]
    assert source["code"] == "accelexp.data.sources.make_synthetic"
    assert (source["train"], source["image_size"]) == ("461", str(cfg.data.image_size))
    assert [(t.key, t.value) for t in logged.tags] == [("mlflow.data.context", "training")]


def test_a_data_set_read_from_a_folder_is_sourced_there_and_digested_by_what_it_is(
    compose_cfg, tracking_uri, tmp_path
):
    tracker = Tracker(compose_cfg().mlflow)
    tracker.connect()
    tracker.start("datasets", {}, {})
    tracker.log_dataset("cifar10", {"train": 45000, "val": 5000}, tmp_path)
    tracker.log_dataset("cifar10", {"train": 40000, "val": 10000}, tmp_path)
    tracker.end()
    first, second = only_run(tracking_uri).inputs.dataset_inputs
    assert first.dataset.source_type == second.dataset.source_type == "local"
    assert json.loads(first.dataset.source) == {"uri": tmp_path.resolve().as_uri()}
    assert first.dataset.digest != second.dataset.digest  # other splits: another data set


def test_one_value_per_epoch_for_each_epoch_metric(tracked):
    _, _, client, mlrun = tracked
    for key in EPOCH_METRICS:
        history = client.get_metric_history(mlrun.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2], key
        assert all(math.isfinite(m.value) for m in history), key
    for key in ("train_acc", "val_acc"):
        assert all(0 <= m.value <= 1 for m in client.get_metric_history(mlrun.info.run_id, key))
    for key in ("epoch_time_s", "samples_per_s", "peak_mem_mb"):
        assert all(m.value > 0 for m in client.get_metric_history(mlrun.info.run_id, key))
    samples = mlrun.data.metrics
    assert samples["samples_per_s_per_device"] == pytest.approx(samples["samples_per_s"])


def test_final_metrics_match_what_run_returned(tracked):
    _, metrics, _, mlrun = tracked
    logged = mlrun.data.metrics
    for key in ("best_val_acc", "test_acc", "test_loss", "total_time_s", "time_to_target_s"):
        assert key in logged, key
        assert logged[key] == metrics[key], key  # what run() returns is what MLflow shows
    assert 0 <= logged["time_to_target_s"] <= logged["total_time_s"]
    assert logged["best_val_acc"] >= 0.05  # the target of 0.05 was reached


def test_artifacts_hold_the_resolved_config_and_the_checkpoint(tracked, tmp_path):
    cfg, _, client, mlrun = tracked
    run_id = mlrun.info.run_id
    paths = {a.path for a in client.list_artifacts(run_id)}
    assert "config_resolved.yaml" in paths
    config_file = client.download_artifacts(run_id, "config_resolved.yaml", str(tmp_path))
    with open(config_file) as f:
        assert yaml.safe_load(f) == OmegaConf.to_container(cfg, resolve=True)
    assert "checkpoints/best.pt" in {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    best = client.download_artifacts(run_id, "checkpoints/best.pt", str(tmp_path))
    state = torch.load(best, weights_only=True)
    assert significant(state["val_acc"]) == mlrun.data.metrics["best_val_acc"]


def test_metrics_are_kept_to_five_significant_digits(tracked):
    _, _, client, mlrun = tracked
    values = [m.value for key in mlrun.data.metrics for m in client.get_metric_history(
        mlrun.info.run_id, key)]  # fmt: skip
    assert all(value == significant(value) for value in values)
    assert significant(0.1234567890123) == 0.12346
    assert significant(123456.789) == 123460.0
    assert significant(1.23456789e-9) == 1.2346e-9  # small is not 0
    assert significant(0.0) == 0.0
    assert math.isnan(significant(float("nan")))
    assert significant(float("inf")) == float("inf")


def test_the_best_model_is_logged_with_mlflow_pytorch_and_loads_back(
    compose_cfg, tracking_uri, tmp_path
):
    """mlflow.log_model=true: the best checkpoint's weights as an MLflow model (the UI's Models
    column), loaded back by `mlflow.pytorch.load_model`, computing what the checkpoint does."""
    import mlflow
    import mlflow.pytorch

    cfg = compose_cfg("mlflow.log_model=true")
    run(cfg, tmp_path / "out")
    mlrun = only_run(tracking_uri)
    (logged,) = mlrun.outputs.model_outputs
    model_info = MlflowClient(tracking_uri).get_logged_model(logged.model_id)
    assert model_info.experiment_id == mlrun.info.experiment_id  # with its run, not in ./mlruns
    assert model_info.artifact_location.startswith((tmp_path / "mlartifacts").as_uri())
    mlflow.set_tracking_uri(tracking_uri)
    loaded = mlflow.pytorch.load_model(f"models:/{logged.model_id}")
    data = build_data(typed(cfg).data, cfg.seed)
    model = build_model(typed(cfg).model, data.in_channels, data.num_classes, data.image_size)
    model.load_state_dict(torch.load(tmp_path / "out/checkpoints/best.pt")["model"])
    images = torch.rand(4, data.in_channels, data.image_size, data.image_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), model.eval()(images))


def test_no_target_no_checkpoint_and_a_chosen_name(compose_cfg, tracking_uri, tmp_path):
    cfg = compose_cfg("target_accuracy=null", "mlflow.run_name=my-run", "mlflow.experiment=other")
    metrics = run(cfg, tmp_path / "out")
    mlrun = only_run(tracking_uri, "other")
    assert mlrun.info.run_name == "my-run"
    assert "time_to_target_s" not in mlrun.data.metrics
    assert "time_to_target_s" not in metrics
    assert "test_acc" in mlrun.data.metrics
    client = MlflowClient(tracking_uri=tracking_uri)
    assert client.list_artifacts(mlrun.info.run_id, "checkpoints") == []
    assert mlrun.outputs.model_outputs == []  # mlflow.log_model is off by default
    assert (tmp_path / "out" / "checkpoints" / "best.pt").is_file()  # kept on disk all the same


def test_a_crash_mid_training_fails_the_run_and_keeps_earlier_metrics(
    compose_cfg, tracking_uri, tmp_path, monkeypatch
):
    train_epoch = Trainer.train_epoch

    def crash_in_epoch_2(self, loader, epoch):
        if epoch == 2:
            raise RuntimeError("injected failure in epoch 2")
        return train_epoch(self, loader, epoch)

    monkeypatch.setattr(Trainer, "train_epoch", crash_in_epoch_2)
    cfg = compose_cfg("epochs=3")
    with pytest.raises(RuntimeError, match="injected failure"):
        run(cfg, tmp_path / "out")
    mlrun = only_run(tracking_uri)
    assert mlrun.info.status == "FAILED"
    assert mlrun.info.end_time is not None
    client = MlflowClient(tracking_uri=tracking_uri)
    for key in EPOCH_METRICS:
        assert [m.step for m in client.get_metric_history(mlrun.info.run_id, key)] == [1], key
    assert "test_acc" not in mlrun.data.metrics


def test_more_params_than_one_mlflow_batch_and_long_values(compose_cfg, tracking_uri):
    cfg = compose_cfg()
    tracker = Tracker(cfg.mlflow)
    tracker.connect()
    params = {f"p.{i:03d}": i for i in range(250)}
    params["long"] = "y" * 9000
    tracker.start("many-params", params, {"purpose": "test"})
    tracker.end()
    mlrun = only_run(tracking_uri)
    logged = mlrun.data.params
    assert len(logged) == 251
    assert logged["p.249"] == "249"
    assert logged["long"] == "y" * MAX_PARAM_VALUE
    assert mlrun.data.tags["purpose"] == "test"
    assert mlrun.info.status == "FINISHED"


def test_a_disabled_tracker_writes_nothing(compose_cfg, tracking_uri):
    cfg = compose_cfg("mlflow.experiment=never")
    tracker = Tracker(cfg.mlflow, enabled=False)
    tracker.connect()
    tracker.start("nothing", {"a": 1}, {})
    tracker.log_metrics({"x": 1.0}, step=1)
    tracker.end()
    assert MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name("never") is None


def open_run_and_end(mlflow_cfg: str, name: str, said: Path) -> None:
    """A run's first touch of its store, in a process of its own: what run.py does before
    training (`train.run`: `Tracker.connect`, which opens the store and creates the experiment
    under `<store>.lock`, then heals stale runs), then a run started, a metric logged, the run
    ended. What went wrong, in `said`."""
    try:
        tracker = Tracker(OmegaConf.create(mlflow_cfg))
        tracker.connect()
        tracker.start(name, {"job": name}, {})
        tracker.log_metrics({"loss": 1.0}, step=1)
        tracker.end()
    except BaseException:
        said.write_text(traceback.format_exc())
        raise


def test_three_runs_started_at_once_on_a_new_store_are_all_recorded(tmp_path):
    """MLflow creates a new SQLite store's tables on first use; done by three processes at once
    it failed ("table runs already exists") and could leave the store broken for later runs.
    Each process opens the store as run.py's does (`Tracker.connect`, run.py's first use of the
    store) without run.py's start-up and training: three processes forked from this one, whose
    imports they share (a new interpreter would spend ~2.5 s CPU importing MLflow before the
    same race; forked, they race at once)."""
    uri = f"sqlite:///{tmp_path}/new.db"
    mlflow_cfg = OmegaConf.to_yaml(compose_config(uri).mlflow, resolve=True)
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 (imported once, here)

    fork = multiprocessing.get_context("fork")
    jobs = [
        fork.Process(
            target=open_run_and_end, args=(mlflow_cfg, f"job{i}", tmp_path / f"job{i}.txt")
        )
        for i in range(3)
    ]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=600)
    said = "\n".join(p.read_text() for p in sorted(tmp_path.glob("job*.txt")))
    assert [job.exitcode for job in jobs] == [0, 0, 0], said
    runs = MlflowClient(uri).search_runs(["1"])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 3
    assert sorted(r.info.run_name for r in runs) == ["job0", "job1", "job2"]


@pytest.mark.parametrize("parallelism", ["single", "ddp"])
def test_a_diverging_run_fails_with_one_message_and_keeps_what_it_logged(
    parallelism, tmp_path, cli
):
    uri = f"sqlite:///{tmp_path}/m.db"
    result = cli(
        "data=synthetic", "data.num_train=256", "data.batch_size=32", "epochs=3",
        "max_steps_per_epoch=3", "progress=false", "threads=1", "optimizer.lr=1e6",
        f"parallelism={parallelism}", f"parallelism.nprocs={2 if parallelism == 'ddp' else 1}",
        f"mlflow.tracking_uri={uri}", tmp_path=tmp_path,
    )  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "Training diverged in epoch 1" in text and "optimizer.lr" in text, text
    assert "accelexp/train.py" not in text, text  # no traceback through our code
    if parallelism == "single":  # (torchrun prints its own ChildFailedError traceback)
        assert "Traceback" not in text, text
    (run_,) = MlflowClient(uri).search_runs(["1"])
    assert run_.info.status == "FAILED"
    assert math.isnan(run_.data.metrics["train_loss"])  # the diverged epoch is on record
    assert "test_acc" not in run_.data.metrics  # and nothing after it ran


@pytest.mark.slow
def test_a_write_waits_out_a_store_locked_by_another_writer(compose_cfg, tracking_uri):
    """Another process holds SQLite's write lock for longer than MLflow's SQLite sessions wait
    (their busy_timeout: 20 s): the tracker retries instead of losing the metrics."""
    tracker = Tracker(compose_cfg().mlflow)
    tracker.connect()
    tracker.start("locked", {}, {})
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN EXCLUSIVE')\n"
            "print('locked', flush=True)\n"
            "time.sleep(25)\n"
            "db.execute('COMMIT')\n",
            tracking_uri.removeprefix("sqlite:///"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        tracker.log_metrics({"loss": 1.5}, step=1)
        tracker.end()
    finally:
        holder.wait(timeout=60)
    run_ = only_run(tracking_uri)
    assert run_.data.metrics["loss"] == 1.5
    assert run_.info.status == "FINISHED"


def test_sweep_jobs_are_named_by_what_they_vary_first(compose_cfg, monkeypatch):
    """The MLflow UI cuts names at about 15 characters: a sweep job's name starts with its swept
    values in short, then the rest of the derived name, so each row is told apart."""
    from accelexp.tracking.names import SWEPT_KEYS_ENV, run_name

    monkeypatch.setenv(SWEPT_KEYS_ENV, "parallelism.nprocs,precision")
    names = {
        run_name(compose_cfg(*job), overrides=job)
        for job in itertools.product(
            ["parallelism=ddp"], ["parallelism.nprocs=1", "parallelism.nprocs=2"],
            ["precision=fp32", "precision=amp"],
        )
    }  # fmt: skip
    assert names == {
        "np1 fp32 simple_cnn-ddp",
        "np1 amp simple_cnn-ddp",
        "np2 fp32 simple_cnn-ddp",
        "np2 amp simple_cnn-ddp",
    }
    assert len({name[:15] for name in names}) == len(names)

    monkeypatch.setenv(SWEPT_KEYS_ENV, "optimizer.lr,optimizer")
    job = ["optimizer=adamw", "optimizer.lr=0.2", "precision=bf16", "epochs=1"]
    name = run_name(compose_cfg(*job), overrides=job)
    assert name == "lr=0.2 adamw simple_cnn-single-bf16"
    second = compose_cfg(*job, "repeats=3", "repeat_index=1")  # a repeat: its index comes first
    assert run_name(second, overrides=job) == "r2 lr=0.2 adamw simple_cnn-single-bf16"
    chosen = compose_cfg("mlflow.run_name=mine")
    assert run_name(chosen, overrides=["optimizer.lr=0.2"]) == "mine"  # the user's name wins

    monkeypatch.delenv(SWEPT_KEYS_ENV)  # not in a sweep: the derived name, as it was
    assert run_name(compose_cfg(*job), overrides=job) == "simple_cnn-single-bf16"


def test_a_sweeps_end_links_to_its_report_in_the_ui(compose_cfg, tracking_uri):
    """The route MLflow 3.17's UI opens an artifact by (`.../artifacts/<path>`), short enough
    for one line: `Sweep done: 4 runs, 0 failed. Report: <link>`."""
    from accelexp.tracking.life import SWEEP_REPORT, end_sweep, start_sweep

    cfg = compose_cfg()
    run_id = start_sweep(cfg.mlflow, "sweep precision=fp32,amp", {"precision": "fp32,amp"}, "d")
    children, failed, link = end_sweep(cfg.mlflow, run_id, artifact=SWEEP_REPORT)
    experiment_id = only_run(tracking_uri).info.experiment_id
    assert (children, failed) == (0, 0)
    page = f"#/experiments/{experiment_id}/runs/{run_id}/artifacts/report/report.html"
    assert link == f"http://127.0.0.1:5000/{page}"
    assert len(f"Sweep done: 4 runs, 0 failed. Report: {link}") <= 150


def test_a_store_that_stops_taking_writes_is_one_message(compose_cfg, tracking_uri):
    """The store breaks mid-run (here its file is overwritten, as a failing disk would): the
    next write raises one AccelexpError that says what to do, and closing the run only warns."""
    from accelexp.tracking.store import TrackingUnavailableError

    tracker = Tracker(compose_cfg().mlflow)
    tracker.connect()
    tracker.start("breaks", {}, {})
    store = tracking_uri.removeprefix("sqlite:///")
    with open(store, "r+b") as file:  # the same file (open connections keep their inode)
        file.write(b"\0" * os.path.getsize(store))
    with pytest.raises(
        TrackingUnavailableError, match=r"Could not write the metrics .* Free space"
    ):
        tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.end("FAILED")  # no exception: the error above stays the one the user sees


@pytest.fixture
def full_disk(tmp_path):
    """A real full disk: a tmpfs of 8 MiB mounted in `tmp_path` (that takes root), its space
    taken by a file once the test has put its store there (`fill`)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a tmpfs mounted for the test, and mounting takes root")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:  # lazily: this process's SQLite connections may still hold the store open
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as filler:
        for size in (1 << 20, 1 << 12):
            try:
                while True:
                    filler.write(b"\0" * size)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error


@pytest.mark.parametrize("store", ["existing", "new"])
def test_a_store_on_a_full_disk_is_one_message(
    store, full_disk, mlflow_template_db, capfd, tmp_path
):
    """`python run.py` with its store on a full disk: one message that says so, where, and
    what to do; no traceback, no resume advice (no checkpoint exists), and no half-made store
    left behind (it would stay broken: "table ... already exists")."""
    uri = (
        new_store(full_disk, mlflow_template_db)
        if store == "existing"
        else (f"sqlite:///{full_disk / 'mlflow.db'}")
    )
    fill(full_disk)
    tiny = ["data=synthetic", "data.image_size=16", "epochs=1", "max_steps_per_epoch=1"]
    result = run_here(capfd, *tiny, "progress=false", "threads=1", f"mlflow.tracking_uri={uri}",
                      tmp_path=tmp_path)  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert f"The disk of the MLflow store is full: {full_disk / 'mlflow.db'}" in text, text
    assert "Free space on that disk, or point mlflow.tracking_uri" in text, text
    for wrong in ("Traceback", "autoflush", "[SQL:", "resume=auto"):
        assert wrong not in text, text
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert len(errors) == 1, text
    assert store == "existing" or not (full_disk / "mlflow.db").exists()
