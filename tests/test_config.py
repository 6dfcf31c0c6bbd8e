"""Every config group option composes and validates; bad values are named in ConfigError."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import CONF_DIR, REPO, group_options
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from accelexp.checkpoint import check_same_training
from accelexp.config import ConfigError, register_configs, validate
from accelexp.config.catalog import primary_groups
from accelexp.config.identity import config_hash, config_id
from accelexp.config.schema import SCHEMAS
from accelexp.config.typed import typed
from accelexp.keys import Affects, affects, choices_of, help_of
from accelexp.report.compare import comparable_settings
from accelexp.schema import Config
from accelexp.tracking.query import RunRecord


def documented_options() -> dict[str, tuple[list[str], str | None]]:
    """docs/configuration.md's table of groups: each group's options and its `(default)` one
    (`sgd (lr 0.1, ...)`: the first option is the default where none is marked)."""
    table = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            options = re.findall(r"`(\w+)`(?: \(([^)]*)\))?", cells[1])
            default = next((o for o, note in options if note == "default"), None)
            table[cells[0].strip("`")] = ([o for o, _ in options], default)
    return table


def test_the_documented_options_are_the_discovered_ones():
    found: dict[str, set[str]] = {}
    for group, option in group_options():
        found.setdefault(group, set()).add(option)
    documented = documented_options()
    assert set(documented) == set(primary_groups())
    for group, (options, _) in documented.items():
        assert set(options) == found[group], f"docs/configuration.md's {group} row vs conf/{group}/"


@pytest.mark.parametrize(("group", "option"), group_options())
def test_every_group_option_composes_validates_and_is_typed_alike_composed_or_read_back(
    compose_cfg, group, option, tmp_path
):
    """Each option composes (a primary group's option on the tiny defaults, an add-on group's
    such as experiment/ as written, on the plain defaults), validates, leaves nothing unset;
    and `typed(cfg)` gives the schema's dataclasses, whether `cfg` is as composed (structured)
    or as a worker reads it back from its resolved file (plain)."""
    if group in primary_groups():
        cfg = compose_cfg(f"{group}={option}")
        assert cfg[group].name == option, (
            f"conf/{group}/{option}.yaml names itself {cfg[group].name}"
        )
    else:
        register_configs()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"+{group}={option}"])
    validate(cfg)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # nothing left unset
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)
    read_back = OmegaConf.load(tmp_path / "config.yaml")
    composed = typed(cfg)
    assert isinstance(composed, Config)
    assert composed == typed(read_back)
    for name in SCHEMAS:
        part = getattr(composed, name)
        assert type(part) in SCHEMAS[name].values(), f"{name}: {type(part).__name__}"


def test_the_defaults_validate(compose_cfg):
    validate(compose_cfg())  # the tiny defaults of the fixture
    cfg = compose_cfg("data=fashion_mnist", "epochs=5", "max_steps_per_epoch=null")
    validate(cfg)


def test_the_plain_defaults_are_the_documented_ones():
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config")
    for group, (_, default) in documented_options().items():
        if default is not None:
            assert cfg[group].name == default, f"docs/configuration.md: {group}'s default"
    validate(cfg)


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("data.batch_size=0", "data.batch_size", "0"),
        ("optimizer.lr=-1", "optimizer.lr", "-1"),
        ("epochs=0", "epochs", "0"),
        ("device=tpu", "device", "tpu"),
        ("precision.name=fp16", "precision.name", "fp16"),
        ("target_accuracy=1.5", "target_accuracy", "1.5"),
        ("data.val_fraction=1.0", "data.val_fraction", "1.0"),
        ("optimizer=adamw optimizer.betas=[0.9,1.5]", "optimizer.betas", "1.5"),
        ("scheduler=steplr scheduler.gamma=0", "scheduler.gamma", "0"),
    ],
)
def test_validate_names_the_bad_key_and_value(compose_cfg, override, key, value):
    cfg = compose_cfg(*override.split())
    with pytest.raises(ConfigError) as caught:
        validate(cfg)
    message = str(caught.value)
    assert f"{key}=" in message
    line = next(line for line in message.splitlines() if f"{key}=" in line)
    assert value in line, f"the value {value} is not named: {line!r}"
    assert "expected" in line  # and what is allowed instead


def test_validate_lists_every_problem_at_once(compose_cfg):
    cfg = compose_cfg("data.batch_size=0", "epochs=0", "device=tpu")
    with pytest.raises(ConfigError) as caught:
        validate(cfg)
    message = str(caught.value)
    for key in ("data.batch_size=0", "epochs=0", "device='tpu'"):
        assert key in message


def test_warmup_must_be_shorter_than_the_run(compose_cfg):
    cfg = compose_cfg("epochs=2", "scheduler.warmup_epochs=2")
    with pytest.raises(ConfigError, match=r"scheduler\.warmup_epochs=2"):
        validate(cfg)
    validate(compose_cfg("epochs=2", "scheduler.warmup_epochs=1"))


def test_config_error_is_an_accelexp_error():
    from accelexp.errors import AccelexpError

    assert issubclass(ConfigError, AccelexpError)


SYNTHETIC_ONLY = {"num_train", "num_test", "image_size", "channels", "num_classes"}


@pytest.mark.parametrize("option", ["fashion_mnist", "cifar10"])
def test_a_real_dataset_has_no_synthetic_sizes(compose_cfg, option):
    """Its shape is its files' (Fashion-MNIST: 60k 28px grey images): no key may say otherwise."""
    cfg = compose_cfg(f"data={option}")
    assert SYNTHETIC_ONLY.isdisjoint(cfg.data)
    assert {"root", "download"} <= set(cfg.data)
    validate(cfg)


def test_the_synthetic_set_has_its_sizes_and_no_files(compose_cfg):
    cfg = compose_cfg("data=synthetic")
    assert set(cfg.data) >= SYNTHETIC_ONLY
    assert {"root", "download"}.isdisjoint(cfg.data)


def test_a_key_of_another_data_option_is_refused(compose_cfg):
    with pytest.raises(ConfigCompositionException, match=r"data\.num_train"):
        compose_cfg("data=fashion_mnist", "data.num_train=100")
    with pytest.raises(ConfigError) as caught:  # added with +, past Hydra's schema
        validate(compose_cfg("data=fashion_mnist", "+data.num_train=100"))
    assert (
        "data.num_train applies only to data=synthetic, not to data=fashion_mnist: drop it, "
        "or pick data=synthetic." in str(caught.value)
    )


def test_a_key_of_other_strategies_names_them(compose_cfg):
    owners = r"parallelism=ddp, parallelism=fsdp, parallelism=hybrid and parallelism=pipeline"
    with pytest.raises(ConfigError, match=owners):
        validate(compose_cfg("+parallelism.backend=gloo"))


@pytest.mark.parametrize("override", ["+optimizer.lrr=0.1", "+anything.unknown=1"])
def test_a_key_nothing_reads_is_refused(compose_cfg, override):
    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"  {key} is not a key of accelexp's config"):
        validate(compose_cfg(override))


@pytest.mark.parametrize(
    "overrides",
    [("+experiment=scaling",), ("+experiment=speedups", "+rung=amp"), ("+mlflow.tags.study=x",)],
)
def test_what_a_user_adds_with_plus_is_accepted(compose_cfg, overrides):
    validate(compose_cfg(*overrides))


def test_a_tag_added_with_plus_is_kept(compose_cfg):
    assert compose_cfg("+mlflow.tags.study=x").mlflow.tags == {"study": "x"}


def schemas() -> list[type]:
    """Every dataclass of the schema: the top level, its sections, every option's."""
    top = dataclasses.fields(Config)
    sections = [f.default_factory for f in top if dataclasses.is_dataclass(f.default_factory)]
    return [Config, *sections, *(schema for group in SCHEMAS.values() for schema in group.values())]


@pytest.mark.parametrize("schema", schemas(), ids=lambda schema: schema.__name__)
def test_every_key_says_what_it_does_and_what_it_affects(schema):
    """`--help` shows the help beside KEY=VALUE: one line, never read as a setting (no `=`)."""
    for declared in dataclasses.fields(schema):
        text = help_of(declared)
        assert text and "\n" not in text and "=" not in text, f"{schema.__name__}.{declared.name}"
        assert affects(declared) in (None, *Affects), f"{schema.__name__}.{declared.name}"
        choices = choices_of(declared)
        assert not choices or declared.default in choices, f"{schema.__name__}.{declared.name}"


def resolved(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


def test_a_resumed_run_may_differ_in_what_cannot_change_its_numbers(compose_cfg, tmp_path):
    """`resume=auto` finds a run by its config_hash, and a checkpoint resumes only its own
    training: keys that affect nothing or speed only may change between the two; a key that
    affects results may not. The report's row (config_id) is one across seeds."""
    base = resolved(compose_cfg())
    watched = resolved(
        compose_cfg("resume=auto", "repeats=3", "progress=true", "mlflow.experiment=other")
    ) | {"threads": 2, "profile": True}  # speed only
    assert config_hash(watched) == config_hash(base)
    assert config_id(watched) == config_id(base)
    check_same_training(base, watched, tmp_path / "last.pt")
    for changed in ("seed=7", "data.num_test=64", "data.batch_size=4", "speed.tf32=true"):
        other = resolved(compose_cfg(changed))
        assert config_hash(other) != config_hash(base), changed
        with pytest.raises(ConfigError, match="another configuration"):
            check_same_training(base, other, tmp_path / "last.pt")
    assert config_id(resolved(compose_cfg("seed=7"))) == config_id(base)


def test_a_sharded_checkpoint_resumes_on_a_world_of_another_shape_only(
    compose_cfg, tmp_path, caplog
):
    """DCP reshards: 4 workers in 2 pipelines may go on as one pipeline of 4 (`pp`), or on 2
    workers with the global batch split otherwise; a gathered checkpoint may not, and a batch
    split otherwise on the same world is another training. A resume refused for another key
    never said it was resuming on another world."""
    pipelines = ("parallelism=pipeline", "parallelism.nprocs=4", "data.batch_size=16")
    saved = resolved(compose_cfg(*pipelines, "parallelism.pp=2"))
    last = tmp_path / "last.pt"
    for world in (("parallelism.pp=4", "data.batch_size=32"), ("parallelism.nprocs=2",)):
        moved = resolved(compose_cfg(*pipelines, *world))
        check_same_training(saved, moved, last, sharded=True)
        with pytest.raises(ConfigError, match="another configuration"):
            check_same_training(saved, moved, last)
    resplit = resolved(compose_cfg(*pipelines, "parallelism.pp=2", "data.batch_size=8"))
    with pytest.raises(ConfigError, match=r"data\.batch_size: 16 -> 8"):
        check_same_training(saved, resplit, last, sharded=True)
    longer = resolved(compose_cfg(*pipelines, "parallelism.pp=4", "epochs=3"))
    caplog.clear()
    with caplog.at_level("INFO"), pytest.raises(ConfigError, match="epochs: 1 -> 3"):
        check_same_training(saved, longer, last, sharded=True)
    assert "another world" not in caplog.text


def test_the_report_compares_runs_in_what_can_change_their_speed_only():
    """Like for like: a key that affects results only (or nothing) is not compared; one that
    affects speed only is, as is one that affects both."""

    def settings(**params: str) -> dict[str, str]:
        return comparable_settings(RunRecord("id", "run", "FINISHED", params=params))

    base = {"data.batch_size": "128", "threads": "1", "profile": "False", "profiler.epoch": "1"}
    ignored = {"seed": "7", "data.root": "/x", "data.eval_batch_size": "64", "device": "cpu"}
    ignored |= {"mlflow.experiment": "e", "resume": "auto", "repeats": "3", "num_params": "9"}
    assert settings(**base, **ignored) == settings(**base)
    for key, value in {"threads": "2", "profiler.epoch": "2", "data.batch_size": "64"}.items():
        assert settings(**(base | {key: value})) != settings(**base), key
