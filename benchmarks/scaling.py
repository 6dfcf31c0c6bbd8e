"""Weak scaling of DDP and Horovod from 1 to N workers, like Horovod's synthetic benchmark.

Each configuration is a real job, `python run.py parallelism=S parallelism.nprocs=N data=synthetic
threads=1 ...` (so the real launchers start the workers), tracked in a throwaway MLflow store.
A job's throughput is the median `samples_per_s` over its epochs after the first (warm-up); the
configurations alternate within each repeat, and the report gives medians over the repeats:
img/s per worker, total img/s, and weak-scaling efficiency = total(N) / (N x total(1)), with the
jobs' CPU time (children's user+sys, start-up included) beside their wall time. A second table
says where a step's time went (accelexp's time accounting, `time/*`: ms per step, medians over
the epochs after the first and over the repeats) and each job's diagnosis.

    python benchmarks/scaling.py                    # ddp and horovod, 1 and 2 workers, 5 repeats
    python benchmarks/scaling.py --strategies ddp --nprocs 1,2,4 --repeats 7
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow import MlflowClient

from accelexp.record import DIAGNOSIS, SAMPLES_PER_S, TIME_PARTS, time_s

REPO = Path(__file__).resolve().parents[1]
PARTS = TIME_PARTS


def run_job(strategy: str, nprocs: int, args: argparse.Namespace, store: Path, tag: str) -> dict:
    uri = f"sqlite:///{store / 'mlflow.db'}"
    command = [
        sys.executable, "run.py", f"parallelism={strategy}", f"parallelism.nprocs={nprocs}",
        f"model={args.model}", "data=synthetic", f"data.batch_size={args.batch_size}",
        f"data.num_train={args.batch_size * args.steps * nprocs * 2}", "data.val_fraction=0",
        "data.num_test=256", f"epochs={args.epochs}", f"max_steps_per_epoch={args.steps}",
        f"threads={args.threads}", "progress=false", f"mlflow.tracking_uri={uri}",
        f"mlflow.run_name={tag}", f"hydra.run.dir={store / tag}",
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    client = MlflowClient(uri)
    run = client.search_runs(
        [client.get_experiment_by_name("accelexp").experiment_id],
        filter_string=f"attributes.run_name = '{tag}'",
    )[0]

    def after_warmup(metric: str) -> float:
        history = client.get_metric_history(run.info.run_id, metric)
        per_epoch = [m.value for m in sorted(history, key=lambda m: m.step)][1:]  # no warm-up
        return statistics.median(per_epoch)

    step_ms = {part: 1e3 * after_warmup(time_s(part)) / args.steps for part in PARTS}
    return {
        "samples_per_s": after_warmup(SAMPLES_PER_S),
        "wall_s": wall,
        "cpu_s": cpu,
        "step_ms": step_ms,
        "diagnosis": run.data.tags.get(DIAGNOSIS, "?"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default="ddp,horovod")
    parser.add_argument("--nprocs", default="1,2")
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (weak scaling)")
    parser.add_argument("--steps", type=int, default=30, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    counts = [int(n) for n in args.nprocs.split(",")]
    configs = list(itertools.product(strategies, counts))
    results: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = configs if repeat % 2 == 0 else configs[::-1]  # alternate, so drift hits all
            for strategy, n in order:
                result = run_job(strategy, n, args, Path(tmp), f"{strategy}-np{n}-r{repeat}")
                results[strategy, n].append(result)
                print(
                    f"  repeat {repeat + 1}: {strategy} np{n}: {result['samples_per_s']:.0f} img/s",
                    flush=True,
                )
    cores = len(os.sched_getaffinity(0))
    print(
        f"\nmodel={args.model} batch/worker={args.batch_size} threads/worker={args.threads} "
        f"cores={cores} repeats={args.repeats} (medians)"
    )
    print(f"{'strategy':<9}{'workers':>8}{'img/s total':>13}{'img/s/worker':>14}{'efficiency':>12}"
          f"{'job wall s':>12}{'job cpu s':>11}")  # fmt: skip
    for strategy in strategies:
        base = statistics.median(r["samples_per_s"] for r in results[strategy, counts[0]])
        for n in counts:
            runs = results[strategy, n]
            total = statistics.median(r["samples_per_s"] for r in runs)
            efficiency = total / (n / counts[0] * base)
            print(
                f"{strategy:<9}{n:>8}{total:>13.0f}{total / n:>14.0f}{efficiency:>12.3f}"
                f"{statistics.median(r['wall_s'] for r in runs):>12.1f}"
                f"{statistics.median(r['cpu_s'] for r in runs):>11.1f}"
            )
    print("\nWhere a step's time went (ms per step, mean over ranks; medians):")
    print(f"{'strategy':<9}{'workers':>8}" + "".join(f"{p:>10}" for p in (*PARTS, "step"))
          + "  diagnosis")  # fmt: skip
    for strategy, n in configs:
        runs = results[strategy, n]
        ms = {p: statistics.median(r["step_ms"][p] for r in runs) for p in PARTS}
        verdicts = sorted({r["diagnosis"] for r in runs})
        print(
            f"{strategy:<9}{n:>8}" + "".join(f"{ms[p]:>10.2f}" for p in PARTS)
            + f"{sum(ms.values()):>10.2f}  {','.join(verdicts)}"
        )  # fmt: skip


if __name__ == "__main__":
    main()
