"""What every stage process runs within: its project and environment, its failures and progress, its Dask cluster.

- `project`   the project root, the params file, the offline in-project environment (MLflow, Prefect, DVC, Dask)
- `lineage`   commit, package versions, device: the tags of every run
- `failures`  `UserError` and exit codes, the one-line explanation of known failures, a stage's outcome file
- `progress`  a stage's progress events, read by the flow's console
- `cluster`   the Dask client (local or a scheduler), worker facts, `run_tasks`
"""
