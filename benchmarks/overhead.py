"""Framework overhead: accelexp's training epoch vs a minimal hand-written PyTorch loop.

Both sides train the same model (same initial weights), on the same in-memory data, with the same
batch size, threads and precision, in this one process. They alternate (A B A B ...) so that the
machine's noise falls on both alike; each side's median over the repeats is reported, in wall
time and in process CPU time, with the ratio accelexp / plain (target: <= 1.03). The loader-only
line is accelexp's data path alone (gather, augment, normalise), to show data is not the
bottleneck. The `unaccounted` side is accelexp's epoch with its time accounting switched off
(`accelexp.timing.StepClock` and the contention probe replaced by ones that do
nothing): the ratio accelexp / unaccounted is what the always-on accounting costs (target:
<= 1.01); the accounting's cost per step is also timed on its own, against the median step.

    python benchmarks/overhead.py                    # fp32 and amp, simple_cnn, synthetic data
    python benchmarks/overhead.py --repeats 7 --steps 60 --precisions fp32
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from timing import timed
from torch.utils.data import RandomSampler

from accelexp.config import register_configs, typed
from accelexp.data import BatchLoader, build_data, resolve_on_device
from accelexp.diagnosis.noise import NoiseSample
from accelexp.engine import Trainer
from accelexp.models import build_model
from accelexp.optim import build_optimizer, build_scheduler
from accelexp.parallel import build_strategy
from accelexp.precision.runtime import Precision
from accelexp.timing import Breakdown, StepClock
from accelexp.train import seed_everything

CONF_DIR = __file__.rsplit("/benchmarks/", 1)[0] + "/conf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--precisions", default="fp32,amp")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per timed epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                f"model={args.model}",
                "data=synthetic",
                f"data.batch_size={args.batch_size}",
                f"data.num_train={args.batch_size * args.steps}",
                "data.val_fraction=0",
                f"max_steps_per_epoch={args.steps}",
                "progress=false",
            ],
        )
    parts = typed(cfg)  # the builders' and the strategy's typed parts
    seed_everything(cfg.seed)
    data = build_data(parts.data, cfg.seed)
    strategy = build_strategy(typed(cfg))
    strategy.setup()
    device = strategy.device
    reference = build_model(parts.model, data.in_channels, data.num_classes, data.image_size)
    mean = torch.tensor(data.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.std).view(1, -1, 1, 1)
    images = ((data.train.images.float() / 255 - mean) / std).to(device)  # the plain loop's data
    labels = data.train.labels.to(device)

    def fresh():
        model = copy.deepcopy(reference).to(device)
        return model, build_optimizer(parts.optimizer, model.parameters(), cfg.optimizer.lr)

    print(
        f"model={args.model} batch={args.batch_size} steps={args.steps} threads={args.threads} "
        f"device={device} repeats={args.repeats} (medians; ratio = accelexp / plain)"
    )
    print(f"{'precision':<10}{'side':<12}{'wall s':>9}{'cpu s':>9}{'samples/s':>11}")
    for name in args.precisions.split(","):
        strategy.precision = Precision(name, device)  # the strategy's, for each side in turn
        compare(args, cfg, data, strategy, fresh, images, labels)


class NoClock:
    """A StepClock that accounts nothing: accelexp's loop as it was before the accounting."""

    excluded = 0.0  # no pause is ever left out

    def start(self) -> None:
        pass

    def mark(self, phase: int) -> None:
        pass

    def stop(self, comm=None) -> Breakdown:
        return Breakdown()

    def step_seconds(self) -> list[float]:
        return []


class NoProbe:
    """A ContentionProbe that samples nothing: the loop without the noise figures."""

    def start(self) -> None:
        pass

    def stop(self, step_seconds) -> NoiseSample:
        return NoiseSample(0.0, None, None, 1, None, None, None)


def accounting_seconds_per_step(device: torch.device, steps: int = 20000) -> float:
    """One step's accounting (five phase marks) timed on its own: the best of 5 runs."""
    clock, best = StepClock(device), float("inf")
    for _ in range(5):
        clock.start()
        start = time.perf_counter()
        for _ in range(steps):
            for phase in range(5):
                clock.mark(phase)
        best = min(best, (time.perf_counter() - start) / steps)
    clock.stop()
    return best


def compare(args, cfg, data, strategy, fresh, images, labels) -> None:
    """Time accelexp's epoch, the plain loop and the loader alone, alternating; print medians."""
    device, precision = strategy.device, strategy.precision
    loader = BatchLoader(
        data.train, args.batch_size, RandomSampler(range(len(data.train))), device,
        data.mean, data.std, augment=cfg.data.augment, drop_last=True,
        on_device=resolve_on_device(cfg.data.on_device, device, data.nbytes),  # as run.py does
    )  # fmt: skip

    def accelexp_epoch(accounting: bool = True):
        model, optimizer = fresh()
        scheduler = build_scheduler(typed(cfg).scheduler, optimizer, args.steps, 1)
        trainer = Trainer(model, optimizer, scheduler, strategy, args.steps, 20, False)
        if not accounting:
            trainer.clock, trainer.probe = NoClock(), NoProbe()
        trainer.train_epoch(loader, epoch=1)

    def plain_epoch():
        model, optimizer = fresh()
        model.train()
        order = torch.randperm(len(labels), device=device)
        for step in range(args.steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            with precision.autocast():
                loss = F.cross_entropy(model(images[idx]), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    def loader_only():
        for _ in loader:
            pass

    accelexp_epoch(), plain_epoch()  # warm-up: allocator, autocast caches, kernels
    times = {"accelexp": [], "plain": [], "loader": [], "unaccounted": []}
    for _ in range(args.repeats):
        times["accelexp"].append(timed(accelexp_epoch))
        times["plain"].append(timed(plain_epoch))
        times["loader"].append(timed(loader_only))
        times["unaccounted"].append(timed(lambda: accelexp_epoch(accounting=False)))
    samples = args.steps * args.batch_size
    medians = {}
    for side, runs in times.items():
        medians[side] = (
            statistics.median(w for w, _ in runs),
            statistics.median(c for _, c in runs),
        )
        wall, cpu = medians[side]
        print(f"{precision.name:<10}{side:<12}{wall:>9.3f}{cpu:>9.3f}{samples / wall:>11.0f}")
    (aw, ac), (pw, pc) = medians["accelexp"], medians["plain"]
    print(f"{precision.name:<10}{'ratio':<12}{aw / pw:>9.3f}{ac / pc:>9.3f}   <- target <= 1.03")
    uw, uc = medians["unaccounted"]
    print(f"{precision.name:<10}{'accounting':<12}{aw / uw:>9.3f}{ac / uc:>9.3f}   <- accelexp / "
          f"unaccounted, target <= 1.01")  # fmt: skip
    per_step, step = accounting_seconds_per_step(device), aw / args.steps
    print(
        f"{precision.name:<10}accounting alone: {per_step * 1e6:.2f} us per step = "
        f"{100 * per_step / step:.4f}% of the median step ({step * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
