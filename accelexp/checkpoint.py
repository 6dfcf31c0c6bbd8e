"""The full training state: written atomically at every epoch's end, read back to resume.

`checkpoints/last.pt` in the run's folder holds what an uninterrupted run would carry into its
next epoch: the model, optimizer, scheduler and GradScaler states, the epoch just finished, the
best validation accuracy and time to target so far, the training seconds spent, the RNG states
of every rank (Python, NumPy, torch CPU and CUDA, the train loader's augmentation generator),
the MLflow run id and the resolved config. `checkpoints/best.pt` holds the best weights.

Only the main rank writes its files (DDP and Horovod replicas are equal; a model cut into stages
is one module in its process), after the ranks' RNG states are gathered to it. Only the main rank
reads them; the state reaches the others by broadcast (`Strategy.broadcast_object`), so no rank
reads another node's disk — but for a sharded state's shards (below), which every rank writes
and reads. Files are written to a temporary name, flushed and renamed: a checkpoint is whole or
absent, never half-written, whenever the job is stopped.

Each file gets its record, written last beside it (`last.pt.json`: its size and sha256, and the
MLflow run it belongs to), and is checked against it before it is read (`load`); a file without
one (written before records existed, or stopped between the rename and the record) is checked
by `torch.load` alone. The `last.pt` replaced by a new one is kept as `previous.pt` (with its
record), so a checkpoint cut short or altered on disk (`CheckpointError`) names a good one to
continue from.

A strategy that shards the training state (`Strategy.checkpoint_sharded`, as its sync says)
gathers none of it: every rank writes its shards of the model's and optimizer's states with
`torch.distributed.checkpoint` (DCP), in parallel, into a new folder beside `last.pt`
(`state-e0002-<hex>/`: one `.distcp` file per rank and DCP's `.metadata`; `save_shards`), and
`last.pt` then names that folder and holds the rest (progress, RNG states, scheduler, scaler).
The shards' sizes and sha256s are in `last.pt`'s record, checked with it; the folder counts only
once a whole `last.pt` names it, so a save cut short leaves the previous checkpoint the one
resumed, and folders no checkpoint names are removed by the next save. DCP reshards on load:
such a checkpoint resumes on a world of another shape (`parallelism.nprocs`, a pipeline's
`parallelism.pp`, and the batch split with it: `data.batch_size`,
`parallelism.accumulate_steps`). The run folder must be on a
filesystem every rank sees. `read_whole` reads any `last.pt` back as one dict of plain tensors,
in one process.

`resume` picks the checkpoint to continue from (`find_resume`); a restarted job — torchrun's
`--max-restarts`, a Slurm requeue — always continues from its own folder's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from accelexp import signals
from accelexp.config.catalog import flatten
from accelexp.config.identity import training_config
from accelexp.errors import AccelexpError, ConfigError

log = logging.getLogger(__name__)

LAST, BEST, PREVIOUS = "last.pt", "best.pt", "previous.pt"
SHARDS = "state-"  # the folders of sharded training states: state-e0002-<hex>
# the world's shape (workers; ranks per pipeline, the rest its replicas, whose stages are
# sharded over them or not), and how a global batch is split over it: a sharded checkpoint
# resumes on another shape (DCP reshards it)
WORLD_SHAPE = ("parallelism.nprocs", "parallelism.pp", "parallelism.dp_shard")
WORLD_KEYS = (*WORLD_SHAPE, "data.batch_size", "parallelism.accumulate_steps")
# restarts of one job: torchrun's restarts of its workers, Slurm's requeues of a job
# and a lockstep job's fresh process after its epochs (accelexp.lockstep.gate.INCARNATION_ENV)
RESTART_ENV = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "ACCELEXP_INCARNATION")


@dataclass
class Progress:
    """Where training stands at an epoch's end."""

    epoch: int = 0  # epochs finished
    best_val_acc: float = -1.0
    time_to_target_s: float | None = None
    elapsed_s: float = 0.0  # training seconds in the epochs finished (earlier attempts included)


# --- RNG states ------------------------------------------------------------------------------
def rng_state(generator: torch.Generator) -> dict[str, Any]:
    """This process's random states; `generator` draws the train loader's augmentation."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # as int64: a uint32 tensor does not survive torch.distributed's object pickling
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "loader": generator.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    generator.set_state(state["loader"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- files -----------------------------------------------------------------------------------
class StorageError(AccelexpError):
    """A checkpoint could not be written (a full disk, a path that is not a writable folder)."""


class CheckpointError(AccelexpError):
    """A checkpoint cannot be read: cut short, altered since it was written, or not one.
    `run_id`: the MLflow run it belongs to, when its record or the previous one's says."""

    def __init__(self, message: str, run_id: str | None = None) -> None:
        super().__init__(message)
        self.run_id = run_id


def record_of(path: Path) -> Path:
    """The record written beside a checkpoint: `last.pt` -> `last.pt.json`."""
    return path.with_name(f"{path.name}.json")


class _Digesting:
    """A file being written, and the size and sha256 of what was written to it."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save(path: Path, payload: Mapping[str, Any], *, keep_previous: bool = False) -> None:
    """Write `payload` to `path` atomically: a temporary file, flushed to disk, then renamed;
    then its record (size, sha256, MLflow run). On failure the previous file at `path` is left
    as it was; with `keep_previous` it is also kept as `previous.pt` once the new one is whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    # a signal inside torch.save would surface as a RuntimeError: it stops the job after the write
    with signals.deferred():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as file:
                written = _Digesting(file)
                torch.save(dict(payload), written)
                file.flush()
                os.fsync(file.fileno())
            if keep_previous:
                _keep_as_previous(path)
            record_of(path).unlink(missing_ok=True)  # no record of the old file for the new one
            tmp.replace(path)
            record = {"size": written.size, "sha256": written.sha256.hexdigest()}
            record |= {"run_id": payload.get("run_id")}
            if payload.get("shards"):  # the shards' folder and digests, checked with the file
                record["shards"] = payload["shards"]
            _write_whole(record_of(path), json.dumps(record))
            if path.name == LAST:
                _drop_unnamed_shards(path.parent)
        except (OSError, RuntimeError) as error:  # torch.save reports a full disk as RuntimeError
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise StorageError(
                f"Could not write the checkpoint {path}: {error}. Free space there, or run in "
                f"another folder (hydra.run.dir=...). The run is FAILED; what it logged is kept in "
                f"MLflow, and the last checkpoint written before, if any, is intact (resume=auto)."
            ) from error


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _keep_as_previous(path: Path) -> None:
    """`path`, if whole, becomes `previous.pt` too (a hard link: no copy) with its record."""
    if not path.is_file() or _problem(path, digest=False):
        return
    previous = path.with_name(PREVIOUS)
    record_of(previous).unlink(missing_ok=True)
    staged = previous.with_name(f".{PREVIOUS}.tmp")
    staged.unlink(missing_ok=True)
    try:
        os.link(path, staged)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(path, staged)
    staged.replace(previous)
    if record_of(path).is_file():
        _write_whole(record_of(previous), record_of(path).read_text())


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint, checked against its record first when it has one; `CheckpointError`,
    naming the last good checkpoint beside it, when it cannot be read."""
    problem = _problem(path)
    if problem is None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(state, dict) and state.get("shards"):  # where they are, for every rank
                state["shards"]["path"] = str(path.parent / state["shards"]["folder"])
            return state
        except Exception as error:  # miniz, unpickling, EOF: torch.load's many ways to say it
            problem = f"torch.load cannot read it ({_said(error, 200)})"
    good = last_good(path)
    then = (
        f"The last good one is {good}: continue from it with resume={good}, or start afresh "
        f"without resume."
        if good
        else "No good checkpoint is kept beside it: start afresh without resume."
    )
    raise CheckpointError(
        f"The checkpoint {path} cannot be read: {problem}. {then}", _run_of(path) or _run_of(good)
    )


def last_good(path: Path) -> Path | None:
    """The checkpoint kept beside `path` that is whole (`previous.pt` for a `last.pt`), if any."""
    previous = path.with_name(PREVIOUS)
    if path.name == LAST and previous.is_file() and not _problem(previous):
        return previous
    return None


def _problem(path: Path, digest: bool = True) -> str | None:
    """What is wrong with `path` by its record (its size; with `digest`, its sha256 too), or
    None: it matches, or it has no record (`torch.load` will check it)."""
    record = _record(path)
    if record is None:
        return None
    if not isinstance(record, dict) or not {"size", "sha256"} <= record.keys():
        return f"its record {record_of(path)} is unreadable"
    try:
        size = path.stat().st_size
        if size != record["size"]:
            return f"it is {size} bytes but was written as {record['size']} (cut short?)"
        if digest and _sha256(path) != record["sha256"]:
            return f"its sha256 is not the one {record_of(path).name} recorded when it was written"
    except OSError as error:
        return str(error)
    return _shards_problem(path.parent, record.get("shards"), digest)


def _shards_problem(folder: Path, shards: object, digest: bool) -> str | None:
    """What is wrong with a sharded checkpoint's folder by the sizes (and sha256s) of its files
    as they were written, or None."""
    if not shards:
        return None
    where = folder / shards["folder"]
    for name, (size, sha256) in sorted(shards["files"].items()):
        file = where / name
        try:
            found = file.stat().st_size
        except OSError:
            return f"its shard {file} is missing"
        if found != size:
            return f"its shard {file} is {found} bytes but was written as {size} (cut short?)"
        if digest and _sha256(file) != sha256:
            return f"the sha256 of its shard {file} is not the one recorded when it was written"
    return None


def _record(path: Path) -> object:
    """A checkpoint's record as written, None without one, "" if it cannot be parsed."""
    try:
        return json.loads(record_of(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""


def _run_of(path: Path | None) -> str | None:
    record = _record(path) if path is not None else None
    return record.get("run_id") if isinstance(record, dict) else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _said(error: BaseException, most: int = 300) -> str:
    """An error's first line (its type's name when it has none), at most `most` characters."""
    return (str(error).splitlines() or [type(error).__name__])[0][:most]


# --- sharded training states (torch.distributed.checkpoint) ----------------------------------
class Collectives(Protocol):
    """What `save_shards` asks of the world (a strategy's `sync`)."""

    def broadcast_object(self, obj: object) -> object: ...

    def gather_object(self, obj: object) -> list: ...


def save_shards(
    checkpoints: Path, state: dict[str, Any], epoch: int, world: Collectives, rank: int, size: int
) -> dict[str, Any] | None:
    """Every rank: `state` (the model's and optimizer's state dicts as this rank holds them,
    `Strategy.sharded_state_dict`) written with `torch.distributed.checkpoint` into a new folder
    of `checkpoints`, each rank its own shards, in parallel (a key several ranks hold, a
    replica's copy, is written once, by the lowest rank holding it: always the same rank's
    values); each rank then hashes its share of the folder's files. Returns, on the main rank,
    what `training_state` keeps of them (the folder's name, each file's size and sha256, the
    world's size); None on the others. The folder counts once a whole `last.pt` names it
    (`save`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    name = world.broadcast_object(f"{SHARDS}e{epoch:04d}-{secrets.token_hex(4)}")
    folder = checkpoints / name
    error: BaseException | None = None
    seen: list[str] = []
    # a signal inside the collective write would stop one rank in it: the job stops after it
    with signals.deferred():
        try:
            # a key several ranks hold (a replica's copy) is written by the lowest of them: one
            # rank's value, always the same one, not whichever rank had written least so far
            planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), planner=planner)
            seen = sorted(f.name for f in folder.iterdir())
        except (OSError, CheckpointException) as failed:  # DCP: every rank's, on every rank
            error = failed
    said = _said(error) if error else None
    # every rank learns of any rank's failure, and each stops with it rather than wait for it
    views, failures = zip(*world.gather_object((seen, said)), strict=True)
    if any(failures):
        raise StorageError(
            f"Could not write the checkpoint's shards in {folder}: "
            f"{next(f for f in failures if f)}. Free space there, or run in another folder "
            f"(hydra.run.dir=...). The run is FAILED; what it logged is kept in MLflow, and the "
            f"last checkpoint written before, if any, is intact (resume=auto)."
        ) from error
    if any(view != views[0] for view in views):
        raise StorageError(
            f"The ranks do not see one checkpoint folder: {folder} holds {views[0]} for rank 0 "
            f"but {next(v for v in views if v != views[0])} for another. Each rank writes its "
            f"shards of the training state there: put the run folder (hydra.run.dir) on a "
            f"filesystem every rank shares."
        )
    files = [folder / f for f in seen[rank::size]]  # this rank's share to hash
    hashed = world.gather_object({f.name: [f.stat().st_size, _sha256(f)] for f in files})
    if rank != 0:
        return None
    return {"folder": name, "files": {k: v for part in hashed for k, v in part.items()},
            "world_size": size}  # fmt: skip


def read_shards(folder: Path, state: dict[str, Any]) -> None:
    """Every rank: fill `state` (its own sharded state dicts, the shapes to read into) from a
    folder `save_shards` wrote, resharded for this world (any number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    except (OSError, CheckpointException) as error:
        said = _said(error)
        raise CheckpointError(
            f"The checkpoint's shards in {folder} cannot be read here: {said}. Every rank reads "
            f"them: the run folder must be on a filesystem all ranks share. Start afresh without "
            f"resume, or resume from previous.pt."
        ) from error


def read_whole(path: Path) -> dict[str, Any]:
    """A `last.pt` as one dict in this process, whatever wrote it: a sharded checkpoint's model
    and optimizer states gathered from its shards (DCP's `dcp_to_torch_save`) as plain tensors,
    by parameter name, as a gathered checkpoint holds them."""
    state = load(path)
    if state.get("shards"):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as scratch:
            whole = Path(scratch) / "whole.pt"
            dcp_to_torch_save(state["shards"]["path"], whole)
            state |= torch.load(whole, map_location="cpu", weights_only=True)
    return state


def _drop_unnamed_shards(checkpoints: Path) -> None:
    """Remove the shard folders neither `last.pt` nor `previous.pt` names (a save cut short, the
    state `previous.pt` no longer keeps); none while either has no readable record."""
    named = set()
    for kept in (checkpoints / LAST, checkpoints / PREVIOUS):
        if not kept.is_file():
            continue
        record = _record(kept)
        if not isinstance(record, dict):
            return
        named.add((record.get("shards") or {}).get("folder"))
    for folder in checkpoints.glob(f"{SHARDS}*"):
        if folder.is_dir() and folder.name not in named:
            shutil.rmtree(folder, ignore_errors=True)


def training_state(
    *,
    model: dict[str, Any] | None,
    optimizer: dict[str, Any] | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: dict,
    progress: Progress,
    rng: list[dict[str, Any]],
    run_id: str | None,
    config: dict,
    shards: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What `last.pt` holds: the whole model's and optimizer's states (gathered from their
    shards), or with `shards` (`save_shards`) the folder that holds them in shards instead; and
    `rng`, one entry per rank, in rank order."""
    whole = {"shards": shards} if shards else {"model": model, "optimizer": optimizer}
    return {
        **whole,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler,
        "progress": asdict(progress),
        "rng": rng,
        "run_id": run_id,
        "config": config,
    }


def restore(
    state: Mapping[str, Any],
    *,
    load_model: Callable[[dict], None],
    load_optimizer: Callable[[dict], None],
    load_shards: Callable[[Path], None],
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    load_scaler: Callable[[dict], None],
    generator: torch.Generator,
    rank: int,
    world_size: int,
) -> Progress:
    """Put a `training_state` back into this rank's objects; returns where training stands.
    A sharded one (every rank calls `load_shards` with its folder) resumes on any number of
    ranks: a rank the checkpoint's world did not have keeps its own seeded random states."""
    saved = len(state["rng"])
    if state.get("shards"):
        load_shards(Path(state["shards"]["path"]))  # the strategy's: DCP reshards
        if saved != world_size and rank == 0:
            log.warning(
                "Resuming a checkpoint of %d rank(s) on %d: its shards are resharded; the "
                "optimizer and lr schedule go on as saved, the data is split for this world, and "
                "ranks it did not have draw fresh random states (the run is not bitwise an "
                "uninterrupted run of either size).",
                saved, world_size,
            )  # fmt: skip
    else:
        if saved <= rank:
            raise ConfigError(
                f"The checkpoint was written by a world of {saved} rank(s); this is rank "
                f"{rank}. Resume with the same parallelism.nprocs as the run it continues."
            )
        load_model(state["model"])  # the strategy's: a sharding one reshards the whole state
        load_optimizer(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    load_scaler(state["scaler"])  # the precision's: its GradScaler's state, if it has one
    if rank < saved:
        set_rng_state(state["rng"][rank], generator)
    return Progress(**state["progress"])


# --- which checkpoint to continue from ------------------------------------------------------
def restarted() -> bool:
    """True in a job its launcher restarted: torchrun's workers after a failure, a requeued
    Slurm job. Such a job continues from its own folder's last checkpoint."""
    return any(int(os.environ.get(name) or 0) > 0 for name in RESTART_ENV)


def find_resume(
    request: str | None,
    output_dir: Path,
    run_folder: Callable[[str], str | None],
    unfinished_folders: Callable[[], list[str]],
    finished: Callable[[str], bool] = lambda run_id: False,
) -> Path | None:
    """The `last.pt` to continue from, or None to start afresh.

    - a restarted job (`restarted()`): its own folder's;
    - `resume=auto`: the run folder's own, else the newest unfinished run of this experiment with
      the same training config that left one (`unfinished_folders()`, from MLflow); never one of
      a run that `finished` (its MLflow run id): then a new run starts, and the log says so;
    - `resume=<MLflow run id>`: that run's (`run_folder(run_id)`);
    - `resume=<path>`: a `last.pt` file, a run folder, or its `checkpoints/` folder.
    """
    own = output_dir / "checkpoints" / LAST
    if restarted() and own.is_file():
        return own
    if not request:
        return None
    if request == "auto":
        return _unfinished(own, unfinished_folders, finished)
    path = Path(request)
    if not path.exists() and len(request) == 32 and request.isalnum():  # an MLflow run id
        folder = run_folder(request)
        if folder is None:
            raise ConfigError(
                f"resume={request}: this experiment has no MLflow run with that id (or it has no "
                f"run folder). Use resume=auto, or the path of a run folder."
            )
        path = Path(folder)
    for candidate in (path, path / LAST, path / "checkpoints" / LAST):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"resume={request}: no checkpoint there (looked for {path}, {path / LAST} and "
        f"{path / 'checkpoints' / LAST}). Give a run folder, its last.pt, an MLflow run id, "
        f"or resume=auto."
    )


def _unfinished(
    own: Path, unfinished_folders: Callable[[], list[str]], finished: Callable[[str], bool]
) -> Path | None:
    """`resume=auto`'s checkpoint: `own`, else an unfinished run's; never a finished run's."""
    found = (Path(folder) / "checkpoints" / LAST for folder in unfinished_folders())
    of_finished: dict[Path, str] = {}  # checkpoints of finished runs -> their run id
    for path in (own, *found):
        if path.resolve() in of_finished or not path.is_file():
            continue
        run_id = _run_of(path) or _saved_run(path)
        if run_id is None or not finished(run_id):
            return path
        of_finished[path.resolve()] = run_id
    if of_finished:
        runs = ", ".join(f"run {run_id} ({path})" for path, run_id in of_finished.items())
        log.info("resume=auto: %s FINISHED, nothing is left unfinished: a new run.", runs)
    return None


def _saved_run(path: Path) -> str | None:
    """The MLflow run id a checkpoint without a record holds (None if it cannot be read: then
    `load` says why)."""
    if record_of(path).is_file():
        return None
    try:
        return load(path).get("run_id")
    except CheckpointError:
        return None


def check_same_training(
    saved: Mapping[str, Any], current: Mapping[str, Any], path: Path, sharded: bool = False
) -> None:
    """A checkpoint continues only the run it came from: refuse one of another config. A
    `sharded` one (DCP reshards it) may continue on a world of another shape
    (`parallelism.nprocs`, a pipeline's `parallelism.pp`), and then with the global batch split
    otherwise (`WORLD_KEYS`)."""
    before = flatten(training_config(saved), empty=False)
    now = flatten(training_config(current), empty=False)
    differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    moved = []
    if sharded and any(k in differ for k in WORLD_SHAPE):
        moved = [k for k in differ if k in WORLD_KEYS]
        differ = [k for k in differ if k not in WORLD_KEYS]
    if differ:
        shown = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in differ[:6])
        raise ConfigError(
            f"The checkpoint {path} is of another configuration ({shown}). Resume with the "
            f"config of the run it continues, or start a new run without resume."
        )
    if moved:  # said once the resume is sure to go on
        log.info(
            "Resuming on another world: %s",
            ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in moved),
        )


def adopt_best(source: Path, checkpoints: Path) -> None:
    """Resuming into a new run folder: bring the best weights so far along."""
    best = source.parent / BEST
    if best.is_file() and best.resolve() != (checkpoints / BEST).resolve():
        checkpoints.mkdir(parents=True, exist_ok=True)
        shutil.copy2(best, checkpoints / BEST)
