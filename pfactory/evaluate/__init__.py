"""The evaluate stage's library: params, input checks and work units, Dask batch inference, prediction files,
reports. The stage itself is `tasks/evaluate.py`; docs/EVALUATE.md has the layout and the metric names."""

from pfactory.evaluate.distributed import EvaluateTaskError
from pfactory.evaluate.inputs import EvaluateInputError
from pfactory.evaluate.params import EvaluateParams

__all__ = ["EvaluateInputError", "EvaluateParams", "EvaluateTaskError"]
