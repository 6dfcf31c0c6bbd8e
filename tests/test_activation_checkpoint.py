"""Activation checkpointing (`speed.activation_checkpointing`) changes memory, not what is trained.

In this process, at a tiny size: each mode gives the gradients and the BatchNorm statistics of
the model without it, and the step's measured peak of live tensors (`step_memory`, MemTracker)
is lower — and within 15 % of what the memory forecast (`estimate=true`) says before any tensor
is allocated. Under DDP, FSDP and pipeline stages, tests/test_contract.py's checkpointed cases end
with the parameters one process reaches without it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config, speed_cfg
from omegaconf import OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from accelexp import activation_checkpoint
from accelexp.config import typed
from accelexp.diagnosis.max_batch import Trial, step_memory
from accelexp.forecast import forecast
from accelexp.models import build_model
from accelexp.optim import build_optimizer
from accelexp.parallel import connect
from accelexp.record import STEP_PEAK_MB
from accelexp.speed import SpeedSwitches

CPU = torch.device("cpu")
MODES = {"full": ("full", "2"), "every2": ("selective", "2"), "op": ("selective", "op")}
# model: (batch, image size, overrides), the smallest whose step peak each mode lowers (measured:
# resnet18 at batch 2, or a ViT of 2 blocks under every2, kept the peak they had without it)
SIZES = {"resnet18": (4, 32, ()), "vit_tiny": (32, 32, ("model.depth=3",))}


@pytest.fixture(scope="module", params=sorted(SIZES))
def model_and_batch(request, tmp_path_factory):
    name = request.param
    batch, size, overrides = SIZES[name]
    uri = f"sqlite:///{tmp_path_factory.mktemp('ac')}/mlflow.db"
    cfg = compose_config(
        uri, f"model={name}", *overrides, f"data.image_size={size}", f"data.batch_size={batch}",
        "device=cpu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(typed(cfg).model, 3, 10, size).train()
    images, labels = torch.randn(batch, 3, size, size), torch.randint(10, (batch,))
    return cfg, model, images, labels, peak_mb(cfg, copy.deepcopy(model), images)


def gradients_and_buffers(model, images, labels):
    F.cross_entropy(model(images), labels).backward()
    grads = {
        name.replace(_CHECKPOINT_PREFIX, ""): p.grad.clone()  # as the state dict names them
        for name, p in model.named_parameters()
    }
    return grads, {name: b.clone() for name, b in model.state_dict().items() if "running" in name}


def peak_mb(cfg, model, images) -> float:
    """A steady step's peak of live tensors (MiB): the optimizer's state made by a step before."""
    strategy = connect(typed(cfg))
    optimizer = build_optimizer(typed(cfg).optimizer, model.parameters(), cfg.optimizer.lr)
    trial = Trial(model, optimizer, strategy, images.shape[1:], 10)
    trial.step(images.shape[0])
    optimizer.zero_grad()
    return step_memory(trial, images.shape[0])[STEP_PEAK_MB]


@pytest.mark.parametrize("kind", MODES)
def test_same_gradients_and_statistics_and_a_lower_step_peak(model_and_batch, kind):
    cfg, model, images, labels, plain_peak = model_and_batch
    mode, option = MODES[kind]
    plain, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    switches = SpeedSwitches.resolve(
        speed_cfg(activation_checkpointing=mode, selective_ac_option=option), CPU, checkpointed
    )
    switches.prepare(checkpointed)
    wrapped = activation_checkpoint.chosen(model, mode, option)
    assert 0 < len(wrapped) <= len(activation_checkpoint.blocks(model))
    assert switches.tags()["activation_checkpointing"] == switches.checkpointing != "none"

    expected_grads, expected_stats = gradients_and_buffers(plain, images, labels)
    grads, stats = gradients_and_buffers(checkpointed, images, labels)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    for name, value in stats.items():  # updated once per step, not again by the recompute
        torch.testing.assert_close(value, expected_stats[name], msg=name)

    measured = peak_mb(cfg, checkpointed, images)
    assert measured < plain_peak
    speed = {"activation_checkpointing": mode, "selective_ac_option": option}
    forecast_mb = forecast(OmegaConf.merge(cfg, {"speed": speed})).peak_mb
    assert abs(forecast_mb - measured) <= 0.15 * measured
