"""What run.py returns to a sweeper (`objective=`), and a bad objective refused before training.

The bad values run run.py's `main` in this process (`conftest.run_here`), as a user types them;
the value a sweeper gets is read from hand-made metrics.
"""

from __future__ import annotations

import math

import pytest
from conftest import output_of

from accelexp import objective, record

TINY = (
    "data=synthetic",
    "data.num_train=256",
    "data.num_test=128",
    "data.image_size=16",
    "max_steps_per_epoch=3",
    "epochs=1",
    "progress=false",
    "threads=1",
)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["objective=accuracy"], "objective='accuracy' is not allowed: expected one of test_acc"),
        (["objective=[test_acc,test_acc]"], "a list of them without repeats"),
        (["objective=[]"], "objective=[] is not allowed"),
        (["objective=time_to_target", "target_accuracy=null"], "set target_accuracy"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_a_bad_objective_is_one_clear_message_and_exit_2(overrides, named, tmp_path, cli):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = cli(*TINY, *overrides, f"mlflow.tracking_uri={uri}", tmp_path=tmp_path)
    text = output_of(result)
    assert result.returncode == 2, text
    assert named in text, text
    assert "Traceback" not in text, text
    assert not (tmp_path / "mlflow.db").exists()  # refused before a run began


def test_the_sweeper_gets_each_objective_and_the_worst_value_for_one_not_measured(caplog):
    metrics = {record.TEST_ACC: 0.5, record.THROUGHPUT: 900.0}
    assert objective.sweeper_value("test_acc", metrics) == 0.5
    assert objective.sweeper_value(["test_acc"], metrics) == 0.5  # one objective: one float
    assert objective.sweeper_value(["samples_per_s", "test_acc"], metrics) == [900.0, 0.5]
    with caplog.at_level("WARNING"):
        never = objective.sweeper_value(["test_acc", "time_to_target"], metrics)
    assert never == [0.5, math.inf]  # minimized: Optuna takes inf, the worst (it refuses NaN)
    assert "val_acc never reached target_accuracy" in caplog.text
    assert objective.tags(["test_acc", "samples_per_s"]) == {
        record.OBJECTIVE: "test_acc,samples_per_s",
        record.OBJECTIVE_DIRECTIONS: "maximize,maximize",
    }
