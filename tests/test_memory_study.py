"""The memory-vs-speed study: it composes, a real tiny sweep of it lands in MLflow, the report's
memory table, its levers (memory saved against speed lost) and plot read it back, and the
largest-batch search (a CPU says why it has none; the search itself on a CUDA GPU only)."""

from __future__ import annotations

import csv
import io
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import (
    CONF_DIR,
    TINY_VIT,
    built_once,
    compose_config,
    new_store,
    output_of,
    run_here,
    store_uri,
)
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from omegaconf import OmegaConf

from accelexp.config import register_configs, typed
from accelexp.config.validate import validate
from accelexp.diagnosis.max_batch import Trial, after_training, not_searched_on, search
from accelexp.parallel import connect
from accelexp.record import OVERRIDES, STEP_PEAK_MB
from accelexp.report.cli import main as report_main
from accelexp.report.memory import (
    LEVERS_CSV,
    LEVERS_HEADING,
    MEMORY_PLOT,
    MemoryRow,
    levers,
    memory_rows,
    memory_vs_speed_figure,
)
from accelexp.tracking import Tracker, query
from accelexp.tracking.query import RunRecord

STUDY = CONF_DIR / "experiment" / "memory_vs_speed.yaml"
CPU_TAG = "not searched: needs a CUDA GPU (device cpu)"


AC = "speed.activation_checkpointing"


def study_jobs() -> list[tuple[str, str, str]]:
    grid = OmegaConf.load(STUDY).hydra.sweeper.params
    return [
        (m, p, ac)
        for m in grid.model.split(",")
        for p in grid.parallelism.split(",")
        for ac in grid[AC].split(",")
    ]


def test_the_study_sweeps_four_strategies_over_two_models_with_and_without_checkpointing():
    jobs = study_jobs()
    assert {p for _, p, _ in jobs} == {"ddp", "fsdp", "model", "hybrid"}
    assert {m for m, _, _ in jobs} == {"vit_tiny", "resnet50"}  # both have blocks to checkpoint
    assert {ac for _, _, ac in jobs} == {"none", "full"}


@pytest.mark.parametrize(("model", "parallelism", "checkpointing"), study_jobs())
def test_each_job_of_the_study_composes_and_validates(
    model: str, parallelism: str, checkpointing: str
) -> None:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = ["+experiment=memory_vs_speed", f"model={model}", f"parallelism={parallelism}"]
        cfg = compose("config", overrides=[*overrides, f"{AC}={checkpointing}"])
    validate(cfg)
    assert cfg.model.name == model and cfg.parallelism.name == parallelism
    assert cfg.speed.activation_checkpointing == checkpointing
    assert cfg.mlflow.experiment == "memory_vs_speed"
    assert cfg.max_batch.search is True
    assert cfg.optimizer.name == "adamw"


@pytest.fixture(scope="session")
def study_sweep(tmp_path_factory: pytest.TempPathFactory, mlflow_template_db: Path):
    """Two jobs of the study for real (simple_cnn: seconds): ddp on 2 workers, model on 1;
    without checkpointing (simple_cnn has no blocks to checkpoint). Once per session."""
    return study(tmp_path_factory, mlflow_template_db, "memory", "model=simple_cnn",
                 "parallelism=ddp,model", f"{AC}=none")  # fmt: skip


@pytest.fixture(scope="session")
def checkpointing_sweep(tmp_path_factory: pytest.TempPathFactory, mlflow_template_db: Path):
    """The study's checkpointing axis for real, on its cheapest strategy (model: one process):
    a ViT of 2 tiny blocks with and without activation checkpointing. Once per session."""
    return study(tmp_path_factory, mlflow_template_db, "checkpointing", *TINY_VIT,
                 "parallelism=model")  # fmt: skip


def study(tmp_path_factory, template: Path, name: str, *overrides: str) -> str:
    """The tracking URI of the memory study swept over `overrides`, in this process, once
    per test session whichever xdist workers ask (`conftest.built_once`)."""

    def sweep(tmp: Path):
        uri = new_store(tmp, template)
        return run_here(
            None, "-m", "+experiment=memory_vs_speed", *overrides, "progress=false",
            f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp / 'sweep'}",
        )  # fmt: skip

    tmp, result = built_once(tmp_path_factory, name, sweep)
    assert result.returncode == 0, output_of(result)
    return store_uri(tmp)


def test_a_cpu_run_says_why_it_has_no_max_batch(study_sweep) -> None:
    uri = study_sweep
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


def memory_report(uri: str, out: Path) -> str:
    """`accelexp-report --memory --format csv`'s stdout."""
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        code = report_main(
            ["--experiment", "memory_vs_speed", "--memory", "--tracking-uri", uri,
             "--output-dir", str(out), "--format", "csv"]
        )  # fmt: skip
    assert code == 0
    return stdout.getvalue()


def test_the_memory_report_reads_the_sweep_back(study_sweep, tmp_path) -> None:
    uri = study_sweep
    out = tmp_path / "report"
    stdout = memory_report(uri, out)
    table = list(csv.DictReader(io.StringIO(stdout)))
    assert [(r["parallelism"], r["world_size"], r["checkpointing"]) for r in table] == [
        ("ddp", "2", "none"), ("model", "1", "none"),
    ]  # fmt: skip
    assert (out / "memory.csv").read_text() == stdout  # no lever pulled: no lever table
    assert not (out / LEVERS_CSV).exists()
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


@pytest.mark.parametrize("sweep", ["study_sweep", "checkpointing_sweep"])
def test_the_forecast_before_launch_is_the_step_peak_measured_after(sweep, request) -> None:
    """`estimate=true` (accelexp.forecast, fake tensors) of each real job's configuration is
    within 15 % of the step peak its run measured: DDP on 2 workers, stages, a checkpointed ViT."""
    from accelexp.forecast import forecast

    uri = request.getfixturevalue(sweep)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("memory_vs_speed").experiment_id])
    children = [run for run in runs if STEP_PEAK_MB in run.data.metrics]
    assert len(children) == 2
    for run in children:
        overrides = shlex.split(run.data.tags[OVERRIDES])  # the job's, as it was composed
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        measured = run.data.metrics[STEP_PEAK_MB]
        assert forecast(cfg).peak_mb == pytest.approx(measured, rel=0.15), overrides


def test_checkpointing_is_a_column_and_a_lever_of_the_memory_report(
    checkpointing_sweep, tmp_path
) -> None:
    """Each run's checkpointing in the table and the plot's legend; the lever table weighs the
    checkpointed run against the same run without it, with the memory table's own figures:
    it saves memory (the blocks' activations are not kept)."""
    uri = checkpointing_sweep
    out = tmp_path / "report"
    runs_csv, levers_csv = memory_report(uri, out).split("\n\n")  # levers after a blank line
    assert [r["checkpointing"] for r in csv.DictReader(io.StringIO(runs_csv))] == ["none", "full"]
    assert (out / "memory.csv").read_text() == runs_csv + "\n"
    assert (out / LEVERS_CSV).read_text() == levers_csv
    markdown = (out / "memory.md").read_text()
    assert "| AC |" in markdown.splitlines()[0]  # activation checkpointing
    assert LEVERS_HEADING in markdown and "| ac:full vs none |" in markdown

    records = query.experiment_runs(uri, query.experiment_id(uri, "memory_vs_speed"))
    without, with_it = memory_rows(records)
    (lever,) = levers(records)
    assert (lever.lever, lever.parallelism, lever.note) == ("ac:full vs none", "model", "")
    assert (lever.run_name, lever.baseline_run) == (with_it.run_name, without.run_name)
    assert lever.memory == "step peak"
    assert (lever.memory_mb, lever.baseline_memory_mb) == (
        with_it.step_peak_mb, without.step_peak_mb
    )  # fmt: skip
    assert lever.memory_change == pytest.approx(with_it.step_peak_mb / without.step_peak_mb - 1)
    assert lever.memory_change < 0
    speeds = (with_it.samples_per_s_per_device, without.samples_per_s_per_device)
    assert (lever.samples_per_s_per_device, lever.baseline_samples_per_s_per_device) == speeds
    assert lever.speed_change == pytest.approx(speeds[0] / speeds[1] - 1)
    assert dict(next(csv.DictReader(io.StringIO(levers_csv))))["memory_change"] == str(
        lever.memory_change
    )  # fmt: skip

    legend = memory_vs_speed_figure([without, with_it]).legends[0]
    assert legend.get_title().get_text() == "parallelism, checkpointing"
    assert [t.get_text() for t in legend.get_texts()] == ["model ac:none", "model ac:full"]


def lever_record(name: str, parallelism: str, peak: float, samples: float, start: int,
                 **params: str) -> RunRecord:  # fmt: skip
    """A finished run of the study as the report reads it: its speed, its step peak."""
    tags = {"model": "vit_tiny", "parallelism": parallelism, "precision": "fp32",
            "world_size": "2", "data": "synthetic"}  # fmt: skip
    settings = {"data.batch_size": "16", "parallelism.sync": parallelism, AC: "none"}
    settings |= params
    tags["activation_checkpointing"] = settings[AC]
    return RunRecord(
        run_id=name, name=name, status="FINISHED", start_time=start, tags=tags, params=settings,
        metrics={"timed_steps": 11.0, "throughput": samples, "step_peak_mb": peak,
                 "state_mem_mb": 10.0},
        histories={"samples_per_s": [(1, samples)], "peak_mem_mb": [(1, 1000.0)]},
    )  # fmt: skip


def test_each_lever_is_weighed_against_the_same_run_without_it() -> None:
    """fsdp against ddp, checkpointing against none, cpu_offload against fsdp's shards on the
    device: like for like only, the newest of several; a lever with no run alike says why."""
    records = [
        lever_record("ddp", "ddp", 60.0, 300.0, 1),
        lever_record("ddp-older", "ddp", 99.0, 999.0, 0),
        lever_record("fsdp", "fsdp", 40.0, 200.0, 2, **{"parallelism.cpu_offload": "False"}),
        lever_record("fsdp-offload", "fsdp", 30.0, 50.0, 3, **{"parallelism.cpu_offload": "True"}),
        lever_record("ddp-ac", "ddp", 45.0, 240.0, 4, **{AC: "full"}),
        lever_record("fsdp-b32", "fsdp", 70.0, 350.0, 5, **{"data.batch_size": "32"}),
    ]
    found = {(lever.lever, lever.run_name): lever for lever in levers(records)}
    assert list(found) == [
        ("fsdp vs ddp", "fsdp"), ("fsdp vs ddp", "fsdp-b32"), ("ac:full vs none", "ddp-ac"),
        ("cpu_offload vs none", "fsdp-offload"),
    ]  # fmt: skip
    fsdp = found["fsdp vs ddp", "fsdp"]
    assert fsdp.baseline_run == "ddp"  # the newest ddp run alike
    assert fsdp.memory_change == pytest.approx(40 / 60 - 1)
    assert fsdp.speed_change == pytest.approx(200 / 300 - 1)
    checkpointed = found["ac:full vs none", "ddp-ac"]
    assert checkpointed.baseline_run == "ddp"
    assert checkpointed.memory_change == pytest.approx(45 / 60 - 1)
    assert checkpointed.speed_change == pytest.approx(240 / 300 - 1)
    offload = found["cpu_offload vs none", "fsdp-offload"]
    assert offload.baseline_run == "fsdp"  # not fsdp-b32: another batch
    assert offload.memory_change == pytest.approx(30 / 40 - 1)
    other_batch = found["fsdp vs ddp", "fsdp-b32"]
    assert other_batch.memory_change is None and other_batch.baseline_run == ""
    assert other_batch.note.startswith("no like-for-like run without it: nearest (ddp) differs in")
    assert "data.batch_size (32 vs 16)" in other_batch.note


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
    strategy = connect(typed(compose_config(tracking_uri, "device=cpu")))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = Tracker(cfg.mlflow, enabled=False)
    trial = Trial(model, optimizer, strategy, (4,), 2)
    assert after_training(cfg, trial, tracker) is None
    found = search(trial, start=8, limit=1024)
    assert found == not_searched_on(torch.device("cpu"))
    assert found.batch_size is None and found.how == CPU_TAG


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the search runs on a CUDA GPU")
def test_on_a_gpu_the_batch_doubles_until_it_runs_out_of_memory(tracking_uri: str) -> None:
    strategy = connect(typed(compose_config(tracking_uri, "device=cuda", "precision=amp")))
    sample = (3, 224, 224)  # 0.6 MB an image: the inputs alone fill any GPU within 20 doublings
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 224 * 224, 10)).to(strategy.device)
    optimizer = torch.optim.AdamW(model.parameters())

    trial = Trial(model, optimizer, strategy, sample, 10)
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
