"""MLflow, and only MLflow: writing runs (`runs`) and reading them back (`query`).

No other part of accelexp imports mlflow; the engine reports through `Tracker`, the sweep
callback through the parent-run functions, the report reads through `query`.
"""

from accelexp.tracking.runs import Tracker, TrackingUnavailableError, check_reachable

__all__ = ["Tracker", "TrackingUnavailableError", "check_reachable"]
