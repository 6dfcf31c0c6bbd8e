"""Every bad input is one clear message: `python run.py` with a wrong, empty, negative, huge,
unset or misspelled value of each key (and of Hydra's own options) exits non-zero, names what is
wrong, and prints no Python traceback.

Each case runs run.py's `main` in this process (`conftest.run_here`: what the process does, its
global state put back after); nearly all fail in validation or in the checks before training.
`SUBPROCESS` cases also run as a real `python run.py` process, one of each kind of failure
(Hydra's parser, a config check, a folder Hydra cannot make, a sweep), where the timeout only
guards against a hang. Values tests/test_config.py and tests/test_cli.py already try (epochs=0,
device=tpu, data.batch_size=0, model=foo, ...) are not repeated here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, output_of, run_cli, run_here
from omegaconf import OmegaConf

from accelexp.config import ConfigError
from accelexp.config.resources import check_resources, usable_cores
from accelexp.data.sources import DEFAULT_DOWNLOAD_ROOT, DatasetNotFoundError, load_cifar10

# A run that would take a second, were its input good; the cases override what they test.
TINY = {
    "data": "synthetic",
    "epochs": "1",
    "max_steps_per_epoch": "1",
    "data.num_train": "64",
    "data.num_test": "32",
    "data.batch_size": "16",
    "data.image_size": "16",
    "progress": "false",
    "threads": "1",
}
RUN_KEYS = ("epochs", "max_steps_per_epoch", "data.batch_size", "progress", "threads")
UNSET = "ACCELEXP_TEST_SURELY_UNSET_VARIABLE"
HUGE = "1000000000000"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="valid where there is a GPU")


def case(overrides: str, named: str, *marks: pytest.MarkDecorator):
    """`overrides` as typed (space-separated); `named`: what the message must mention."""
    return pytest.param(overrides.split(), named, marks=marks, id=overrides)


CASES = [
    # --- top-level keys -------------------------------------------------------------------
    case("seed=-1", "seed"),
    case("seed=4294967296", "seed"),
    case("seed=abc", "seed"),
    case("seed=", "seed"),
    case("epochs=1.5", "epochs"),
    case("max_steps_per_epoch=-1", "max_steps_per_epoch"),
    case("target_accuracy=nan", "target_accuracy"),
    case("device=cuda", "device=cuda", no_gpu),
    case("threads=0", "threads"),
    case("threads=100000", "threads"),
    case("log_every_n_steps=0", "log_every_n_steps"),
    case("debug.raise_at_step=-3", "debug.raise_at_step"),
    # misspelled, added with +, removed, unknown options and flags
    case("epoch=1", "epoch"),
    case("+epoch=3", "epoch"),
    case("+optimizer.learning_rate=0.1", "optimizer.learning_rate"),
    case("~model", "model"),
    case("model=null", "Config group override"),
    case("+experiment=nope", "experiment"),
    case("--foo", "--foo"),
    # Hydra's composition errors, in one line that says what to type
    case("parallelism=ddpp", "Did you mean parallelism=ddp?"),
    case("data=", "Available options: cifar10, fashion_mnist, synthetic"),
    case("+model=resnet18", "model=resnet18, without +"),
    case("experiment=scaling", "+experiment=scaling"),
    case("modle=resnet18", "Did you mean model=resnet18?"),
    case("data.batchsize=3", "Did you mean data.batch_size=3?"),
    case("hydra.foo=1", "hydra.foo is not a key of Hydra's config"),
    case("epochs=null", "epochs cannot be null"),
    case("epochs==2", "epochs=2"),
    case("epochs=[1,2", "close the bracket"),
    case("precision=fp32,", "no trailing comma"),
    case("=3", "has no key"),
    case("--config-name=nope", "leave out --config-name"),
    case("--cfg=jobb", "invalid choice: 'jobb'"),
    case("-m epochs=range(0)", "epochs=range(0) sweeps no value"),
    case("-m epochs=choice()", "epochs=choice(1,2)"),
    case("-m parallelism=ddpp,ddp", "Did you mean parallelism=ddp?"),
    case("model=simple_cnn,mlp", "add -m to run a job for each"),
    case("~model.hidden", "model.hidden cannot be removed"),
    # --- mlflow ----------------------------------------------------------------------------
    case("mlflow.tracking_uri=foo://bar", "mlflow.tracking_uri"),
    case("mlflow.tracking_uri=", "mlflow.tracking_uri"),
    case("mlflow.tracking_uri=sqlite://", "mlflow.tracking_uri"),  # in memory: nothing kept
    case("mlflow.tracking_uri=sqlite:////proc/forbidden/mlflow.db", "/proc/forbidden"),
    case(f"mlflow.tracking_uri=${{oc.env:{UNSET}}}", UNSET),
    case("mlflow.experiment=", "mlflow.experiment"),
    case("mlflow.artifact_location=foo://bar", "mlflow.artifact_location"),
    case("mlflow.tags=abc", "mlflow.tags"),
    # --- speed -----------------------------------------------------------------------------
    case("speed.channels_last=maybe", "speed.channels_last"),
    case("speed.compile=fast", "speed.compile"),
    case("speed.optimizer_impl=turbo", "speed.optimizer_impl"),
    case("speed.tf32=maybe", "speed.tf32"),
    case("speed.activation_checkpointing=sometimes", "speed.activation_checkpointing"),
    case("speed.activation_checkpointing=selective speed.selective_ac_option=0", "op"),
    case("speed.activation_checkpointing=full", "no repeated blocks"),  # simple_cnn: none
    # --- data ------------------------------------------------------------------------------
    case("data.name=foo", "data.name"),
    case("data=fashion_mnist data.root=/nonexistent", "/nonexistent"),
    case(f"data=fashion_mnist data.root=/{'x' * 256}", "File name too long"),  # > NAME_MAX
    case(f"data=fashion_mnist data.root=${{oc.env:{UNSET}}}", UNSET),
    case("data.root=/tmp", "data.root applies only to"),  # synthetic reads no files
    case("data.batch_size=1000000000", "data.batch_size"),
    case("data.eval_batch_size=-1", "data.eval_batch_size"),
    case("data.num_workers=-1", "data.num_workers"),
    case("data.num_workers=1000", "data.num_workers"),
    case("data.val_fraction=0.999", "data.batch_size"),
    case("data.num_train=0", "data.num_train"),
    case(f"data.num_train={HUGE}", "data.num_train"),
    case("data.image_size=4", "data.image_size"),
    case("data.image_size=100000", "memory"),
    case("data.channels=0", "data.channels"),
    case("data.num_classes=1", "data.num_classes"),
    case("data.on_device=maybe", "data.on_device"),
    case("data.download=maybe", "data.download"),
    # --- model -----------------------------------------------------------------------------
    case("model.channels=[]", "model.channels"),
    case("model.hidden=1000000000", "model.hidden"),
    case("model.dropout=1", "model.dropout"),
    case("model=mlp model.widths=[]", "model.widths"),
    # --- precision -------------------------------------------------------------------------
    case("precision=amp precision.init_scale=0", "precision.init_scale"),
    case("precision=amp precision.growth_interval=99999999999", "precision.growth_interval"),
    case("precision.init_scale=1024", "applies only to precision=amp"),  # fp32: no scaler
    case("precision=fp8", "compute capability >= 8.9", no_gpu),  # fp8 tensor cores, or refused
    case("precision=fp8 parallelism=ddp", "compute capability >= 8.9", no_gpu),  # no worker
    # --- optimizer -------------------------------------------------------------------------
    case("optimizer.lr=1e308", "optimizer.lr"),
    case("optimizer.lr=nan", "optimizer.lr"),
    case("optimizer.momentum=1", "optimizer.momentum"),
    case("optimizer.nesterov=true optimizer.momentum=0", "optimizer.nesterov"),
    case("optimizer.weight_decay=1e308", "optimizer.weight_decay"),
    case("optimizer=adamw optimizer.betas=[0.9]", "optimizer.betas"),
    case("optimizer=adamw optimizer.eps=0", "optimizer.eps"),
    # --- scheduler -------------------------------------------------------------------------
    case("scheduler.warmup_epochs=-1", "scheduler.warmup_epochs"),
    case("scheduler=steplr scheduler.step_size=0", "scheduler.step_size"),
    case("scheduler=onecycle scheduler.pct_start=1", "scheduler.pct_start"),
    case("scheduler.name=foo", "scheduler.name"),
    # --- parallelism -----------------------------------------------------------------------
    case("parallelism.nprocs=0", "parallelism.nprocs"),
    case("parallelism.nprocs=2", "parallelism.nprocs"),  # single runs in one process
    case("parallelism=ddp parallelism.nprocs=64", "parallelism.oversubscribe=true", no_gpu),
    case(
        "parallelism=ddp parallelism.nprocs=2 data.num_train=64 data.batch_size=64",
        "data.batch_size",
    ),
    case("parallelism=ddp parallelism.backend=nccl", "parallelism.backend", no_gpu),
    case("parallelism=ddp parallelism.master_port=70000", "parallelism.master_port"),
    case("parallelism.lr_scaling=cubic", "parallelism.lr_scaling"),
    case("parallelism.accumulate_steps=0", "parallelism.accumulate_steps"),
    case("parallelism=model parallelism.chunks=3", "parallelism.chunks"),
    case("parallelism=hybrid parallelism.sync=mpi", "parallelism.sync"),
    case(
        "parallelism=hybrid parallelism.engine=horovod",
        "parallelism.engine is now parallelism.sync: parallelism.sync=horovod",
    ),
    case("parallelism=ddp parallelism.sync=horovod", "use parallelism=horovod"),
    case("parallelism=hybrid parallelism.sync=none", "use parallelism=model"),
    case("parallelism=horovod parallelism.op=sum", "parallelism.op"),
    # --- Hydra's own options ---------------------------------------------------------------
    case("hydra.run.dir=/proc/forbidden", "hydra.run.dir"),
    case("hydra.run.dir=", "hydra.run.dir"),
    case(f"hydra.run.dir=${{oc.env:{UNSET}}}", UNSET),
    case("-m hydra.sweep.dir=/proc/forbidden seed=1", "hydra.sweep.dir"),
    case("-m seed=-1", "seed"),
    case("hydra.job.chdir=maybe", "chdir"),
    case("hydra/launcher=nope", "hydra/launcher"),
]


def command(overrides: list[str], tmp_path: Path, tracking_uri: str) -> list[str]:
    """Flags first, then the tiny run's settings the case does not set, then the case's (the
    synthetic set's sizes only when the case does not pick its own data)."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    flags = [o for o in overrides if o.startswith("-")]
    given = [o for o in overrides if not o.startswith("-")]
    tiny = TINY if "data" not in keys else {k: v for k, v in TINY.items() if k in RUN_KEYS}
    defaults = {
        **tiny,
        "mlflow.tracking_uri": tracking_uri,
        "hydra.run.dir": str(tmp_path / "job"),
        "hydra.sweep.dir": str(tmp_path / "sweep"),
    }
    return [*flags, *(f"{k}={v}" for k, v in defaults.items() if k not in keys), *given]


def assert_one_clear_message(result: subprocess.CompletedProcess, named: str) -> None:
    text = output_of(result)
    assert result.returncode != 0, text
    assert "Traceback" not in text, text
    assert named in text, f"the message does not name {named!r}:\n{text}"
    for long_text in ("Config search path", "full_key:", "usage: run.py", "Could not override"):
        assert long_text not in text, f"Hydra's long message, not accelexp's line:\n{text}"


@pytest.mark.parametrize(("overrides", "named"), CASES)
def test_bad_input_is_one_clear_message(overrides, named, tmp_path, tracking_uri, capfd):
    assert_one_clear_message(run_here(capfd, *command(overrides, tmp_path, tracking_uri)), named)


SUBPROCESS = ["--foo", "epoch=1", "optimizer.lr=nan", "hydra.run.dir=/proc/forbidden", "-m seed=-1"]


@pytest.mark.parametrize(
    ("overrides", "named"), [c for c in CASES if " ".join(c.values[0]) in SUBPROCESS]
)
def test_bad_input_in_a_real_process_is_one_clear_message(overrides, named, tmp_path, tracking_uri):
    result = run_cli(*command(overrides, tmp_path, tracking_uri))  # its timeout: a hang guard
    assert_one_clear_message(result, named)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        case("-m repeats=0", "repeats=0: each configuration runs at least once; give repeats=1"),
        case("-m repeats=-1", "repeats=-1: each configuration runs at least once"),
        case(
            "-m precision=fp32,amp objective=time_to_target target_accuracy=null",
            "The job `precision=fp32` cannot run, so no job of the sweep ran",
        ),
    ],
)
def test_a_sweep_refuses_bad_input_before_its_first_job(
    overrides, named, tmp_path, tracking_uri, capfd
):
    result = run_here(capfd, *command(overrides, tmp_path, tracking_uri))
    assert_one_clear_message(result, named)
    assert result.returncode == 2, output_of(result)  # outcome.EXIT_BAD_INPUT
    assert "AssertionError" not in output_of(result)
    assert "Sweep FAILED after 0 runs" in output_of(result)  # its parent run closed, no job ran


def test_hydra_full_error_still_shows_the_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
    result = subprocess.run(
        [sys.executable, "run.py", "hydra.run.dir=/proc/forbidden"],
        cwd=REPO,
        env={**env, "HYDRA_FULL_ERROR": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Traceback" in output_of(result)


# --- the checks behind some of the cases, in-process -----------------------------------------


def test_more_cpu_workers_than_cores_only_when_forced(compose_cfg):
    workers = usable_cores() + 1
    cfg = compose_cfg("parallelism=ddp", "device=cpu", "data.batch_size=8", "threads=null")
    with pytest.raises(ConfigError, match=r"parallelism\.oversubscribe=true"):
        check_resources(cfg, workers=workers)
    check_resources(OmegaConf.merge(cfg, {"parallelism": {"oversubscribe": True}}), workers)


@no_gpu
def test_fp8_without_fp8_tensor_cores_exits_2_before_any_worker(tmp_path, tracking_uri, capfd):
    overrides = ["precision=fp8", "parallelism=ddp"]
    result = run_here(capfd, *command(overrides, tmp_path, tracking_uri))
    text = output_of(result)
    assert result.returncode == 2, text
    assert "fp8 tensor cores" in text and "it computes on the CPU" in text  # why
    assert "Use precision=bf16 " in text and "precision=bf16_true" in text  # what instead
    assert "Starting 2 ddp workers" not in text


def test_a_given_data_root_must_exist(compose_cfg):
    cfg = compose_cfg("data=cifar10", "data.root=/nonexistent/cifar", "data.download=false")
    with pytest.raises(DatasetNotFoundError, match=r"data\.root=/nonexistent/cifar does not exist"):
        load_cifar10(cfg.data)


def test_a_root_in_the_download_folder_may_not_exist_yet(compose_cfg):
    """accelexp's own `outputs/data/` is where downloads go: there a missing root is created."""
    root = DEFAULT_DOWNLOAD_ROOT / "surely-not-there"
    cfg = compose_cfg("data=cifar10", f"data.root={root}", "data.download=false")
    with pytest.raises(DatasetNotFoundError, match="CIFAR-10 was not found"):
        load_cifar10(cfg.data)
    assert not root.exists()
