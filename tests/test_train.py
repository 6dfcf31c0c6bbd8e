"""Real tiny training runs: each precision and scheduler, learning, the best checkpoint."""

from __future__ import annotations

import itertools
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import (
    compose_config,
    final_params,
    group_options,
    new_store,
    only_run,
)
from mlflow import MlflowClient
from omegaconf import OmegaConf
from torch.utils.data import SequentialSampler

from accelexp import engine
from accelexp.config import typed
from accelexp.data import BatchLoader, build_data
from accelexp.errors import AccelexpError
from accelexp.models import build_model
from accelexp.optim import build_optimizer, build_scheduler, lr_factor
from accelexp.parallel import connect
from accelexp.precision import fp8_problem
from accelexp.precision.runtime import Precision, float8_eligible
from accelexp.step import train_step
from accelexp.tracking.runs import significant
from accelexp.train import run

FINAL_KEYS = ("best_val_acc", "test_loss", "test_acc", "total_time_s")


def assert_sane_final_metrics(metrics: dict[str, float]) -> None:
    for key in FINAL_KEYS:
        assert key in metrics, f"run() did not return {key}"
        assert math.isfinite(metrics[key]), f"{key}={metrics[key]}"
    assert 0.0 <= metrics["test_acc"] <= 1.0
    assert 0.0 <= metrics["best_val_acc"] <= 1.0
    assert metrics["test_loss"] > 0.0


def lr_history(tracking_uri: str) -> list[float]:
    run_id = only_run(tracking_uri).info.run_id
    history = MlflowClient(tracking_uri=tracking_uri).get_metric_history(run_id, "lr")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


# --- precision --------------------------------------------------------------------------------


# every precision a CPU runs (fp8 needs a GPU of compute capability >= 8.9: refused here,
# tests/test_bad_input.py), and the dtype its weights are stored in
CPU_PRECISIONS = {"fp32": "float32", "amp": "float32", "bf16": "float32", "bf16_true": "bfloat16"}


def test_bf16_true_trains_bf16_weights_and_optimizer_state(compose_cfg):
    """The model the strategy wraps, its gradients and its optimizer's state are bf16 (its
    BatchNorm's fp32), the batch is cast to bf16, nothing is autocast or scaled, and a few
    steps on one batch bring its loss down."""
    cfg = compose_cfg("precision=bf16_true", "model=resnet18", "optimizer=adamw")
    strategy = connect(typed(cfg))
    precision = strategy.precision
    assert (precision.param_dtype, precision.compute_dtype) == (torch.bfloat16, torch.bfloat16)
    assert precision.autocast_dtype is None and precision.scaler is None
    assert precision.effective_name == "bf16_true"
    torch.manual_seed(0)
    model = strategy.wrap_model(build_model(typed(cfg).model, 3, 10, 16))
    optimizer = build_optimizer(typed(cfg).optimizer, model.parameters(), 1e-3)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(10, (8,))
    assert precision.cast_inputs(images).dtype == torch.bfloat16
    losses = [train_step(model, images, labels, optimizer, strategy)[0].item() for _ in range(4)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    norms = {
        id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()
    }
    assert norms
    for param in model.parameters():
        dtype = torch.float32 if id(param) in norms else torch.bfloat16
        state = optimizer.state[param]
        assert param.dtype == dtype
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == dtype
    running = [m.running_var for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(r.dtype == torch.float32 for r in running)


def test_fp8_is_refused_without_fp8_tensor_cores_and_converts_only_multiples_of_16():
    cpu, ampere = fp8_problem("cpu"), fp8_problem("cuda", [(9, 0), (8, 0)])
    assert "compute capability >= 8.9" in cpu and "no CUDA GPU" in cpu
    assert "compute capability 8.0" in ampere and "precision=bf16_true" in ampere
    assert fp8_problem("cuda", [(8, 9), (9, 0)]) == ""
    layers = (nn.Linear(32, 16), nn.Linear(20, 32), nn.Conv2d(16, 16, 1))
    assert [float8_eligible(layer) for layer in layers] == [True, False, False]
    precision = Precision("fp8", torch.device("cpu"))
    assert precision.autocast_dtype == torch.bfloat16 and precision.param_dtype == torch.float32
    with pytest.raises(AccelexpError, match=r"compute capability >= 8\.9"):
        precision.prepare_model(nn.Linear(32, 16))


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp32", None),
        ("amp", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("bf16_true", None),  # no autocast: its model and inputs are bf16 themselves
    ],
)
def test_precision_autocasts_the_forward_pass_on_cpu(name, dtype):
    precision = Precision(name, torch.device("cpu"))
    layer = torch.nn.Linear(4, 3)
    with precision.autocast():
        out = layer(torch.randn(2, 4))
    assert out.dtype == (dtype or torch.float32)
    assert precision.scaler is None  # no GradScaler on a CPU: bf16 needs no loss scaling
    assert precision.grad_scale() is None


# --- schedulers -------------------------------------------------------------------------------

BASE_LR = 0.1  # conf/optimizer/sgd.yaml
STEPS = 3  # max_steps_per_epoch of the tiny runs


def onecycle_lr(step: int, total: int, pct_start=0.3, div=25.0, final_div=1e4) -> float:
    """torch's OneCycleLR with cosine annealing, written out."""
    initial, peak = BASE_LR / div, BASE_LR
    floor = initial / final_div
    rise_end = pct_start * total - 1
    if step <= rise_end:
        start, end, pct = initial, peak, step / rise_end
    else:
        start, end, pct = peak, floor, (step - rise_end) / (total - 1 - rise_end)
    return end + (start - end) / 2 * (1 + math.cos(math.pi * pct))


# The lr at the start of each of 3 epochs of 3 steps (the `lr` metric logged per epoch).
EXPECTED_EPOCH_LRS = {
    "none": [BASE_LR] * 3,
    "cosine": [BASE_LR * 0.5 * (1 + math.cos(math.pi * s / 9)) for s in (0, 3, 6)],
    "steplr": [BASE_LR, BASE_LR * 0.5, BASE_LR * 0.25],
    "onecycle": [onecycle_lr(s, 9) for s in (0, 3, 6)],
}


# Each run checks one precision a CPU runs and one scheduler: as many runs as the longer list,
# the shorter one taken round again, so every precision and every scheduler is covered.
PRECISIONS, SCHEDULERS = sorted(CPU_PRECISIONS), sorted(EXPECTED_EPOCH_LRS)
RUNS = [
    (PRECISIONS[i % len(PRECISIONS)], SCHEDULERS[i % len(SCHEDULERS)])
    for i in range(max(len(PRECISIONS), len(SCHEDULERS)))
]


@pytest.mark.parametrize(("precision", "scheduler"), RUNS)
def test_each_precision_and_each_scheduler_trains_and_the_logged_lr_follows_it(
    compose_cfg, tracking_uri, tmp_path, precision, scheduler
):
    extra = ["scheduler.step_size=1", "scheduler.gamma=0.5"] if scheduler == "steplr" else []
    cfg = compose_cfg(f"precision={precision}", f"scheduler={scheduler}", "epochs=3", *extra)
    metrics = run(cfg, tmp_path / "out")
    assert_sane_final_metrics(metrics)
    logged = only_run(tracking_uri).data
    assert logged.tags["precision"] == precision
    assert logged.params["param_dtype"] == CPU_PRECISIONS[precision]
    # the best weights as trained: bf16 under bf16_true
    weights = final_params(tmp_path / "out")
    assert {str(t.dtype) for t in weights.values()} == {f"torch.{CPU_PRECISIONS[precision]}"}
    assert lr_history(tracking_uri) == [significant(lr) for lr in EXPECTED_EPOCH_LRS[scheduler]]


def test_every_scheduler_option_is_covered():
    options = {o for g, o in group_options() if g == "scheduler"}
    assert options == set(EXPECTED_EPOCH_LRS), "a new scheduler needs its expected lr curve here"


def lrs_over_run(cfg, steps_per_epoch: int, epochs: int) -> list[float]:
    """The lr before the first step and after each optimizer step of a whole run."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR, momentum=0.9)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch, epochs)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps_per_epoch * epochs):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def scheduler_cfg(compose_cfg, name: str, *overrides: str):
    return typed(compose_cfg(f"scheduler={name}", *[f"scheduler.{o}" for o in overrides])).scheduler


def test_cosine_warms_up_linearly_then_decays_to_its_floor(compose_cfg):
    cfg = scheduler_cfg(
        compose_cfg, "cosine", "warmup_epochs=1", "warmup_start_factor=0.1", "min_lr_factor=0.1"
    )
    lrs = lrs_over_run(cfg, steps_per_epoch=4, epochs=3)
    assert len(lrs) == 13
    assert lrs[:5] == pytest.approx([BASE_LR * f for f in (0.1, 0.325, 0.55, 0.775, 1.0)])
    assert lrs[8] == pytest.approx(BASE_LR * 0.55)  # half way through the decay
    assert lrs[12] == pytest.approx(BASE_LR * 0.1)  # the floor at the end of the run
    decay = lrs[4:]
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_steplr_warms_up_then_steps_by_gamma(compose_cfg):
    cfg = scheduler_cfg(compose_cfg, "steplr", "warmup_epochs=1", "step_size=2", "gamma=0.5")
    lrs = lrs_over_run(cfg, steps_per_epoch=4, epochs=3)
    assert lrs[0] == pytest.approx(BASE_LR * 0.1)
    assert lrs[1:4] == sorted(lrs[1:4]) and lrs[3] < BASE_LR
    assert lrs[4:8] == pytest.approx([BASE_LR] * 4)
    assert lrs[8:] == pytest.approx([BASE_LR * 0.5] * 5)


def test_none_is_constant_after_warmup(compose_cfg):
    cfg = scheduler_cfg(compose_cfg, "none", "warmup_epochs=0.5", "warmup_start_factor=0.2")
    lrs = lrs_over_run(cfg, steps_per_epoch=4, epochs=2)
    assert lrs[:2] == pytest.approx([BASE_LR * 0.2, BASE_LR * 0.6])
    assert lrs[2:] == pytest.approx([BASE_LR] * 7)


def test_onecycle_warmup_epochs_set_where_it_peaks(compose_cfg):
    cfg = scheduler_cfg(compose_cfg, "onecycle", "warmup_epochs=1")
    lrs = lrs_over_run(cfg, steps_per_epoch=4, epochs=3)[:12]  # OneCycleLR has 12 steps
    assert lrs[0] == pytest.approx(BASE_LR / cfg.div_factor)
    peak = max(range(12), key=lrs.__getitem__)
    assert peak == 3  # 1 warmup epoch of 3: pct_start 1/3 of 12 steps
    assert lrs[peak] == pytest.approx(BASE_LR)
    assert lrs[11] == pytest.approx(BASE_LR / cfg.div_factor / cfg.final_div_factor)


def test_lr_factor_without_warmup_starts_at_one(compose_cfg):
    for name in ("cosine", "steplr", "none"):
        factor = lr_factor(scheduler_cfg(compose_cfg, name), steps_per_epoch=5, epochs=2)
        assert factor(0) == pytest.approx(1.0), name


# --- learning and the best checkpoint ---------------------------------------------------------

LEARN = (
    "data.num_train=2048",
    "data.num_test=256",
    "data.batch_size=64",
    "epochs=3",
    "max_steps_per_epoch=null",
    "optimizer=adamw",
    "optimizer.lr=0.003",
)


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory, mlflow_template_db):
    """Three full epochs on 1843 synthetic 16px images (a few seconds); shared, read-only."""
    home = tmp_path_factory.mktemp("learned")
    uri = new_store(home, mlflow_template_db)
    cfg = compose_config(uri, *LEARN)
    metrics = run(cfg, home / "out")
    return cfg, home / "out", uri, metrics


def test_training_on_synthetic_data_learns(learned_run):
    cfg, _, uri, metrics = learned_run
    chance = 1 / cfg.data.num_classes
    assert metrics["best_val_acc"] > 3 * chance
    assert metrics["test_acc"] > 3 * chance
    client = MlflowClient(tracking_uri=uri)
    run_id = only_run(uri).info.run_id
    losses = [m.value for m in sorted(client.get_metric_history(run_id, "val_loss"), key=_step)]
    assert len(losses) == 3
    assert losses[-1] < losses[0] < math.log(cfg.data.num_classes) + 0.1


def _step(metric) -> int:
    return metric.step


def test_best_checkpoint_reproduces_the_logged_test_accuracy(learned_run):
    cfg, out, uri, _ = learned_run
    checkpoint = torch.load(Path(out) / "checkpoints" / "best.pt", weights_only=True)
    data = build_data(typed(cfg).data, cfg.seed)
    model = build_model(typed(cfg).model, data.in_channels, data.num_classes, data.image_size)
    model.load_state_dict(checkpoint["model"])
    model.eval()
    loader = BatchLoader(
        data.test,
        cfg.data.eval_batch_size,
        SequentialSampler(range(len(data.test))),
        torch.device("cpu"),
        data.mean,
        data.std,
    )
    correct = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += int((model(images).argmax(1) == labels).sum())
    accuracy = correct / len(data.test)

    logged = only_run(uri).data.metrics
    assert significant(accuracy) == logged["test_acc"]
    assert accuracy > 3 / cfg.data.num_classes  # a trained model, not a fresh one
    assert significant(checkpoint["val_acc"]) == logged["best_val_acc"]
    assert 1 <= checkpoint["epoch"] <= cfg.epochs
    assert checkpoint["config"] == OmegaConf.to_container(cfg, resolve=True)


def test_a_batch_larger_than_the_training_set_is_a_clear_error(compose_cfg, tmp_path):
    """230 training images in batches of 256 with drop_last: no step at all would run."""
    cfg = compose_cfg("data.batch_size=256")
    with pytest.raises(AccelexpError, match=r"data\.batch_size"):
        run(cfg, tmp_path / "out")


# --- the console ------------------------------------------------------------------------------


def test_evaluation_shows_its_progress_in_plain_lines_when_piped(
    compose_cfg, tmp_path, monkeypatch, caplog, capsys
):
    """Not a terminal (pytest's stderr): no bar, a plain line per `LINE_EVERY_S` (0 here)."""
    monkeypatch.setattr(engine, "LINE_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="accelexp.engine"):
        run(compose_cfg("progress=true", "data.eval_batch_size=16"), tmp_path / "out")
    lines = [r.getMessage() for r in caplog.records if r.name == "accelexp.engine"]
    assert [line for line in lines if line.startswith("val: ")] == [
        "val: batch 1/2",
        "val: batch 2/2",
    ]
    assert "test: batch 8/8" in lines  # 128 test images in batches of 16
    assert "\r" not in capsys.readouterr().err
