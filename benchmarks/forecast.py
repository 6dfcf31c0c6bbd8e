"""The memory forecast (`estimate=true`) against the step peak measured in real runs.

For each model x strategy x activation checkpointing: the forecast (`accelexp.forecast`, fake
tensors, in this process), and a real short run (`python run.py … max_batch.search=true`, its
workers started as usual) whose step peak of live tensors is measured after training with
PyTorch's MemTracker (`step_peak_mb`, rank 0's device); the table prints both and their ratio.

    python benchmarks/forecast.py                      # docs/memory.md's table (CPU, ~15 min)
    python benchmarks/forecast.py --models resnet18 --strategies fsdp --checkpointing full
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from mlflow import MlflowClient

from accelexp.config import register_configs
from accelexp.forecast import forecast
from accelexp.record import STEP_PEAK_MB

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = {  # name: its overrides
    "single": ("parallelism=single",),
    "ddp2": ("parallelism=ddp", "parallelism.nprocs=2"),
    "fsdp2": ("parallelism=fsdp", "parallelism.nprocs=2"),
}
SIZE = (  # one short real run: the step is measured once after training
    "data=synthetic", "data.image_size=32", "data.batch_size=16", "data.num_train=256",
    "data.num_test=64", "epochs=1", "max_steps_per_epoch=2", "threads=1", "progress=false",
    "optimizer=adamw",
)  # fmt: skip


def overrides(model: str, strategy: str, checkpointing: str) -> list[str]:
    return [f"model={model}", *STRATEGIES[strategy], *SIZE,
            f"speed.activation_checkpointing={checkpointing}"]  # fmt: skip


def measured(args: list[str], folder: Path) -> float:
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    command = [sys.executable, str(REPO / "run.py"), *args, "max_batch.search=true",
               f"mlflow.tracking_uri={uri}", f"hydra.run.dir={folder / 'run'}"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=REPO)
    (run,) = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("accelexp").experiment_id]
    )
    return run.data.metrics[STEP_PEAK_MB]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["resnet18", "resnet50", "vit_tiny", "vit_small"]
    )
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--checkpointing", nargs="+", default=["none", "full"])
    options = parser.parse_args()
    register_configs()
    print(
        "| model | strategy | checkpointing | forecast MiB | measured MiB | forecast / measured |"
    )
    print("|---|---|---|---:|---:|---:|")
    for model in options.models:
        for strategy in options.strategies:
            for checkpointing in options.checkpointing:
                args = overrides(model, strategy, checkpointing)
                with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
                    cfg = compose("config", args)
                predicted = forecast(cfg).peak_mb
                with tempfile.TemporaryDirectory() as folder:
                    real = measured(args, Path(folder))
                print(f"| {model} | {strategy} | {checkpointing} | {predicted:.1f} | {real:.1f} "
                      f"| {predicted / real:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
