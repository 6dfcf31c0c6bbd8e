"""What the per-epoch training-state checkpoint costs: `last.pt` written as `train.py` writes it.

The full state (model, SGD with momentum, scheduler, RNG states) of torchvision's resnet18 and
resnet50 (10 classes) is written with `accelexp.checkpoint.save` — temporary file and its sha256,
fsync, the one it replaces kept as previous.pt, rename, the record —
`--repeats` times; the median wall and process CPU time per write is printed with the file size.
This is paid once per epoch, outside the timed training steps (`samples_per_s`).

    python benchmarks/checkpoint_cost.py
    python benchmarks/checkpoint_cost.py --models resnet50 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torchvision

from accelexp import checkpoint


def cost(name: str, repeats: int) -> tuple[float, float, float]:
    """(MiB, median wall s, median CPU s) of writing `name`'s last.pt."""
    model = getattr(torchvision.models, name)(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()  # momentum buffers exist, as after a real epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(0)
    walls, cpus = [], []
    with tempfile.TemporaryDirectory(dir=".") as folder:
        path = Path(folder) / checkpoint.LAST
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            state = checkpoint.training_state(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler={},
                progress=checkpoint.Progress(),
                rng=[checkpoint.rng_state(generator)],
                run_id=None,
                config={},
            )
            checkpoint.save(path, state, keep_previous=True)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        size = path.stat().st_size / 2**20
    return size, statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name in args.models:
        size, wall, cpu = cost(name, args.repeats)
        print(
            f"{name}: last.pt {size:.0f} MiB, one write: median wall {wall:.3f} s, "
            f"CPU {cpu:.3f} s ({args.repeats} repeats)"
        )


if __name__ == "__main__":
    main()
