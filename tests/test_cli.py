"""`python run.py` with bad input: a non-zero exit and a message a user can act on, no traceback.

Each case runs run.py's `main` in this process (`conftest.run_here`: a new process would only
repeat pytest's imports) and fails before any training (the piped-output case trains one epoch).
Hydra's job folder goes to tmp, and a run that gets as far as the tracker uses a tmp store.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import CONF_DIR, group_options, new_store, output_of, run_py_help
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from accelexp.config import register_configs
from accelexp.config.catalog import HIDDEN_KEYS, flatten, primary_groups
from accelexp.parallel.world import free_port

ADD_ON_GROUPS = ("experiment", "rung")  # `+GROUP=OPTION`: they set keys of the other groups


def assert_clean_failure(result: subprocess.CompletedProcess) -> str:
    text = output_of(result)
    assert result.returncode != 0, text
    assert "Traceback" not in text, text
    return text


@pytest.fixture(scope="module")
def help_text(tmp_path_factory) -> str:
    result = run_py_help(tmp_path_factory)  # once a test session (tests/test_docs.py's too)
    text = output_of(result)
    assert result.returncode == 0, text
    assert "Traceback" not in text
    return text


def option_block(help_text: str, heading: str, label: str) -> str:
    """The lines `--help` gives one option: `  *label  keys...` and the lines under it."""
    section = help_text.split(f"\n{heading}", 1)[1].split("\n\n", 1)[0].splitlines()
    start = next(i for i, line in enumerate(section) if line[3:].split(" ")[0] == label)
    block = [section[start]]
    for line in section[start + 1 :]:
        if len(line) - len(line.lstrip()) <= 3:  # the next option
            break
        block.append(line)
    return "\n".join(block)


def typed_values(words: str) -> dict[str, object]:
    """`a=1 b=[2,3] c=null d='x y'` read back the way Hydra reads a command line."""
    parser = OverridesParser.create()
    quoted_or_not = re.findall(r"(?:'[^']*'|\S)+", words)  # 'one device': one word
    pairs = (parser.parse_override(word.lstrip("*")) for word in quoted_or_not if "=" in word)
    return {pair.key_or_group: pair.value() for pair in pairs}


def file_options() -> list[tuple[str, str]]:
    """Every `conf/<group>/<option>.yaml`, nested groups (hydra/launcher) too."""
    return sorted(
        (path.parent.relative_to(CONF_DIR).as_posix(), path.stem)
        for path in CONF_DIR.rglob("*.yaml")
        if path.parent != CONF_DIR
    )


def test_help_lists_every_option_file(help_text):
    for group, option in file_options():
        assert f"\n{group}:" in help_text, f"--help does not list the group {group}"
        label = option if group in ADD_ON_GROUPS else f"{group}={option}"
        assert option_block(help_text, f"{group}:", label), f"--help lacks {group}={option}"


@pytest.mark.parametrize(
    ("group", "option"), [o for o in group_options() if o[0] in primary_groups()]
)
def test_help_shows_each_option_with_the_keys_it_composes(help_text, group, option):
    """Every key and default `group=option` really composes to, typable as shown; no others."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = OmegaConf.to_container(compose("config", overrides=[f"{group}={option}"])[group])
    composed.pop("name")
    shown = typed_values(option_block(help_text, f"{group}:", f"{group}={option}"))
    shown.pop(group)  # the option's own label, group=option
    assert shown == composed


@pytest.mark.parametrize(("group", "option"), [o for o in file_options() if o[0] in ADD_ON_GROUPS])
def test_help_shows_what_each_study_sets_and_sweeps(help_text, group, option):
    body = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    picks = {
        k.removeprefix("override /"): v for d in body.pop("defaults", []) for k, v in d.items()
    }
    hydra = body.pop("hydra", {})
    sweeps = hydra.get("sweeper", {}).pop("params", {})  # the rest it sets: Optuna's n_trials...
    block = option_block(help_text, f"{group}:", option)
    shown = typed_values(block.split(" sets ", 1)[1].split(" sweeps ", 1)[0])
    assert shown == picks | flatten(body) | flatten({"hydra": hydra}, empty=False)
    for key, values in sweeps.items():
        assert f"{key}={values}" in block.split(" sweeps ", 1)[1]


def test_help_shows_the_top_level_keys_without_the_test_hooks(help_text):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config"))
    expected = flatten({k: v for k, v in cfg.items() if k not in primary_groups()})
    shown, prefix = {}, ""
    for line in help_text.split("\nTop-level keys", 1)[1].split("\n\n", 1)[0].splitlines()[1:]:
        first = line.split()[0]
        if line[2] != " ":  # a new line of its own, not a continuation
            prefix = first if first.endswith(".") else ""
        shown |= {prefix + key: value for key, value in typed_values(line).items()}
    assert "debug" not in help_text  # the test hooks are not for users
    assert "repeat_index" not in help_text  # nor what the sweeper sets per job
    assert shown == {k: v for k, v in expected.items() if k.split(".")[0] not in HIDDEN_KEYS}


def test_help_fits_in_100_columns(help_text):
    assert [line for line in help_text.splitlines() if len(line) > 100] == []


def test_unknown_key(tmp_path, cli):
    text = assert_clean_failure(cli("model.foo=1", tmp_path=tmp_path))
    assert "model.foo" in text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+optimizer.lrr=0.1", "optimizer.lrr is not a key of accelexp's config"),
        ("+anything.unknown=1", "anything.unknown is not a key of accelexp's config"),
        ("+data.num_train=100", "data.num_train applies only to data=synthetic"),
    ],
)
def test_a_key_added_with_plus_that_nothing_reads_exits_2(tmp_path, override, message, cli):
    result = cli(override, f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db", tmp_path=tmp_path)
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert text.count("is not a key") + text.count("applies only") == 1, text  # one message
    assert message in text
    assert not (tmp_path / "job" / "checkpoints").exists()  # nothing trained


def test_a_sweep_study_without_m_says_to_use_m(tmp_path, cli):
    text = assert_clean_failure(cli("+experiment=amp_vs_fp32", tmp_path=tmp_path))
    assert "This study is a sweep (precision=fp32,amp,bf16): run it with -m" in text
    assert "python run.py -m +experiment=amp_vs_fp32" in text
    assert not (tmp_path / "job" / "checkpoints").exists()  # nothing trained


def test_one_job_of_a_study_picks_every_swept_key(tmp_path):
    from accelexp.config.validate import ConfigError, check_one_job_of_a_study

    sweep = {"+rung": "fp32,tf32,amp"}
    check_one_job_of_a_study(sweep, ["+experiment=speedups", "+rung=amp"])  # on purpose: fine
    with pytest.raises(ConfigError, match=r"e\.g\. \+rung=fp32"):
        check_one_job_of_a_study(sweep, ["+experiment=speedups"])


def test_the_hint_names_the_key_that_failed(tmp_path, cli):
    text = assert_clean_failure(cli("data.batch_size=0", tmp_path=tmp_path))
    assert "e.g. `python run.py data.batch_size=...`" in text


def test_piped_output_has_no_progress_bar_frames(tmp_path, tracking_uri, cli):
    """A Slurm log or `| cat`: no tqdm `\r` frames glued onto the log lines, and the run ends
    with one short line. run.py in this process, its output captured at the descriptors
    (`conftest.run_here`): stderr is not a terminal, as in a pipe (engine.py asks
    `sys.stderr.isatty()`); a new process would only repeat pytest's imports."""
    result = cli(
        "data=synthetic", "data.num_train=512", "data.image_size=16", "data.batch_size=16",
        "epochs=1", "progress=true", "log_every_n_steps=1",
        f"mlflow.tracking_uri={tracking_uri}", tmp_path=tmp_path,
    )  # fmt: skip
    text = output_of(result)
    assert result.returncode == 0, text
    assert "epoch 1/1  train_loss" in text
    assert "\r" not in text and "it/s]" not in text
    # one line each at the start and the end: where it runs and writes, what it took, the weights
    assert "Training simple_cnn-single-fp32 on cpu: 1 process(es)" in text
    assert f"output in {tmp_path / 'job'}" in text
    assert f"best checkpoint {tmp_path / 'job' / 'checkpoints' / 'best.pt'}" in text
    assert "Trained in " in text
    # and the last line is short: the link to the run and the command that starts the UI
    (end,) = [line for line in text.splitlines() if "Run FINISHED: http" in line]
    message = end.partition("] - ")[2]  # after the logger's time and name
    assert "/#/experiments/1/runs/" in message and "mlflow ui --backend-store-uri" in message
    # with the default store (this test's has a longer path): about 150 characters
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert len(message) - len(uri) + len("sqlite:///outputs/mlflow.db") <= 155, message


def test_unknown_group_option_lists_the_available_ones(tmp_path, cli):
    text = assert_clean_failure(cli("model=foo", tmp_path=tmp_path))
    assert "model/foo" in text or "model=foo" in text
    assert "Available options" in text
    for group, option in group_options():
        if group == "model":
            assert option in text


def test_wrong_type(tmp_path, cli):
    text = assert_clean_failure(cli("epochs=abc", tmp_path=tmp_path))
    assert "epochs" in text
    assert "abc" in text


def test_out_of_range_value_exits_2_and_names_the_key(tmp_path, cli):
    result = cli(
        "data.batch_size=0",
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        tmp_path=tmp_path,
    )
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "data.batch_size=0" in text


def test_unreachable_tracking_server_exits_2(tmp_path, cli):
    uri = f"http://127.0.0.1:{free_port()}"
    result = cli(f"mlflow.tracking_uri={uri}", "data=synthetic", tmp_path=tmp_path)
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "unreachable" in text
    assert uri in text
    assert "mlflow.tracking_uri" in text  # what to change


@pytest.fixture
def tmp_store(tmp_path, mlflow_template_db) -> str:
    return new_store(tmp_path / "store", mlflow_template_db)


def test_missing_dataset_exits_2_and_says_what_to_do(tmp_path, tmp_store, cli):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli(
        "data=cifar10",
        f"data.root={empty}",
        "data.download=false",
        f"mlflow.tracking_uri={tmp_store}",
        "progress=false",
        tmp_path=tmp_path,
    )
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "CIFAR-10" in text
    assert str(empty) in text
    assert "data.download=true" in text or "data.root" in text


def test_a_sweep_with_an_unreachable_tracking_server_stops_before_its_jobs(tmp_path, cli):
    uri = f"http://127.0.0.1:{free_port()}"
    result = cli(
        "-m", "precision=fp32,amp", "data=synthetic", f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "The sweep cannot start" in text and "unreachable" in text and uri in text
    assert "Launching 2 jobs" not in text  # no job ran
