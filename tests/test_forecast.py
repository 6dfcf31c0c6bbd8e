"""The memory forecast (`estimate=true`, accelexp/forecast.py) before launch, at a tiny size.

Against real measurements: the step peak measured in this process (tests/test_activation_
checkpoint.py's, with and without checkpointing) and in the memory study's real 2-worker runs
(tests/test_memory_study.py). Here: what `estimate=true` prints and that it trains nothing, the
largest batch, and a world of 2 forecast in this one process.
"""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_VIT, compose_config, run_here
from mlflow import MlflowClient

from accelexp.forecast import forecast, largest_batch
from accelexp.record import STEP_PEAK_MB, step_peak_kind_mb


def test_estimate_prints_the_forecast_and_trains_nothing(
    capfd, tmp_path: Path, tracking_uri: str
) -> None:
    uri = tracking_uri  # a copy of the migrated store: no migrations to read it back
    result = run_here(
        capfd, "estimate=true", *TINY_VIT, "data=synthetic", "data.image_size=16",
        f"mlflow.tracking_uri={uri}", tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Memory forecast of one training step" in result.stdout
    assert "cpu: peak " in result.stdout and "activations" in result.stdout
    assert "give the device's memory, e.g. max_batch.device_mem_gb=80" in result.stdout
    assert not MlflowClient(uri).search_experiments(filter_string="name = 'accelexp'")


def test_the_largest_batch_is_the_last_that_fits(tracking_uri: str) -> None:
    cfg = compose_config(tracking_uri, *TINY_VIT, "data.batch_size=8")
    first = forecast(cfg)
    memory = first.peak_mb * 3  # room for a few times the batch
    batch, at = largest_batch(cfg, memory, first)
    assert batch > first.batch and at.peak_mb <= memory < forecast(cfg, batch + 1).peak_mb


def test_fsdp_workers_hold_a_share_of_the_state_and_ddp_workers_a_bucket_more(tracking_uri):
    """Forecast in this one process: FSDP in a fake world of 2 holds half of what one process
    holds of the optimizer state (each shard padded to the world: a little more); a DDP worker
    holds one more copy of the gradients, its buckets."""

    def peaks(*parallelism: str) -> dict[str, float]:
        cfg = compose_config(tracking_uri, *TINY_VIT, "optimizer=adamw", *parallelism)
        return forecast(cfg).peaks["cpu"]

    single = peaks()
    fsdp = peaks("parallelism=fsdp", "parallelism.nprocs=2")
    ddp = peaks("parallelism=ddp", "parallelism.nprocs=2")
    opt, sync = step_peak_kind_mb("opt"), step_peak_kind_mb("sync")
    assert single[opt] / 2 <= fsdp[opt] < 0.55 * single[opt]
    assert fsdp[STEP_PEAK_MB] < single[STEP_PEAK_MB] < ddp[STEP_PEAK_MB]
    assert abs(ddp[sync] - single[step_peak_kind_mb("param")]) < 1e-6


def test_a_gradscaler_does_not_stop_the_forecast(tracking_uri, monkeypatch) -> None:
    """fp16 amp on CUDA steps through a GradScaler, which reads whether a gradient overflowed:
    a value fake tensors do not have (on the H200 `compare=lockstep precision=amp` stopped at
    its memory check with DataDependentOutputException). A CPU has no fp16 amp, so its
    Precision is given a scaler here, as CUDA's has; the forecast is the one without it."""
    import torch

    from accelexp.precision.runtime import Precision

    built = Precision.from_config

    def with_scaler(cfg, device):
        precision = built(cfg, device)
        precision.scaler = torch.amp.GradScaler(device.type)
        return precision

    cfg = compose_config(tracking_uri, *TINY_VIT, "precision=amp")
    plain = forecast(cfg).peak_mb
    monkeypatch.setattr(Precision, "from_config", with_scaler)
    assert forecast(cfg).peak_mb == plain


def _held_by_one_rank(cfg, rank: int, order: list[str]) -> float:
    """What pipeline rank `rank` of a 2-stage pipeline holds at its peak (MiB), measured: its
    real stage module on real tensors, no process group, the actions `order` ("F"/"B", one per
    micro-batch, oldest backward first) of one step after a first, under MemTracker; the
    receive buffers a PipelineStage keeps (an input per micro-batch for stage 1, an output
    gradient per micro-batch for stage 0) allocated within it."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from accelexp.config.typed import typed
    from accelexp.data.sources import set_shape
    from accelexp.models import build_model
    from accelexp.optim import build_optimizer
    from accelexp.parallel.pipeline import split_layers

    parts = typed(cfg)
    shape = set_shape(parts.data)
    model = build_model(parts.model, shape.channels, shape.num_classes, shape.image_size)
    stages, _ = split_layers(model, 2)
    m = parts.parallelism.microbatches
    micro = parts.data.batch_size // m
    images = torch.randn(micro, shape.channels, shape.image_size, shape.image_size)
    labels = torch.randint(shape.num_classes, (micro,))
    with torch.no_grad():
        between = stages[0](images)
    stage = stages[rank]
    optimizer = build_optimizer(parts.optimizer, stage.parameters(), parts.optimizer.lr)

    def step() -> None:
        buffers = [torch.empty_like(between) for _ in range(m)]
        held = []
        for action in order:
            if action == "F":
                x = images if rank == 0 else buffers[len(held)].requires_grad_()
                call = torch.nn.Sequential(stage)  # a root of its own: MemTracker's rule
                out = call(x)
                if rank == 1:
                    out = torch.nn.functional.cross_entropy(out, labels) / m
                held.append((out, call))
            else:
                out, call = held.pop(0)
                out.backward(buffers[0] if rank == 0 else None)
                del out, call
        optimizer.step()
        optimizer.zero_grad()

    step()
    tracker = MemTracker()
    tracker.track_external(stage, optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**20


def test_a_pipeline_is_forecast_per_rank_with_its_schedules_micro_batches_in_flight(
    tracking_uri,
):
    """parallelism=pipeline of 2 ranks, 4 micro-batches: each rank's forecast equals what its
    stage holds, measured in this process on real tensors in the schedule's order (GPipe: all 4
    forwards, then the backwards; 1F1B: 2 forwards on rank 0, 1 on rank 1, then one backward and
    one forward in turn); 1F1B holds less than GPipe on stage 0."""
    tiny = (
        "model=vit_tiny", "model.dim=64", "model.depth=2", "model.heads=2", "data=synthetic",
        "data.image_size=32", "data.batch_size=16", "parallelism=pipeline",
        "parallelism.microbatches=4",
    )  # fmt: skip
    orders = {
        "gpipe": [["F"] * 4 + ["B"] * 4] * 2,
        "1f1b": [["F", "F", "B", "F", "B", "F", "B", "B"], ["F", "B"] * 4],
    }
    forecast_mb = {}
    for schedule, by_rank in orders.items():
        cfg = compose_config(tracking_uri, *tiny, f"parallelism.schedule={schedule}")
        found = forecast(cfg)
        lines = list(found.peaks)
        assert len(lines) == 2 and found.peak_mb == max(
            p[STEP_PEAK_MB] for p in found.peaks.values()
        )
        for rank, order in enumerate(by_rank):
            predicted = found.peaks[lines[rank]][STEP_PEAK_MB]
            measured = _held_by_one_rank(cfg, rank, order)
            assert abs(predicted / measured - 1) < 0.15, (schedule, rank, predicted, measured)
        forecast_mb[schedule] = [found.peaks[line][STEP_PEAK_MB] for line in lines]
    assert forecast_mb["1f1b"][0] < forecast_mb["gpipe"][0]
