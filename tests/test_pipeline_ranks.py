"""`parallelism=pipeline`: a pipeline's stages across ranks trains what one process trains.

One torchrun launch of this file as a harness (`stepped`, built once a module): 4 real worker
processes over Gloo build the product's strategy (`accelexp.parallel.build_strategy`) for every
schedule the installed torch has, as 2 pipelines of 2 ranks (`parallelism.pp=2`: a 2-D mesh
pp x dp, each stage's gradients averaged over dp; 1f1b once more with each stage sharded over
dp, `parallelism.dp_shard`), step it through the loop's step
(`accelexp.step.train_step`), each pipeline on its half of a batch, and, in the same processes, a
single-process reference from the same initial weights on the whole batch; and 1F1B in fp16
with a GradScaler whose skipped steps every rank must share (`_fp16_scaled`). Each rank reports
what it saw; the tests read the report. The end-to-end path (run.py's
launcher, MLflow, best.pt) is `test_contract.py`'s `vit-pipeline-1f1b` case; bad input is refused
before any worker starts (`test_refused_before_any_worker`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXACT, compose_config, new_store, store_uri

HERE = Path(__file__).resolve()
STEPS = 3
FP16 = "1f1b+fp16"  # `_fp16_scaled`'s report
RESUMED_EPOCHS = 2  # `_trained_then_resumed_sharded`'s: resumed after the first
FP16_SCALE = 2.0**8  # no step overflows at it: only the inf made at step 2
FP16_STEPS = 2
BATCH = 16  # per pipeline: the reference trains on REPLICAS * BATCH
MICROBATCHES = 4
PP, REPLICAS = 2, 2
RANKS = PP * REPLICAS


def _stepped_in_this_worker(out: Path) -> None:
    """The harness, in each torchrun worker: every schedule against the reference."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from accelexp import checkpoint
    from accelexp.config import typed
    from accelexp.models import build_model
    from accelexp.parallel import build_strategy
    from accelexp.parallel.base import Strategy
    from accelexp.parallel.config import ParallelismConfig
    from accelexp.parallel.stages_per_rank import available_schedules
    from accelexp.step import train_step

    sys.path.insert(0, str(HERE.parent))
    from conftest import EXACT, compose_config

    def local(tensor: torch.Tensor) -> torch.Tensor:
        """The part of `tensor` this rank holds (its shard, under `dp_shard`)."""
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the strategies below join it: none tears it down
    rank = dist.get_rank()
    report: dict[str, dict] = {}
    cases = [(schedule, False) for schedule in available_schedules()]
    cases.append(("1f1b", True))  # each stage sharded over dp (FSDP2)
    for schedule, sharded in cases:
        name = f"{schedule}+dp_shard" if sharded else schedule
        cfg = typed(
            compose_config(
                "sqlite:///unused.db",
                *EXACT,
                "parallelism=pipeline",
                f"parallelism.nprocs={RANKS}",
                f"parallelism.pp={PP}",
                f"parallelism.schedule={schedule}",
                f"parallelism.microbatches={MICROBATCHES}",
                f"parallelism.dp_shard={sharded}",
                f"data.batch_size={BATCH}",
            )
        )
        torch.manual_seed(0)
        model = build_model(cfg.model, 3, 10, cfg.data.image_size)
        reference = copy.deepcopy(model)
        single = Strategy(ParallelismConfig())
        strategy = build_strategy(cfg)
        strategy.setup()
        replica = strategy.shape.replica
        rows = slice(replica * BATCH, (replica + 1) * BATCH)  # this pipeline's half
        placed = strategy.wrap_model(model)
        sgd = {"lr": 0.1, "momentum": 0.9}  # momentum: an optimizer state to save and resume
        optimizer = strategy.wrap_optimizer(torch.optim.SGD(placed.parameters(), **sgd), placed)
        expected_optimizer = torch.optim.SGD(reference.parameters(), **sgd)
        losses, expected_losses, logits_apart = [], [], 0.0
        generator = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            size = (REPLICAS * BATCH, 3, cfg.data.image_size, cfg.data.image_size)
            images = torch.randn(*size, generator=generator)
            labels = torch.randint(0, 10, (REPLICAS * BATCH,), generator=generator)
            loss, logits = train_step(placed, images[rows], labels[rows], optimizer, strategy)
            expected, expected_logits = train_step(
                reference, images, labels, expected_optimizer, single
            )
            losses.append(loss.item())  # this pipeline's: their mean is the whole batch's
            expected_losses.append(expected.item())
            apart = (logits - expected_logits[rows]).abs().max().item()
            logits_apart = max(logits_apart, apart)
        whole = strategy.model_state_dict(placed)
        apart = None
        if whole is not None:
            expected_state = reference.state_dict()
            assert whole.keys() == expected_state.keys(), (list(whole), list(expected_state))
            apart = max((whole[k] - expected_state[k]).abs().max().item() for k in whole)
        # evaluation: the whole batch through the ranks, the logits on every rank
        placed.eval()
        reference.eval()
        with torch.no_grad():
            images = torch.randn(BATCH + 3, 3, cfg.data.image_size, cfg.data.image_size)
            eval_apart = (placed(images) - reference(images)).abs().max().item()
        # the training state through DCP (`save_shards`, as `last.pt` saves it): each rank its
        # stages' shards, by the whole model's names; a resume reads them back (below)
        trained = {k: local(v).clone() for k, v in placed.state_dict().items()}
        momenta = [local(s["momentum_buffer"]).clone() for s in optimizer.state.values()]
        shards = checkpoint.save_shards(
            out / name, strategy.sharded_state_dict(placed, optimizer), 1, strategy.sync,
            rank, RANKS,
        )  # fmt: skip
        if rank == 0:  # last.pt naming them (`read_whole`'s), and the gathered model beside it
            checkpoint.save(out / name / "last.pt", {"shards": shards, "run_id": None})
            torch.save(whole, out / name / "gathered.pt")
        folder = out / name / strategy.sync.broadcast_object(shards and shards["folder"])
        # the whole model's weights back into the stages (best.pt's test, a resume)
        fresh = build_model(cfg.model, 3, 10, cfg.data.image_size).state_dict()
        strategy.load_model_state_dict(placed, strategy.sync.broadcast_object(fresh))
        again = strategy.model_state_dict(placed)
        reloaded = None if again is None else all(torch.equal(again[k], fresh[k]) for k in fresh)
        # the optimizer's state: saved on rank 0 (per pipeline rank), each rank's back (a
        # resume of a `last.pt` written gathered, before checkpoints were sharded: never sharded)
        saved = optimizer_resumed = None
        if not sharded:
            saved = strategy.optimizer_state_dict(placed, optimizer)
            for state in optimizer.state.values():  # lost, as in a fresh process
                state["momentum_buffer"].zero_()
            strategy.load_optimizer_state_dict(
                placed, optimizer, strategy.sync.broadcast_object(saved)
            )
            resumed = [s["momentum_buffer"] for s in optimizer.state.values()]
            optimizer_resumed = len(momenta) > 0 and all(
                torch.equal(a, b) for a, b in zip(momenta, resumed, strict=True)
            )
        # the resume of the sharded state: fresh weights and lost momenta, then the shards read
        for state in optimizer.state.values():
            state["momentum_buffer"].zero_()
        filled = strategy.sharded_state_dict(placed, optimizer)
        checkpoint.read_shards(folder, filled)
        strategy.load_sharded_state_dict(placed, optimizer, filled)
        after = optimizer.state.values()
        shards_resumed = all(
            torch.equal(local(v), trained[k]) for k, v in placed.state_dict().items()
        )
        shards_resumed &= all(
            torch.equal(a, local(s["momentum_buffer"])) for a, s in zip(momenta, after, strict=True)
        )
        report[name] = {
            "losses": losses,
            "expected_losses": expected_losses,
            "logits_apart": logits_apart,
            "params_apart": apart,
            "eval_apart": eval_apart,
            "reloaded": reloaded,
            "saved_ranks": None if saved is None else len(saved["ranks"]),
            "optimizer_resumed": optimizer_resumed,
            "shards_resumed": shards_resumed,
            "stages": strategy.describe()["stages"],
            "replica": replica,
            "stage": strategy.shape.stage,
            "train_shard": list(strategy.train_sampler(4 * REPLICAS, seed=0)),
            "own_params": sum(p.numel() for p in placed.parameters()),
            "held_params": sum(local(p).numel() for p in placed.parameters()),
            "all_params": sum(p.numel() for p in reference.parameters()),
        }
    for source in ("gpipe", "1f1b+dp_shard"):
        report[f"pp4-from-{source}"] = _resharded(out, source, cfg.model, rank)
    report[FP16] = _fp16_scaled()
    _trained_then_resumed_sharded(out)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _fp16_scaled() -> dict:
    """In the same workers: 1F1B over 2 pipelines of 2 ranks, each stage sharded over the two
    (`dp_shard`), in fp16 autocast with a GradScaler (on the CPU: torch's own fp16 autocast and
    GradScaler("cpu"), what `precision=amp` is on CUDA), against one process with the same
    scaler, 2 steps of a small MLP (a CPU's fp16 kernels are slow). At step 2 the first linear
    layer's gradients on rank 0 alone are made inf (and the reference's): every rank must skip
    that step and halve its scale, as the one process does, though stage 1 sees no inf."""
    import torch
    import torch.distributed as dist

    from accelexp.config import typed
    from accelexp.models import build_model, layer_sequence
    from accelexp.parallel import build_strategy
    from accelexp.parallel.base import Strategy
    from accelexp.parallel.config import ParallelismConfig
    from accelexp.precision.runtime import Precision
    from accelexp.step import train_step

    def fp16_on_cpu() -> Precision:
        precision = Precision("amp", torch.device("cpu"), init_scale=FP16_SCALE)
        precision.compute_dtype = precision.autocast_dtype = torch.float16
        precision.scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)
        return precision

    cfg = typed(
        compose_config(
            "sqlite:///unused.db", *EXACT, "parallelism=pipeline", f"parallelism.nprocs={RANKS}",
            f"parallelism.pp={PP}", f"parallelism.microbatches={MICROBATCHES}",
            f"data.batch_size={BATCH}", "parallelism.dp_shard=true", "model=mlp",
            "model.widths=[32,32]",
        )
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model, 3, 10, cfg.data.image_size)
    reference = copy.deepcopy(model)
    single, strategy = Strategy(ParallelismConfig()), build_strategy(cfg)
    strategy.setup()
    single.__dict__["precision"], strategy.__dict__["precision"] = fp16_on_cpu(), fp16_on_cpu()
    placed = strategy.wrap_model(model)
    step = [0]

    def inf_at_step_2(module, args, output: torch.Tensor) -> None:
        """The gradient of the layer's output made inf at step 2 (so its weights'), whether
        the weights are sharded (FSDP computes with gathered copies) or not."""
        if step[0] == 1:
            output.register_hook(lambda grad: grad * float("inf"))

    def first_with_weights(layers) -> torch.nn.Module:
        return next(layer for layer in layers if any(True for _ in layer.parameters()))

    if dist.get_rank() == 0:  # stage 0 of pipeline 0
        first_with_weights(placed.parts[0]).register_forward_hook(inf_at_step_2)
    first_with_weights(m for _, m in layer_sequence(reference)).register_forward_hook(inf_at_step_2)
    optimizer = torch.optim.SGD(placed.parameters(), lr=0.1)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    replica = strategy.shape.replica
    rows = slice(replica * BATCH, (replica + 1) * BATCH)
    generator = torch.Generator().manual_seed(1)
    scales, expected_scales = [], []
    for step[0] in range(FP16_STEPS):
        images = torch.randn(REPLICAS * BATCH, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 10, (REPLICAS * BATCH,), generator=generator)
        train_step(placed, images[rows], labels[rows], optimizer, strategy)
        train_step(reference, images, labels, expected_optimizer, single)
        scales.append(strategy.precision.grad_scale())
        expected_scales.append(single.precision.grad_scale())
    whole = strategy.model_state_dict(placed)
    expected = reference.state_dict()
    apart = (
        None if whole is None else max((whole[k] - expected[k]).abs().max().item() for k in whole)
    )
    return {"scales": scales, "expected_scales": expected_scales, "params_apart": apart}


def _trained_then_resumed_sharded(out: Path) -> None:
    """In the same workers, the loop's whole run (`train.run`, what each worker of run.py's
    launch runs, tracked by rank 0 into the fixture's store): one pipeline of 4 ranks trains 2
    epochs on batches of 64, then its epoch-1 checkpoint is resumed as 2 pipelines of 2 ranks
    with each stage sharded over the two (`dp_shard`), on batches of 32 each: the pipeline's
    depth, its replicas and its sharding changed at once (DCP reshards)."""
    from accelexp.train import run

    uri = store_uri(out / "store")
    base = (
        *(o for o in EXACT if not o.startswith("epochs=")), "parallelism=pipeline",
        f"parallelism.nprocs={RANKS}", f"epochs={RESUMED_EPOCHS}", "max_steps_per_epoch=2",
    )  # fmt: skip
    run(compose_config(uri, *base, "data.batch_size=64"), out / "one")
    previous = out / "one" / "checkpoints" / "previous.pt"  # epoch 1's
    sharded = (f"parallelism.pp={PP}", "parallelism.dp_shard=true", "data.batch_size=32")
    run(compose_config(uri, *base, *sharded, f"resume={previous}"), out / "sharded")


def _resharded(out: Path, source: str, model_cfg, rank: int) -> dict:
    """In the same workers: `source`'s checkpoint (2 stages x 2 replicas) read by one pipeline
    of 4 stages (`parallelism.pp=4`), unsharded; each rank keeps what it read, by the whole
    model's names."""
    import torch

    from accelexp import checkpoint
    from accelexp.config import typed
    from accelexp.models import build_model
    from accelexp.parallel import build_strategy

    cfg = typed(
        compose_config(
            "sqlite:///unused.db", *EXACT, "parallelism=pipeline", f"parallelism.nprocs={RANKS}",
            f"parallelism.pp={RANKS}", "parallelism.schedule=gpipe",
            f"parallelism.microbatches={MICROBATCHES}", f"data.batch_size={BATCH}",
        )
    )  # fmt: skip
    strategy = build_strategy(cfg)
    strategy.setup()
    placed = strategy.wrap_model(build_model(model_cfg, 3, 10, cfg.data.image_size))
    optimizer = torch.optim.SGD(placed.parameters(), lr=0.5, momentum=0.9)
    state = strategy.sharded_state_dict(placed, optimizer)
    checkpoint.read_shards(Path(checkpoint.load(out / source / "last.pt")["shards"]["path"]), state)
    strategy.load_sharded_state_dict(placed, optimizer, state)
    torch.save(strategy.sharded_state_dict(placed, optimizer), out / f"pp4-from-{source}-{rank}.pt")
    return {"stage": strategy.shape.stage, "params": sum(p.numel() for p in placed.parameters())}


@pytest.fixture(scope="module")
def harness(tmp_path_factory, mlflow_template_db) -> Path:
    """The harness's folder, once it ran (one torchrun launch of this file, 4 workers): each
    rank's report, each schedule's checkpoint, and the MLflow store (`store/`) and folders of
    the run resumed on sharded pipelines."""
    out = tmp_path_factory.mktemp("pipeline-ranks")
    new_store(out / "store", mlflow_template_db)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[1])}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(HERE), str(out)],
        cwd=out, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="module")
def stepped(harness) -> dict[int, dict[str, dict]]:
    """Each rank's report of the harness."""
    return {r: json.loads((harness / f"rank{r}.json").read_text()) for r in range(RANKS)}


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
SHARDED = "1f1b+dp_shard"  # each stage sharded over the 2 pipelines by FSDP2 (`dp_shard`)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [*SCHEDULES, SHARDED])
def test_each_schedule_trains_what_one_process_trains(stepped, schedule):
    if schedule not in stepped[0]:
        pytest.skip(f"this torch has no {schedule} schedule")
    seen = {rank: stepped[rank][schedule] for rank in range(RANKS)}
    # the mesh: rank = pipeline rank * replicas + replica (ranks 0, 1: stage 0 of pipelines 0, 1)
    assert [(s["stage"], s["replica"]) for s in seen.values()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_replica = {r: [s for s in seen.values() if s["replica"] == r] for r in range(REPLICAS)}
    for replica, ranks in by_replica.items():
        # every rank of a pipeline holds its step's loss (the last stage's, sent to the others)
        assert ranks[0]["losses"] == ranks[1]["losses"], replica
        # each pipeline its own shard of the data, the pipelines' shards disjoint
        assert ranks[0]["train_shard"] == ranks[1]["train_shard"], replica
    shards = [set(by_replica[r][0]["train_shard"]) for r in range(REPLICAS)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 4 * REPLICAS
    # the pipelines' losses average to the whole batch's: each trained on its half
    halves = (by_replica[r][0]["losses"] for r in range(REPLICAS))
    mean = [sum(pair) / REPLICAS for pair in zip(*halves, strict=True)]
    assert mean == pytest.approx(seen[0]["expected_losses"], rel=1e-5)
    for rank, mine in seen.items():
        assert mine["logits_apart"] < 1e-4, rank  # its half's logits, as one process's
        assert mine["eval_apart"] < 1e-4, rank
        assert 0 < mine["own_params"] < mine["all_params"], rank  # its own stages only
        assert (mine["params_apart"] is None) == (rank != 0)
    for replica0, replica1 in zip(*by_replica.values(), strict=True):  # the same stages
        held = replica0["held_params"], replica1["held_params"]
        if schedule == SHARDED:  # each of the two pipelines half of them, together all
            assert max(held) < replica0["own_params"] == sum(held), held
        else:
            assert held == (replica0["own_params"],) * REPLICAS
    main = seen[0]
    # the whole model, gathered on rank 0, is what one process trained on the whole batch: the
    # gradients were averaged over the pipelines (dp), or reduce-scattered to their shards
    assert main["params_apart"] < 1e-5
    assert main["reloaded"] is True
    if schedule != SHARDED:  # a `last.pt` written gathered (before sharded ones) resumes
        assert main["saved_ranks"] == PP  # the first pipeline's ranks' optimizer states
        assert all(mine["optimizer_resumed"] for mine in seen.values())
    # the same state saved through DCP (`save_shards`) and read back (`read_shards`): bitwise
    assert all(mine["shards_resumed"] for mine in seen.values())
    assert main["stages"] == (4 if schedule.startswith(("interleaved", "zero")) else 2)


# who writes a checkpoint of 2 stages x 2 replicas: a replicated stage once (the first
# pipeline's ranks, world ranks 0 and 2), a sharded one by each rank (its shard)
WRITERS = {"gpipe": {0, 2}, SHARDED: {0, 1, 2, 3}}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # this process: no world
@pytest.mark.parametrize("source", WRITERS)
def test_a_pipeline_checkpoint_holds_the_whole_model_by_name_and_reshards(harness, stepped, source):
    """A checkpoint of 2 stages x 2 replicas (`save_shards`), each stage replicated (gpipe) or
    sharded over the replicas (`dp_shard`): its shards are the whole model by the plain model's
    names, each part written once; one unsharded pipeline of 4 stages and one process with the
    plain model each read the whole of it back."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    from accelexp import checkpoint
    from accelexp.config import typed
    from accelexp.models import build_model

    last = harness / source / "last.pt"
    whole = checkpoint.read_whole(last)  # read from the shards in this process
    gathered = torch.load(harness / source / "gathered.pt", weights_only=True)  # best.pt's
    assert whole["model"].keys() == gathered.keys()  # the whole model's names
    assert all(torch.equal(whole["model"][k], v) for k, v in gathered.items())
    momenta = {k for k in whole["optimizer"] if k.startswith("state.")}
    assert momenta == {f"state.{k}.momentum_buffer" for k in gathered}
    folder = Path(checkpoint.load(last)["shards"]["path"])
    metadata = dcp.FileSystemReader(folder).read_metadata()
    written = {i.relative_path for i in metadata.storage_data.values()}
    assert written == {f"__{rank}_0.distcp" for rank in WRITERS[source]}

    def same(got: dict, want: dict) -> bool:
        return got.keys() == want.keys() and all(
            torch.equal(v, want[k]) if torch.is_tensor(v) else v == want[k] for k, v in got.items()
        )

    # one pipeline of 4 stages read it (4 ranks, each one stage): together, all of it, bitwise
    read = [stepped[r][f"pp4-from-{source}"]["stage"] for r in range(RANKS)]
    assert sorted(read) == list(range(RANKS))
    parts = [
        torch.load(harness / f"pp4-from-{source}-{r}.pt", weights_only=True) for r in range(RANKS)
    ]
    for key in ("model", "optimizer"):  # the optimizer's lr too (0.1 saved, built with 0.5)
        assert same({k: v for p in parts for k, v in p[key].items()}, whole[key]), key

    # one process, the plain model: the same shards read by name (DCP, no world)
    cfg = typed(compose_config("sqlite:///unused.db", *EXACT))
    model = build_model(cfg.model, 3, 10, cfg.data.image_size)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, sgd, options=flat)
    state = {"model": model_state, "optimizer": optimizer_state}
    checkpoint.read_shards(folder, state)
    set_state_dict(model, sgd, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=flat)  # fmt: skip
    assert same(model.state_dict(), gathered)
    assert same(get_state_dict(model, sgd, options=flat)[1], whole["optimizer"])
    assert sgd.param_groups[0]["lr"] == 0.1


def bad(overrides: str, named: str):
    return pytest.param(overrides.split(), named, id=overrides)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        bad("parallelism.schedule=zigzag", "parallelism.schedule"),
        bad("parallelism.microbatches=3", "parallelism.microbatches=3 does not cut"),
        bad("parallelism.microbatches=0", "parallelism.microbatches"),
        bad("parallelism.microbatches=1", "1F1B needs at least one micro-batch per rank"),
        bad("parallelism.schedule=interleaved_1f1b parallelism.microbatches=5 data.batch_size=20",
            "multiple of their rounds"),
        bad("parallelism.sync=horovod", "Horovod's collectives-only API"),
        bad("parallelism.sync=fsdp", "parallelism.dp_shard=true"),
        bad("parallelism.dp_shard=true", "parallelism.dp_shard=true shards each stage over"),
        bad("estimate=true parallelism.nprocs=4 parallelism.pp=2 parallelism.dp_shard=true",
            "does not model a pipeline's stages sharded"),
        bad("parallelism.pp=3 parallelism.nprocs=4", "parallelism.pp=3 does not divide"),
        bad("parallelism.nprocs=1", "at least 2"),
        bad("parallelism.accumulate_steps=2", "parallelism.accumulate_steps=2"),
        bad("speed.compile=default", "speed.compile=default with parallelism=pipeline"),
    ],
)  # fmt: skip
def test_refused_before_any_worker(overrides, named, cli, tmp_path, tracking_uri):
    result = cli(
        "parallelism=pipeline", "data=synthetic", "data.batch_size=16", "progress=false",
        f"mlflow.tracking_uri={tracking_uri}", *overrides, tmp_path=tmp_path,
    )  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "Traceback" not in text and "Starting" not in text, text
    assert named in text, text


def test_more_stages_than_layers_names_the_ranks_and_schedule():
    import torch.nn as nn

    from accelexp.errors import ConfigError
    from accelexp.parallel.config import PipelineConfig
    from accelexp.parallel.stages_per_rank import RankStages
    from accelexp.parallel.world import WorldShape

    placement = RankStages(PipelineConfig(nprocs=2, schedule="interleaved_1f1b"), "cpu")
    placement.shape = WorldShape(devices_per_replica=2, ranks_per_replica=2)
    three_layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    said = r"nprocs=2 with parallelism.schedule=interleaved_1f1b cuts Sequential into 4 stages"
    with pytest.raises(ConfigError, match=said):
        placement.place(three_layers)


# --- the report: a pipeline's keys are compared, its memory not (hand-made records, no launch) --
def _logged(name, parallelism, precision, samples, **params):
    from accelexp.tracking.query import RunRecord

    workers = "1" if parallelism == "single" else "2"
    pipeline = {"parallelism.schedule": "1f1b", "parallelism.microbatches": "4"}
    return RunRecord(
        run_id=f"id-{name}",
        name=name,
        status="FINISHED",
        start_time=0,
        tags={"parallelism": parallelism, "precision": precision, "model": "m", "data": "d",
              "world_size": workers},
        params={"epochs": "3", "data.batch_size": "64", "parallelism.nprocs": workers,
                **(pipeline if parallelism == "pipeline" else {}), **params},
        metrics={"timed_steps": 20.0, "state_mem_mb": 40.0, "peak_mem_mb": 900.0},
        histories={"samples_per_s": list(enumerate(samples, start=1))},
    )  # fmt: skip


def test_the_report_compares_a_pipeline_only_with_the_same_schedule_and_micro_batches():
    from accelexp.report import compare
    from accelexp.report.memory import memory_row

    records = [
        _logged("single", "single", "fp32", [1, 100, 100]),
        _logged("1f1b", "pipeline", "fp32", [1, 150, 150]),
        _logged("gpipe", "pipeline", "fp32", [1, 120, 120], **{"parallelism.schedule": "gpipe"}),
        _logged("1f1b-bf16", "pipeline", "bf16", [1, 300, 300]),
        _logged("m8-bf16", "pipeline", "bf16", [1, 200, 200], **{"parallelism.microbatches": "8"}),
    ]
    rows = {row.run_name: row for row in compare(records)}
    # against one process, the schedule is what the pipeline changes: a speedup
    assert rows["1f1b"].speedup == pytest.approx(1.5)
    assert rows["gpipe"].speedup == pytest.approx(1.2)
    # an AMP gain over the fp32 run of the same schedule (300 / 150), not gpipe's (300 / 120)
    assert rows["1f1b-bf16"].amp_gain == pytest.approx(2.0)
    # none where no fp32 run has its micro-batches, and the note says which key differs
    assert rows["m8-bf16"].amp_gain is None
    assert "parallelism.microbatches (8 vs 4)" in rows["m8-bf16"].note
    # the memory study: a pipeline's rank 0 logs its own stages' state only, so it stays blank
    pipeline, single = memory_row(records[1]), memory_row(records[0])
    assert pipeline.peak_mem_mb == 900.0 and pipeline.state_mem_mb is None
    assert "a pipeline's ranks hold different stages" in pipeline.note
    assert single.state_mem_mb == 40.0


if __name__ == "__main__":
    _stepped_in_this_worker(Path(sys.argv[1]))


@pytest.mark.slow
def test_fp16_loss_scaling_skips_a_step_on_every_rank_when_one_rank_overflows(stepped):
    """fp16 with a GradScaler over 2 pipelines of 2 ranks, stages sharded: an inf in the
    gradients of rank 0 (stage 0) at step 2 makes every rank skip that step and halve its
    scale (the scaler's inf check summed over the world: `Precision.agree_on_overflow`), as one
    process does; the whole model then ends as the one process's, to fp16's rounding."""
    seen = [stepped[rank][FP16] for rank in range(RANKS)]
    halved = [FP16_SCALE, FP16_SCALE / 2]
    assert all(mine["scales"] == mine["expected_scales"] == halved for mine in seen), seen
    assert seen[0]["params_apart"] < 1e-3, seen[0]


@pytest.mark.slow
def test_a_pipeline_run_resumes_on_sharded_pipelines_of_another_depth(harness):
    """One pipeline of 4 ranks, resumed after epoch 1 as 2 pipelines of 2 ranks with each stage
    sharded over them (the batch split in two): the same MLflow run goes on to FINISHED, and
    ends with the weights and momenta the uninterrupted run ended with."""
    import torch
    from mlflow import MlflowClient

    from accelexp.checkpoint import read_whole

    client = MlflowClient(store_uri(harness / "store"))
    (run,) = client.search_runs([client.get_experiment_by_name("accelexp").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["resumed_after_epoch"] == "1"
    one, sharded = (read_whole(harness / f / "checkpoints" / "last.pt") for f in ("one", "sharded"))
    assert one["progress"]["epoch"] == sharded["progress"]["epoch"] == RESUMED_EPOCHS
    for part in ("model", "optimizer"):  # the optimizer's flattened by parameter
        assert sharded[part].keys() == one[part].keys(), part
        for name, value in one[part].items():
            if torch.is_tensor(value):
                torch.testing.assert_close(sharded[part][name], value, rtol=1e-4, atol=1e-5)
