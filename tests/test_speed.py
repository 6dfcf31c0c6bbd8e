"""Speed switches: each reaches the model, the optimizer or the backends, and is logged.

Tiny real runs through `accelexp.train.run` (and real worker processes for DDP and Horovod),
read back from their MLflow store and their checkpoint. On this CPU, TF32 and cuDNN change no
arithmetic, but their flags are still set and checked; `torch.compile` really compiles (Inductor
generates and builds C++ here), so those runs take tens of seconds.
"""

from __future__ import annotations

import math
import resource
import statistics
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import (
    TINY_DATA,
    assert_same_params,
    final_params,
    only_run,
    speed_cfg,
)
from mlflow import MlflowClient

from accelexp.checkpoint import read_whole
from accelexp.config import typed
from accelexp.engine import eager_warmup_steps
from accelexp.models import build_model
from accelexp.optim import build_optimizer
from accelexp.parallel import connect
from accelexp.speed import SpeedConfigError, SpeedSwitches, set_tf32, tf32_enabled
from accelexp.train import run

CPU = torch.device("cpu")
# compiled bf16 kernels round otherwise than eager ones on a CPU without native bf16 (AVX2: max
# 3.4e-4 apart after 4 steps of simple_cnn, measured; bit-equal on an AMX CPU); a wrong lr or a
# lost step moves the weights ~1e-2
BF16_KERNELS_ATOL = 1e-3


@pytest.fixture(autouse=True)
def restore_backend_flags():
    """The flags are process-wide: leave them as the test found them."""
    benchmark, tf32 = torch.backends.cudnn.benchmark, tf32_enabled()
    yield
    torch.backends.cudnn.benchmark = benchmark
    set_tf32(tf32)


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))


def test_every_switch_reaches_the_model_the_optimizer_and_the_backends(compose_cfg, tmp_path):
    cfg = compose_cfg(
        "speed.channels_last=true",
        "speed.tf32=true",
        "speed.cudnn_benchmark=true",
        "speed.optimizer_impl=fused",
    )
    set_tf32(False)
    torch.backends.cudnn.benchmark = False
    run(cfg, tmp_path / "out")
    assert torch.backends.cudnn.benchmark is True
    assert tf32_enabled()
    assert torch.get_float32_matmul_precision() == "high"
    conv = final_params(tmp_path / "out")["0.weight"]  # simple_cnn's first convolution
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()

    run_ = only_run(cfg.mlflow.tracking_uri)
    tags, params = run_.data.tags, run_.data.params
    assert tags["speed"] == "tf32+cl+fused"
    assert run_.info.run_name == "simple_cnn-single-fp32-tf32+cl+fused"
    assert (tags["channels_last"], tags["tf32"], tags["cudnn_benchmark"]) == ("true",) * 3
    assert tags["optimizer_impl"] == "fused" and tags["compile"] == "off"
    assert tags["heap"] == "pinned"  # speed.heap=auto on a CPU
    assert tags["data_placement"] == params["data_placement"] == "device"
    assert params["speed.channels_last"] == "True" and params["speed.optimizer_impl"] == "fused"
    assert "compile_s" not in run_.data.metrics


TENSORS_A_STEP, TENSOR_BYTES = 5, 2**24
FAULTS_PER_STEP = f"""
import resource, sys, torch
from accelexp.schema import SpeedConfig
from accelexp.speed import SpeedSwitches
SpeedSwitches.resolve(SpeedConfig(heap=sys.argv[1]), torch.device("cpu"), torch.nn.Linear(1, 1)
                      ).apply_backends()
def step():  # 80 MiB of 16-MiB tensors, freed together: more than glibc's moving trim threshold
    [torch.ones({TENSOR_BYTES}, dtype=torch.uint8) for _ in range({TENSORS_A_STEP})]
    # (which can reach 2 x 32 MiB)
step()
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_pinned_heap_does_not_fault_a_steps_tensors_in_again_each_step(tmp_path):
    """glibc's moving thresholds give the top of the heap back when a step frees it, so the
    next step faults it in again (what made one process's fp32 run 40 % slower than another's,
    `accelexp.heap`); pinned (`auto` on a CPU), the same steps reuse their pages. At a size whose
    faults do not depend on what the process freed before (the thresholds' ceilings)."""

    def faults(heap: str) -> list[int]:  # minor page faults of each step after the first
        code = [sys.executable, "-c", FAULTS_PER_STEP, heap]
        done = subprocess.run(code, capture_output=True, text=True, check=True)
        return [int(line) for line in done.stdout.split()]

    pinned, dynamic = faults("auto"), faults("dynamic")
    # glibc's own thresholds fault the second step's tensors in again, the whole step (later
    # steps vary with what the process freed: its history); pinned, a step's pages are kept:
    # most steps fault none, and never half a step's (a tensor's 4,096 pages, give or take one,
    # came back now and then on this VM, in two steps running once: the host reclaims cold pages)
    half_a_step = TENSORS_A_STEP * TENSOR_BYTES // resource.getpagesize() // 2
    assert statistics.median(pinned) == 0, (pinned, dynamic)
    assert max(pinned) < half_a_step < dynamic[0], (pinned, dynamic)


@pytest.mark.parametrize(
    ("impl", "expected"),
    [("fused", {"fused": True}), ("foreach", {"foreach": True}), ("for_loop", {"foreach": False})],
)
def test_the_optimizer_implementation_is_the_one_asked_for(compose_cfg, impl, expected):
    cfg = compose_cfg("optimizer=adamw")
    switches = SpeedSwitches.resolve(speed_cfg(optimizer_impl=impl), CPU, conv_net())
    model = nn.Linear(3, 2)
    optimizer = build_optimizer(
        typed(cfg).optimizer, model.parameters(), 0.1, **switches.optimizer_kwargs()
    )
    for key, value in expected.items():
        assert optimizer.defaults[key] is value
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()  # the chosen kernels run here


def test_deterministic_wins_over_autotuning_and_tf32():
    switches = SpeedSwitches.resolve(
        speed_cfg(cudnn_benchmark=True, tf32=True), CPU, conv_net(), deterministic=True
    )
    assert not switches.cudnn_benchmark and not switches.tf32
    torch.backends.cudnn.benchmark = True
    set_tf32(True)
    switches.apply_backends()
    assert torch.backends.cudnn.benchmark is False and not tf32_enabled()


def test_channels_last_auto_is_off_on_a_cpu_and_refused_for_a_model_without_convolutions():
    assert SpeedSwitches.resolve(speed_cfg(), CPU, conv_net()).channels_last is False
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    assert SpeedSwitches.resolve(speed_cfg(channels_last="auto"), CPU, mlp).channels_last is False
    with pytest.raises(SpeedConfigError, match=r"speed\.channels_last=true.*no 2-D convolution"):
        SpeedSwitches.resolve(speed_cfg(channels_last=True), CPU, mlp)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("speed.compile=fast", "speed.compile='fast'"),
        ("data.on_device=maybe", "data.on_device='maybe'"),
        ("speed.channels_last=sometimes", "speed.channels_last='sometimes'"),
        ("speed.optimizer_impl=apex", "speed.optimizer_impl='apex'"),
        ("model=mlp speed.channels_last=true", "speed.channels_last=true"),
        ("data.on_device=true data.num_workers=2", "data.on_device=true"),
    ],
)
def test_a_bad_switch_stops_before_training_with_one_message(
    override, named, tmp_path, tracking_uri, cli
):
    # the tiny set and a copy of the migrated store: channels_last on an MLP is refused only
    # once the model is built, after the data and the MLflow connection
    result = cli(
        "data=synthetic", *TINY_DATA, *override.split(), f"mlflow.tracking_uri={tracking_uri}",
        tmp_path=tmp_path,
    )  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "Traceback" not in text and named in text, text
    assert "epoch 1" not in text  # nothing trained


def test_model_parallel_compiles_each_stage_and_keeps_the_outputs(compose_cfg):
    # the MLP: the fewest kernels to compile of the models that split into stages
    cfg = compose_cfg("model=mlp", "parallelism=model", "parallelism.stages=2", "model.dropout=0")
    strategy = connect(typed(cfg))
    torch.manual_seed(0)
    model = build_model(typed(cfg).model, 3, 10, 16)
    expected = model.eval()(torch.ones(4, 3, 16, 16))
    wrapped = strategy.wrap_model(model, compile_mode="default").eval()
    assert all(stage._compiled_call_impl is not None for stage in strategy.pipeline.stages)
    assert wrapped._compiled_call_impl is None  # the clock loop between stages stays eager
    torch.testing.assert_close(wrapped(torch.ones(4, 3, 16, 16)), expected)
    assert list(strategy.unwrap(wrapped).state_dict()) == list(model.state_dict())


@pytest.mark.slow
def test_the_speedups_study_runs_one_child_per_rung_and_times_compiling_apart(
    tmp_path, tracking_uri, cli
):
    """The ladder, one child run per rung; its compiled rung is also the run that shows a
    compiled run's compile time reported apart from its throughput (2 epochs of 5 steps), and
    that a model compiled under bf16 autocast trains as the eager one: the compile rung differs
    from the bf16 rung by `speed.compile` alone (no dropout: its masks are drawn otherwise when
    compiled), so both end with the same parameters."""
    uri, batch, sweep = tracking_uri, 32, tmp_path / "sweep"
    result = cli(
        "-m", "+experiment=speedups", "model.dropout=0", "data.num_train=256", "data.num_test=128",
        "data.image_size=16", f"data.batch_size={batch}", "epochs=2", "max_steps_per_epoch=5",
        "progress=false", "threads=1", "repeats=1", f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("speedups").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("accelexp.sweep") == "true"]
    children = {
        r.data.tags["rung"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert list(children) and len(children) == len(runs) - 1 == 7
    rungs = sorted(children.values(), key=lambda r: int(r.data.tags["rung_index"]))
    summary = [(r.data.tags["rung"], r.data.tags["precision"], r.data.tags["speed"]) for r in rungs]
    assert summary == [
        ("fp32", "fp32", "eager"),
        ("tf32", "fp32", "tf32"),
        ("channels_last", "fp32", "tf32+cl"),
        ("amp", "amp", "tf32+cl"),
        ("bf16", "bf16", "tf32+cl"),
        ("compile", "bf16", "tf32+cl+compile:default"),
        ("bf16_true", "bf16_true", "tf32+cl+compile:default"),
    ]
    assert all(r.info.status == "FINISHED" for r in rungs)
    assert all("compile_s" in r.data.metrics for r in rungs[-2:])
    assert all("compile_s" not in r.data.metrics for r in rungs[:-2])
    assert rungs[-1].data.params["param_dtype"] == "bfloat16"

    compiled = rungs[-2]  # speed.compile=default
    run_id = compiled.info.run_id
    compile_s = client.get_metric_history(run_id, "compile_s")
    assert [m.step for m in compile_s] == [1] and compile_s[0].value > 0  # the first epoch only
    epoch_time = {m.step: m.value for m in client.get_metric_history(run_id, "epoch_time_s")}
    speed = {m.step: m.value for m in client.get_metric_history(run_id, "samples_per_s")}
    # epoch 1's throughput counts its 2 steps after the 3 warm-up steps, in the time they took
    # (both figures stored to 5 significant digits); epoch 2 times all of its 5 steps
    assert speed[1] == pytest.approx(2 * batch / epoch_time[1], rel=1e-3)
    timed = client.get_metric_history(run_id, "timed_steps")
    assert {m.step: m.value for m in timed} == {1: 2, 2: 5}
    assert compile_s[0].value > epoch_time[1]  # compiling costs more than two small steps
    assert compiled.data.tags["compile"] == "default"
    assert compiled.info.run_name.endswith("-bf16-tf32+cl+compile:default")

    # compiled = eager under bf16 autocast (and channels_last): the compile rung's weights are
    # the bf16 rung's, to the rounding of compiled bf16 kernels
    folders = {(job / "mlflow_run_id").read_text().strip(): job for job in sweep.glob("[0-9]*")}
    eager, compiled_weights = (
        read_whole(folders[r.info.run_id] / "checkpoints" / "last.pt")["model"]
        for r in rungs[-3:-1]
    )  # the weights after the last step (best.pt's epoch may differ on a flipped prediction)
    assert_same_params(compiled_weights, eager, atol=BF16_KERNELS_ATOL)


def linear_trainer(batches: int, warmup_steps: int = 0):
    """(Trainer, loader): a linear model in fp32 on the CPU, `batches` batches of 8 per epoch."""
    from torch.utils.data import SequentialSampler

    from accelexp.data import BatchLoader, ImageSet
    from accelexp.engine import Trainer
    from accelexp.parallel.base import Strategy
    from accelexp.parallel.config import ParallelismConfig

    torch.manual_seed(0)
    n = 8 * batches
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    loader = BatchLoader(ImageSet(images, torch.arange(n) % 4), 8, SequentialSampler(range(n)),
                         CPU, [0.5] * 3, [0.25] * 3)  # fmt: skip
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = Strategy(ParallelismConfig())  # one device, alone
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    trainer = Trainer(model, optimizer, scheduler, strategy, progress=False,
                      warmup_steps=warmup_steps)  # fmt: skip
    return trainer, loader


@pytest.mark.parametrize(
    ("batches", "compile_steps", "first_timed"),
    [(16, 0, 12), (40, 0, 35), (3, 0, 3), (5, 0, 4), (16, 3, 13), (2, 3, 1)],
)
def test_the_first_epoch_trained_leaves_its_warm_up_steps_out_of_the_timing(
    batches, compile_steps, first_timed
):
    """Eager: min(5, a quarter) of the first epoch's steps are not timed; compiled: the compile
    steps; at least one step is always timed, and later epochs time every step. Loss and
    accuracy still count every sample."""
    assert [eager_warmup_steps(n) for n in (1, 3, 4, 8, 20, 21, 1000)] == [0, 0, 1, 2, 5, 5, 5]
    trainer, loader = linear_trainer(batches, compile_steps)
    first, second = (trainer.train_epoch(loader, epoch) for epoch in (1, 2))
    assert (first.timed_steps, second.timed_steps) == (first_timed, batches)
    assert (first.samples, second.samples) == (8 * first_timed, 8 * batches)
    assert first.samples_per_s == first.samples / first.seconds
    assert (first.compile_seconds is not None) == (compile_steps > 0) and not second.compile_seconds
    assert 0 <= first.accuracy <= 1 and math.isfinite(first.loss)


def test_an_overflowing_step_is_skipped_the_scale_halves_and_training_goes_on():
    """The loop's handling of an inf gradient under a GradScaler. The product scales losses only
    for fp16 on CUDA (`scripts/gpu_check.py` checks it there); here the precision is given a
    real CPU GradScaler, so the same loop, strategy and scaler code runs."""
    trainer, loader = linear_trainer(batches=4)
    model, optimizer, precision = trainer.model, trainer.optimizer, trainer.strategy.precision
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)

    backward_passes, snapshots, stepped = [0], [], []
    weight = model[1].weight

    def poison_second_backward(grad):
        backward_passes[0] += 1
        return grad * math.inf if backward_passes[0] == 2 else grad

    weight.register_hook(poison_second_backward)
    optimizer.register_step_post_hook(lambda *_: stepped.append(backward_passes[0]))
    loader_iter = iter(loader)

    class Recording:  # the loader, with the weights seen before each batch recorded
        def __len__(self):
            return len(loader)

        def set_epoch(self, epoch):
            loader.set_epoch(epoch)

        def __iter__(self):
            for batch in loader_iter:
                snapshots.append(weight.detach().clone())
                yield batch

    result = trainer.train_epoch(Recording(), epoch=1)
    snapshots.append(weight.detach().clone())
    assert stepped == [1, 3, 4]  # the optimizer did not step on the second batch
    assert torch.equal(snapshots[2], snapshots[1])  # so the weights did not move
    assert not torch.equal(snapshots[3], snapshots[2])  # and training went on
    assert precision.grad_scale() == 512.0  # halved once
    assert torch.isfinite(weight).all() and math.isfinite(result.loss)
