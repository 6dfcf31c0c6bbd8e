"""The GPU machine's scripts, tested on a CPU: the parity benchmark, gpu_check, the session.

`benchmarks/gpu_parity.py --cpu --tiny` runs both sides for real (subprocesses, MLflow store) in
one precision, amp (on a CPU amp is bf16 autocast, as bf16 is; fp32 is the same loop without the
autocast: neither adds a path), and its printed table is checked against its own numbers; the
AMP gain table's arithmetic is checked on given figures. `scripts/gpu_check.py --cpu` runs its
jobs at toy size (16 px, 2 steps of 16 images); the slow test runs only the checks whose code is
in its `main` (6, dp, which no other test trains; 10, fsdp with amp and the search; 11, the
CUDA-only skip). Both `main`s run in this process, their jobs as processes (gpu_parity's start
as a process is the session's dry run's; gpu_check's `__main__` is `sys.exit(main())`).
Checks 1, 8 and 9 are functions, called directly by fast tests, including with a broken
component to see that they fail when they should. 2-5 and 7 run through the script on a GPU
only: what they train here (model and hybrid parallelism, the switches with compile) is
test_pipeline's, test_contract's and test_speed's runs.
`scripts/gpu_session.sh` is checked for syntax and by its dry run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import compose_config, new_store

from accelexp.config import validate
from accelexp.data import BatchLoader
from accelexp.precision.runtime import Precision
from accelexp.speed import set_tf32, tf32_enabled

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """A script of the repo imported as a module (scripts/ and benchmarks/ are no packages)."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


parity = load_script("benchmarks/gpu_parity.py")
gpu_check = load_script("scripts/gpu_check.py")


def markdown_table(text: str, first_header: str) -> list[dict[str, str]]:
    """The rows of the markdown table whose header row starts with `| first_header |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    names = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True)))
    return rows


def shown(*values: float) -> float:
    """The relative error of a quotient of these figures as printed (one decimal each)."""
    return sum(0.05 / value for value in values)


def markdown_table_amp(text: str) -> dict[str, str]:
    """The AMP gain table's single row; its two `diff` columns named diff and diff_bf16."""
    section = text[text.index("## AMP gain") :]
    header = next(line for line in section.splitlines() if line.startswith("| shape |"))
    names = [cell.strip() for cell in header.strip("|").split("|")]
    names[names.index("diff", names.index("diff") + 1)] = "diff_bf16"
    row = section.splitlines()[section.splitlines().index(header) + 2]
    return dict(zip(names, (c.strip() for c in row.strip("|").split("|")), strict=True))


@pytest.fixture
def runs_folder(monkeypatch, tmp_path, mlflow_template_db) -> Path:
    """The folder a script makes for its runs (`tempfile.mkdtemp(prefix="accelexp-gpu-...")`),
    made here with a copy of the migrated MLflow store in it: its run.py jobs skip MLflow's
    schema migrations (seconds). Other temporary folders are made as usual."""
    folder = tmp_path / "runs"
    made = tempfile.mkdtemp

    def mkdtemp(suffix=None, prefix=None, dir=None):
        if prefix is not None and prefix.startswith("accelexp-gpu-"):
            new_store(folder, mlflow_template_db)
            return str(folder)
        return made(suffix, prefix, dir)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return folder


# --- gpu_parity: the plan ------------------------------------------------------------------------


def test_quick_plan_measures_every_precision_twice_and_one_compiled_configuration_once():
    jobs = parity.plan_jobs(parity.parse_args([]))
    eager = [job for job in jobs if job.variant != "compile"]
    compiled = [job for job in jobs if job.variant == "compile"]
    assert {(job.shape.key, job.variant, job.precision) for job in eager} == {
        (shape, "channels_last", precision)
        for shape in ("224", "32")
        for precision in parity.PRECISIONS
    }
    assert all(job.repeats == 2 for job in eager)
    assert [(job.shape.key, job.precision, job.repeats) for job in compiled] == [("32", "bf16", 1)]
    assert compiled[0].compile_mode == "reduce-overhead"
    order = parity.schedule(jobs)
    # every configuration once, the compiled one last of that round, then the second repeats
    assert [job.name for _, job in order[:7]] == [job.name for job in jobs]
    assert order[6][1].variant == "compile" and len(order) == 13


def test_dry_run_total_is_the_sum_of_the_runs_it_lists(capsys):
    assert parity.main(["--plan", "quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    runs = re.findall(r"#\d+: plain ~(\d+)s, accelexp ~(\d+)s", out)
    assert len(runs) == 13  # the quick plan's schedule, each line a pair
    (total,) = re.findall(r"26 subprocess runs .*, about ([\d.]+) min by the GPU estimate", out)
    listed = sum(int(plain) + int(ours) for plain, ours in runs)
    # each listed figure rounded to 1 s, the total to 0.1 min
    assert float(total) * 60 == pytest.approx(listed, abs=3 + 0.5 * 2 * len(runs))


def test_grid_flags_replace_the_plan_and_keep_every_compiled_combination():
    args = parity.parse_args(["--shapes", "224", "--variants", "eager,compile", "--repeats", "3"])
    jobs = parity.plan_jobs(args)
    assert [(job.variant, job.precision, job.repeats) for job in jobs] == [
        ("eager", "fp32", 3), ("eager", "amp", 3), ("eager", "bf16", 3),
        ("compile", "fp32", 1), ("compile", "amp", 1), ("compile", "bf16", 1),
    ]  # fmt: skip
    assert {job.compile_mode for job in jobs} == {None, "default"}
    full = parity.plan_jobs(parity.parse_args(["--plan", "full"]))
    assert len(full) == 18 and {job.repeats for job in full} == {5, 2}


def test_tiny_plan_and_bad_flags():
    jobs = parity.plan_jobs(parity.parse_args(["--cpu", "--tiny", "--steps", "2"]))
    assert {job.shape.model for job in jobs} == {"simple_cnn"}
    assert {job.variant for job in jobs} == {"eager", "channels_last"}
    assert {job.shape.steps for job in jobs} == {2}
    with pytest.raises(SystemExit, match="--variants 'fused' is not one of"):
        parity.plan_jobs(parity.parse_args(["--variants", "fused"]))
    with pytest.raises(SystemExit):
        parity.parse_args(["--epochs", "1"])


@pytest.mark.parametrize("shape", ["224", "32"])
def test_accelexp_side_is_a_valid_run_py_command_line(shape, tracking_uri):
    args = parity.parse_args(["--shapes", shape, "--variants", "compile", "--precisions", "amp"])
    (job,) = parity.plan_jobs(args)
    cfg = compose_config(tracking_uri, *parity.accelexp_overrides(job, args))
    validate(cfg)
    steps, batch = job.shape.steps, job.shape.batch_size
    assert (cfg.model.name, cfg.data.image_size, cfg.data.batch_size) == (
        "resnet50",
        int(shape),
        batch,
    )
    assert (cfg.epochs, cfg.max_steps_per_epoch, cfg.data.num_train) == (2, steps, steps * batch)
    assert cfg.data.val_fraction == 0 and cfg.scheduler.name == "none"
    assert (cfg.speed.channels_last, cfg.speed.compile) == (True, job.compile_mode)
    assert cfg.precision.name == "amp" and cfg.device == "auto"
    spec = parity.plain_spec(job, args)
    assert (spec["batch_size"], spec["steps"], spec["compile_mode"]) == (
        batch,
        steps,
        cfg.speed.compile,
    )


def test_render_marks_rows_under_goal_and_amp_gains_apart():
    args = parity.parse_args(["--cpu", "--tiny", "--variants", "eager"])
    jobs = parity.plan_jobs(args)
    figures = {"fp32": (100.0, 99.0), "amp": (200.0, 150.0), "bf16": (300.0, 297.0)}
    results = {
        job.name: {
            side: [parity.Measurement(figures[job.precision][i], [1.0, 2.0])]
            for i, side in enumerate(("plain", "accelexp"))
        }
        for job in jobs
    }
    text = parity.render(["header"], jobs, results, ["a note"])
    rows = {row["precision"]: row for row in markdown_table(text, "shape")}
    assert (rows["fp32"]["ratio"], rows["fp32"]["goal"]) == ("0.990", "ok")
    assert (rows["amp"]["ratio"], rows["amp"]["goal"]) == ("0.750", "**UNDER**")
    gain = markdown_table_amp(text)
    assert gain["plain amp/fp32"] == "2.000" and gain["accelexp amp/fp32"] == "1.515"
    assert gain["diff"].startswith("-24.2%") and "**OFF**" in gain["diff"]
    assert gain["diff_bf16"] == "+0.0%"
    assert text.rstrip().endswith("a note")


def test_deadline_skips_what_cannot_finish_and_still_writes_the_table(tmp_path):
    out = tmp_path / "parity.md"
    assert parity.main(["--cpu", "--tiny", "--deadline-s", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Skipped (deadline): 16-eager-fp32 #1" in text
    assert all(row["n"] == "0" for row in markdown_table(text, "shape"))


# --- gpu_parity: both sides, for real -------------------------------------------------------------


@pytest.mark.slow
def test_parity_cpu_tiny_measures_both_sides_and_prints_consistent_figures(
    tmp_path, capsys, runs_folder
):
    """One pair, amp: on a CPU the plain loop's autocast (bf16) and run.py's precision=amp;
    fp32 is the same loop without it. The AMP gain table's arithmetic is test_render's."""
    out = tmp_path / "parity.md"
    code = parity.main(
        ["--cpu", "--tiny", "--repeats", "1", "--variants", "eager", "--precisions", "amp",
         "--steps", "2", "--out", str(out)]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "planned: 1 configurations, 2 subprocess runs (1 plain, 1 accelexp)" in stdout
    printed = stdout[stdout.index("# GPU parity") :]
    assert printed.strip() == out.read_text().strip()
    assert not runs_folder.exists()  # the runs' store, removed after

    (row,) = markdown_table(printed, "shape")
    plain, ours = float(row["plain img/s"]), float(row["accelexp img/s"])
    assert row["precision"] == "amp" and plain > 0 and ours > 0 and row["n"] == "1", row
    ratio = ours / plain
    assert float(row["ratio"]) == pytest.approx(ratio, abs=5e-4 + ratio * shown(plain, ours))
    assert row["goal"] == ("ok" if float(row["ratio"]) >= parity.RATIO_GOAL else "**UNDER**")
    gain = markdown_table_amp(printed)  # no fp32 measured: no gain to show
    assert gain["plain amp/fp32"] == gain["diff"] == gain["plain bf16/fp32"] == "-"

    runs = markdown_table(printed, "configuration")
    assert {(row["side"], row["data"], row["failed"]) for row in runs} == {
        ("plain", "device", "0"),
        ("accelexp", "device", "0"),  # on a CPU data.on_device=auto holds the set "on the device"
    }


# --- gpu_check: the new checks --------------------------------------------------------------------


def test_true_fp32_turns_tf32_off_inside_and_restores_the_flags_exactly():
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        set_tf32(True)
        with gpu_check.true_fp32():
            assert not tf32_enabled()
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cudnn.allow_tf32 is False
        assert tf32_enabled()
        # a mixed state (PyTorch's own default: cuDNN TF32 on, matmuls IEEE) comes back as it was
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True
        with gpu_check.true_fp32():
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def test_split_check_passes_and_catches_a_pipeline_that_computes_otherwise(monkeypatch):
    cpus = [torch.device("cpu")] * 2
    detail = gpu_check.check_same_numbers(cpus, gpu_check.CPU_IMAGE_SIZE)
    assert detail.startswith("outputs and gradients equal (fp32, TF32 off) for chunks 1 and 4")

    class Skewed(gpu_check.Pipeline):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 1.01

    monkeypatch.setattr(gpu_check, "Pipeline", Skewed)
    with pytest.raises(AssertionError, match="not close"):
        gpu_check.check_same_numbers(cpus, gpu_check.CPU_IMAGE_SIZE)


def test_loader_check_passes_and_catches_paths_that_differ(monkeypatch):
    detail = gpu_check.check_loader_paths(torch.device("cpu"))
    assert detail.startswith("22 batches over 2 epochs identical: device vs host")

    host_batches = BatchLoader._host_batches

    def off_by_one(self, plan):
        for images, labels in host_batches(self, plan):
            images = images.clone()
            images[0, 0, 0, 0] += 1
            yield images, labels

    monkeypatch.setattr(BatchLoader, "_host_batches", off_by_one)
    with pytest.raises(AssertionError, match="images differ"):
        gpu_check.check_loader_paths(torch.device("cpu"))


def test_grad_scaler_check_passes_and_catches_a_step_that_ignores_the_overflow(monkeypatch):
    detail = gpu_check.check_grad_scaler_overflow(torch.device("cpu"))
    assert "step skipped (parameters unchanged), scale 1024 -> 512" in detail
    assert "GradScaler('cpu')" in detail

    def step_regardless(self, optimizer):  # unscales and updates, but never skips a step
        self.scaler.unscale_(optimizer)
        optimizer.step()
        self.scaler.update()

    monkeypatch.setattr(Precision, "step", step_regardless)
    with pytest.raises(AssertionError, match="inf gradient changed the parameters"):
        gpu_check.check_grad_scaler_overflow(torch.device("cpu"))


def test_parse_only():
    assert gpu_check.parse_only(None) is None
    assert gpu_check.parse_only("1,7, 8") == {1, 7, 8}


@pytest.mark.slow
def test_gpu_check_cpu_runs_the_checks_of_its_main(tmp_path, capsys, runs_folder):
    """The script's CPU path end to end (its flags, its run.py jobs, its JSON), for the checks
    whose code is in `main` and that no other test covers (see the module docstring). Its runs'
    folder is removed when every check passed."""
    report = tmp_path / "results.json"
    checks = "6,10,11"
    code = gpu_check.main(["--cpu", "--only", checks, "--json", str(report)])
    assert code == 0, capsys.readouterr().out
    results = json.loads(report.read_text())
    assert [name.split()[0] for name in results] == checks.split(",")
    offload = results.pop("11 fsdp, cpu_offload, bf16, vit_tiny")
    assert offload.startswith("SKIP") and "needs CUDA" in offload
    assert all(value.startswith("PASS") for value in results.values()), results
    assert "max_batch None (not searched" in results["10 fsdp, amp, largest-batch search"]
    assert not runs_folder.exists()


# --- gpu_session.sh -------------------------------------------------------------------------------


def test_session_script_parses_and_its_dry_run_lists_every_step(tmp_path):
    session = REPO / "scripts" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(session)], capture_output=True).returncode == 0
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(session)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    started = re.findall(r"START (\w+) \(timeout (\d+)s\)", result.stdout)
    names = [name for name, _ in started if name != "wheels"]  # wheels: only where .whl exists
    assert names == ["versions", "gpu_check", "lockstep_aa", "parity"]
    assert sum(int(limit) for name, limit in started if name != "parity") < 525
    assert "scripts/gpu_check.py --only 1,2,3,4,5,6,7,8,9 --json" in result.stdout
    assert "noise.py --designs shared" in result.stdout and "model=resnet50" in result.stdout
    assert "gpu_parity.py --plan quick --deadline-s" in result.stdout
    assert "planned: 7 configurations, 26 subprocess runs" in result.stdout
    assert (tmp_path / "session.log").is_file()


def test_session_ladder_plan_runs_the_ladder_and_its_report(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_session.sh")], cwd=REPO, env={**env, "PLAN": "ladder"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    started = [n for n in re.findall(r"START (\w+) \(timeout", result.stdout) if n != "wheels"]
    assert started == ["versions", "ladder", "report"]
    assert "+experiment=speedups model=resnet50 data.image_size=224" in result.stdout


def test_session_memory_plan_runs_the_fsdp_checks_and_the_memory_study(tmp_path, tracking_uri):
    session = REPO / "scripts" / "gpu_session.sh"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(session)], cwd=REPO, env={**env, "PLAN": "memory"}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    steps = dict(re.findall(r"START (\w+) \(timeout \d+s\): (.*)", result.stdout))
    steps.pop("wheels", None)  # only where .whl exists
    assert list(steps) == ["versions", "fsdp_checks", "memory_study", "memory_report"]
    assert "gpu_check.py --only 10,11" in steps["fsdp_checks"]
    # the study's command line composes into a valid config (its first job)
    study = steps["memory_study"].split(" run.py -m ", 1)[1].split()
    cfg = compose_config(tracking_uri, *(arg.split(",")[0] for arg in study))
    validate(cfg)
    assert (cfg.model.name, cfg.parallelism.name) == ("vit_b_16", "fsdp")
    assert cfg.max_batch.search and cfg.precision.name == "amp"
