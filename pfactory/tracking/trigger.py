"""Who triggered a flow run, verified by the MLflow server rather than taken from the client's word.

Prefect's server authenticates its clients with one shared auth string, not per person, so the tag
`pfactory.triggered-by:<user>` that `factory deploy --run-now` puts on a flow run is a claim any holder of
that string could write. On a team's MLflow server each user's experiment `perception-factory/<user>` is
writable by that user alone (`pfactory.tracking.runs.own_experiment`), so the person who triggers leaves a
record there that nobody else could have written:

1. `record_trigger(deployment_id)`, in the person's `factory deploy --run-now`, before the flow run exists:
   an MLflow run in their own experiment, tagged with the deployment; its id goes on the flow run as the
   Prefect tag `pfactory.trigger-record:<mlflow run id>`;
2. `bind_trigger(record, flow_run_id)`, right after the flow run is created: the record names that flow run
   (a record copied onto another flow run does not name it);
3. `verify_trigger(claims, flow_run_id)`, on the worker: the claimed user's record is a run of
   `perception-factory/<user>` that names this flow run. Returns the tags of the pipeline's parent run:
   `pfactory.triggered_by` (the claim) and `pfactory.triggered_by.verified` ("yes: ..." or "no: <why>").

`parent_trigger_tags`: those two tags of the pipeline's parent run, which promotion copies onto the candidate
version it registers (the version names who triggered the run, and whether the server backed it).

Without per-user experiments (no team: one experiment anyone may write to) nothing is recorded and a claim
stays unverified, said so in the tag.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

CLAIM_PREFIX = "pfactory.triggered-by:"  # the Prefect tag of the claim (flows/deploy.py)
RECORD_PREFIX = "pfactory.trigger-record:"  # the Prefect tag naming the MLflow record
DEPLOYMENT_TAG = "pfactory.trigger.deployment"
FLOW_RUN_TAG = "pfactory.trigger.flow_run"
TRIGGERED_BY = "pfactory.triggered_by"
VERIFIED = "pfactory.triggered_by.verified"


def record_trigger(deployment_id: str) -> str | None:
    """An MLflow run in the current user's own experiment saying they trigger a run of `deployment_id`; its
    run id, or None when the tracking server has no per-user experiments (no team)."""
    from pathlib import Path

    import mlflow

    from pfactory.tracking.runs import EXPERIMENT, experiment_id, own_experiment

    if own_experiment() == EXPERIMENT:
        return None
    run = mlflow.MlflowClient().create_run(
        experiment_id(Path.cwd()), run_name="trigger", tags={DEPLOYMENT_TAG: deployment_id, "trigger": "true"}
    )
    return run.info.run_id


def bind_trigger(record: str, flow_run_id: str) -> None:
    """Name the flow run the record `record` triggered, and close the record."""
    import mlflow

    client = mlflow.MlflowClient()
    client.set_tag(record, FLOW_RUN_TAG, flow_run_id)
    client.set_terminated(record, "FINISHED")


def claims(tags: Iterable[str]) -> tuple[str | None, str | None]:
    """(claimed user, MLflow record id) from a flow run's Prefect tags; None where absent."""
    tags = list(tags)
    user = next((t.removeprefix(CLAIM_PREFIX) for t in tags if t.startswith(CLAIM_PREFIX)), None)
    record = next((t.removeprefix(RECORD_PREFIX) for t in tags if t.startswith(RECORD_PREFIX)), None)
    return user, record


def verify_trigger(
    user: str | None, record: str | None, flow_run_id: str, client: Any = None, wait_s: float = 30.0
) -> dict[str, str]:
    """The parent run's trigger tags (module docstring) for a flow run claiming `user` with `record`; {} when
    nothing is claimed. Waits up to `wait_s` for the record to name the flow run (the person's client binds it
    a moment after creating the flow run, which a worker may already have picked up)."""
    if user is None:
        return {}
    if record is None:
        return {TRIGGERED_BY: user, VERIFIED: "no: no MLflow record of the trigger (a claim on the Prefect run only)"}
    import mlflow
    from mlflow.exceptions import MlflowException

    from pfactory.tracking.runs import user_experiment

    client = client or mlflow.MlflowClient()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            run = client.get_run(record)
            exp = client.get_experiment(run.info.experiment_id)
        except MlflowException as e:
            return {TRIGGERED_BY: user, VERIFIED: f"no: record {record}: {e.error_code}"}
        if exp.name != user_experiment(user):
            return {TRIGGERED_BY: user, VERIFIED: f"no: record {record} is in {exp.name!r}, not {user}'s experiment"}
        bound = run.data.tags.get(FLOW_RUN_TAG)
        if bound == flow_run_id:
            return {TRIGGERED_BY: user, VERIFIED: f"yes: record {record} in {exp.name}"}
        if bound is not None or time.monotonic() > deadline:
            what = f"names flow run {bound}" if bound else f"names no flow run after {wait_s:g} s"
            return {TRIGGERED_BY: user, VERIFIED: f"no: record {record} {what}, not {flow_run_id}"}
        time.sleep(0.5)


def parent_trigger_tags(client: Any) -> dict[str, str]:
    """The trigger tags (`TRIGGERED_BY`, `VERIFIED`) of the pipeline's parent run this stage runs under
    (`PFACTORY_PARENT_RUN_ID`); {} for a stage run by hand or a run nobody triggered."""
    import os

    from pfactory.tracking.runs import PARENT_ENV

    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return {}
    tags = client.get_run(parent).data.tags
    return {k: tags[k] for k in (TRIGGERED_BY, VERIFIED) if k in tags}
