"""The chaos benchmark (benchmarks/chaos.py) at its smallest size finds nothing wrong.

Its smallest size is one `run.py -m` sweep of three tiny jobs, stopped by SIGINT or SIGTERM
during its first or second job: the jobs before the signal FINISHED, the one it stopped KILLED,
the sweep's parent KILLED, exit 128 + the signal, no process left. The default size (32 jobs over
every strategy, about 5 minutes) is run by hand: docs/failures.md has its figures.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_the_chaos_benchmark_at_its_smallest_size_finds_nothing_wrong(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--quick", "--keep", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    counts = dict(re.findall(r"^  (wrong statuses|orphans|hangs)\s+(\d+)$", report, re.M))
    assert counts == {"wrong statuses": "0", "orphans": "0", "hangs": "0"}, report
    assert re.search(r"^  single\s+SIG(INT|TERM) run\.py\s+1$", report, re.M), report
