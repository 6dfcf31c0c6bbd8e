"""Shared fixtures: Hydra-composed configs that run tiny and track into a private SQLite store.

`compose_cfg(*overrides)` composes `conf/config.yaml` with Hydra's compose API, the way `run.py`
does, on top of defaults that make a run take about a second on one CPU thread (synthetic 16px
data, 3 steps per epoch, one epoch) and that point MLflow at `<tmp_path>/mlflow.db`. Any default
is dropped when the test overrides the same key.

Creating an MLflow SQLite store runs all of MLflow's schema migrations (seconds). The session
migrates one empty store once and each test gets its own byte copy of it, so every test still
writes into a store of its own and none sees another's runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from mlflow.entities import Run
from omegaconf import DictConfig

from accelexp.config import register_configs
from accelexp.schema import SpeedConfig

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

# A run of about a second: 230 synthetic training images of 16x16, three steps of 32.
TINY_DATA = (
    "data.num_train=256",
    "data.num_test=128",
    "data.batch_size=32",
    "data.image_size=16",
)
TINY_RUN = ("progress=false", "epochs=1", "max_steps_per_epoch=3", "threads=1")
TINY_VIT = ("model=vit_tiny", "model.dim=32", "model.depth=2", "model.heads=2")  # 2 blocks

# No dropout and no augmentation: the only randomness left is the data order, which every
# strategy draws from the same seeded permutation (see Strategy.train_sampler).
EXACT = (
    "model.dropout=0",
    "data.augment=false",
    "parallelism.lr_scaling=none",
    "epochs=1",
    "data.num_train=512",  # enough for 4 full steps of 64
)


def group_options() -> list[tuple[str, str]]:
    """Every (group, option) pair found as `conf/<group>/<option>.yaml`."""
    return sorted(
        (group.name, option.stem)
        for group in CONF_DIR.iterdir()
        if group.is_dir()
        for option in group.glob("*.yaml")
    )


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compose_config(tracking_uri: str, *overrides: str) -> DictConfig:
    """Compose the run config with Hydra's compose API; tiny defaults unless overridden."""
    register_configs()
    given = {_key(o) for o in overrides}
    defaults = [f"mlflow.tracking_uri={tracking_uri}", *TINY_RUN]
    if "data" not in given:  # the tiny sizes only make sense for the synthetic set
        defaults += ["data=synthetic", *TINY_DATA]
    defaults = [d for d in defaults if _key(d) not in given]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[*defaults, *overrides])


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """`-m alone` (`make test`'s second phase) imports only the test files that mark a test
    `alone`: collecting the other files' tests only to deselect them takes seconds."""
    test_file = collection_path.name.startswith("test_") and collection_path.suffix == ".py"
    if config.getoption("markexpr") == "alone" and test_file:
        return "mark.alone" not in collection_path.read_text() or None
    return None


@pytest.fixture(autouse=True)
def _alone_when_marked(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """A test marked `alone` measures time or other processes' CPU (the verdicts, the noise
    probe), so it runs with no other test beside it. `make test` runs them after the others, by
    themselves; under `pytest -n 2` (pytest-xdist) with them in, this keeps them apart: an
    `alone` test takes the room's lock exclusively, the others share it, and a turnstile keeps
    new tests from starting while an `alone` test waits for the room."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    shared = shared_folder(tmp_path_factory)
    alone = request.node.get_closest_marker("alone") is not None
    with open(shared / "turnstile.lock", "a") as turnstile, open(shared / "room.lock", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, fully migrated MLflow SQLite store, copied (never used) by each test."""
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def store_uri(directory: Path) -> str:
    """The tracking URI of the MLflow store `new_store` makes in `directory`."""
    return f"sqlite:///{directory / 'mlflow.db'}"


def new_store(directory: Path, template: Path) -> str:
    """A fresh MLflow store in `directory`; returns its tracking URI."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, directory / "mlflow.db")
    return store_uri(directory)


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder all the xdist workers of this test session see (this session's own without)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> tuple[Path, object]:
    """(the folder `name`, what `build(folder)` returned), built once per test session whichever
    xdist workers ask for it: the first builds it under a lock, the others wait and read it back
    (pytest-xdist's recipe for a session fixture computed once; a module fixture is otherwise
    built again in each worker its tests land on). `build` returns JSON, or a finished
    process (`subprocess.CompletedProcess`: kept as its code and output). A build that raised is
    tried again by the next test that asks (and fails as it did)."""
    folder = shared_folder(tmp_path_factory) / name
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / "built.json"
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not kept.is_file():
            value = build(folder)
            if isinstance(value, subprocess.CompletedProcess):
                value = {"process": [value.args, value.returncode, value.stdout, value.stderr]}
            kept.write_text(json.dumps(value))
    value = json.loads(kept.read_text())
    if isinstance(value, dict) and list(value) == ["process"]:
        value = subprocess.CompletedProcess(*value["process"])
    return folder, value


@pytest.fixture(scope="session")
def reference_folder(
    tmp_path_factory: pytest.TempPathFactory, mlflow_template_db: Path
) -> Callable[..., tuple[Path, dict[str, float]]]:
    """`reference_folder(*overrides)` -> (the folder, the final metrics) of the tiny run the
    overrides compose, trained in this process once per test session whichever tests and workers
    ask for it (`built_once`). The folder holds the run folder `out/` and the MLflow store
    `mlflow.db`."""
    from accelexp.launch import launch

    def trained(*overrides: str) -> tuple[Path, dict[str, float]]:
        def train(folder: Path) -> dict[str, float]:
            uri = new_store(folder, mlflow_template_db)
            return launch(compose_config(uri, *overrides), folder / "out")

        name = hashlib.sha256("\0".join(overrides).encode()).hexdigest()[:16]
        return built_once(tmp_path_factory, f"references/{name}", train)

    return trained


@pytest.fixture(scope="session")
def reference(
    reference_folder: Callable[..., tuple[Path, dict[str, float]]],
) -> Callable[..., tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """`reference(*overrides)` -> (final parameters, final metrics) of the tiny run the overrides
    compose, trained once per test session (`reference_folder`)."""

    def trained(*overrides: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        folder, metrics = reference_folder(*overrides)
        return final_params(folder / "out"), metrics

    return trained


@pytest.fixture
def tracking_uri(tmp_path: Path, mlflow_template_db: Path) -> str:
    """This test's own MLflow store: `sqlite:///<tmp_path>/mlflow.db`."""
    return new_store(tmp_path, mlflow_template_db)


@pytest.fixture
def compose_cfg(tracking_uri: str) -> Callable[..., DictConfig]:
    """`compose_cfg("precision=amp", "epochs=2")` -> a composed, tiny, tracked-to-tmp config."""

    def _compose(*overrides: str) -> DictConfig:
        return compose_config(tracking_uri, *overrides)

    return _compose


def only_run(tracking_uri: str, experiment: str = "accelexp") -> Run:
    """The single run of `experiment` in the store, read back with a fresh client."""
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {tracking_uri}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected one run, found {len(runs)}"
    return runs[0]


def run_cli(*args: str, tmp_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
    extra = [f"hydra.run.dir={tmp_path / 'job'}"] if tmp_path is not None else []
    return subprocess.run(
        [sys.executable, "run.py", *args, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@functools.cache
def _entry_point() -> types.ModuleType:
    """The repository's run.py as a module (importing it registers the configs and --help).
    Its task function is given `__main__` as its module, as under `python run.py`: Hydra finds
    `conf/` beside the file then (it reads the config path of a named module as a package's)."""
    spec = importlib.util.spec_from_file_location("accelexp_run_py", REPO / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main.__wrapped__.__module__ = "__main__"
    return module


def run_here(
    capfd: pytest.CaptureFixture[str] | None, *args: str, tmp_path: Path | None = None
) -> subprocess.CompletedProcess:
    """`python run.py ARGS` in this process: run.py's `main` through `startup.run_main`, as its
    `__main__` does, with what the process would change put back afterwards (argv, environment,
    working folder, torch's threads, signal handlers, logging, Hydra's global state). For the
    many cases that end before training (bad input), and for runs whose process start-up would
    only repeat what pytest's has done (a sweep, a run read back from MLflow). Output is captured
    at the descriptors with `capfd`; without it (a fixture wider than a test), what this process
    writes through `sys.stdout`/`sys.stderr` (the job's log, progress, errors), not what the
    processes it starts write."""
    from hydra.core.global_hydra import GlobalHydra

    from accelexp import startup

    saved = (sys.argv, dict(os.environ), torch.get_num_threads())
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    loggers = {name: logging.getLogger(name) for name in ("", "accelexp")}
    logging_state = {name: (lg.handlers[:], lg.level) for name, lg in loggers.items()}
    for key in [k for k in os.environ if k.startswith(("HYDRA_", "MLFLOW_"))]:
        del os.environ[key]
    extra = [f"hydra.run.dir={tmp_path / 'job'}"] if tmp_path is not None else []
    sys.argv = [str(REPO / "run.py"), *args, *extra]
    if capfd is not None:
        capfd.readouterr()
    written = io.StringIO(), io.StringIO()
    try:
        with (
            contextlib.chdir(REPO),  # and back, whatever the job changed
            contextlib.redirect_stdout(written[0] if capfd is None else sys.stdout),
            contextlib.redirect_stderr(written[1] if capfd is None else sys.stderr),
        ):
            try:
                code = startup.run_main(_entry_point().main)
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else (exit.code is not None)
    finally:
        sys.argv = saved[0]
        os.environ.clear()
        os.environ.update(saved[1])
        torch.set_num_threads(saved[2])  # threads=N sets the process's
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for name, (kept, level) in logging_state.items():
            for handler in loggers[name].handlers:
                if handler not in kept:
                    handler.close()
            loggers[name].handlers[:] = kept
            loggers[name].setLevel(level)
        GlobalHydra.instance().clear()
    out, err = capfd.readouterr() if capfd is not None else (w.getvalue() for w in written)
    return subprocess.CompletedProcess(args, int(code), out, err)


@pytest.fixture
def cli(capfd: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess]:
    """`cli("model.foo=1", tmp_path=tmp_path)`: run.py in this process (`run_here`), for
    command lines that end before training."""
    return lambda *args, tmp_path=None: run_here(capfd, *args, tmp_path=tmp_path)


def final_params(output_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(output_dir / "checkpoints" / "best.pt", weights_only=True)["model"]


def assert_same_params(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5
) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)


def output_of(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def speed_cfg(**values: object) -> SpeedConfig:
    """A `speed` section, typed (as `SpeedSwitches.resolve` takes it): the schema's defaults,
    `values` over them."""
    return SpeedConfig(**values)


@contextlib.contextmanager
def served(store: str, folder: Path) -> Iterator[str]:
    """A real `mlflow server` of `store` on a free local port, its artifacts and log in
    `folder`; yields its base URL, stops it after. Its start is waited for as long as a loaded
    machine may take (5 minutes), only to catch a server that never answers."""
    import time

    from accelexp.parallel.world import free_port

    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "server.log", "w") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri",
             store, "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--artifacts-destination", str(folder / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no job workers
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while not _answers(f"{base}/health"):
                said = (folder / "server.log").read_text()
                assert process.poll() is None, said
                if time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not answer /health:\n{said[-2000:]}")
                time.sleep(0.5)
            yield base
        finally:
            process.terminate()
            process.wait(timeout=30)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


# A two-worker DDP run shared by the tests that read its profiler traces (test_profiler) and
# its memory figures (test_fsdp, beside the FSDP run of `two_workers_of_a_wide_mlp("fsdp")`):
# trained once a session (`reference_folder`), one worker launch for both.
def two_workers_of_a_wide_mlp(strategy: str) -> tuple[str, ...]:
    """Overrides of a run of 2 `strategy` workers on an MLP whose parameters outweigh its
    activations, its profiler on (epoch 1's steps 2-4 traced) and its step's memory measured
    after training (`max_batch.search=true`: `state_mem_mb`, `step_peak_mb` on a CPU)."""
    return (
        f"parallelism={strategy}",
        "parallelism.nprocs=2",
        "model=mlp",
        "model.widths=[512,512]",
        "max_batch.search=true",
        "profile=true",
        "data.num_train=1024",
        "max_steps_per_epoch=8",
    )


def run_py_help(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """`python run.py --help` in this process (`run_here`), once per test session whichever tests
    and xdist workers ask (`built_once`): tests/test_cli.py reads what it lists, and
    tests/test_docs.py runs the docs' `run.py --help` with it (it composes every option: ~2 s)."""
    return built_once(tmp_path_factory, "run-py-help", lambda folder: run_here(None, "--help"))[1]
