"""The memory-vs-speed study: it composes, a real tiny sweep of it lands in MLflow, the report's
memory table and plot read it back, and the largest-batch search (a CPU says why it has none; the
search itself on a CUDA GPU only)."""

from __future__ import annotations

import csv
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import CONF_DIR, compose_config, output_of, run_here
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from omegaconf import OmegaConf

from accelexp.config import register_configs
from accelexp.config.validate import validate
from accelexp.diagnosis.max_batch import Trial, after_training, not_searched_on, search
from accelexp.parallel import connect
from accelexp.report.cli import main as report_main
from accelexp.report.memory import (
    MEMORY_PLOT,
    MemoryRow,
    memory_rows,
    memory_vs_speed_figure,
)
from accelexp.tracking import Tracker, query

STUDY = CONF_DIR / "experiment" / "memory_vs_speed.yaml"
CPU_TAG = "not searched: needs a CUDA GPU (device cpu)"


def study_jobs() -> list[tuple[str, str]]:
    grid = OmegaConf.load(STUDY).hydra.sweeper.params
    return [(m, p) for m in grid.model.split(",") for p in grid.parallelism.split(",")]


def test_the_study_sweeps_four_strategies_over_two_models() -> None:
    jobs = study_jobs()
    assert {p for _, p in jobs} == {"ddp", "fsdp", "model", "hybrid"}
    assert {m for m, _ in jobs} == {"vit_tiny", "resnet50"}


@pytest.mark.parametrize(("model", "parallelism"), study_jobs())
def test_each_job_of_the_study_composes_and_validates(model: str, parallelism: str) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = ["+experiment=memory_vs_speed", f"model={model}", f"parallelism={parallelism}"]
        cfg = compose("config", overrides=overrides)
    validate(cfg)
    assert cfg.model.name == model and cfg.parallelism.name == parallelism
    assert cfg.mlflow.experiment == "memory_vs_speed"
    assert cfg.max_batch.search is True
    assert cfg.optimizer.name == "adamw"


@pytest.fixture(scope="module")
def study_sweep(tmp_path_factory: pytest.TempPathFactory, mlflow_template_db: Path):
    """Two jobs of the study for real (simple_cnn: seconds): ddp on 2 workers, model on 1."""
    from conftest import new_store

    tmp = tmp_path_factory.mktemp("memory")
    uri = new_store(tmp, mlflow_template_db)
    result = run_here(
        None, "-m", "+experiment=memory_vs_speed", "model=simple_cnn", "parallelism=ddp,model",
        "progress=false", f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp / 'sweep'}",
    )  # fmt: skip
    assert result.returncode == 0, output_of(result)
    return tmp, uri


def test_a_cpu_run_says_why_it_has_no_max_batch(study_sweep) -> None:
    _, uri = study_sweep
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("memory_vs_speed")
    runs = client.search_runs([experiment.experiment_id])
    runs = [run for run in runs if run.data.tags.get("accelexp.sweep") != "true"]  # the jobs
    assert len(runs) == 2
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["max_batch"] == CPU_TAG
        assert "max_batch" not in run.data.metrics
        assert run.data.metrics["peak_mem_mb"] > 0
        # what a CPU gives instead: the step's peak of live tensors, by kind
        metrics = run.data.metrics
        kinds = [v for k, v in metrics.items() if k.startswith("step_peak_")]
        kinds.remove(metrics["step_peak_mb"])
        assert metrics["step_peak_param_mb"] > 0 and metrics["step_peak_act_mb"] > 0
        assert sum(kinds) == pytest.approx(metrics["step_peak_mb"], rel=1e-3)


def test_the_memory_report_reads_the_sweep_back(study_sweep) -> None:
    tmp, uri = study_sweep
    out = tmp / "report"
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        code = report_main(
            ["--experiment", "memory_vs_speed", "--memory", "--tracking-uri", uri,
             "--output-dir", str(out), "--format", "csv"]
        )  # fmt: skip
    assert code == 0
    table = list(csv.DictReader(io.StringIO(stdout.getvalue())))
    assert [(r["parallelism"], r["world_size"]) for r in table] == [("ddp", "2"), ("model", "1")]
    assert (out / "memory.csv").read_text() == stdout.getvalue()
    assert (out / MEMORY_PLOT).read_bytes().startswith(b"\x89PNG")
    assert "—" in (out / "memory.md").read_text()  # the max batch, not searched on a CPU

    rows = memory_rows(query.experiment_runs(uri, query.experiment_id(uri, "memory_vs_speed")))
    for row in rows:
        assert row.samples_per_s > 0 and row.peak_mem_mb > 0
        assert row.samples_per_s_per_device == pytest.approx(row.samples_per_s / row.num_devices)
        assert row.max_batch is None and CPU_TAG in row.note
        assert row.step_peak_mb > 0
    model_parallel = next(row for row in rows if row.parallelism == "model")
    assert model_parallel.num_devices == 1  # its two stages share the one CPU

    figure = memory_vs_speed_figure(rows)
    (axes,) = figure.axes
    assert axes.get_xlim()[0] == 0 and axes.get_ylim()[0] == 0
    assert axes.get_xlabel() == "peak tensor memory of a step per device (MiB)"
    assert axes.get_title() == "simple_cnn"
    assert "synthetic" in figure._suptitle.get_text() and "cpu" in figure._suptitle.get_text()
    legend = figure.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["ddp", "model"]


def fake_row(model: str, parallelism: str, samples: float | None, peak: float) -> MemoryRow:
    return MemoryRow(
        run_name=f"{model}-{parallelism}", run_id=f"{model}{parallelism}", status="FINISHED",
        model=model, parallelism=parallelism, world_size=2, num_devices=2, precision="fp32",
        data="synthetic", device="NVIDIA H200", samples_per_s=samples, peak_mem_mb=peak,
    )  # fmt: skip


def test_the_plot_has_a_panel_per_model_and_a_style_per_parallelism() -> None:
    rows = [
        fake_row("vit_tiny", "ddp", 900.0, 3000.0),
        fake_row("vit_tiny", "fsdp", 800.0, 1800.0),
        fake_row("resnet50", "ddp", 400.0, 9000.0),
        fake_row("resnet50", "fsdp", 380.0, 6000.0),
        fake_row("resnet50", "hybrid", None, 5000.0),  # no throughput: not plotted
    ]
    figure = memory_vs_speed_figure(rows)
    panels = figure.axes
    assert [a.get_title() for a in panels] == ["vit_tiny", "resnet50"]
    styles = {}
    for axes in panels:
        assert axes.get_xlim()[0] == 0 and axes.get_ylim()[0] == 0
        for line in axes.get_lines():
            style = (line.get_color(), line.get_marker())
            assert styles.setdefault(line.get_label(), style) == style  # same in every panel
    assert set(styles) == {"ddp", "fsdp"} and len(set(styles.values())) == 2
    assert "NVIDIA H200" in figure._suptitle.get_text()
    assert memory_vs_speed_figure(rows[-1:]) is None


def test_no_search_is_asked_by_default_and_a_cpu_never_searches(tracking_uri: str) -> None:
    cfg = compose_config(tracking_uri)
    assert cfg.max_batch.search is False
    strategy, precision = connect(compose_config(tracking_uri, "device=cpu"))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = Tracker(cfg.mlflow, enabled=False)
    trial = Trial(model, optimizer, precision, strategy, (4,), 2)
    assert after_training(cfg, trial, tracker) is None
    found = search(trial, start=8, limit=1024)
    assert found == not_searched_on(torch.device("cpu"))
    assert found.batch_size is None and found.how == CPU_TAG


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the search runs on a CUDA GPU")
def test_on_a_gpu_the_batch_doubles_until_it_runs_out_of_memory(tracking_uri: str) -> None:
    strategy, precision = connect(compose_config(tracking_uri, "device=cuda", "precision=amp"))
    sample = (3, 224, 224)  # 0.6 MB an image: the inputs alone fill any GPU within 20 doublings
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 224 * 224, 10)).to(strategy.device)
    optimizer = torch.optim.AdamW(model.parameters())

    trial = Trial(model, optimizer, precision, strategy, sample, 10)
    capped = search(trial, start=64, limit=256)
    assert capped.batch_size == 256 and "stopped at max_batch.limit=256" in capped.how

    found = search(trial, start=1024, limit=2**30)
    assert found.batch_size is not None and found.batch_size >= 1024
    assert f"{found.batch_size * 2} ran out of memory" in found.how
    assert torch.cuda.memory_allocated(strategy.device) < 2**30  # freed after the last trial


def test_the_report_offers_memory_instead_of_the_comparison_or_the_diagnosis(capsys) -> None:
    from accelexp.report.cli import build_parser

    assert "--memory" in build_parser().format_help()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--experiment", "x", "--memory", "--diagnose"])
    assert "not allowed with argument" in capsys.readouterr().err
