"""FSDP2 (`parallelism=fsdp`) on the real engine: torchrun workers over Gloo on this CPU.

Two workers holding half of every parameter each must train exactly as one process with their
global batch (to fp32 rounding: the gradient average is a reduce-scatter, summed in another
order than one process's batch mean, ~1e-7 relative per step), with and without gradient
accumulation; the best checkpoint is the whole model, loadable in one process; each worker holds
about half the model's state that a DDP worker holds; bad combinations stop before training.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from conftest import compose_config, new_store, only_run, store_uri, two_workers_of_a_wide_mlp

from accelexp.config import ConfigError, typed, validate
from accelexp.errors import AccelexpError
from accelexp.launch import launch
from accelexp.parallel import connect
from accelexp.parallel.world import World, WorldShape

FSDP = ("parallelism=fsdp", "parallelism.nprocs=2")


def test_an_fsdp_worker_holds_half_the_state_a_ddp_worker_holds(
    tmp_path, mlflow_template_db, reference_folder
):
    """`state_mem_mb`: parameters, gradients and SGD momentum as each worker stores them; and
    `step_peak_mb`, the peak of live tensors over a step measured after training (a CPU's). The
    DDP run is the one test_profiler reads the traces of."""
    ddp_folder, _ = reference_folder(*two_workers_of_a_wide_mlp("ddp"))
    uri = new_store(tmp_path, mlflow_template_db)
    launch(compose_config(uri, *two_workers_of_a_wide_mlp("fsdp")), tmp_path / "out")
    held, peak = {}, {}
    for name, store in (("ddp", store_uri(ddp_folder)), ("fsdp", uri)):
        metrics = only_run(store).data.metrics
        held[name], peak[name] = metrics["state_mem_mb"], metrics["step_peak_mb"]
    # mlp on 3x16x16 images: ~0.66 M parameters x (weight + gradient + momentum) x 4 bytes
    assert 7.0 < held["ddp"] < 8.0
    # each FSDP worker: half of every parameter (dim-0 shards, padded to equal sizes)
    assert held["fsdp"] == pytest.approx(held["ddp"] / 2, rel=0.01)
    # a step's peak: FSDP adds the gathered weights of a unit or two, far below half the model
    assert peak["fsdp"] < 0.8 * peak["ddp"]


def test_hybrid_cannot_shard_its_pipelines(compose_cfg):
    cfg = compose_cfg("parallelism=hybrid", "parallelism.sync=fsdp")
    with pytest.raises(ConfigError, match=r"sharding pipeline stages .* is not supported"):
        validate(cfg)


def test_fsdp_with_cuda_graphs_stops_before_training(compose_cfg):
    with pytest.raises(ConfigError, match=r"speed\.compile=reduce-overhead with parallelism=fsdp"):
        validate(compose_cfg(*FSDP, "speed.compile=reduce-overhead"))
    validate(compose_cfg(*FSDP, "speed.compile=default"))


def test_fsdp_compiles_each_layer_before_sharding_it(compose_cfg):
    """speed.compile under fsdp: each layer with parameters is a compiled module with FSDP's
    hooks outside it; the outputs and gradients are the eager model's, and the state dict (what
    best.pt holds) keeps the plain model's names."""
    strategy = connect(typed(compose_cfg(*FSDP, "parallelism.nprocs=1", "model.dropout=0")))
    try:
        torch.manual_seed(0)
        reference = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.ReLU(), ConvBlock(8), nn.Flatten(), nn.Linear(8 * 4 * 4, 10)
        )
        sharded = strategy.wrap_model(copy.deepcopy(reference), compile_mode="default")
        compiled = [m for m in sharded.modules() if "forward" in vars(m)]  # compiled forwards
        assert len(compiled) == 3 and strategy.describe()["fsdp_compiled_layers"] == 3
        x = torch.randn(6, 3, 8, 8)
        outputs = []
        for model in (reference, sharded):
            out = model(x)
            out.square().mean().backward()
            outputs.append(out)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-5)
        for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-5)
        full = strategy.model_state_dict(sharded)
        assert list(full) == list(reference.state_dict())
    finally:
        strategy.teardown()


def test_fsdp_cpu_offload_on_a_cpu_is_one_message(tmp_path, tracking_uri):
    cfg = compose_config(tracking_uri, "parallelism=fsdp", "parallelism.cpu_offload=true")
    with pytest.raises(ConfigError, match=r"cpu_offload=true moves FSDP.s shards .* no GPU"):
        launch(cfg, tmp_path / "out")


def test_fsdp_keys_belong_to_fsdp(compose_cfg):
    with pytest.raises(Exception, match=r"parallelism\.granularity"):
        compose_cfg("parallelism=ddp", "parallelism.granularity=block")


def test_more_fsdp_workers_than_gpus_stop_before_training(monkeypatch, tmp_path, tracking_uri):
    """The machine's GPU count is what decides; here one GPU is what CUDA reports."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = compose_config(tracking_uri, *FSDP, "device=auto")
    with pytest.raises(AccelexpError, match="this machine has 1 GPU"):
        launch(cfg, tmp_path / "out")
    # a world a launcher made with more workers per machine than GPUs (torchrun, srun)
    devices = [torch.device("cuda", 0)]
    with pytest.raises(ConfigError, match="worker 1 of this machine has no GPU of its own"):
        WorldShape.build(World(1, 2, 1, "torchrun"), devices, shards=True)
    assert WorldShape.build(World(1, 2, 1, "torchrun"), devices, shards=False).replicas == 2


def test_fsdp_computes_in_the_precisions_dtype_over_fp32_master_weights(compose_cfg):
    """precision=bf16: FSDP casts each unit's gathered weights to bf16 for forward and backward;
    the shards it keeps (what the optimizer steps) and the reduced gradients stay fp32."""
    # a world of one, in this process
    strategy = connect(typed(compose_cfg(*FSDP, "parallelism.nprocs=1", "precision=bf16")))
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        model = strategy.wrap_model(model)
        out = model(torch.randn(4, 8))
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
        assert strategy.describe()["fsdp_units"] == 3  # two linears, then the root
        full = strategy.model_state_dict(model)  # plain tensors: loads into the unsharded model
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).load_state_dict(full)
    finally:
        strategy.teardown()


class ConvBlock(nn.Module):
    """A residual block's shape: one FSDP unit under granularity=block, BatchNorms inside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(width, width, 3), nn.BatchNorm2d(width)
        self.shortcut_norm = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)) + self.shortcut_norm(x[..., 1:-1, 1:-1]))


@pytest.mark.parametrize("granularity", ["block", "model"])
def test_fsdp_keeps_batchnorm_in_fp32_under_mixed_precision(granularity, compose_cfg):
    """A model with BatchNorm under fsdp + bf16 trains as the plain model under the loop's
    autocast: BatchNorm's weights stay fp32 beside its fp32 running statistics (cast to bf16
    like the convolutions', batch_norm refuses them: "expected scalar type BFloat16 but found
    Float"), so outputs, gradients and running statistics match the unsharded model's."""
    overrides = (*FSDP, "parallelism.nprocs=1", "precision=bf16")
    strategy = connect(typed(compose_cfg(*overrides, f"parallelism.granularity={granularity}")))
    try:
        torch.manual_seed(0)
        reference = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
            ConvBlock(8),
            nn.Flatten(), nn.Linear(8 * 4 * 4, 10), nn.BatchNorm1d(10),
        )  # fmt: skip
        sharded = strategy.wrap_model(copy.deepcopy(reference))
        x = torch.randn(6, 3, 8, 8)
        outputs = []
        for model in (reference, sharded):
            with torch.autocast("cpu", torch.bfloat16):
                out = model(x)
            out.float().square().mean().backward()
            outputs.append(out)
        torch.testing.assert_close(outputs[1], outputs[0])
        for (name, p), q in zip(sharded.named_parameters(), reference.parameters(), strict=True):
            assert p.dtype == torch.float32
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
        for p, q in zip(sharded.buffers(), reference.buffers(), strict=True):
            torch.testing.assert_close(p, q)
        # block: each layer with parameters (5) and the root, the block's BatchNorms one fp32
        # group before it (a layer that is a BatchNorm is an fp32 unit itself); model: one
        # unit, all BatchNorms one fp32 group
        units = {"block": (6, 1), "model": (1, 1)}[granularity]
        described = strategy.describe()
        assert (described["fsdp_units"], described["fsdp_fp32_norm_groups"]) == units
    finally:
        strategy.teardown()
