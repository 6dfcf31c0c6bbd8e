"""`python run.py` with bad input: a non-zero exit and a message a user can act on, no traceback.

Each case fails before any training, so each subprocess costs only Python's and torch's start.
Hydra's job folder goes to tmp, and a run that gets as far as the tracker uses a tmp store.
"""

from __future__ import annotations

import subprocess

import pytest
from conftest import group_options, new_store, output_of, primary_groups, run_cli

from accelexp.parallel.world import free_port


def assert_clean_failure(result: subprocess.CompletedProcess) -> str:
    text = output_of(result)
    assert result.returncode != 0, text
    assert "Traceback" not in text, text
    return text


@pytest.fixture(scope="module")
def help_text() -> str:
    result = run_cli("--help")
    text = output_of(result)
    assert result.returncode == 0, text
    assert "Traceback" not in text
    return text


def test_help_lists_every_group_and_option(help_text):
    for group in primary_groups():
        assert f"{group}:" in help_text, f"--help does not list the group {group}"
        for option in (o for g, o in group_options() if g == group):
            assert option in help_text, f"--help does not list {group}={option}"


def test_help_lists_the_add_on_groups_too(help_text):
    """conf/experiment/ and any other group outside the defaults list (`+experiment=...`)."""
    for group, option in group_options():
        if group not in primary_groups():
            assert option in help_text, f"--help does not list +{group}={option}"


def test_unknown_key(tmp_path):
    text = assert_clean_failure(run_cli("model.foo=1", tmp_path=tmp_path))
    assert "model.foo" in text


def test_a_sweep_study_without_m_says_to_use_m(tmp_path):
    text = assert_clean_failure(run_cli("+experiment=amp_vs_fp32", tmp_path=tmp_path))
    assert "This study is a sweep (precision=fp32,amp,bf16): run it with -m" in text
    assert "python run.py -m +experiment=amp_vs_fp32" in text
    assert not (tmp_path / "job" / "checkpoints").exists()  # nothing trained


def test_one_job_of_a_study_picks_every_swept_key(tmp_path):
    from accelexp.config.validate import ConfigError, check_one_job_of_a_study

    sweep = {"+rung": "fp32,tf32,amp"}
    check_one_job_of_a_study(sweep, ["+experiment=speedups", "+rung=amp"])  # on purpose: fine
    with pytest.raises(ConfigError, match=r"e\.g\. \+rung=fp32"):
        check_one_job_of_a_study(sweep, ["+experiment=speedups"])


def test_the_hint_names_the_key_that_failed(tmp_path):
    text = assert_clean_failure(run_cli("data.batch_size=0", tmp_path=tmp_path))
    assert "e.g. `python run.py data.batch_size=...`" in text


def test_piped_output_has_no_progress_bar_frames(tmp_path):
    """A Slurm log or `| cat`: no tqdm `\r` frames glued onto the log lines."""
    result = run_cli(
        "data=synthetic", "data.num_train=512", "data.image_size=16", "data.batch_size=16",
        "epochs=1", "progress=true", "log_every_n_steps=1",
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db", tmp_path=tmp_path,
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


def test_unknown_group_option_lists_the_available_ones(tmp_path):
    text = assert_clean_failure(run_cli("model=foo", tmp_path=tmp_path))
    assert "model/foo" in text or "model=foo" in text
    assert "Available options" in text
    for group, option in group_options():
        if group == "model":
            assert option in text


def test_wrong_type(tmp_path):
    text = assert_clean_failure(run_cli("epochs=abc", tmp_path=tmp_path))
    assert "epochs" in text
    assert "abc" in text


def test_out_of_range_value_exits_2_and_names_the_key(tmp_path):
    result = run_cli(
        "data.batch_size=0",
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        tmp_path=tmp_path,
    )
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "data.batch_size=0" in text


def test_unreachable_tracking_server_exits_2(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    result = run_cli(f"mlflow.tracking_uri={uri}", "data=synthetic", tmp_path=tmp_path)
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "unreachable" in text
    assert uri in text
    assert "mlflow.tracking_uri" in text  # what to change


@pytest.fixture
def tmp_store(tmp_path, mlflow_template_db) -> str:
    return new_store(tmp_path / "store", mlflow_template_db)


def test_missing_dataset_exits_2_and_says_what_to_do(tmp_path, tmp_store):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli(
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


def test_a_sweep_with_an_unreachable_tracking_server_stops_before_its_jobs(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    result = run_cli(
        "-m", "precision=fp32,amp", "data=synthetic", f"mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )  # fmt: skip
    text = assert_clean_failure(result)
    assert result.returncode == 2, text
    assert "The sweep cannot start" in text and "unreachable" in text and uri in text
    assert "Launching 2 jobs" not in text  # no job ran
