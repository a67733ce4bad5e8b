"""The `factory` command: the CLI of the pipeline, its stages, the team's services, workers and disk.

- `cli`        the Typer app (`factory run|prepare|...|promote|data|report|compare|team|worker|gc|...`)
- `run`        `factory run`: the pipeline flow with its console, services and summary
- `stage_cli`  one command per stage, generated from each stage's declared options
- `team`, `worker`, `gc`, `doctor`, `summary`: the commands of the same names and their output
The Prefect flows it runs live in `flows/`.
"""
