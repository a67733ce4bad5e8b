"""MLflow: runs, who the server authenticated, and comparisons of runs.

- `runs`      `stage_run` (one MLflow run per stage, lineage tags), reaping orphaned runs, the server check
- `identity`  who the MLflow server authenticated and what it grants them (`NotAuthenticated`, `PermissionRefused`)
- `compare`   `factory compare`: runs side by side, regressions flagged
"""
