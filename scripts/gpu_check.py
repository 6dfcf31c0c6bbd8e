"""Model and hybrid parallelism over real GPUs: the check a maintainer runs on a GPU machine.

    .venv/bin/python scripts/gpu_check.py            # on 1 GPU: two stages share cuda:0
    .venv/bin/python scripts/gpu_check.py --cpu      # the same checks on the CPU: tests the script

With 2 or more GPUs each stage gets its own GPU and `hybrid` runs GPUs // 2 replicas of 2 GPUs; on
one GPU both stages are placed on it and `hybrid` runs one replica. Checks, each PASS or FAIL:

1. the split model (resnet18, eval-mode BatchNorm) gives the unsplit model's outputs and
   gradients on the GPU, for chunks 1 and 4;
2. `parallelism=model precision=amp`: fp16 autocast per stage and one GradScaler over the stages'
   parameters train 2 epochs, and the stages' devices and peak memory are logged;
3. `parallelism=model precision=bf16 parallelism.balance=compute`;
4. `parallelism=hybrid parallelism.engine=ddp` (NCCL, DDP over the multi-device replica);
5. `parallelism=hybrid parallelism.engine=horovod`, when Horovod was built with GPU operations
   (`scripts/build_horovod.sh` on a machine with CUDA and NCCL); otherwise SKIP, said why.

Exit code 0 when nothing failed. Runs go to a temporary MLflow store; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from accelexp.models import build_model  # noqa: E402
from accelexp.parallel.pipeline import Pipeline, split_layers  # noqa: E402

SMALL_RUN = (
    "data=synthetic",
    "data.image_size=32",
    "data.num_train=2048",
    "data.num_test=512",
    "data.batch_size=64",
    "epochs=2",
    "max_steps_per_epoch=10",
    "progress=false",
)


def check_same_numbers(devices: list[torch.device]) -> str:
    cfg = OmegaConf.create({"name": "resnet18", "pretrained": False, "small_input_max_size": 64})
    torch.manual_seed(0)
    reference = build_model(cfg, 3, 10, 32).to(devices[0]).eval()
    x = torch.randn(16, 3, 32, 32, device=devices[0])
    y = torch.randint(0, 10, (16,), device=devices[0])
    expected = reference(x)
    F.cross_entropy(expected, y).backward()
    for chunks in (1, 4):
        model = copy.deepcopy(reference)
        model.zero_grad()
        parts, _ = split_layers(model, len(devices))
        out = Pipeline(model, parts, devices, chunks).eval()(x)
        torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-4)
        F.cross_entropy(out, y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.to(q.device), q.grad, rtol=1e-3, atol=1e-4, msg=name)
    return f"outputs and gradients equal for chunks 1 and 4 over {[str(d) for d in devices]}"


def run_job(store: Path, name: str, *overrides: str) -> dict:
    """`python run.py ...` as a user types it; returns the run's params and metrics."""
    uri = f"sqlite:///{store / name}.db"
    command = [
        sys.executable, "run.py", *SMALL_RUN, *overrides,
        f"mlflow.tracking_uri={uri}", f"hydra.run.dir={store / name}",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr}")
    (run,) = MlflowClient(uri).search_runs(["1"])
    assert run.info.status == "FINISHED", run.info.status
    return {"params": run.data.params, "metrics": run.data.metrics}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run every check on the CPU instead")
    args = parser.parse_args()
    gpus = 0 if args.cpu else torch.cuda.device_count()
    if not args.cpu and gpus == 0:
        print(
            "No CUDA GPU is visible: run this on a GPU machine, or with --cpu to test the script."
        )
        return 2
    if args.cpu:
        devices, device_flag = ["cpu", "cpu"], ["device=cpu"]
    else:
        devices, device_flag = (["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cuda:0"]), []
    per_replica = 2 if gpus >= 2 else 1
    replicas = max(1, gpus // 2) if gpus else 2
    placement = f"parallelism.devices=[{','.join(devices)}]"
    hybrid = (
        "parallelism=hybrid", f"parallelism.nprocs={replicas}",
        f"parallelism.devices_per_replica={per_replica}", "parallelism.stages=2",
        "parallelism.chunks=2", "model=resnet18",
    )  # fmt: skip
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0) if gpus else 'CPU run'}; stages on "
          f"{devices}; hybrid: {replicas} replica(s) x {per_replica} device(s)")  # fmt: skip

    store = Path(tempfile.mkdtemp(prefix="accelexp-gpu-check-"))
    results: dict[str, str] = {}

    def check(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            detail = fn()
            status = "SKIP" if detail.startswith("SKIP") else "PASS"
            results[name] = f"{status} ({time.perf_counter() - start:.0f}s) {detail}"
        except Exception as error:  # every check runs; the summary says which failed
            results[name] = f"FAIL {type(error).__name__}: {error}"
        print(f"{name}: {results[name]}", flush=True)

    def model_amp() -> str:
        job = run_job(store, "model-amp", *device_flag, "parallelism=model", placement,
                      "parallelism.chunks=4", "precision=amp", "model=resnet18")  # fmt: skip
        params, metrics = job["params"], job["metrics"]
        assert [params["stage0_device"], params["stage1_device"]] == devices, params
        peaks = [metrics["stage0_peak_mem_mb"], metrics["stage1_peak_mem_mb"]]
        scale = metrics.get("grad_scale")
        if not args.cpu:
            assert scale and scale > 0, f"no GradScaler scale logged: {scale}"
        stage_params = f"{params['stage0_params']}/{params['stage1_params']}"
        return (f"test_acc {metrics['test_acc']:.3f}, grad_scale {scale}, stage params "
                f"{stage_params}, peak MiB {[round(p) for p in peaks]}")  # fmt: skip

    def model_bf16() -> str:
        job = run_job(store, "model-bf16", *device_flag, "parallelism=model", placement,
                      "precision=bf16", "parallelism.balance=compute",
                      "model=resnet18")  # fmt: skip
        params, metrics = job["params"], job["metrics"]
        return f"split_points {params['split_points']}, test_acc {metrics['test_acc']:.3f}"

    def hybrid_run(engine: str) -> str:
        job = run_job(store, f"hybrid-{engine}", *device_flag, *hybrid,
                      f"parallelism.engine={engine}", "precision=amp")  # fmt: skip
        params = job["params"]
        shape = {k: params[k] for k in ("world_size", "replicas", "devices_per_replica")}
        assert int(params["replicas"]) == replicas, shape
        return f"{shape}, {job['metrics']['samples_per_s']:.0f} samples/s"

    def hybrid_horovod() -> str:
        try:
            import horovod.torch as hvd
        except ImportError as error:
            return f"SKIP Horovod is not importable ({error}); run make setup"
        if not args.cpu and not hvd.nccl_built():
            return "SKIP this Horovod has no GPU operations (built without NCCL)"
        return hybrid_run("horovod")

    check("1 split == unsplit", lambda: check_same_numbers([torch.device(d) for d in devices]))
    check("2 model, amp (fp16 + GradScaler)", model_amp)
    check("3 model, bf16, balance=compute", model_bf16)
    check("4 hybrid, engine=ddp", lambda: hybrid_run("ddp"))
    check("5 hybrid, engine=horovod", hybrid_horovod)
    (store / "results.json").write_text(json.dumps(results, indent=2))
    failed = [name for name, result in results.items() if result.startswith("FAIL")]
    print(f"\n{len(results) - len(failed)}/{len(results)} passed or skipped; runs in {store}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
