"""Model and hybrid parallelism on this machine's CPU: every stage on `cpu`, the same code path
that puts stages on GPUs. The split model must compute what the unsplit one computes; training
through it must equal training without it; two hybrid replicas must equal one process.
"""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    TINY_DATA,
    compose_config,
    only_run,
    output_of,
)
from mlflow import MlflowClient

from accelexp.config import ConfigError, typed, validate
from accelexp.launch import launch
from accelexp.models import build_model, layer_sequence
from accelexp.parallel import build_strategy
from accelexp.parallel.model import parse_devices
from accelexp.parallel.pipeline import Pipeline, balanced_split, split_layers
from accelexp.parallel.world import WorldShape
from accelexp.schema import ResNetConfig, SimpleCNNConfig

CPU = torch.device("cpu")


def model_of(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "simple_cnn":
        cfg = SimpleCNNConfig(channels=[8, 16], hidden=32, dropout=0.0)
    else:
        cfg = ResNetConfig(name=name, pretrained=False, small_input_max_size=64)
    return build_model(cfg, in_channels=3, num_classes=10, image_size=16)


def pipelined(model: nn.Module, stages: int, chunks: int, **split) -> Pipeline:
    parts, _ = split_layers(model, stages, **split)
    return Pipeline(model, parts, [CPU] * stages, chunks)


def batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=generator), torch.randint(
        0, 10, (n,), generator=generator
    )


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


# --- the split ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["simple_cnn", "resnet18", "resnet50"])
def test_the_layer_sequence_is_the_forward_pass(name):
    model = model_of(name).eval()
    x, _ = batch(4)
    layers = nn.Sequential(*(layer for _, layer in layer_sequence(model)))
    with torch.no_grad():
        torch.testing.assert_close(layers(x), model(x), rtol=0, atol=0)


def test_a_model_that_is_not_sequential_like_is_refused():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) + self.b(x)

    with pytest.raises(ConfigError, match="Branchy cannot be split into stages"):
        split_layers(Branchy(), 2)


def test_balanced_split_minimises_the_heaviest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [2]
    assert balanced_split([6, 1, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_split([1, 2, 3, 4, 5], 5) == [1, 2, 3, 4]
    # weightless layers (ReLU, pooling) are spread, not piled into one stage
    assert balanced_split([5, 0, 0, 0, 0, 5], 3) == [2, 4]
    assert [len(s) for s in _stages([0, 4, 0, 0, 4, 0, 0, 4, 0], 3)] == [3, 3, 3]


def _stages(weights, stages):
    bounds = [0, *balanced_split(weights, stages), len(weights)]
    return [weights[a:b] for a, b in itertools.pairwise(bounds)]


def test_resnet50_splits_by_parameters_into_near_equal_stages():
    model = model_of("resnet50")
    total = sum(p.numel() for p in model.parameters())
    for stages in (2, 4):
        parts, points = split_layers(model, stages)
        params = [sum(p.numel() for p in part.parameters()) for part in parts]
        assert sum(params) == total
        assert len(points) == stages - 1
        # no cut can beat the heaviest block (layer4's first, ~6M): the split reaches it or balance
        assert max(params) <= max(total / stages * 1.35, 6.1e6)


def test_compute_balance_times_each_layer_and_splits_all_of_it():
    model = model_of("resnet18")
    x, _ = batch(8)
    parts, points = split_layers(model, 3, balance="compute", example=x)
    assert len(parts) == 3 and len(points) == 2
    assert sum(len(part) for part in parts) == len(layer_sequence(model))


# --- the same numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize(("name", "stages"), [("simple_cnn", 3), ("resnet18", 2)])
def test_the_split_model_computes_the_same_outputs_and_gradients(name, stages, chunks):
    model = model_of(name)
    reference = copy.deepcopy(model)
    pipeline = pipelined(model, stages, chunks)
    x, y = batch()
    # chunks > 1 and BatchNorm in training: each micro-batch is normalised on its own (GPipe),
    # so there the reference is the unsplit model applied micro-batch by micro-batch
    per_micro_batch = chunks > 1 and any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    expected = (
        torch.cat([reference(part) for part in x.tensor_split(chunks)])
        if per_micro_batch
        else reference(x)
    )
    out = pipeline(x)
    torch.testing.assert_close(out, expected)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(expected, y).backward()
    for (key, got), want in zip(grads(model).items(), grads(reference).values(), strict=True):
        torch.testing.assert_close(got, want, msg=key)
    for (key, got), want in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, msg=key)  # BatchNorm's running statistics too


def test_with_batchnorm_in_eval_mode_any_chunks_give_the_unsplit_outputs_and_gradients():
    model = model_of("resnet18").eval()
    reference = copy.deepcopy(model)
    pipeline = pipelined(model, 4, chunks=4).eval()
    x, y = batch()
    out, expected = pipeline(x), reference(x)
    torch.testing.assert_close(out, expected)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(expected, y).backward()
    for (key, got), want in zip(grads(model).items(), grads(reference).values(), strict=True):
        torch.testing.assert_close(got, want, msg=key)


def test_a_short_last_batch_runs_in_as_many_micro_batches_as_it_has_samples():
    model = model_of("simple_cnn").eval()
    x, _ = batch(3)
    with torch.no_grad():
        torch.testing.assert_close(pipelined(copy.deepcopy(model), 2, 8)(x), model(x))


# --- what is logged ------------------------------------------------------------------------


def test_stage_parameters_and_peak_memory_are_logged(tmp_path, tracking_uri):
    cfg = compose_config(
        tracking_uri,
        "model=resnet18",
        "parallelism=model",
        "parallelism.stages=3",
        "parallelism.chunks=2",
        "epochs=2",  # a peak per epoch
        "max_steps_per_epoch=1",  # a step holds each stage's weights, gradients, activations
        "data.num_test=32",
    )
    launch(cfg, tmp_path / "out")
    run = only_run(tracking_uri)
    params, metrics = run.data.params, run.data.metrics
    stage_params = [int(params[f"stage{k}_params"]) for k in range(3)]
    assert sum(stage_params) == int(params["num_params"])
    assert all(n > 0 for n in stage_params)
    assert [params[f"stage{k}_device"] for k in range(3)] == ["cpu"] * 3
    assert params["stage0_layers"].startswith("conv1..") and params["stage2_layers"].endswith("fc")
    assert len(json.loads(params["split_points"])) == 2
    assert params["world_size"] == params["replicas"] == params["devices_per_replica"] == "1"
    assert run.info.run_name == "resnet18-model-s3c2-fp32"
    client = MlflowClient(tracking_uri)
    for k in range(3):
        history = client.get_metric_history(run.info.run_id, f"stage{k}_peak_mem_mb")
        assert [m.step for m in history] == [1, 2]
        # at least the stage's parameters and their gradients (fp32: 8 bytes per parameter)
        assert all(m.value >= stage_params[k] * 8 / 2**20 for m in history)
    # the first stage holds the largest activations of resnet18 (full resolution, 64 channels)
    assert metrics["stage0_peak_mem_mb"] > stage_params[0] * 8 / 2**20 + 0.5


def test_every_precision_trains_through_the_stages(tmp_path, tracking_uri):
    cfg = compose_config(
        tracking_uri,
        "parallelism=model",
        "parallelism.chunks=2",
        "precision=amp",  # bf16 autocast on a CPU (fp16 + GradScaler on CUDA: gpu_check.py)
        "epochs=2",
    )
    metrics = launch(cfg, tmp_path / "out")
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_with_one_gradscaler_over_stages_on_cuda(tmp_path, tracking_uri):
    cfg = compose_config(
        tracking_uri,
        "parallelism=model",
        "parallelism.devices=[cuda:0,cuda:0]",
        "parallelism.chunks=2",
        "precision=amp",
        "epochs=2",
    )
    metrics = launch(cfg, tmp_path / "out")
    assert all(math.isfinite(v) for v in metrics.values())
    run = only_run(tracking_uri)
    assert run.data.params["stage1_device"] == "cuda:0"
    assert run.data.metrics["grad_scale"] > 0


# --- hybrid: replicas of a split model -------------------------------------------------------


def test_one_hybrid_replica_trains_in_this_process(tmp_path, tracking_uri):
    cfg = compose_config(tracking_uri, "parallelism=hybrid", "parallelism.nprocs=1")
    metrics = launch(cfg, tmp_path / "out")
    assert 0 <= metrics["test_acc"] <= 1
    run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    assert (run.data.params["replicas"], run.data.params["stages"]) == ("1", "2")


def test_the_world_shape_drives_the_sampler_the_lr_and_the_device_count(compose_cfg):
    strategy = build_strategy(
        typed(compose_cfg("parallelism=hybrid", "parallelism.lr_scaling=linear"))
    )
    strategy.shape = WorldShape(replicas=2, devices_per_replica=2, rank=1)
    assert strategy.shape.world_size == 4  # devices: the per-device figures divide by it
    assert strategy.scale_lr(0.1) == pytest.approx(0.2)  # 2 replicas' batches per step
    assert len(strategy.train_sampler(100, seed=0)) == 50  # sharded over replicas, not devices
    assert list(strategy.eval_sampler(6)) == [1, 3, 5]


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("parallelism.stages=3", "parallelism.split_points=[5,3]"),
            "parallelism.split_points=[5, 3] is not allowed: expected null or strictly increasing",
        ),
        (
            ("parallelism.stages=3", "parallelism.split_points=[4]"),
            "gives 2 stages, but parallelism.stages=3",
        ),
        (
            ("data.batch_size=100", "parallelism.chunks=8"),
            "parallelism.chunks=8 does not cut data.batch_size=100 into equal micro-batches",
        ),
        (("data.batch_size=4", "parallelism.chunks=8"), "use chunks in [1, 2, 4]"),
        (("parallelism.balance=flops",), "parallelism.balance='flops' is not allowed"),
    ],
)
def test_bad_pipeline_settings_are_refused_before_anything_runs(compose_cfg, overrides, message):
    cfg = compose_cfg("parallelism=model", *overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("stages", "split_points", "message"),
    [
        (12, None, "parallelism.stages=12, but SimpleCNN has only 11 layers to split (0:0, 1:1,"),
        (2, [11], "parallelism.split_points=[11] must be 1 layer indices in 1..10"),
        (3, [0, 4], "must be 2 layer indices in 1..10"),
    ],
)
def test_splits_the_model_cannot_have_are_refused(stages, split_points, message):
    with pytest.raises(ConfigError) as error:
        split_layers(model_of("simple_cnn"), stages, split_points)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        (["cuda:99"], "asks for cuda:99, but this machine has"),
        (["banana"], "'banana', which is not a device name"),
        (["meta"], "only cpu and cuda:N devices are supported"),
    ],
)
def test_devices_that_do_not_exist_are_refused(devices, message):
    with pytest.raises(ConfigError, match=message):
        parse_devices(devices)


def test_more_devices_than_stages_is_refused(compose_cfg):
    cfg = compose_cfg("parallelism=model", "parallelism.devices=[cpu,cpu,cpu]")
    with pytest.raises(ConfigError, match=r"lists 3 devices for parallelism\.stages=2"):
        build_strategy(typed(cfg)).setup()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("parallelism.stages=20",), "parallelism.stages=20, but SimpleCNN has only 11 layers"),
        (("parallelism.devices=[cuda:99]",), "parallelism.devices asks for cuda:99, but this"),
        (("parallelism.nprocs=2",), "parallelism=model runs in one process"),
    ],
)
def test_run_py_says_what_is_wrong_and_exits_2_before_training(
    overrides, message, tmp_path, cli, tracking_uri
):
    uri = tracking_uri
    result = cli(
        "parallelism=model",
        *overrides,
        "data=synthetic",
        *TINY_DATA,
        "progress=false",
        f"mlflow.tracking_uri={uri}",
        tmp_path=tmp_path,
    )
    assert result.returncode == 2, output_of(result)
    assert message in output_of(result)
    assert "epoch 1" not in output_of(result)
    assert "Traceback" not in output_of(result)
