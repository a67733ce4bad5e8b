"""Failures as data (pfactory/runtime/failures.py): every error a user can act on carries its exit code and hint; a
stage process writes its verdict as JSON; the failure screen is built from that, never from message text.

- rewording every user-facing message (the `reworded` fixture) leaves the screen's stage, hint and exit code
  as they were, and the reason is the new wording;
- a real stage process (`tasks._stage.stage_main`) writes the outcome for each kind of ending: done, an
  error of ours, bad params, bad arguments, a bug, a transient failure, a kill from outside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from factory.worker import WorkerError
from flows.failure import failure_lines, stage_failure
from flows.params import ParamsError
from flows.workspace import StageFailed
from pfactory.config.plugins import PluginError
from pfactory.detectors.io import CheckpointError
from pfactory.evaluate.distributed import EvaluateTaskError
from pfactory.evaluate.inputs import EvaluateInputError
from pfactory.evaluate.nusc_submission import NuscSubmissionError
from pfactory.optimize.errors import BackendUnavailable, ParityError
from pfactory.prepare.errors import RejectFractionExceeded, SchemaError
from pfactory.prepare.publish import OutputError
from pfactory.prepare.scaleout import PrepareTaskError
from pfactory.promote.errors import EvidenceError, LockTimeout, PromotionRefused, RegistryError, UnknownRef
from pfactory.runtime.failures import OUTCOME_ENV, UsageError, UserError, read_outcome, stage_outcome
from pfactory.sensors.errors import DatasetError
from pfactory.storage.fsutil import OutputRefused
from pfactory.team.errors import TeamError
from pfactory.tracking.identity import NotAuthenticated, PermissionRefused
from pfactory.tracking.runs import TrackingUnavailable
from pfactory.train.runtime import LaunchFailed
from pfactory.train.trainer import Preempted, TrainingDiverged

REPO = Path(__file__).resolve().parents[2]

# One instance of every error a user can act on, and the exit code `factory run` must give for it.
ERRORS: dict[type[UserError], tuple[Callable[[], UserError], int]] = {
    OutputRefused: (lambda: OutputRefused("out", "holds a user's files"), 2),
    ParamsError: (lambda: ParamsError("train.lr: expected a number"), 2),
    CheckpointError: (lambda: CheckpointError("model.pt: truncated"), 2),
    PluginError: (lambda: PluginError("model plugin 'x' (dist 0.1, m:ARCH) cannot be loaded: ..."), 2),
    SchemaError: (lambda: SchemaError("prepared: schema 9 is newer"), 2),
    RejectFractionExceeded: (lambda: RejectFractionExceeded(12, 12, 0.1, "rejected.jsonl"), 1),
    DatasetError: (lambda: DatasetError("calib/0.txt", "P2", "12 numbers"), 1),
    TrainingDiverged: (lambda: TrainingDiverged("loss is NaN at step 3"), 1),
    Preempted: (lambda: Preempted("stopped by SIGTERM at step 9 of 20: checkpoint written"), 143),
    WorkerError: (lambda: WorkerError("--dir /srv/x: inside a git checkout of the project"), 2),
    LaunchFailed: (lambda: LaunchFailed("train: node 1's worker exited 2: -S differs from node 0's", 2), 2),
    TrackingUnavailable: (lambda: TrackingUnavailable("http://127.0.0.1:5999 does not answer"), 75),
    EvaluateInputError: (lambda: EvaluateInputError("optimized: backend.json missing"), 2),
    EvaluateTaskError: (lambda: EvaluateTaskError("unit 3 failed"), 1),
    PrepareTaskError: (lambda: PrepareTaskError("shard 2 failed"), 1),
    OutputError: (lambda: OutputError("s3://bucket: a bucket root"), 1),
    ParityError: (lambda: ParityError(["ort/int8: match rate 0.7 < 0.75"], "p.json"), 1),
    BackendUnavailable: (lambda: BackendUnavailable("tensorrt: not installed"), 2),
    RegistryError: (lambda: RegistryError("no champion"), 1),
    EvidenceError: (lambda: EvidenceError("kpis.json: no mAP"), 1),
    LockTimeout: (lambda: LockTimeout("registry lock held 60 s"), 1),
    UnknownRef: (lambda: UnknownRef("registered model 'm' has no version 9"), 2),
    PromotionRefused: (lambda: PromotionRefused("the gates refused v2 (min_map)"), 1),
    UsageError: (lambda: UsageError("unrecognized arguments: --bogus"), 2),
    NuscSubmissionError: (lambda: NuscSubmissionError("raw/v1.0-synth/sample.json: no sample 'x'"), 2),
    TeamError: (lambda: TeamError("team dir /srv/team: no services started here"), 2),
    NotAuthenticated: (lambda: NotAuthenticated("the MLflow server http://h refused the request: 401"), 77),
    PermissionRefused: (lambda: PermissionRefused("promote refused: user 'alice' has READ"), 77),
}


def _subclasses(cls: type) -> set[type]:
    return {c for s in cls.__subclasses__() for c in (s, *_subclasses(s))}


@pytest.fixture
def reworded(monkeypatch: pytest.MonkeyPatch) -> Callable[[BaseException], str]:
    """Every user-facing message reworded: none of its original words survive (reversed, tagged)."""

    def wording(e: BaseException) -> str:
        return f"reworded {type(e).__name__}: {BaseException.__str__(e)[::-1]}"

    monkeypatch.setattr(UserError, "__str__", wording)
    return wording


def test_every_user_error_has_an_instance_here() -> None:
    missing = {c.__name__ for c in _subclasses(UserError)} - {c.__name__ for c in ERRORS}
    assert not missing, f"add an instance of {sorted(missing)} to ERRORS (and its exit code)"


@pytest.mark.parametrize("kind", list(ERRORS), ids=lambda c: c.__name__)
def test_a_reworded_message_keeps_stage_reason_hint_and_exit_code(kind, reworded, tmp_path) -> None:
    make, code = ERRORS[kind]
    exc = make()
    e = StageFailed("prepare", stage_outcome("prepare", exc), "", tmp_path / "p.log", returncode=255,
                    index=2, total=6)  # fmt: skip
    f = stage_failure(e, tmp_path, cwd=tmp_path)
    text = "\n".join(t for _, t in failure_lines(f, width=300))
    assert f.exit_code == code and text.splitlines()[-1].startswith(f"exit {code} ")
    assert "failed at stage prepare (2 of 6)" in text
    assert f"reason: {reworded(exc).splitlines()[0].strip()}" in text
    if kind.hint:
        assert kind.hint in f.hints  # the class' own hint, whatever the message says


SCRIPT = """
import os, signal, sys
from pfactory.prepare.errors import RejectFractionExceeded
from tasks._command import Command
from tasks._stage import stage_main
from tasks.synth import sections

def body(params, options):
    how = os.environ["HOW"]
    if how == "ours":
        raise RejectFractionExceeded(3, 4, 0.1, "rejected.jsonl")
    if how == "bug":
        raise RuntimeError("boom")
    if how == "transient":
        raise ConnectionResetError("reset by peer")
    if how == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"ok": 1}

stage_main(Command("synth", "a stage that ends as HOW says", (), body, sections), sys.argv[1:])
"""


@pytest.mark.parametrize(
    ("how", "args", "rc", "code", "error"),
    [
        ("done", [], 0, 0, None),
        ("ours", [], 1, 1, "RejectFractionExceeded"),
        ("done", ["-S", "synth.nosuch=1"], 2, 2, "ParamsError"),
        ("done", ["-S", "promote.min_map=0.5"], 2, 2, "ParamsError"),  # not a parameter synth reads
        ("done", ["--bogus"], 2, 2, "UsageError"),
        ("bug", [], 1, 1, "RuntimeError"),
        ("transient", [], 75, 75, "ConnectionResetError"),
        ("killed", [], -9, None, None),
    ],
)
def test_a_stage_process_writes_its_outcome(how, args, rc, code, error, tmp_path) -> None:
    (tmp_path / "stage.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, OUTCOME_ENV: str(tmp_path / "outcomes"), "HOW": how, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "stage.py", "--params", str(REPO / "params.yaml"), *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == rc, r.stderr[-2000:]
    outcome = read_outcome(tmp_path / "outcomes", "synth")
    assert outcome is not None and outcome.code == code and outcome.error == error, outcome
    doc = json.loads((tmp_path / "outcomes" / "synth.json").read_text())
    assert set(doc) == {"stage", "code", "error", "reason", "hint", "where", "log", "transient"}
    if how == "ours":
        assert outcome.hint == RejectFractionExceeded.hint and "3 of 4 frames refused" in outcome.reason[0]
    if how == "bug":
        assert outcome.reason == ["RuntimeError: boom"] and outcome.where == "at stage.py:13 in body"
    if how == "transient":
        assert outcome.transient
    if how == "killed":  # no verdict: the flow reads it as killed from outside, worth a retry
        e = StageFailed("synth", outcome, "", tmp_path / "s.log", returncode=255)
        assert e.killed and e.transient
