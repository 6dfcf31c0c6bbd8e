"""Every command in README.md and docs/*.md is run here, or checked as far as this machine allows.

The fenced shell blocks (```bash, ```sh, ```console) of the docs are read line by line (`\\`
continuations joined, `# comments` dropped; in ```console blocks only the `$ ` lines). Each
command is handled by the first rule in `RULES` that matches it; a command no rule knows fails
its test, so a new kind of command in the docs needs a rule here. What the rules do:

- `python run.py ...` composes every job of the command with Hydra (a `-m` sweep: every point of its
  grid; an Optuna study: the ends of its intervals) and validates it with accelexp's own checks
  (a sweep's objective against its sweeper's direction too). The README's commands, the ones a
  user pastes first, then run for real (run.py's `main` in this process: a new process would only
  repeat pytest's imports) into this module's MLflow store, at a tiny size: `epochs=1
  max_steps_per_epoch=2 threads=1 progress=false repeats=1`, the synthetic set shrunk to 256 images
  of 16 px (other data sets keep their size), a sweep cut to two jobs (the first two values of its
  first swept key, the first value of the others), folders in tmp; one whose path another test
  runs for real (`RUN_BY`) is composed only. The docs/ commands are composed
  and validated (every mission path they show runs for real in its own test file). Not run even in
  the README: a command whose comment says it `needs a GPU` / `needs N GPUs`, one on CIFAR-10 when
  the set is not on disk (tests have no network), one with `...` (a pattern: your overrides go
  there), and Slurm (`hydra/launcher=slurm` also checks that nodes x tasks per node =
  `parallelism.nprocs`).
- `torchrun` / `horovodrun` / `srun`: the run.py part is composed and validated (a world that
  torchrun and horovodrun make on one host is joined for real in tests/test_parallel.py).
- `accelexp-report ...` runs against a store that holds a sweep of the experiment it names
  (`accelexp` when it names none), writing into tmp; its `main` in this process (the installed
  command is started for real in tests/test_report_diagnose.py). The memory study's and the
  scaling study's sweeps are the ones their own tests run (tests/test_memory_study.py,
  tests/test_sweeps.py: their session fixtures, imported here); another experiment's is a tiny
  sweep of it; each built once a test session whichever tests and xdist workers ask
  (`conftest.built_once`), not once per worker that happens to run a report.
- `mlflow ui` / `mlflow server`: MLflow's own parser takes the command line (a real server is
  started and used in tests/test_sweeps.py and tests/test_credentials.py).
- `pip install -e '.[EXTRAS]'`: each extra is declared in pyproject.toml (installing needs the
  network). `make TARGET` exists (`make -n`). `bash scripts/X.sh` is valid shell (`bash -n`), and
  runs for real when `DRY_RUN=1` (unless the test `DRY_RUN_BY` names runs that very dry run).
  `horovodrun --check-build` runs, in this process (its checks fork: from here, with torch
  imported), and says it was built with PyTorch. `python benchmarks/X.py` answers `--help`, in
  this process (a new one would only repeat pytest's imports; the benchmarks take minutes: `make
  bench` runs them, and tests/test_chaos.py starts benchmarks/chaos.py for real). `run.py
  --help` is the one tests/test_cli.py reads (`conftest.run_py_help`).

Placeholders in commands are written `<like this>` (`<run id>`, `<db host>`); `...` stands for the
user's own overrides. Commands that start several processes or compile are marked slow.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import itertools
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf, open_dict
from test_memory_study import study_sweep  # noqa: F401 (a fixture: the memory study's sweep)
from test_sweeps import grid_sweep  # noqa: F401 (a fixture: the scaling study's sweep)

from accelexp.config import register_configs
from accelexp.config.validate import check_one_job_of_a_study, check_sweep_objective, validate
from accelexp.report import main as report_main
from tests.conftest import (
    CONF_DIR,
    REPO,
    built_once,
    new_store,
    run_here,
    run_py_help,
    store_uri,
)

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent  # the venv's bin: python, torchrun, horovodrun, mlflow, ...
FENCE = re.compile(r"^\s*```(\S*)\s*$")
SHELL_BLOCKS = {"bash", "sh", "console"}
PLACEHOLDER = re.compile(r"<[^<>]+>")
NEEDS_GPU = re.compile(r"\bneeds (a|\d+) GPUs?\b")

# The tiny size every real run is cut to (keys the command sets are replaced, not duplicated).
# (repeats=1: a study's repeats run one round; tests/test_sweeps.py runs repeats for real)
TINY = {
    "progress": "false",
    "epochs": "1",
    "max_steps_per_epoch": "2",
    "threads": "1",
    "repeats": "1",
}
TINY_SYNTHETIC = {
    "data.num_train": "256",
    "data.num_test": "128",
    "data.batch_size": "32",
    "data.image_size": "16",
}


@dataclass(frozen=True)
class Command:
    """One command line of a doc: where it is, its text (continuations joined), its comment."""

    source: str
    text: str
    comment: str = ""

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    def words(self) -> tuple[dict[str, str], list[str]]:
        """Leading `VAR=value` assignments, and the command with `.venv/bin/` dropped from it."""
        argv, env = self.argv, {}
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
        if argv:
            argv[0] = argv[0].removeprefix(".venv/bin/")
        return env, argv


def split_comment(line: str) -> tuple[str, str]:
    """`cmd 'a # b' # note` -> ("cmd 'a # b'", "note"): a # after a blank, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def doc_commands(path: Path) -> list[Command]:
    """The commands of the shell blocks of one Markdown file."""
    commands: list[Command] = []
    language = None  # inside a fence: its language
    pending, start, notes = "", 0, []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(raw)
        if fence:
            language = None if language is not None else fence.group(1)
            continue
        if language not in SHELL_BLOCKS:
            continue
        line = raw.strip()
        if language == "console":
            if not line.startswith("$ ") and not pending:
                continue  # output
            line = line.removeprefix("$ ")
        text, note = split_comment(line)
        if not text:
            continue  # a comment or blank line
        if not pending:
            start = number
        notes.append(note)
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{start}"
        commands.append(Command(where, pending + text, " ".join(n for n in notes if n)))
        pending, notes = "", []
    return commands


def unique(commands: list[Command]) -> list[Command]:
    """One of each command text (its first place, and the others named in its source)."""
    places: dict[str, list[Command]] = {}
    for command in commands:
        places.setdefault(command.text, []).append(command)
    return [
        Command(", ".join(c.source for c in same), same[0].text, same[0].comment)
        for same in places.values()
    ]


ALL_COMMANDS = unique([command for path in DOCS for command in doc_commands(path)])


# --- composing a run.py command ----------------------------------------------------------------


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _points(override: Override) -> list[str]:
    """The values a swept key takes: each of a list, choice() or range(); the two ends of an
    interval(), which an optimizing sweeper (Optuna's) draws between."""
    if override.is_interval_sweep():
        interval = override.value()
        return [str(interval.start), str(interval.end)]
    return list(override.sweep_string_iterator())


def _parsed(key: str, value: str) -> Override:
    return OverridesParser.create().parse_overrides([f"{key}={value}"])[0]


def _compose(overrides: list[str]) -> DictConfig:
    """The config of one job, with its `hydra` node (launcher, sweeper params)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _without_hydra(cfg: DictConfig) -> DictConfig:
    job = cfg.copy()
    with open_dict(job):
        del job["hydra"]
    return job


@dataclass
class RunPy:
    """A `run.py` command's overrides, taken apart: the fixed ones and the swept ones."""

    overrides: list[str]
    multirun: bool
    options: list[str] = field(default_factory=list)  # --help, --cfg job, ...

    @classmethod
    def parse(cls, args: list[str]) -> RunPy:
        args = [PLACEHOLDER.sub(lambda m: m.group(0)[1:-1], a) for a in args]  # <run-id> -> run-id
        multirun = any(a in ("-m", "--multirun") for a in args)
        args = [a for a in args if a not in ("-m", "--multirun", "...")]
        options = [a for a in args if a.startswith("-")]
        if "--cfg" in options or "-c" in options:  # its value follows it
            i = args.index(options[0])
            options, args = args[i : i + 2], args[:i] + args[i + 2 :]
        return cls([a for a in args if not a.startswith("-")], multirun, options)

    def grid(self) -> tuple[list[str], dict[str, list[str]]]:
        """The fixed overrides, and each swept key's values: the command line's sweep over the
        study's grid (the command line wins)."""
        parsed = OverridesParser.create().parse_overrides(self.overrides)
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        swept = {o.get_key_element(): _points(o) for o in parsed if o.is_sweep_override()}
        if not self.multirun:
            assert not swept, f"a sweep ({', '.join(swept)}) without -m"
            return fixed, {}
        study = _compose(fixed).hydra.sweeper.get("params") or {}
        given = {_key(o) for o in fixed} | {_key(k) for k in swept}
        grid = {
            key: _points(p) if p.is_sweep_override() else [p.get_value_element_as_str()]
            for key, value in study.items()
            if _key(key) not in given
            for p in [_parsed(key, value)]
        }
        return fixed, grid | swept

    def jobs(self) -> list[list[str]]:
        """Every job's overrides."""
        fixed, grid = self.grid()
        points = itertools.product(*grid.values())
        return [fixed + [f"{k}={v}" for k, v in zip(grid, point, strict=True)] for point in points]


def compose_and_validate(run: RunPy) -> list[DictConfig]:
    """Each job of the command composed by Hydra and validated; their full configs."""
    configs = []
    for job in run.jobs():
        cfg = _compose(job)
        validate(_without_hydra(cfg))
        if not run.multirun:  # a study that sweeps, started without -m, is refused
            check_one_job_of_a_study(cfg.hydra.sweeper.get("params") or {}, job)
        else:  # and a sweep's objective the sweeper's direction disagrees with
            check_sweep_objective(cfg)
        configs.append(cfg)
    return configs


def _many_processes(cfg: DictConfig) -> bool:
    return cfg.parallelism.nprocs > 1 or cfg.speed.compile != "off"


# --- running things ------------------------------------------------------------------------


# The session fixtures (imported above) whose sweep an `accelexp-report --experiment NAME` reads.
SWEEP_OF = {"memory_vs_speed": "study_sweep", "scaling": "grid_sweep"}


@dataclass
class Store:
    """This module's MLflow store and scratch folder, shared by every command (like a user's),
    and the stores the reports read (`sweep_of`)."""

    root: Path
    uri: str
    request: pytest.FixtureRequest
    count: int = 0

    def folder(self, name: str) -> Path:
        self.count += 1
        return self.root / f"{name}-{self.count}"

    def sweep_of(self, experiment: str) -> str:
        """The tracking URI of a store whose newest sweep is one of `experiment`: the sweep its
        own test runs (`SWEEP_OF`), else a tiny sweep of it (`tiny_sweep`); built once a test
        session whichever tests and xdist workers ask."""
        if experiment in SWEEP_OF:
            built = self.request.getfixturevalue(SWEEP_OF[experiment])
            return built if isinstance(built, str) else built[1]  # grid_sweep: (folder, uri, ..)
        factory = self.request.getfixturevalue("tmp_path_factory")
        template = self.request.getfixturevalue("mlflow_template_db")
        folder, _ = built_once(
            factory, f"docs-sweeps/{experiment}", lambda f: tiny_sweep(experiment, f, template)
        )
        return store_uri(folder)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, mlflow_template_db: Path, request) -> Store:
    root = tmp_path_factory.mktemp("docs")
    return Store(root, new_store(root, mlflow_template_db), request)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "MLFLOW_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env | (extra or {})


def run_py_ok(args: list[str]) -> None:
    """`python run.py ARGS` in this process (`conftest.run_here`): a new process would only
    repeat pytest's imports (torch, MLflow: most of a tiny run's time)."""
    result = run_here(None, *args)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"run.py {shlex.join(args)} exited {result.returncode}\n{output}"


def run_ok(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run a command in the repository; its output, or a failure that shows it."""
    done = subprocess.run(
        argv, cwd=REPO, env=_env(env), capture_output=True, text=True, timeout=1800
    )  # the timeout only guards against a hang
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{output[-4000:]}"
    return output


def executable(word: str) -> str:
    """`python`/`.venv/bin/python` -> this venv's python; `torchrun` -> the venv's torchrun."""
    name = word.removeprefix(".venv/bin/")
    if name in ("python", "python3"):
        return sys.executable
    return str(BIN / name) if (BIN / name).exists() else name


def run_tiny(
    run: RunPy, configs: list[DictConfig], uri: str, folder: Callable[[str], Path]
) -> None:
    """Run the command for real, its overrides cut to the tiny size and to two jobs (the first
    two values of its first swept key, the first of the others; an Optuna study, two trials
    among those values), tracked into the store `uri`, its folders `folder("run")` and
    `folder("sweep")`."""
    sizes = dict(TINY)
    if all(cfg.data.name == "synthetic" for cfg in configs):
        sizes |= TINY_SYNTHETIC
    warmup = max(cfg.scheduler.warmup_epochs for cfg in configs)
    sizes["epochs"] = str(int(warmup) + 1)
    sizes["mlflow.tracking_uri"] = uri
    sizes["hydra.run.dir"] = str(folder("run"))
    sizes["hydra.sweep.dir"] = str(folder("sweep"))
    if configs[0].hydra.sweeper.get("n_trials") is not None:  # an optimizing sweeper's
        sizes["hydra.sweeper.n_trials"] = "2"
    fixed, grid = run.grid()
    kept = [o for o in fixed if _key(o) not in sizes]
    swept = [(key, values) for key, values in grid.items() if _key(key) not in sizes]
    for i, (key, values) in enumerate(swept):
        kept.append(f"{key}={','.join(values[: 2 if i == 0 else 1])}")
    multirun = ["-m"] if run.multirun else []
    run_py_ok([*multirun, *kept, *(f"{k}={v}" for k, v in sizes.items())])


def cifar10_on_disk(cfg: DictConfig) -> bool:
    root = Path(cfg.data.root or REPO / "outputs/data/cifar10")
    return (root / "cifar-10-batches-py").is_dir()


def pasted_first(command: Command) -> bool:
    """A README command: what a new user runs first, so it runs for real here."""
    return any(place.startswith(README.name + ":") for place in command.source.split(", "))


# README commands whose path another test runs for real (the same overrides, at a tiny size):
# composed and validated here, not run twice. Each test named must set those keys.
RUN_BY = {
    "+experiment=memory_vs_speed": "tests/test_memory_study.py",  # the study's sweep
    "+experiment=scaling": "tests/test_sweeps.py",  # the study's sweep: workers x precision
    "repeats=3": "tests/test_sweeps.py",  # repeats round-robin, one row per configuration
    "parallelism=fsdp model=vit_tiny": "tests/test_contract.py",  # FSDP workers train a ViT
    "parallelism=pipeline parallelism.schedule=1f1b model=vit_tiny": "tests/test_contract.py",
    "parallelism=ddp parallelism.nprocs=2 data=synthetic": "tests/test_contract.py",  # DDP workers
    "-m precision=fp32,amp,bf16": "tests/test_sweeps.py",  # a sweep over precisions, its report
    "+experiment=autotune": "tests/test_autotune.py",  # the loop, its decisions, its path
    "+experiment=optuna": "tests/test_optuna.py",  # Optuna studies: one and two objectives
}


def run_elsewhere(command: Command) -> str | None:
    """The test that runs this README command's path for real, if one does."""
    return next((test for text, test in RUN_BY.items() if text in command.text), None)


def test_the_tests_named_for_readme_commands_run_them() -> None:
    for text, test in RUN_BY.items():
        assert any(text in c.text for c in doc_commands(README)), f"no README command has {text}"
        source = (REPO / test).read_text()
        words = [w.split("=")[0] for w in text.split() if "=" in w]
        assert all(w in source for w in words), f"{test} does not run {text}"


def not_here(command: Command, configs: list[DictConfig]) -> str | None:
    """Why the command is not run here (then it is only composed and validated), or None."""
    if not pasted_first(command):
        return "a docs/ command: composed and validated; its path runs in its own test"
    if run_elsewhere(command):
        return f"its path runs for real in {run_elsewhere(command)}"
    if NEEDS_GPU.search(command.comment):
        return "needs a GPU"
    if "..." in command.argv or PLACEHOLDER.search(command.text):
        return "a pattern: `...` and `<placeholders>` stand for the user's values"
    if any(cfg.data.name == "cifar10" and not cifar10_on_disk(cfg) for cfg in configs):
        return "CIFAR-10 is not on disk and tests have no network"
    return None


def check_run_py(command: Command, store: Store) -> None:
    """Compose and validate every job; run it for real at a tiny size where this machine can."""
    _, argv = command.words()
    at = argv.index("run.py")
    run = RunPy.parse(argv[at + 1 :])
    if run.options == ["--help"] and not run.overrides:  # tests/test_cli.py's, read there
        result = run_py_help(store.request.getfixturevalue("tmp_path_factory"))
        assert result.returncode == 0, result.stdout + result.stderr
        return
    if run.options:  # --cfg job, --info ...: Hydra answers without training
        run_py_ok([*run.options, *run.overrides])
        return
    configs = compose_and_validate(run)
    if configs[0].hydra.launcher.get("_target_", "").endswith("SlurmLauncher"):
        launcher_cfg = configs[0].hydra.launcher
        for cfg in configs:
            workers = launcher_cfg.nodes * launcher_cfg.tasks_per_node
            assert workers == cfg.parallelism.nprocs, (
                f"{command.source}: Slurm starts nodes x tasks_per_node = {workers} workers, but "
                f"parallelism.nprocs={cfg.parallelism.nprocs}"
            )
        return  # needs Slurm: composed and validated
    if not_here(command, configs):
        return
    assert command_is_slow(command) or not any(map(_many_processes, configs)), (
        f"{command.source} starts several processes or compiles: make command_is_slow() know it"
    )
    run_tiny(run, configs, store.uri, store.folder)


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of the flag `name` in `args` (`--name V` or `--name=V`); None when absent."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def check_launcher(command: Command, store: Store) -> None:
    """torchrun/horovodrun/srun + run.py: the run.py part composed and validated, in the world
    the launcher's flags make where they say its size (`launch.take_world_size`: the config
    takes it)."""
    _, argv = command.words()
    at = argv.index("run.py")
    flags = argv[:at]
    size = _flag(flags, "-np")
    if (per_node := _flag(flags, "--nproc-per-node")) is not None:
        size = str(int(per_node) * int(_flag(flags, "--nnodes") or 1))
    world = [f"parallelism.nprocs={size}"] if size else []
    compose_and_validate(RunPy.parse([*argv[at + 1 :], *world]))


def tiny_sweep(experiment: str, folder: Path, template: Path) -> bool:
    """A tiny sweep of `experiment` into a new store in `folder`, as a user's sweep of it would
    be: the study's first value of each swept key (a 1-worker fp32 baseline) when it is a study,
    else the docs' precision sweep, tracked to that experiment."""
    study = CONF_DIR / "experiment" / f"{experiment}.yaml"
    if study.is_file():
        grid = OmegaConf.load(study).hydra.sweeper.params
        text = f"run.py -m +experiment={experiment} " + " ".join(
            f"{key}={_points(_parsed(key, values))[0]}" for key, values in grid.items()
        )
    else:
        text = f"run.py -m precision=fp32,bf16 data=synthetic mlflow.experiment={experiment}"
    run = RunPy.parse(shlex.split(text)[1:])
    uri = new_store(folder, template)
    run_tiny(run, compose_and_validate(run), uri, lambda name: folder / name)
    return True


def check_report(command: Command, store: Store) -> None:
    """accelexp-report against a store with a sweep of the experiment it names (`accelexp`
    when it names none: `--sweep latest` is that sweep), writing into tmp."""
    _, argv = command.words()
    args = argv[1:]
    named = "--experiment" in args
    experiment = args[args.index("--experiment") + 1] if named else "accelexp"
    if "--tracking-uri" not in args:
        args += ["--tracking-uri", store.sweep_of(experiment)]
    if "--output-dir" not in args:
        args += ["--output-dir", str(store.folder("report"))]
    # in this process: the installed command's own start is tests/test_report_diagnose.py's
    assert report_main(args) == 0, f"accelexp-report {shlex.join(args)} failed (its output above)"


def check_mlflow_server(command: Command, store: Store) -> None:
    """mlflow ui/server: MLflow's own command-line parser takes every option as written (`ui` is
    `server` under another name). A PostgreSQL URI names the driver that the `postgres` extra
    installs. Not started here: tests/test_sweeps.py and tests/test_credentials.py start a real
    `mlflow server` over a store of runs and use it (REST API, browser, basic auth)."""
    _, argv = command.words()
    uri = next((argv[i + 1] for i, a in enumerate(argv) if a == "--backend-store-uri"), "")
    if uri.startswith("postgresql"):
        driver = uri.split("://")[0].partition("+")[2]
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        names = [re.split(r"[\[<>=]", r)[0] for r in extras["optional-dependencies"]["postgres"]]
        assert driver in names, f"{command.source}: {uri} needs {driver or 'a named driver'}"
        from sqlalchemy import create_engine

        create_engine(uri).dispose()  # imports the driver setup installed; connects to nothing
    from mlflow.cli import cli as mlflow_cli

    group = mlflow_cli.make_context("mlflow", argv[1:], resilient_parsing=False)
    name, subcommand, rest = mlflow_cli.resolve_command(group, argv[1:])
    subcommand.make_context(name, rest, parent=group)  # a usage error for an unknown option


def check_pip_extras(command: Command, store: Store) -> None:
    """pip install -e '.[a,b]': each extra is declared and installed (scripts/setup.sh installs
    the `team` extra, so this is what a fresh machine's setup really installed)."""
    _, argv = command.words()
    spec = next(a for a in argv if a.startswith(".["))
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = declared["optional-dependencies"]
    for extra in spec[2:-1].split(","):
        assert extras.get(extra), f"{command.source}: no extra {extra!r} in pyproject.toml"
        for requirement in extras[extra]:
            name = re.split(r"[\[<>=]", requirement)[0]
            assert importlib.metadata.version(name), f"{command.source}: {name} not installed"


def check_make(command: Command, store: Store) -> None:
    """make TARGET [VAR=...]: the target exists (`make -n` prints what it would run)."""
    _, argv = command.words()
    targets = [a for a in argv[1:] if "=" not in a and not a.startswith("-")]
    run_ok(["make", "-n", *targets])


# Dry runs of scripts that a test runs as the docs show them (the same variables and values;
# PYTHON: this venv's): not run twice.
DRY_RUN_BY = {
    # test_session_script_parses_and_its_dry_run_lists_every_step (and the ladder, memory plans)
    "scripts/gpu_session.sh": "tests/test_gpu_scripts.py",
}


def dry_run_elsewhere(env: dict[str, str], argv: list[str]) -> str | None:
    """The test that runs this very dry run (each variable the command sets, in the test's
    environment as `"NAME": "value"`; the script, with no arguments), if one does."""
    test = DRY_RUN_BY.get(argv[1])
    if test is None or argv[2:]:
        return None
    source = (REPO / test).read_text()
    given = {k: v for k, v in env.items() if k != "PYTHON"}  # the test gives this venv's
    ran = Path(argv[1]).name in source
    return test if ran and all(f'"{k}": "{v}"' in source for k, v in given.items()) else None


def test_the_tests_named_for_dry_runs_run_them() -> None:
    for script, test in DRY_RUN_BY.items():
        assert dry_run_elsewhere({"DRY_RUN": "1", "PYTHON": "python"}, ["bash", script]) == test
        assert dry_run_elsewhere({"DRY_RUN": "1", "PLAN": "nope"}, ["bash", script]) is None


def check_script(command: Command, store: Store) -> None:
    """bash scripts/X.sh: valid shell; run for real when it is a dry run (and no test runs it)."""
    env, argv = command.words()
    run_ok(["bash", "-n", argv[1]])
    if env.get("DRY_RUN") and not dry_run_elsewhere(env, argv):
        env = {k: executable(v) if k == "PYTHON" else v for k, v in env.items()}
        run_ok(["bash", *argv[1:]], env | {"OUT": str(store.folder("gpu-session"))})


def check_horovod_build(command: Command, store: Store) -> None:
    """horovodrun --check-build: the installed command's own `run_commandline`, in this process
    (its start would only repeat pytest's imports; the `horovodrun` script itself starts a world
    in tests/test_parallel.py). Each check it makes imports a Horovod extension in a process it
    forks: forked from here, torch is imported already (a new process imports it ~14 times)."""
    from horovod.runner.launch import run_commandline

    _, argv = command.words()
    printed, saved = io.StringIO(), sys.argv
    sys.argv = [executable("horovodrun"), *argv[1:]]
    try:
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as done:
            run_commandline()
    finally:
        sys.argv = saved
    assert done.value.code in (0, None), f"horovodrun --check-build exited {done.value.code}"
    assert "[X] PyTorch" in printed.getvalue(), printed.getvalue()  # built against this torch


def check_benchmark(command: Command, store: Store) -> None:
    """python benchmarks/X.py: it exists and parses its arguments (it runs for minutes): its
    `__main__` with `--help`, in this process."""
    _, argv = command.words()
    printed, saved = io.StringIO(), sys.argv
    sys.argv = [argv[1], "--help"]
    try:
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as done:
            runpy.run_path(str(REPO / argv[1]), run_name="__main__")
    finally:
        sys.argv = saved
    assert done.value.code in (0, None), f"{argv[1]} --help exited {done.value.code}"
    assert "usage:" in printed.getvalue(), printed.getvalue()


@dataclass(frozen=True)
class Rule:
    name: str
    matches: Callable[[list[str]], bool]
    check: Callable[[Command, Store], None]


RUN_PY = Rule(
    "run.py", lambda a: a[0] in ("python", "python3") and a[1:2] == ["run.py"], check_run_py
)
RULES = [
    Rule("make target", lambda a: a[0] == "make", check_make),
    RUN_PY,
    Rule(
        "launcher + run.py",
        lambda a: a[0] in ("torchrun", "horovodrun", "srun") and "run.py" in a,
        check_launcher,
    ),
    Rule(
        "horovodrun --check-build",
        lambda a: a[:2] == ["horovodrun", "--check-build"],
        check_horovod_build,
    ),
    Rule("accelexp-report", lambda a: a[0] == "accelexp-report", check_report),
    Rule(
        "mlflow ui/server",
        lambda a: a[0] == "mlflow" and a[1] in ("ui", "server"),
        check_mlflow_server,
    ),
    Rule("pip extras", lambda a: a[:3] == ["pip", "install", "-e"], check_pip_extras),
    Rule("setup script", lambda a: a[0] == "bash" and a[1].startswith("scripts/"), check_script),
    Rule(
        "benchmark",
        lambda a: a[0] in ("python", "python3") and a[1].startswith("benchmarks/"),
        check_benchmark,
    ),
]


def rule_for(command: Command) -> Rule | None:
    _, argv = command.words()
    return next((rule for rule in RULES if argv and rule.matches(argv)), None)


def command_is_slow(command: Command) -> bool:
    """Runs here and starts several processes or compiles (read from the command and the study
    it names)."""
    if rule_for(command) is not RUN_PY or not pasted_first(command) or run_elsewhere(command):
        return False  # composed only
    if NEEDS_GPU.search(command.comment) or "launcher=slurm" in command.text:
        return False
    text = command.text
    for study in re.findall(r"\+experiment=(\w+)", text):
        path = CONF_DIR / "experiment" / f"{study}.yaml"
        text += " " + path.read_text() if path.is_file() else ""
    many = re.search(
        r"nprocs[=:] ?[\d,]*[2-9]|parallelism=(ddp|fsdp|horovod|hybrid|pipeline)|"
        r"/parallelism: (ddp|fsdp|horovod)",
        text,
    )
    return bool(many or re.search(r"compile", text))


def _param(command: Command) -> pytest.param:
    slow = rule_for(command) is not None and command_is_slow(command)
    return pytest.param(
        command,
        id=f"{command.source} {command.text[:70]}",
        marks=[pytest.mark.slow] if slow else [],
    )


@pytest.mark.parametrize("command", [_param(c) for c in ALL_COMMANDS])
def test_doc_command(command: Command, store: Store) -> None:
    rule = rule_for(command)
    assert rule is not None, (
        f"{command.source}: no rule checks `{command.text}`: add a rule in tests/test_docs.py"
    )
    rule.check(command, store)


# --- the docs' shape ------------------------------------------------------------------------


def test_readme_fits_a_screen_and_keeps_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move details to docs/"
    texts = [c.text for c in doc_commands(README)]
    assert "make run" in texts and "make test" in texts


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a file's headings (`## Speed on a GPU`: speed-on-a-gpu)."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", path.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).lower().replace(" ", "-") for h in headings}


def test_every_doc_link_resolves() -> None:
    """Links between README.md and docs/ name files that exist, and headings they have."""
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            linked = (path.parent / file) if file else path
            where = f"{path.relative_to(REPO)} links to {target}"
            assert linked.exists(), where
            assert not anchor or anchor in anchors(linked), f"{where}: no such heading"


def test_the_parser_finds_commands(tmp_path: Path) -> None:
    """A Markdown change that hides the blocks from the parser would pass every rule silently."""
    kinds = {rule_for(c).name for c in ALL_COMMANDS if rule_for(c)}
    assert {"make target", "run.py", "accelexp-report", "mlflow ui/server"} <= kinds
    assert len(ALL_COMMANDS) >= 30
    doc = tmp_path / "parser.md"
    doc.write_text(
        "text\n```bash\n# a comment\nx 'a # b' \\\n  --y 1   # note\n```\n"
        "```console\n$ z\nits output\n```\n```text\nnot a command\n```\n"
    )
    found = [(c.text, c.comment) for c in doc_commands(doc)]
    assert found == [("x 'a # b' --y 1", "note"), ("z", "")]
    assert rule_for(Command("new.md:1", "curl https://example.org")) is None  # its test fails
