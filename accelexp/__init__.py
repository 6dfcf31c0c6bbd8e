"""accelexp: measure how much faster PyTorch training gets, and at what cost.

Hydra config groups compose a run (model, data, parallelism, precision, optimizer, scheduler);
`accelexp.train.train` builds and runs it; every run is tracked in MLflow.
"""

__version__ = "0.1.0"
