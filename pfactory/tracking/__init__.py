"""MLflow: runs, and who the server authenticated.

- `runs`      `stage_run` (one MLflow run per stage, lineage tags), reaping orphaned runs, the server check
- `identity`  who the MLflow server authenticated and what it grants them (`NotAuthenticated`, `PermissionRefused`)
Comparing runs (`factory compare`) is a report: `pfactory.report.compare`.
"""
