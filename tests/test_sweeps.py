"""Sweeps you can compare: parent runs, failed children, the report, the MLflow UI for real.

One real 2x2 sweep (`parallelism.nprocs=1,2` x `precision=fp32,amp`, DDP over Gloo, tiny) feeds
the parent/child checks, a real `mlflow server` on 127.0.0.1 read over its REST API and rendered
in headless Chromium, and logging over HTTP to that server.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, compose_config, output_of, run_cli
from mlflow import MlflowClient

from accelexp.launch import launch
from accelexp.parallel.world import free_port

TINY = (
    "data=synthetic",
    "data.num_train=256",
    "data.num_test=128",
    "data.image_size=16",
    "data.batch_size=32",
    "max_steps_per_epoch=3",
    "epochs=2",
    "progress=false",
)
SCREENSHOTS = REPO / "outputs" / "test-artifacts"


def sweep(tmp: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    uri = f"sqlite:///{tmp}/mlflow.db"
    result = run_cli(
        "-m", *TINY, *overrides, f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp / 'sweep'}"
    )
    return result, uri


def runs_of(uri: str) -> tuple[object, list]:
    """(the sweep's parent run, its children) in the `accelexp` experiment."""
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])
    parents = [r for r in runs if r.data.tags.get("accelexp.sweep") == "true"]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == len(runs) - 1, "every other run is a child of the sweep"
    return parents[0], children


@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grid")
    result, uri = sweep(tmp, "parallelism=ddp", "parallelism.nprocs=1,2", "precision=fp32,amp")
    assert result.returncode == 0, output_of(result)
    return tmp, uri, result


def test_a_sweep_is_one_parent_run_with_a_child_per_job(grid_sweep):
    tmp, uri, _ = grid_sweep
    parent, children = runs_of(uri)
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "sweep parallelism.nprocs=1,2 precision=fp32,amp"
    assert parent.data.params["parallelism.nprocs"] == "1,2"
    assert parent.data.params["precision"] == "fp32,amp"
    assert parent.data.tags["sweep_dir"] == str(tmp / "sweep")
    assert sorted(r.info.run_name for r in children) == [
        "simple_cnn-ddp-amp",
        "simple_cnn-ddp-fp32",
        "simple_cnn-ddp-np2-amp",
        "simple_cnn-ddp-np2-fp32",
    ]
    for child in children:  # the np2 children were logged by a worker process, not this job
        assert child.info.status == "FINISHED"
        assert child.data.tags["sweep"] == parent.info.run_name
        assert child.data.tags["world_size"] == child.data.params["world_size"]
        assert {"parallelism", "precision", "model"} <= child.data.tags.keys()


def test_the_parent_carries_the_summary_and_the_plots(grid_sweep):
    _, uri, result = grid_sweep
    parent, children = runs_of(uri)
    client = MlflowClient(uri)
    names = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {f"report/{n}" for n in ("summary.csv", "summary.md", "throughput.png")} <= names
    local = client.download_artifacts(parent.info.run_id, "report/summary.csv")
    rows = list(csv.DictReader(io.StringIO(Path(local).read_text())))
    assert len(rows) == len(children) == 4
    # the sweep's end prints where to look: the runs table, not MLflow 3's GenAI landing page
    assert f"#/experiments/{parent.info.experiment_id}/runs" in output_of(result)


def test_a_failed_job_is_a_failed_child_and_the_sweep_goes_on(tmp_path):
    # the second job's batch is larger than the training set: a ConfigError in that job only
    result, uri = sweep(tmp_path, "data.batch_size=32,100000")
    assert result.returncode == 1, output_of(result)
    parent, children = runs_of(uri)
    assert parent.info.status == "FAILED"
    status = {r.data.params.get("data.batch_size", "?"): r.info.status for r in children}
    failed = [r for r in children if r.info.status == "FAILED"]
    assert len(children) == 2 and len(failed) == 1, status
    client = MlflowClient(uri)
    error = Path(client.download_artifacts(failed[0].info.run_id, "error.txt")).read_text()
    assert "data.batch_size=100000" in error
    summary = Path(client.download_artifacts(parent.info.run_id, "report/summary.csv")).read_text()
    assert "FAILED" in summary


def test_a_single_run_has_no_parent(tmp_path, tracking_uri):
    launch(compose_config(tracking_uri), tmp_path / "out")
    (run,) = MlflowClient(tracking_uri).search_runs(["1"])
    assert "mlflow.parentRunId" not in run.data.tags


def test_a_sweep_through_submitit_logs_its_children_under_the_parent(tmp_path):
    result, uri = sweep(tmp_path, "hydra/launcher=submitit_local", "precision=fp32,bf16")
    assert result.returncode == 0, output_of(result)
    parent, children = runs_of(uri)
    assert parent.info.status == "FINISHED"
    assert sorted(r.data.tags["precision"] for r in children) == ["bf16", "fp32"]


# --- a real MLflow server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(grid_sweep):
    tmp, uri, _ = grid_sweep
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", uri,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--artifacts-destination", str(tmp / "served-artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):  # the server migrates and starts in seconds; bounded wait
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                assert server.poll() is None, "mlflow server exited"
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer /health")
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def rest(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{base}/api/2.0/mlflow/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def test_the_server_serves_the_sweep_over_its_rest_api(mlflow_server):
    experiment = rest(mlflow_server, "experiments/search", {"max_results": 10})["experiments"]
    experiment_id = next(e["experiment_id"] for e in experiment if e["name"] == "accelexp")
    runs = rest(mlflow_server, "runs/search", {"experiment_ids": [experiment_id]})["runs"]
    tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    (parent,) = [r for r, t in zip(runs, tags, strict=True) if t.get("accelexp.sweep") == "true"]
    children = [t for t in tags if t.get("mlflow.parentRunId") == parent["info"]["run_id"]]
    assert len(children) == 4
    for run in runs:
        if run is parent:
            continue
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        metrics = {m["key"] for m in run["data"]["metrics"]}
        assert params["world_size"] in ("1", "2")
        assert {"samples_per_s", "val_acc", "test_acc"} <= metrics


def chromium(*args: str, user_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("chromium") or "/usr/bin/chromium", "--headless", "--no-sandbox",
         "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run", f"--user-data-dir={user_dir}", "--window-size=1600,1000",
         "--virtual-time-budget=20000", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_mlflow_ui_shows_the_runs_in_a_real_browser(mlflow_server, grid_sweep, tmp_path):
    _, uri, _ = grid_sweep
    parent, children = runs_of(uri)
    runs = [parent, *children]
    ids = urllib.parse.quote(json.dumps([r.info.run_id for r in runs]))
    experiments = urllib.parse.quote(json.dumps([parent.info.experiment_id]))
    page = chromium(
        "--dump-dom",
        f"{mlflow_server}/#/compare-runs?runs={ids}&experiments={experiments}",
        user_dir=tmp_path / "profile1",
    )
    for run in runs:
        assert run.info.run_name in page.stdout, f"{run.info.run_name} not rendered"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "mlflow-ui-runs.png"
    chromium(
        f"--screenshot={shot}",
        f"{mlflow_server}/#/experiments/{parent.info.experiment_id}/runs",
        user_dir=tmp_path / "profile2",
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_logs_to_the_server_over_http(mlflow_server, tmp_path):
    cfg = compose_config(mlflow_server, "mlflow.experiment=over-http")
    metrics = launch(cfg, tmp_path / "out")
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("over-http").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_acc"] == pytest.approx(metrics["test_acc"])
    assert "config_resolved.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
