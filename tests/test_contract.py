"""The contract every way of splitting work keeps: it trains the model one process would train.

One parametrized suite over every strategy, against references trained once per test session
(`conftest.reference`, shared by both xdist workers):

- **N workers = 1 process**: 2 workers (DDP, Horovod, FSDP, hybrid replicas) with batch 32 end
  with the parameters one process reaches with batch 64, to float rounding;
- **accumulation = the larger batch**: 2 workers x 2 micro-batches of 16, the same (for DDP and
  Horovod this is their N-workers case too: the second micro-batch's backward is a plain synced
  one, DDP's outside `no_sync`, Horovod's the allreduce its `backward_passes_per_step` delayed;
  both run compiled, below; FSDP's accumulates as one unit, `granularity=model`, of an MLP
  whose layers are compiled; its block units run eager on a ViT);
- **split = unsplit**: a model cut into stages (`parallelism=model`, any chunks or split points,
  any optimizer and precision) trains as the whole model on one device does; so does a pipeline
  across 2 ranks (`parallelism=pipeline`, 1F1B, 4 micro-batches, a tiny ViT: README's command,
  run.py's launch end to end; every schedule is stepped against one process in
  `test_pipeline_ranks.py`);
- **switch = eager**: `speed.compile` under 2 workers ends where one eager process ends, in fp32,
  each sync compiling its own way: DDP the DDP module, Horovod the model with its gradient hooks
  intact (with `speed.channels_last` too: its gradients synced through contiguous copies), FSDP
  each layer before sharding it (an MLP's two: the fewest graphs; convolutions and a block with
  BatchNorm compiled under FSDP in one process in `test_fsdp.py`). DDP's and Horovod's share
  one reference, the one process most cases share. Under bf16 autocast a compiled model trains
  as the eager one in the speedups study (`test_speed.py`: its compile rung against its bf16
  rung, one process);
  `speed.activation_checkpointing` (full, every k-th block, by op) under DDP, FSDP and stages
  ends where one process without it ends.

Every run is real: run.py's path (`accelexp.launch`), real worker processes over Gloo
(torchrun) or Horovod (horovodrun --gloo), tracked into a store of its own and read back.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import EXACT, TINY_VIT, assert_same_params, compose_config, final_params, only_run
from mlflow.entities import Run

from accelexp.launch import launch

ONE_PROCESS = (*EXACT, "data.batch_size=64", "max_steps_per_epoch=4")  # 4 steps of 64
TWO_WORKERS = (*EXACT, "parallelism.nprocs=2", "data.batch_size=32", "max_steps_per_epoch=4")
ACCUMULATING = (  # 2 workers x 2 micro-batches of 16 = one step on 64 samples
    *EXACT,
    "parallelism.nprocs=2",
    "parallelism.accumulate_steps=2",
    "data.batch_size=16",
    "max_steps_per_epoch=8",
)
# 2 steps of 16: bf16 convolutions take 90x longer on a CPU without AVX-512 bf16 (658 s at 4 x 64
# on an AVX2 host, 7.5 s with AMX)
RESNET18 = (
    "model=resnet18",
    *(o for o in ONE_PROCESS if not o.startswith(("model.dropout", "data.batch", "max_steps"))),
    "data.batch_size=16",
    "max_steps_per_epoch=2",
)
# one hidden layer: the fewest layers to compile each of (FSDP compiles every layer apart)
TINY_MLP = ("model=mlp", "model.widths=[32]")
ADAMW = ("optimizer=adamw", "scheduler=onecycle")


@dataclass(frozen=True)
class Case:
    """A run that must end with the parameters of the run its `reference` overrides train."""

    id: str
    overrides: tuple[str, ...]
    reference: tuple[str, ...] = ONE_PROCESS
    check: Callable[[Run], None] | None = None  # what else it must have logged
    atol: float = 1e-5  # of the parameters (assert_same_params)

    @property
    def param(self):
        marks = [pytest.mark.slow] if "parallelism.nprocs=2" in self.overrides else []
        return pytest.param(self, id=self.id, marks=marks)


def _world_of_two(run: Run) -> None:
    assert run.data.params["world_size"] == "2"
    # threads=0 (auto): the cores shared out among the workers
    assert run.data.params["threads"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


def _fsdp_units(units: int, name: str = "simple_cnn-fsdp-np2-fp32") -> Callable[[Run], None]:
    def check(run: Run) -> None:
        # granularity=block: each layer with parameters and the root; model: the root alone
        assert run.data.params["fsdp_units"] == str(units)
        assert run.info.run_name == name

    return check


def _hybrid(sync: str, name: str | None = None) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        params = run.data.params
        # on a CPU both stages of a replica share the one CPU: 2 replicas x 1 device
        facts = (params["replicas"], params["devices_per_replica"], params["world_size"])
        assert facts == ("2", "1", "2")
        assert (run.data.tags["placement"], run.data.tags["sync"]) == ("stages", sync)
        assert "stage1_peak_mem_mb" in run.data.metrics
        assert name is None or run.info.run_name == name

    return check


def _pipeline(run: Run) -> None:
    params = run.data.params
    # one pipeline: 1 replica over 2 ranks, a stage each
    facts = ("replicas", "devices_per_replica", "world_size", "stages", "stage1_rank")
    assert tuple(params[k] for k in facts) == ("1", "2", "2", "2", "1")
    assert (run.data.tags["placement"], run.data.tags["sync"]) == ("stages per rank", "p2p")
    assert {"stage0_peak_mem_mb", "stage1_peak_mem_mb"} <= run.data.metrics.keys()
    assert run.info.run_name == "vit_tiny-pipeline-np2-1f1b-m4-fp32"
    _stages_of_a_vit(run)  # cut where its layer sequence cuts: embedding .. blocks, .. head


def _compiled_fsdp(run: Run) -> None:
    _fsdp_units(1, "mlp-fsdp-np2-fp32-compile:default")(run)  # granularity=model: the root
    assert run.data.params["fsdp_compiled_layers"] == "2"  # the MLP's 2 linears
    assert run.data.metrics["compile_s"] > 0  # the warm-up that compiles, timed apart


def _compiled_world_of_two(run: Run) -> None:
    _world_of_two(run)
    assert run.data.metrics["compile_s"] > 0  # the warm-up that compiles, timed apart
    assert run.data.tags["compile"] == "default"


def _stages_of_a_vit(run: Run) -> None:
    assert run.data.params["stage0_layers"].startswith("embed..blocks.")
    assert run.data.params["stage1_layers"].endswith("..head")


def _vit_units_checkpointed(mode: str) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        assert run.data.params["fsdp_units"] == "5"  # embedding, 2 blocks, head; the root
        _checkpointing(mode)(run)

    return check


def _checkpointing(mode: str) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        assert run.data.tags["activation_checkpointing"] == mode
        assert f"ac:{mode}" in run.info.run_name

    return check


def checkpointed(mode: str) -> tuple[str, ...]:
    """`speed.activation_checkpointing` overrides: full, every<k> (selective) or op."""
    if mode == "full":
        return ("speed.activation_checkpointing=full",)
    option = mode.removeprefix("every")
    return ("speed.activation_checkpointing=selective", f"speed.selective_ac_option={option}")


CASES = [
    # N workers = 1 process (DDP's and Horovod's: their accumulating cases; a ViT's FSDP
    # block units: vit-fsdp-checkpointed)
    Case(
        "hybrid-ddp",
        (
            "parallelism=hybrid",
            "parallelism.sync=ddp",
            "parallelism.devices_per_replica=2",
            "parallelism.chunks=2",
            *TWO_WORKERS,
        ),
        check=_hybrid("ddp", "simple_cnn-hybrid-ddp-np2-s2c2-fp32"),
    ),
    # accumulation = the larger batch (no sync on the first micro-batch; DDP's and Horovod's
    # run compiled, under switch = eager)
    Case(
        "hybrid-horovod-accumulate",
        ("parallelism=hybrid", "parallelism.sync=horovod", "parallelism.chunks=4", *ACCUMULATING),
        check=_hybrid("horovod"),
    ),
    # split = unsplit: one process, the model in stages
    Case(
        "stages-2",
        ("parallelism=model", "parallelism.stages=2", "parallelism.chunks=2", *ONE_PROCESS),
    ),
    Case(
        "stages-3-chunks-4",
        ("parallelism=model", "parallelism.stages=3", "parallelism.chunks=4", *ONE_PROCESS),
    ),
    Case(
        "split-points",
        (
            "parallelism=model",
            "parallelism.split_points=[3,7,9]",
            "parallelism.stages=4",
            *ONE_PROCESS,
        ),
    ),
    Case(
        "resnet18-bf16",
        (
            "parallelism=model",
            "parallelism.stages=2",
            "parallelism.chunks=1",
            "precision=bf16",
            *RESNET18,
        ),
        (*RESNET18, "precision=bf16"),
    ),
    Case(
        "vit-pipeline-1f1b",  # README's pipeline command, tiny
        (
            *TINY_VIT,
            "parallelism=pipeline",
            "parallelism.nprocs=2",
            "parallelism.schedule=1f1b",
            "parallelism.microbatches=4",
            *ONE_PROCESS,
        ),
        (*TINY_VIT, *ONE_PROCESS),
        check=_pipeline,
    ),
    Case(
        "adamw-onecycle",
        ("parallelism=model", "parallelism.chunks=2", *ADAMW, *ONE_PROCESS),
        (*ONE_PROCESS, *ADAMW),
    ),
    Case(
        "vit-stages",
        (
            *TINY_VIT,
            "parallelism=model",
            "parallelism.stages=2",
            "parallelism.chunks=2",
            *ONE_PROCESS,
        ),
        (*TINY_VIT, *ONE_PROCESS),
        check=_stages_of_a_vit,
    ),
    # switch = eager
    Case(
        "fsdp-compile-model-accumulate",  # one FSDP unit (granularity=model), its layers compiled
        (
            *TINY_MLP,
            "parallelism=fsdp",
            "parallelism.granularity=model",
            *ACCUMULATING,
            "speed.compile=default",
        ),
        (*TINY_MLP, *ONE_PROCESS),
        check=_compiled_fsdp,
    ),
    Case(
        "ddp-compile-accumulate",
        ("parallelism=ddp", *ACCUMULATING, "speed.compile=default"),
        check=_compiled_world_of_two,
    ),
    Case(
        "vit-fsdp-checkpointed",
        (*TINY_VIT, "parallelism=fsdp", *TWO_WORKERS, *checkpointed("full")),
        (*TINY_VIT, *ONE_PROCESS),
        check=_vit_units_checkpointed("full"),
    ),
    Case(
        "vit-ddp-checkpointed-by-op",
        (*TINY_VIT, "parallelism=ddp", *TWO_WORKERS, *checkpointed("op")),
        (*TINY_VIT, *ONE_PROCESS),
        check=_checkpointing("op"),
    ),
    Case(
        "vit-stages-checkpointed",
        (
            *TINY_VIT,
            "parallelism=model",
            "parallelism.chunks=2",
            *ONE_PROCESS,
            *checkpointed("every1"),
        ),
        (*TINY_VIT, *ONE_PROCESS),
        check=_checkpointing("every1"),
    ),
    # Horovod: the model compiled with its gradient hooks intact (the allreduce its
    # backward_passes_per_step delayed fires on the second micro-batch), channels_last
    # gradients synced through a contiguous copy (as Horovod needs)
    Case(
        "horovod-compile-channels-last-accumulate",
        (
            "parallelism=horovod",
            *ACCUMULATING,
            "speed.compile=default",
            "speed.channels_last=true",
        ),
        check=_compiled_world_of_two,
    ),
]


@pytest.mark.parametrize("case", [case.param for case in CASES])
def test_trains_the_parameters_of_its_reference(case, reference, tmp_path, tracking_uri):
    expected_params, expected_metrics = reference(*case.reference)
    cfg = compose_config(tracking_uri, *case.overrides)
    metrics = launch(cfg, tmp_path / "out")
    params = final_params(tmp_path / "out")
    # best.pt holds the whole model as plain tensors (gathered on rank 0): it loads anywhere
    assert all(type(t) is torch.Tensor for t in params.values())
    assert_same_params(params, expected_params, atol=case.atol)
    if cfg.precision.name == "fp32":
        # the same model on the same test set (bf16 may flip a borderline prediction)
        assert math.isclose(metrics["test_acc"], expected_metrics["test_acc"], abs_tol=1e-3)
    run = only_run(tracking_uri)
    assert run.info.status == "FINISHED"
    if "speed.channels_last=true" in case.overrides:
        assert params["0.weight"].is_contiguous(memory_format=torch.channels_last)
    if case.check is not None:
        case.check(run)
