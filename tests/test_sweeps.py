"""Sweeps you can compare: parent runs, failed children, the report, the MLflow UI for real.

One real 2x2 sweep, the README's scaling study (`+experiment=scaling`: `parallelism.nprocs=1,2` x
`precision=fp32,amp`, DDP over Gloo), tiny, feeds the parent/child checks (and the scaling reports
of tests/test_docs.py), a real `mlflow server` on 127.0.0.1 read over its REST API and rendered
in headless Chromium (the runs, and the sweep's report.html in MLflow's artifact viewer, driven
with Playwright since that viewer shows the report inside a sandboxed frame), and logging over
HTTP to that server. report.html itself is checked on hand-made rows first.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import (
    REPO,
    built_once,
    compose_config,
    new_store,
    output_of,
    run_here,
    served,
    store_uri,
)
from mlflow import MlflowClient
from playwright.sync_api import sync_playwright

from accelexp import record, stats
from accelexp.launch import launch
from accelexp.report import LADDER, RUNS, LadderRow, Row, compare
from accelexp.report.compare import everything_set_aside
from accelexp.report.html import write_html
from accelexp.stats import Estimate, format_estimate
from accelexp.tracking import query

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
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's; scripts/setup.sh installs it
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def sweep(tmp: Path, template: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    """`run.py -m` at the tiny size into a store of its own (a copy of the migrated template),
    in this process (`conftest.run_here`: what a new one adds is only its start-up)."""
    uri = new_store(tmp, template)
    result = run_here(
        None,
        "-m",
        *TINY,
        *overrides,
        f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp / 'sweep'}",
    )
    return result, uri


def runs_of(uri: str, experiment: str = "accelexp") -> tuple[object, list]:
    """(the sweep's parent run, its children) in `experiment`."""
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parents = [r for r in runs if r.data.tags.get("accelexp.sweep") == "true"]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == len(runs) - 1, "every other run is a child of the sweep"
    return parents[0], children


GRID = "scaling"  # the experiment of the grid: the scaling study's own


@pytest.fixture(scope="session")
def grid_sweep(tmp_path_factory, mlflow_template_db):
    """A 2 x 2 sweep (workers x precision): the README's `run.py -m +experiment=scaling
    parallelism.nprocs=1,2 threads=1` (DDP; its precision=fp32,amp) at the tiny size, each
    configuration once (the study's repeats=3 is its real size). Run once per test session
    (`built_once`); tests/test_docs.py's scaling reports read it too."""

    def run(tmp: Path) -> subprocess.CompletedProcess:
        # 16 steps an epoch on each of two workers, two epochs: the second epoch has
        # steady-state steps enough for a throughput (compare.MIN_STEADY_STEPS)
        return sweep(
            tmp,
            mlflow_template_db,
            "+experiment=scaling",
            "parallelism.nprocs=1,2",
            "precision=fp32,amp",
            "threads=1",
            "repeats=1",
            "data.num_train=1024",
            "max_steps_per_epoch=16",
        )[0]

    tmp, result = built_once(tmp_path_factory, "grid", run)
    assert result.returncode == 0, output_of(result)
    return tmp, store_uri(tmp), result


def test_a_sweep_is_one_parent_run_with_a_child_per_job(grid_sweep):
    tmp, uri, _ = grid_sweep
    parent, children = runs_of(uri, GRID)
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "sweep parallelism.nprocs=1,2 precision=fp32,amp"
    assert parent.data.params["parallelism.nprocs"] == "1,2"
    assert parent.data.params["precision"] == "fp32,amp"
    assert parent.data.tags["sweep_dir"] == str(tmp / "sweep")
    assert sorted(r.info.run_name for r in children) == [  # what the jobs differ in first
        "np1 amp simple_cnn-ddp",
        "np1 fp32 simple_cnn-ddp",
        "np2 amp simple_cnn-ddp",
        "np2 fp32 simple_cnn-ddp",
    ]
    for child in children:  # the np2 children were logged by a worker process, not this job
        assert child.info.status == "FINISHED"
        assert child.data.tags["sweep"] == parent.info.run_name
        assert child.data.tags["world_size"] == child.data.params["world_size"]
        assert {"parallelism", "precision", "model"} <= child.data.tags.keys()


def test_the_parent_carries_the_summary_and_the_plots(grid_sweep, tmp_path):
    _, uri, result = grid_sweep
    parent, children = runs_of(uri, GRID)
    client = MlflowClient(uri)
    names = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {f"report/{n}" for n in ("summary.csv", "summary.md", "throughput.png")} <= names
    local = client.download_artifacts(parent.info.run_id, "report/summary.csv", str(tmp_path))
    rows = list(csv.DictReader(io.StringIO(Path(local).read_text())))
    assert len(rows) == len(children) == 4
    # the sweep's end prints where to look: the runs table, not MLflow 3's GenAI landing page
    assert f"#/experiments/{parent.info.experiment_id}/runs" in output_of(result)


def test_a_failed_job_is_a_failed_child_and_the_sweep_goes_on(tmp_path, mlflow_template_db):
    # the second job's batch is larger than the training set: a ConfigError in that job only
    result, uri = sweep(tmp_path, mlflow_template_db, "data.batch_size=32,100000")
    assert result.returncode == 1, output_of(result)
    parent, children = runs_of(uri)
    assert parent.info.status == "FAILED"
    status = {r.data.params.get("data.batch_size", "?"): r.info.status for r in children}
    failed = [r for r in children if r.info.status == "FAILED"]
    assert len(children) == 2 and len(failed) == 1, status
    client = MlflowClient(uri)
    error = Path(client.download_artifacts(failed[0].info.run_id, "error.txt", str(tmp_path)))
    error = error.read_text()
    assert "data.batch_size=100000" in error
    summary = client.download_artifacts(parent.info.run_id, "report/summary.csv", str(tmp_path))
    summary = Path(summary).read_text()
    assert "FAILED" in summary


def test_repeats_run_round_robin_and_the_report_makes_each_configuration_one_row(
    tmp_path, mlflow_template_db
):
    # 12 steps an epoch, two epochs: the second has steady steps enough for a throughput
    result, uri = sweep(
        tmp_path,
        mlflow_template_db, "precision=fp32,bf16", "repeats=2", "repeat_seed=vary",
        "data.num_train=512", "max_steps_per_epoch=12",
    )  # fmt: skip
    assert result.returncode == 0, output_of(result)
    assert "This sweep runs 4 jobs (2 configurations x 2 repeats)." in output_of(result)
    parent, children = runs_of(uri)
    children.sort(key=lambda r: r.info.start_time)
    order = [(r.data.tags["precision"], r.data.tags["repeat_index"]) for r in children]
    # A B, B A: round after round, every other round backwards
    assert order == [("fp32", "0"), ("bf16", "0"), ("bf16", "1"), ("fp32", "1")]
    assert [r.data.params["seed"] for r in children] == ["42", "42", "43", "43"]
    assert [r.info.run_name for r in children] == [
        "r1 fp32 simple_cnn-single", "r1 bf16 simple_cnn-single",
        "r2 bf16 simple_cnn-single", "r2 fp32 simple_cnn-single",
    ]  # fmt: skip
    ids = [r.data.tags["config_id"] for r in children]
    assert ids[0] == ids[3] != ids[1] == ids[2]  # one configuration across repeats and seeds
    for run in children:  # an interval where the steps support one (a burst can make it
        metrics = run.data.metrics  # unbounded: then none is claimed, accelexp.stats.rate)
        assert metrics["throughput_steps"] >= stats.MIN_BATCH_MEANS
        if "throughput_low" in metrics:
            assert metrics["throughput_low"] <= metrics["throughput"] <= metrics["throughput_high"]
        assert run.data.tags["noise"] in ("quiet", "contended")
    assert any("throughput_low" in run.data.metrics for run in children)
    records = query.child_runs(uri, parent.info.run_id)
    rows = compare(records)
    assert [row.run_name for row in rows] == ["fp32 simple_cnn-single", "bf16 simple_cnn-single"]
    every_run_aside = bool(everything_set_aside(records))  # said once, not per repeat
    for row in rows:  # two repeats each: behind the figures, or set aside with why (contended)
        aside = 2 if every_run_aside else row.note.count("set aside")
        behind = 0 if row.noise == "contended" else row.repeats
        assert behind + aside == 2, row
        # over two repeats an interval always exists; one run left has its own batch means,
        # which a burst can leave unbounded (none claimed: the runs' check above)
        assert row.samples_per_s_low is not None or behind < 2, row


def test_repeats_without_m_and_a_sweep_of_repeats_are_refused_with_what_to_type(tmp_path, cli):
    single = cli(*TINY, "repeats=3", tmp_path=tmp_path)
    assert single.returncode == 2 and "add -m" in output_of(single), output_of(single)
    swept = cli("-m", *TINY, "repeats=2,3", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert swept.returncode == 2 and "repeats cannot be swept" in output_of(swept)
    assert "Traceback" not in output_of(single) + output_of(swept)


def test_a_single_run_has_no_parent(tmp_path, tracking_uri):
    launch(compose_config(tracking_uri), tmp_path / "out")
    (run,) = MlflowClient(tracking_uri).search_runs(["1"])
    assert "mlflow.parentRunId" not in run.data.tags


def test_a_sweep_through_submitit_logs_its_children_under_the_parent(tmp_path, mlflow_template_db):
    # one job: submitit starts each job in a process of its own, which the parent reaches
    # through the environment it hands each job (a second job would start another such process)
    result, uri = sweep(
        tmp_path, mlflow_template_db, "hydra/launcher=submitit_local", "precision=bf16"
    )
    assert result.returncode == 0, output_of(result)
    parent, children = runs_of(uri)
    assert parent.info.status == "FINISHED"
    (child,) = children
    assert child.data.tags["precision"] == "bf16"  # the job's own override
    assert child.data.tags[record.PID] != str(os.getpid())  # run by submitit's process


# --- report.html ---------------------------------------------------------------------------


class Page(HTMLParser):
    """What a browser would show of a page: its tables' cells, its images' sources, its text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []  # table -> row -> cell text
        self.images: list[str] = []
        self.text: list[str] = []
        self.in_cell = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append("")
            self.in_cell = True
        elif tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag in ("script", "link", "iframe"):
            raise AssertionError(f"<{tag}> in a page meant to need nothing else")

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.in_cell = False

    def handle_data(self, data):
        self.text.append(data)
        if self.in_cell:
            self.tables[-1][-1][-1] += data


def fake_row(name: str, status: str = "FINISHED", **figures) -> Row:
    return Row(name, f"id-{name}", status, "ddp", 2, "amp", "eager", "simple_cnn", "synthetic",
               **figures)  # fmt: skip


def test_report_html_holds_the_tables_notes_and_plots_and_escapes_text(tmp_path):
    rows = [
        fake_row("fp32", samples_per_s=1234.5678, speedup=1.0, best_val_acc=0.91234),
        fake_row("<script>alert(1)</script>", note="too short to measure: 4 steady steps < 10"),
        fake_row("broken", status="FAILED"),
    ]
    rungs = [
        LadderRow(0, "fp32", "FINISHED", "r0", "id0", "fp32", "eager", "simple_cnn", "synthetic",
                  samples_per_s=100.0),
        LadderRow(1, "tf32", "FINISHED", "r1", "id1", "fp32", "tf32", "simple_cnn", "synthetic",
                  samples_per_s=150.0, gain_vs_previous=1.5, previous_rung="fp32"),
    ]  # fmt: skip
    png = tmp_path / "throughput.png"
    png.write_bytes(PNG_MAGIC + b"pixels")
    (tmp_path / "summary.csv").write_text("not a picture")

    path = write_html("Sweep <a&b>", rows, tmp_path / "out", rungs, [png, tmp_path / "summary.csv"])

    text = path.read_text()
    assert path.name == "report.html" and text.startswith("<!DOCTYPE html>")
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    page = Page(text)
    runs, ladder = page.tables
    shown = RUNS.shown(rows)
    assert runs[0] == list(shown.values())
    assert runs[1:] == [[RUNS.cell(key, getattr(row, key)) for key in shown] for row in rows]
    assert runs[1][list(shown).index("samples_per_s")] == "1234.6"
    assert ladder[1:] == [
        [LADDER.cell(key, getattr(rung, key)) for key in LADDER.shown(rungs)] for rung in rungs
    ]
    assert "1.50×" in ladder[2]
    words = " ".join("".join(page.text).split())
    assert "Sweep <a&b>" in words
    assert "<script>alert(1)</script>: too short to measure: 4 steady steps < 10" in words
    assert "fp32:" not in words  # a row without a note has no line
    assert page.images == [f"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}"]
    assert 'class="failed"' in text

    plain = Page(write_html("Sweep", rows[:1], tmp_path / "plain").read_text())
    assert len(plain.tables) == 1 and plain.images == []  # no ladder, no plots: no sections


# --- a real MLflow server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(grid_sweep, tmp_path_factory):
    _, uri, _ = grid_sweep
    with served(uri, tmp_path_factory.mktemp("server")) as base:
        yield base


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
    experiment_id = next(e["experiment_id"] for e in experiment if e["name"] == GRID)
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
        [CHROMIUM, "--headless", *CHROMIUM_ARGS, f"--user-data-dir={user_dir}",
         "--window-size=1600,1000", "--virtual-time-budget=20000", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_mlflow_ui_shows_the_runs_in_a_real_browser(mlflow_server, grid_sweep, tmp_path):
    _, uri, _ = grid_sweep
    parent, children = runs_of(uri, GRID)
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


def test_the_sweeps_html_report_opens_in_the_mlflow_ui(mlflow_server, grid_sweep):
    _, uri, result = grid_sweep
    parent, children = runs_of(uri, GRID)
    run_page = f"#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
    route = f"{run_page}/artifacts/report/report.html"
    assert route in output_of(result), "the sweep's end links straight to its report"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(f"{mlflow_server}/{route}")
            # MLflow's artifact viewer renders an HTML artifact in a sandboxed frame of its own
            frame_element = page.wait_for_selector("iframe.mlflow-html-iframe", timeout=60_000)
            frame = frame_element.content_frame()
            frame.wait_for_selector("table tbody tr", timeout=60_000)
            header = frame.locator("table").first.locator("thead th").all_inner_texts()
            table = {
                cells[0]: dict(zip(header, cells, strict=True))
                for tr in frame.locator("table").first.locator("tbody tr").all()
                if (cells := tr.locator("td").all_inner_texts())
            }
            images = frame.evaluate(
                "Array.from(document.images, i => i.complete && i.naturalWidth > 0)"
            )
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shot = SCREENSHOTS / "mlflow-ui-sweep-report.png"
            page.screenshot(path=str(shot))
        finally:
            browser.close()

    assert sorted(table) == sorted(child.info.run_name for child in children)
    for child in children:  # the figures MLflow holds, as the report's table formats them
        row = table[child.info.run_name]
        metrics = child.data.metrics
        assert row["best val acc"] == RUNS.cell("best_val_acc", metrics["best_val_acc"])
        assert row["test acc"] == RUNS.cell("test_acc", metrics["test_acc"])
        # its steady-state samples/s with the 95 % interval the run logged
        bounds = (metrics.get("throughput_low"), metrics.get("throughput_high"))  # or none
        logged = Estimate(metrics["throughput"], *bounds)
        assert row["samples/s"] == format_estimate(logged, RUNS.display["samples_per_s"]), row
    assert len(images) >= 2 and all(images), "every plot is embedded and decodes"
    assert shot.read_bytes()[:8] == PNG_MAGIC


def test_a_run_logs_to_the_server_over_http(mlflow_server, tmp_path):
    cfg = compose_config(mlflow_server, "mlflow.experiment=over-http")
    metrics = launch(cfg, tmp_path / "out")
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("over-http").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test_acc"] == pytest.approx(metrics["test_acc"])
    assert "config_resolved.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
