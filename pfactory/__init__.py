"""perception-factory domain library: config, sensors, geometry, data, model, metrics, tracking.

No orchestration lives here (that is `flows/` and `tasks/`); nothing here imports them.
Heavy dependencies (torch, DALI, MLflow, ...) are imported inside the functions that need
them so that `factory --help` stays fast.
"""

__version__ = "0.1.0"
