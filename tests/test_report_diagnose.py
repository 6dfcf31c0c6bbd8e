"""`accelexp-report --diagnose`: time shares computed by hand, read back from a real SQLite store.

The store holds runs as the engine logs them: per epoch the `time/*` seconds of the timed steps
(step = epoch), at the end the `diagnosis`, `diagnosis_next` and `diagnosis_detail` tags. Every
first epoch's seconds are deliberately different, so a report that does not use the last epoch
gets other shares. One run predates the accounting (no `time/*` metrics, no tags); one FAILED
after its first epoch (seconds, but no verdict and no `time/comm_s`).
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from conftest import REPO, new_store
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from accelexp.report import SEGMENTS, TIME_PLOT, build_parser, main
from accelexp.report.diagnose import NO_ACCOUNTING, diagnosis_row
from accelexp.tracking.query import RunRecord

WARM_UP = dict.fromkeys(SEGMENTS, 5.0)  # epoch 1: equal shares, never the answer


# --- the store ----------------------------------------------------------------------------------
@dataclass
class Timed:
    """One run: its last epoch's seconds per segment (None: it predates the accounting)."""

    name: str
    world_size: int
    precision: str
    seconds: dict[str, float] | None
    verdict: dict[str, str] = field(default_factory=dict)  # diagnosis tags
    extra: dict[str, float] = field(default_factory=dict)  # time/gpu_busy, time/comm_overlap, ...
    status: str = "FINISHED"
    epochs: int = 3


COMPUTE_BOUND = Timed(  # of 10 s: input 10 %, fwd+bwd 60 %, optimizer 10 %, comm 0, other 20 %
    "ddp1-fp32", 1, "fp32",
    {"input": 1.0, "forward": 2.0, "backward": 4.0, "optimizer": 1.0, "comm": 0.0, "other": 2.0},
    {"diagnosis": "compute", "diagnosis_next": "speed=tf32+cl",
     "diagnosis_detail": "forward+backward 60% of step time"},
    {"time/gpu_busy": 0.85, "flop_utilisation": 0.31},
)  # fmt: skip
COMM_BOUND = Timed(  # of 10 s: 5 %, 40 %, 5 %, 40 %, 10 %
    "ddp2-fp32", 2, "fp32",
    {"input": 0.5, "forward": 1.5, "backward": 2.5, "optimizer": 0.5, "comm": 4.0, "other": 1.0},
    {"diagnosis": "communication", "diagnosis_next": "parallelism.comm_hook=fp16",
     "diagnosis_detail": "communication waited 40% of step time, 25% of it hidden"},
    {"time/comm_overlap": 0.25, "time/comm_inflight_s": 5.3},
)  # fmt: skip
INPUT_BOUND = Timed(  # of 12.5 s: 62 %, 20 %, 4 %, 8 %, 6 %
    "ddp2-amp", 2, "amp",
    {"input": 7.75, "forward": 1.0, "backward": 1.5, "optimizer": 0.5, "comm": 1.0, "other": 0.75},
    {"diagnosis": "input", "diagnosis_next": "data.on_device=true",
     "diagnosis_detail": "input wait 62% of step time"},
    {"time/gpu_busy": 0.30},
)  # fmt: skip
OLD = Timed("ddp4-fp32", 4, "fp32", None)
FAILED = Timed(  # one epoch, no comm logged, no verdict; of 8 s: 12.5 %, 25 %, 12.5 %, 0, 50 %
    "ddp4-amp", 4, "amp",
    {"input": 1.0, "forward": 1.0, "backward": 1.0, "optimizer": 1.0, "other": 4.0},
    status="FAILED", epochs=1,
)  # fmt: skip
SWEEP = [FAILED, INPUT_BOUND, OLD, COMPUTE_BOUND, COMM_BOUND]  # logged out of the report's order
ORDER = ["ddp1-fp32", "ddp2-fp32", "ddp2-amp", "ddp4-fp32", "ddp4-amp"]
SHARES = {  # run -> (input, fwd+bwd, optimizer, comm, other), by hand from the seconds above
    "ddp1-fp32": (10, 60, 10, 0, 20),
    "ddp2-fp32": (5, 40, 5, 40, 10),
    "ddp2-amp": (62, 20, 4, 8, 6),
    "ddp4-amp": (12.5, 25, 12.5, 0, 50),
}


def log_timed(client: MlflowClient, experiment_id: str, run: Timed, start: int, parent: str) -> str:
    tags = {
        "mlflow.parentRunId": parent,
        "parallelism": "ddp",
        "precision": run.precision,
        "model": "simple_cnn",
        "data": "synthetic",
        "world_size": str(run.world_size),
        **run.verdict,
    }
    run_id = client.create_run(experiment_id, start, tags, run.name).info.run_id
    metrics = []
    for epoch in range(1, run.epochs + 1):
        at = start + epoch
        metrics.append(Metric("samples_per_s", 100.0 * epoch, at, epoch))
        if run.seconds is not None:
            seconds = run.seconds if epoch == run.epochs else WARM_UP
            metrics += [Metric(f"time/{s}_s", v, at, epoch) for s, v in seconds.items()]
    metrics += [Metric(key, value, start + 99, run.epochs) for key, value in run.extra.items()]
    params = [Param("world_size", str(run.world_size)), Param("precision.name", run.precision)]
    client.log_batch(run_id, metrics=metrics, params=params)
    client.set_terminated(run_id, status=run.status)
    return run_id


def log_sweep(client: MlflowClient, experiment_id: str, name: str, start: int, runs) -> str:
    tags = {"accelexp.sweep": "true", "sweep_dir": f"outputs/multirun/{name}"}
    parent = client.create_run(experiment_id, start, tags, name).info.run_id
    client.set_terminated(parent)
    for i, run in enumerate(runs, 1):
        log_timed(client, experiment_id, run, start + 10 * i, parent)
    return parent


@pytest.fixture(scope="module")
def store(tmp_path_factory, mlflow_template_db):
    """Experiment `timing` (the sweep `diag-sweep` of SWEEP) and `legacy` (a sweep of old runs
    without time accounting)."""
    home = tmp_path_factory.mktemp("diagnose-store")
    uri = new_store(home, mlflow_template_db)
    client = MlflowClient(tracking_uri=uri)

    def experiment(name: str) -> str:
        return client.create_experiment(name, (home / "mlartifacts" / name).as_uri())

    timing, legacy = experiment("timing"), experiment("legacy")
    sweep = log_sweep(client, timing, "diag-sweep", 1000, SWEEP)
    old = [OLD, Timed("ddp4-amp-old", 4, "amp", None)]
    legacy_sweep = log_sweep(client, legacy, "old-sweep", 2000, old)
    return {"uri": uri, "sweep": sweep, "legacy": legacy_sweep}


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def diagnose_sweep(capsys, store, tmp_path, *args: str) -> tuple[int, str, str]:
    base = ["--tracking-uri", store["uri"], "--sweep", store["sweep"], "--diagnose"]
    return run_main(capsys, *base, "--output-dir", str(tmp_path), *args)


# --- the rows, pure -----------------------------------------------------------------------------
def test_shares_come_from_the_last_epoch_and_a_missing_comm_is_zero():
    seconds = {"input": 3.0, "forward": 2.0, "backward": 2.0, "optimizer": 1.0, "other": 2.0}
    record = RunRecord(
        "id",
        "r",
        "FINISHED",
        tags={"diagnosis": "input"},
        metrics={f"time/{s}_s": v for s, v in seconds.items()} | {"time/gpu_busy": 0.5},
    )
    row = diagnosis_row(record)
    assert (row.input_pct, row.compute_pct, row.comm_pct) == pytest.approx((30, 40, 0))
    assert (row.forward_pct, row.backward_pct) == pytest.approx((20, 20))
    assert row.step_time_s == pytest.approx(10)
    assert row.gpu_busy_pct == pytest.approx(50)
    assert row.bound == "input" and row.note is None


def test_no_or_all_zero_seconds_is_no_accounting():
    zeros = {f"time/{s}_s": 0.0 for s in SEGMENTS}
    for metrics in ({}, zeros, {"time/input_s": 1.0}):
        row = diagnosis_row(RunRecord("id", "r", "FINISHED", metrics=metrics))
        assert not row.accounted
        assert row.input_pct is None and row.note == NO_ACCOUNTING


# --- the command --------------------------------------------------------------------------------
def test_csv_shares_computed_by_hand(store, capsys, tmp_path):
    code, out, _ = diagnose_sweep(capsys, store, tmp_path, "--format", "csv", "--no-plots")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["run_name"] for r in rows] == ORDER
    by_name = {r["run_name"]: r for r in rows}
    for name, shares in SHARES.items():
        row = by_name[name]
        columns = ("input_pct", "compute_pct", "optimizer_pct", "comm_pct", "other_pct")
        assert [float(row[c]) for c in columns] == pytest.approx(shares), name
        assert sum(float(row[f"{s}_pct"]) for s in SEGMENTS) == pytest.approx(100)
    assert float(by_name["ddp1-fp32"]["forward_pct"]) == pytest.approx(20)
    assert float(by_name["ddp1-fp32"]["backward_pct"]) == pytest.approx(40)
    assert float(by_name["ddp2-amp"]["step_time_s"]) == pytest.approx(12.5)
    assert [r["bound"] for r in rows] == ["compute", "communication", "input", "", ""]
    assert by_name["ddp2-fp32"]["next_override"] == "parallelism.comm_hook=fp16"
    assert by_name["ddp2-amp"]["detail"] == "input wait 62% of step time"
    assert float(by_name["ddp1-fp32"]["gpu_busy_pct"]) == pytest.approx(85)
    assert by_name["ddp2-fp32"]["gpu_busy_pct"] == ""  # not logged (a CPU run)
    assert float(by_name["ddp2-fp32"]["comm_overlap_pct"]) == pytest.approx(25)
    assert float(by_name["ddp1-fp32"]["flop_utilisation_pct"]) == pytest.approx(31)
    old = by_name["ddp4-fp32"]
    assert old["note"] == NO_ACCOUNTING
    assert all(old[f"{s}_pct"] == "" for s in SEGMENTS)
    assert all(by_name[name]["note"] == "" for name in SHARES)
    assert (tmp_path / "diagnosis.csv").read_text() == out
    assert not (tmp_path / "summary.csv").exists()  # --diagnose leaves the comparison alone


def test_json_has_numbers_and_nulls(store, capsys, tmp_path):
    args = ("--tracking-uri", store["uri"], "--experiment", "timing", "--diagnose")
    code, out, _ = run_main(capsys, *args, "--format", "json", "--output-dir", str(tmp_path))
    assert code == 0
    rows = json.loads(out)
    assert [r["run_name"] for r in rows] == ORDER  # the experiment's runs, no sweep parent
    comm = rows[1]
    assert comm["bound"] == "communication"
    assert comm["comm_pct"] == pytest.approx(40)
    assert comm["gpu_busy_pct"] is None
    assert rows[3]["bound"] is None and rows[3]["input_pct"] is None
    assert rows[3]["note"] == NO_ACCOUNTING
    assert rows[4]["status"] == "FAILED" and rows[4]["other_pct"] == pytest.approx(50)


def test_rich_table_fits_100_columns_with_a_footnote(store, capsys, tmp_path):
    code, out, _ = diagnose_sweep(capsys, store, tmp_path, "--no-plots")
    assert code == 0
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, out
    # the shares' headers are two lines, "input" over "%": 100 columns hold the whole table
    top = next(i for i, line in enumerate(lines) if "fwd+bwd" in line)
    assert lines[top].split() == ["input", "fwd+bwd", "optim", "comm", "other", "GPU"]
    assert lines[top + 1].split() == ["run", "bound", *"%%%%%", "busy", "%", "next"]
    flat = "".join(out.split())  # a long cell may fold over lines: compare without the breaks
    for text in ("communication", "data.on_device=true", "62.0", "60.0", "85.0", "—"):
        assert text in out
    assert "parallelism.comm_hook=fp16" in flat.replace("│", "").replace("┃", "")
    assert "no time/* metrics for ddp4-fp32: it predates the time accounting" in " ".join(
        out.split()
    )


def test_markdown_with_dashes_and_the_footnote(store, capsys, tmp_path):
    code, out, _ = diagnose_sweep(capsys, store, tmp_path, "--format", "markdown", "--no-plots")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == (
        "| run | bound | input % | fwd+bwd % | optim % | comm % | other % | GPU busy % | next |"
    )
    assert (
        "| ddp2-amp | input | 62.0 | 20.0 | 4.0 | 8.0 | 6.0 | 30.0 | data.on_device=true |" in out
    )
    assert "| ddp4-fp32 | — | — | — | — | — | — | — | — |" in out
    assert "| ddp4-amp | — | 12.5 | 25.0 | 12.5 | 0.0 | 50.0 | — | — |" in out
    assert lines[-1].startswith("— no time/* metrics for ddp4-fp32: it predates")
    assert (tmp_path / "diagnosis.md").read_text() == out


def test_time_breakdown_png_in_the_default_folder(store, capsys, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.image import imread

    monkeypatch.chdir(tmp_path)
    args = ("--tracking-uri", store["uri"], "--experiment", "timing", "--sweep", "latest")
    code, _, err = run_main(capsys, *args, "--diagnose", "--format", "csv")
    assert code == 0
    folder = tmp_path / "outputs" / "reports" / "diag-sweep"
    assert {p.name for p in folder.iterdir()} == {"diagnosis.csv", "diagnosis.md", TIME_PLOT}
    png = folder / TIME_PLOT
    assert png.stat().st_size > 0
    image = imread(png)
    height, width = image.shape[:2]
    assert width > 500 and height > 300
    assert f"{TIME_PLOT} to outputs/reports/diag-sweep" in err


def test_no_plot_without_accounting_and_none_with_no_plots(store, capsys, tmp_path):
    (tmp_path / TIME_PLOT).write_bytes(b"an older report's plot")
    args = ("--tracking-uri", store["uri"], "--sweep", store["legacy"], "--diagnose")
    code, out, err = run_main(capsys, *args, "--format", "markdown", "--output-dir", str(tmp_path))
    assert code == 0
    assert not (tmp_path / TIME_PLOT).exists()
    assert f"Skipped {TIME_PLOT}: no data to plot" in err
    assert "for ddp4-fp32, ddp4-amp-old: they predate the time accounting" in out

    code, _, err = diagnose_sweep(capsys, store, tmp_path, "--no-plots")
    assert code == 0
    assert not (tmp_path / TIME_PLOT).exists()
    assert "Skipped" not in err


def test_errors_exit_2_and_help_names_diagnose(store, capsys, tmp_path):
    args = ("--tracking-uri", store["uri"], "--output-dir", str(tmp_path))
    code, out, err = run_main(capsys, *args, "--experiment", "nope", "--diagnose")
    assert code == 2 and out == ""
    assert err.startswith("accelexp-report: error: MLflow experiment 'nope' does not exist")
    shown = build_parser().format_help()  # what `--help` prints
    assert "--diagnose" in shown
    assert "where each run's step time went" in " ".join(shown.split())


def test_the_installed_command(store, tmp_path):
    """`python -m accelexp.report` as its own process (what it prints for `--help` is its parser's
    help, read in-process above)."""
    command = [sys.executable, "-m", "accelexp.report"]
    args = ["--tracking-uri", store["uri"], "--sweep", store["sweep"], "--diagnose"]
    done = subprocess.run(
        [*command, *args, "--output-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert max(map(len, done.stdout.splitlines())) <= 100
    assert (tmp_path / TIME_PLOT).stat().st_size > 0
