"""The evaluate stage's library: params, input checks and work units, Dask batch inference, prediction files,
scoring, reports, and `evaluation.evaluate` which runs them. The stage itself is `tasks/evaluate.py`;
docs/EVALUATE.md has the layout and the metric names. Nothing heavy is imported here (`flows.params`
reads `params`): import the module you need (`pfactory.evaluate.inputs.EvaluateInputError`,
`pfactory.evaluate.distributed.EvaluateTaskError`, ...).
"""
