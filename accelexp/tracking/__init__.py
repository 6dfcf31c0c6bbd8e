"""MLflow, and only MLflow: reaching the store (`store`), naming and tagging runs (`names`),
a run's and a sweep's status from start to end and the healing of stale runs (`life`), writing
one run (`runs`), reading runs back (`query`), credentials kept out of what is recorded
(`credentials`).

No other part of accelexp imports mlflow; the engine reports through `Tracker`, the sweep
callback through the parent-run functions (`life`), the report reads through `query`.
"""

from accelexp.tracking.runs import Tracker
from accelexp.tracking.store import TrackingUnavailableError, check_reachable

__all__ = ["Tracker", "TrackingUnavailableError", "check_reachable"]
