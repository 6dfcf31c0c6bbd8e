"""Checkpoints that cannot be read, and `resume=auto` after a finished run.

Each checkpoint is checked against the record written beside it (size, sha256); one cut short or
altered ends the job with one message naming it and the last good one (`previous.pt`), and the
run it continued is FAILED, not left KILLED. A checkpoint written before records existed still
loads. `resume=auto` never reopens a FINISHED run: it starts a new one and says so. A sharded
checkpoint (FSDP's, torch.distributed.checkpoint) counts once a whole `last.pt` names its folder,
and each shard is checked against the record too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import output_of
from mlflow import MlflowClient

from accelexp import checkpoint
from accelexp.checkpoint import CheckpointError, record_of
from accelexp.parallel.base import Sync
from accelexp.parallel.config import ParallelismConfig

TINY = ("data=synthetic", "data.num_train=256", "data.num_test=64", "data.image_size=16")
TINY += ("epochs=2", "max_steps_per_epoch=2", "progress=false", "threads=1")


def runs(uri: str):
    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])


def cut_to_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_checkpoint_fails_its_run_with_one_message_naming_the_last_good_one(
    tmp_path, tracking_uri, cli
):
    tiny = (*TINY, f"mlflow.tracking_uri={tracking_uri}")
    assert cli(*tiny, tmp_path=tmp_path).returncode == 0
    (run,) = runs(tracking_uri)
    MlflowClient(tracking_uri).set_terminated(run.info.run_id, "KILLED")  # as if interrupted
    folder = tmp_path / "job" / "checkpoints"
    last, previous = folder / "last.pt", folder / "previous.pt"
    assert torch.load(previous, weights_only=True)["progress"]["epoch"] == 1  # kept whole
    cut_to_half(last)

    result = cli(*tiny, "resume=auto", tmp_path=tmp_path)
    text = output_of(result)
    assert result.returncode == 2, text
    assert "Traceback" not in text
    assert f"The checkpoint {last} cannot be read: it is " in text
    assert f"The last good one is {previous}: continue from it with resume={previous}" in text
    (failed,) = runs(tracking_uri)
    assert failed.info.run_id == run.info.run_id
    assert failed.info.status == "FAILED"

    # recoverable: the last good one continues the same run to its end
    result = cli(*tiny, f"resume={previous}", tmp_path=tmp_path / "again")
    assert result.returncode == 0, output_of(result)
    assert "Resuming after epoch 1 of 2" in output_of(result)
    (resumed,) = runs(tracking_uri)
    assert (resumed.info.run_id, resumed.info.status) == (run.info.run_id, "FINISHED")


def test_a_checkpoint_altered_on_disk_is_refused_by_its_digest(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint.save(path, {"weights": torch.arange(1000), "run_id": "abc"})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(path)
    assert "its sha256 is not the one last.pt.json recorded when it was written" in str(
        refused.value
    )
    assert "No good checkpoint is kept beside it: start afresh without resume" in str(refused.value)
    assert refused.value.run_id == "abc"  # the run it belongs to, to be closed FAILED


def test_a_checkpoint_written_before_records_still_loads(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"weights": torch.arange(10)}, path)  # as written before: no last.pt.json
    assert torch.equal(checkpoint.load(path)["weights"], torch.arange(10))
    cut_to_half(path)  # then only torch.load can tell, and the message says what it said
    with pytest.raises(CheckpointError, match=r"torch\.load cannot read it \(.*central directory"):
        checkpoint.load(path)


def test_resume_auto_after_a_finished_run_starts_a_new_run(tmp_path, tracking_uri, cli):
    tiny = (*TINY, "epochs=1", f"mlflow.tracking_uri={tracking_uri}")
    assert cli(*tiny, tmp_path=tmp_path).returncode == 0
    (first,) = runs(tracking_uri)
    result = cli(*tiny, "resume=auto", tmp_path=tmp_path)  # the same folder
    text = output_of(result)
    assert result.returncode == 0, text
    assert "Resuming" not in text
    assert f"resume=auto: run {first.info.run_id} (" in text
    assert "FINISHED, nothing is left unfinished: a new run." in text
    assert sorted(r.info.status for r in runs(tracking_uri)) == ["FINISHED", "FINISHED"]
    tags = MlflowClient(tracking_uri).get_run(first.info.run_id).data.tags
    assert "resumed_after_epoch" not in tags


@pytest.mark.slow
def test_ddp_workers_stop_on_a_truncated_checkpoint_with_its_message_and_the_run_failed(
    tmp_path, tracking_uri, cli
):
    """Rank 0 reads the checkpoint; the other rank gets its error by broadcast instead of losing
    its peer ("connection closed"), and the run it continued is FAILED, not left KILLED."""
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment("accelexp")
    run_id = client.create_run(experiment).info.run_id
    client.set_terminated(run_id, "KILLED")  # interrupted earlier
    last = tmp_path / "job" / "checkpoints" / "last.pt"
    checkpoint.save(last, {"weights": torch.zeros(10_000), "run_id": run_id})
    cut_to_half(last)
    ddp = ("parallelism=ddp", "parallelism.nprocs=2", "data.batch_size=32")
    result = cli(
        *TINY, *ddp, f"mlflow.tracking_uri={tracking_uri}", "resume=auto", tmp_path=tmp_path
    )
    text = output_of(result)
    assert result.returncode == 2, text
    assert f"rank0: CheckpointError: The checkpoint {last} cannot be read" in text
    assert f"rank1: CheckpointError: The checkpoint {last} cannot be read" in text
    assert "Connection closed" not in text
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no world
def test_a_sharded_checkpoint_counts_once_named_and_is_checked_shard_by_shard(tmp_path):
    """As an FSDP run saves it (`save_shards`, then `last.pt` naming the shards' folder), here by
    one process: a folder no `last.pt` names (a save cut short) is removed by the next save, the
    one `previous.pt` names is kept; a shard cut short is refused by the record, naming the last
    good one, which still reads whole; shards that cannot be written are one StorageError."""
    folder = tmp_path / "checkpoints"
    last, previous = folder / "last.pt", folder / "previous.pt"
    alone = Sync(ParallelismConfig())  # one process: its collectives are itself

    def save_epoch(epoch: int) -> None:
        state = {"model": {"w": torch.full((4096,), float(epoch))}}
        shards = checkpoint.save_shards(folder, state, epoch, alone, rank=0, size=1)
        payload = {"shards": shards, "run_id": "abc", "progress": {"epoch": epoch}}
        checkpoint.save(last, payload, keep_previous=True)

    save_epoch(1)
    (folder / "state-e0002-cut").mkdir()  # its shards written, then the job died: never named
    save_epoch(2)
    named = {json.loads(record_of(p).read_text())["shards"]["folder"] for p in (last, previous)}
    assert {p.name for p in folder.glob("state-*")} == named and len(named) == 2
    assert torch.equal(checkpoint.read_whole(last)["model"]["w"], torch.full((4096,), 2.0))

    (shard,) = (folder / checkpoint.load(last)["shards"]["folder"]).glob("*.distcp")
    cut_to_half(shard)
    with pytest.raises(CheckpointError) as refused:
        checkpoint.load(last)
    assert f"its shard {shard} is " in str(refused.value)
    assert "(cut short?). The last good one is " in str(refused.value)
    assert torch.equal(checkpoint.read_whole(previous)["model"]["w"], torch.full((4096,), 1.0))

    (tmp_path / "in-the-way").write_text("a file, not a folder")
    with pytest.raises(checkpoint.StorageError, match=r"Could not write the checkpoint's shards"):
        checkpoint.save_shards(tmp_path / "in-the-way", {"w": torch.ones(4)}, 3, alone, 0, 1)
