"""The pipeline flow end to end on a tiny dataset, in a throw-away git copy of the project.

Every test here runs the real thing: `factory run` (Prefect flow -> `dvc repro <stage>` in a run workspace,
a git worktree -> the stage processes -> MLflow -> `dvc exp save`), DVC's own commands at the root
(`dvc exp show`, `metrics diff`, `repro` without Prefect), and the follow-up commands on the project's
defaults. One module-scoped project and three runs, each serving many checks (docs/TESTING.md):

- `first`: a newcomer's first run (no Prefect or MLflow database yet), every stage computed;
- then two `factory run` started at the same moment: `again` (first's parameters: every stage restored from
  the run-cache) and `lr-b` (another train.lr: trains anew), in isolated workspaces with one shared cache and
  run-cache and serialized experiment saves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.flows.pipeline_project import (
    STAGES,
    clean_env,
    dvc,
    factory,
    make_project,
    tiny_args,
    write_tiny_params,
)  # fmt: skip

pytestmark = pytest.mark.slow

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}
LR = {"first": 0.003, "again": 0.003, "lr-b": 0.004}  # first and again: params.yaml's train.lr


def _git(project: Path, *args: str) -> str:
    env = {**clean_env(project), **GIT_IDENTITY}
    return subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True, text=True).stdout


# The project's train stage, made to lose its connection once when PFACTORY_TEST_FLAKY_ONCE names a marker file
# that does not exist yet (a transient failure); without that variable it is the stage itself.
FLAKY_ONCE = """

import os as _os

_run_once_flaky = run


def run(*args, **kwargs):  # test: with PFACTORY_TEST_FLAKY_ONCE, the first attempt loses its connection
    marker = _os.environ.get("PFACTORY_TEST_FLAKY_ONCE")
    if marker and not _os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionResetError("simulated: connection reset by peer")
    return _run_once_flaky(*args, **kwargs)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project committed to a fresh git repository (DVC with git, not no_scm), the tiny
    parameters written into its params.yaml (so the follow-up commands are tiny on their defaults); no Prefect
    or MLflow database yet: its first run is a newcomer's first run (the other pipeline tests start from a
    migrated Prefect database). Its tasks/train.py has FLAKY_ONCE appended (inert unless asked)."""
    root = make_project(tmp_path_factory.mktemp("project"), first_start=True)
    train = root / "tasks" / "train.py"
    train.write_text(train.read_text().replace("\ndef main(", FLAKY_ONCE + "\n\ndef main(", 1))
    (root / ".dvc" / "config").write_text("[core]\n    analytics = false\n")
    write_tiny_params(root)
    assert yaml.safe_load((root / "params.yaml").read_text())["train"]["lr"] == LR["first"]
    (root / "docs").mkdir()
    (root / "docs" / "NOTES.md").write_text("a subfolder to run commands from\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "baseline")
    return root


def _start(project: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", *tiny_args(), *extra, "--name", name, "--json"],
        cwd=project, env={**clean_env(project), **GIT_IDENTITY, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _result(name: str, p: subprocess.Popen) -> dict:
    """The run's --json result, with its terminal's stderr under "stderr"."""
    stdout, stderr = p.communicate(timeout=1500)
    assert p.returncode == 0, f"factory run {name} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}"
    return {**json.loads(stdout[stdout.index("{") :]), "stderr": stderr}


@pytest.fixture(scope="module")
def first(project: Path) -> dict:
    """The project's first `factory run` (--json result)."""
    return _result("first", _start(project, "first"))


@pytest.fixture(scope="module")
def runs(project: Path, first: dict) -> dict[str, dict]:
    """`again` and `lr-b` started at the same moment after `first`; the three --json results by name.
    lr-b's train stage fails once with a transient error (FLAKY_ONCE; the marker: `flaky_marker`)."""
    procs = {
        "again": _start(project, "again"),
        "lr-b": _start(project, "lr-b", "-S", f"train.lr={LR['lr-b']}", env={"PFACTORY_TEST_FLAKY_ONCE": str(flaky_marker(project))}),
    }
    return {"first": first, **{name: _result(name, p) for name, p in procs.items()}}


def flaky_marker(project: Path) -> Path:
    return project.parent / "train-failed-once"


def _dvc_ok(project: Path, *args: str) -> str:
    r = dvc(project, *args, env=GIT_IDENTITY)
    assert r.returncode == 0, f"dvc {' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout


def _changed(status_json: str) -> dict:
    """`dvc status --json` without the promote stage's `always changed` (it always runs, by design)."""
    return {k: v for k, v in json.loads(status_json).items() if v != ["always changed"]}


def _mlflow_client(project: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'artifacts' / 'mlflow' / 'mlflow.db'}")


def _stages_present(project: Path) -> list[str]:
    declared = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    return [s for s in STAGES if s in declared]


def test_factory_run_end_to_end(project: Path, first: dict) -> None:
    result = first
    assert result["startup"]["prefect_first_start"] and result["startup"]["mlflow_first_start"], result["startup"]
    stages = _stages_present(project)
    assert sorted(result["stages"]) == sorted(stages)
    assert all(result["stages"][s]["ran"] for s in stages), result["stages"]

    ws = Path(result["workspace"])
    assert ws.parent == project / "artifacts" / "runs"
    assert (ws / ".git").is_file(), "the workspace is a git worktree of the project"
    assert result["experiment"]["name"] == "first"
    assert result["experiment"]["baseline"] == _git(project, "rev-parse", "HEAD").strip()
    lock = yaml.safe_load((ws / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(stages)
    # Each stage's upstream was reproduced by this run just before it: --single-item (Workspace.repro).
    commands = [(ws / "logs" / f"{s}.log").read_text().splitlines()[0] for s in stages]
    assert commands == [f"$ dvc repro --single-item {s}" for s in stages]
    # The workspace's params are the project's + the overrides.
    ws_params = yaml.safe_load((ws / "params.yaml").read_text())
    assert ws_params["synth"]["frames"] == 12 and ws_params["train"]["epochs"] == 1
    # the params file written the way `dvc exp run -S` writes it: its comments are kept
    assert "# perception-factory parameters" in (ws / "params.yaml").read_text()
    # DVC's view of the workspace: everything up to date, outputs in the shared cache.
    st = dvc(ws, "status", "--json")
    assert st.returncode == 0 and _changed(st.stdout) == {}, st.stdout + st.stderr
    assert (project / ".dvc" / "cache" / "files" / "md5").is_dir()

    # MLflow: one parent run with lineage + nested stage runs.
    client = _mlflow_client(project)
    parent = client.get_run(result["mlflow_run_id"])
    tags, metrics, params = parent.data.tags, parent.data.metrics, parent.data.params
    assert (
        tags["pipeline"] == "true"
        and tags["run_id"] == result["run_id"]
        and tags["mlflow.runName"] == "first"
    )
    assert {"git.dirty", "git.commit", "device", "version.torch", "version.dvc"} <= set(tags)
    assert any(k.startswith("data.artifacts/prepared") for k in tags), sorted(tags)
    assert params["synth.frames"] == "12" and params["train.epochs"] == "1"
    for s in stages:
        assert metrics[f"time/{s}_s"] > 0
    assert 0 < metrics["orchestration/fraction"] < 1
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert {c.data.tags["stage"] for c in children} >= set(stages) - {"synth"}
    if "evaluate" in stages:
        kpis = json.loads((ws / "artifacts" / "eval" / "kpis.json").read_text())
        assert metrics["eval/mAP"] == pytest.approx(kpis["mAP"])
        assert "latency/p99_ms" in metrics
        _parent_shows_the_evaluation(client, parent, kpis)
    # The MLflow UI: a machine-learning experiment, and a shared runs-table view whose KPI columns exist.
    exp_tags = client.get_experiment(parent.info.experiment_id).tags
    assert exp_tags["mlflow.experimentKind"] == "custom_model_development"
    columns = json.loads(exp_tags["mlflow.sharedViewState.kpis"])["selectedColumns"]
    shown = [c.split(".", 1)[1].strip("`") for c in columns if c.startswith("metrics.")]
    always = {"time/total_s"} | ({"eval/mAP", "eval/NDS", "latency/p99_ms"} if "evaluate" in stages else set())
    assert always <= set(shown) and always <= set(metrics), (shown, sorted(metrics))


def _parent_shows_the_evaluation(client, parent, kpis: dict) -> None:
    """The parent run has the error breakdown as metrics and the evaluate stage's report (files + images)."""
    metrics, pid = parent.data.metrics, parent.info.run_id
    for cls, block in kpis["errors"].items():
        assert metrics[f"eval/{cls}/errors/localization"] == block["localization"], cls
        assert metrics[f"eval/{cls}/errors/missed"] == block["missed"], cls
        assert {f"eval/{cls}/dap/{k}" for k, v in block["dap"].items() if v == v} <= set(metrics), cls
    report = {a.path for a in client.list_artifacts(pid, "report")}
    assert {"report/report.html", "report/pr.png"} <= report, report
    images = {a.path for a in client.list_artifacts(pid, "images")}
    assert any("pr_curves" in p for p in images), images


def test_second_run_is_restored_from_the_run_cache(project: Path, runs: dict) -> None:
    result = runs["again"]
    assert not result["startup"]["prefect_first_start"], result["startup"]
    compute = [
        s for s in _stages_present(project) if s != "promote"
    ]  # promote always runs (the registry moves)
    for s in compute:
        assert result["stages"][s]["restored_from_run_cache"], (s, result["stages"][s])
    assert not runs["lr-b"]["stages"]["train"]["restored_from_run_cache"]  # another lr: trained anew
    # The restored parent leads to the runs that computed its outputs (the first run's stage runs).
    client = _mlflow_client(project)
    parent = client.get_run(result["mlflow_run_id"])
    first = client.search_runs([parent.info.experiment_id], "attributes.run_name = 'first'")[0]
    first_stages = {
        r.data.tags["stage"]: r.info.run_id
        for r in client.search_runs(
            [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{first.info.run_id}'"
        )
    }
    tags = parent.data.tags
    assert tags["stage.train.how"] == "run-cache"
    assert tags["stage.train.run_id"] == first_stages["train"] and tags["stage.train.from_parent"] == first.info.run_id
    assert first_stages["train"][:8] in tags["mlflow.note.content"]  # the description links it
    if "evaluate" in compute:
        kpis = json.loads((Path(result["workspace"]) / "artifacts" / "eval" / "kpis.json").read_text())
        _parent_shows_the_evaluation(client, parent, kpis)  # although evaluate did not run
        # `factory report <restored run>` follows the lineage tag to the evaluate run that computed it.
        r = factory(project, "report", "again", "--vs", "none", "--out", "again.html", env=GIT_IDENTITY)
        assert r.returncode == 0 and (project / "again.html").is_file(), r.stdout[-2000:] + r.stderr[-2000:]


def test_a_transient_stage_failure_is_retried(project: Path, runs: dict) -> None:
    """lr-b's train stage lost its connection on the first attempt (exit 75): retried, and the run finished."""
    assert flaky_marker(project).exists()
    assert "train: transient failure (exit 75); retrying" in runs["lr-b"]["stderr"], runs["lr-b"]["stderr"]
    log = (Path(runs["lr-b"]["workspace"]) / "logs" / "train.log").read_text()
    assert log.count("$ dvc repro --single-item train") == 2 and "simulated: connection reset by peer" in log
    assert "retrying" not in runs["again"]["stderr"] and "retrying" not in runs["first"]["stderr"]


def test_each_run_is_a_dvc_experiment_dvc_exp_show_lists_with_map(project: Path, runs: dict) -> None:
    head = _git(project, "rev-parse", "HEAD").strip()
    for name, r in runs.items():
        assert r["experiment"]["name"] == name and r["experiment"]["baseline"] == head
        assert (Path(r["workspace"]) / ".git").is_file(), "the workspace is a git worktree of the project"
    shown = json.loads(_dvc_ok(project, "exp", "show", "--json"))
    exps = {
        rev["name"]: rev["data"]
        for base in shown
        for exp in base.get("experiments") or []
        for rev in exp["revs"]
    }
    assert set(LR) <= set(exps), sorted(exps)
    for name, lr in LR.items():
        data = exps[name]
        head = data["metrics"]["artifacts/eval/metrics.json"]["data"]
        assert head["mAP"] == pytest.approx(runs[name]["kpis"]["mAP"])
        assert data["params"]["params.yaml"]["data"]["train"]["lr"] == lr
    # The metrics DVC shows are the headline (tens of numbers), not kpis.json's detail.
    flat = _dvc_ok(project, "metrics", "show", "--json")
    assert "artifacts/eval/kpis.json" not in flat and len(flat) < 6000, len(flat)


def test_dvc_metrics_diff_and_exp_diff_compare_two_runs(project: Path, runs: dict) -> None:
    diff = json.loads(_dvc_ok(project, "metrics", "diff", "first", "lr-b", "--json"))
    diff = diff.get("diff", diff)
    # The learning rate moves the training loss for sure; the tiny runs' mAP may tie (DVC leaves an unchanged
    # metric out of the diff).
    loss = diff["artifacts/model/metrics.json"]["final_loss"]
    assert loss["old"] != loss["new"], loss
    a, b = runs["first"]["kpis"]["mAP"], runs["lr-b"]["kpis"]["mAP"]
    ev = diff.get("artifacts/eval/metrics.json", {})
    if a != b:
        assert ev["mAP"]["old"] == pytest.approx(a) and ev["mAP"]["new"] == pytest.approx(b), ev
    else:
        assert "mAP" not in ev, ev
    ediff = json.loads(_dvc_ok(project, "exp", "diff", "first", "lr-b", "--json"))
    assert ediff["params"]["params.yaml"]["train.lr"] == {"old": 0.003, "new": 0.004, "diff": pytest.approx(0.001)}
    pdiff = _dvc_ok(project, "params", "diff", "first", "lr-b")
    assert "train.lr" in pdiff and "0.003" in pdiff and "0.004" in pdiff


def test_runs_at_the_same_moment_stay_isolated_and_share_the_cache(project: Path, runs: dict) -> None:
    """again and lr-b ran at the same moment: each workspace has its own params, MLflow run and outputs that
    match its own dvc.lock; the same data is one copy in the shared cache; the project's files are untouched."""
    assert len({r["run_id"] for r in runs.values()}) == len({r["mlflow_run_id"] for r in runs.values()}) == 3
    client = _mlflow_client(project)
    for name, r in runs.items():
        ws = Path(r["workspace"])
        assert yaml.safe_load((ws / "params.yaml").read_text())["train"]["lr"] == LR[name]
        assert client.get_run(r["mlflow_run_id"]).data.params["train.lr"] == str(LR[name])
        st = dvc(ws, "status", "--json")  # every output matches its own dvc.lock
        assert st.returncode == 0 and _changed(st.stdout) == {}, (name, st.stdout + st.stderr)
    assert _git(project, "status", "--porcelain", "--", "params.yaml", "pfactory", "tasks") == ""
    locks = {n: yaml.safe_load((Path(r["workspace"]) / "dvc.lock").read_text())["stages"] for n, r in runs.items()}
    md5 = lambda lock: next(o["md5"] for o in lock["train"]["outs"] if o["path"].endswith("model.pt"))  # noqa: E731
    assert md5(locks["again"]) == md5(locks["first"]) != md5(locks["lr-b"])  # another lr: other weights, kept
    assert locks["first"]["prepare"]["outs"] == locks["lr-b"]["prepare"]["outs"]  # same data: one cached copy
    assert not list((Path(runs["lr-b"]["workspace"]) / ".dvc").glob("cache"))
    assert (project / ".dvc" / "cache" / "runs").is_dir()


def test_outputs_brought_to_the_project_root_match_a_run(project: Path, runs: dict) -> None:
    root_lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    src = next(r for r in runs.values()
               if yaml.safe_load((Path(r["workspace"]) / "dvc.lock").read_text())["stages"]["train"] == root_lock["train"])  # fmt: skip
    assert src["checked_out"], src.get("checked_out")
    ws = Path(src["workspace"])
    for rel in ("artifacts/model/model.pt", "artifacts/eval/kpis.json", "artifacts/optimized/backend.json",
                "artifacts/eval/kitti_frames.txt"):  # fmt: skip
        assert (project / rel).read_bytes() == (ws / rel).read_bytes(), rel
    # The KITTI benchmark's files came too: the documented re-scoring gives kpis.json's numbers.
    r = factory(project, "kpi", "--gt", "artifacts/data/raw/synth/training/label_2", "--pred",
                "artifacts/eval/kitti_results", "--frames", "artifacts/eval/kitti_frames.txt", "--metrics", "kitti",
                "--out", "rescored.json", env=GIT_IDENTITY)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    kpis = json.loads((project / "artifacts" / "eval" / "kpis.json").read_text())
    again = json.loads((project / "rescored.json").read_text())
    assert kpis["kitti"] and again["kitti"] == kpis["kitti"] and again["kitti_R11"] == kpis["kitti_R11"]


def _no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize(
    "cmd",
    [
        ["evaluate"],
        # the same generated stage command (factory/stage_cli.py) as evaluate's; the stage: tests/tasks/test_optimize.py
        pytest.param(["optimize"], marks=pytest.mark.full),
        ["profile", "train", "--steps", "1"],  # the trace's content: tests/train/test_trainer.py
        ["data", "show"],
        ["promote", "--dry-run"],
        ["lineage"],
    ],
    ids=lambda c: " ".join(c),
)
def test_follow_up_command_on_its_defaults_after_factory_run(project: Path, runs: dict, cmd: list[str]) -> None:
    r = factory(project, *cmd, timeout=900, env=GIT_IDENTITY)
    _no_traceback(r)
    if cmd[0] == "promote":  # tiny runs fail the min_map gate: a dry run says so with the gate table, exit 1
        assert r.returncode in (0, 1) and "min_map" in r.stdout, r.stdout + r.stderr
        return
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if cmd == ["data", "show"]:
        assert (project / "frame.png").is_file()
    if cmd[0] == "profile":
        assert (project / "artifacts" / "profile").is_dir()


def test_commands_find_the_project_from_a_subfolder(project: Path, runs: dict) -> None:
    at_root = factory(project, "params", env=GIT_IDENTITY)
    in_docs = factory(project / "docs", "params", env=GIT_IDENTITY)
    assert at_root.returncode == 0 and in_docs.returncode == 0, in_docs.stderr
    root_p, docs_p = yaml.safe_load(at_root.stdout), yaml.safe_load(in_docs.stdout)
    assert docs_p["paths"]["model"] == str(project / "artifacts" / "model")  # the project's paths, anchored
    docs_p["paths"] = root_p["paths"]
    assert docs_p == root_p
    r = factory(project / "docs", "data", "show", "--out", "f.png", env=GIT_IDENTITY)
    assert r.returncode == 0 and (project / "docs" / "f.png").is_file(), r.stderr


def test_dvc_repro_without_prefect_then_nothing_to_do(project: Path, runs: dict) -> None:
    """The same DAG at the project root, no Prefect: `dvc exp apply first` brings first's outputs and params;
    another `evaluate.slice_frames` (how the work is cut, not what it computes) makes `dvc repro` rerun
    evaluate alone, to the same KPIs; a second `dvc repro` has nothing to do."""
    _dvc_ok(project, "exp", "apply", "first")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["evaluate"]["slice_frames"] = 3
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    targets = [s for s in _stages_present(project) if s != "promote"]
    again = _dvc_ok(project, "repro", *targets)
    ran = {ln.split("'")[1] for ln in again.splitlines() if ln.startswith("Running stage")}
    assert ran == {"evaluate"}, again
    kpis = json.loads((project / "artifacts" / "eval" / "kpis.json").read_text())
    assert kpis["mAP"] == pytest.approx(runs["first"]["kpis"]["mAP"], abs=1e-9)
    second = _dvc_ok(project, "repro", *targets)
    assert "Running stage" not in second and "up to date" in second, second


def test_bad_override_is_refused_before_anything_runs(project: Path) -> None:
    r = factory(project, "run", "-S", "train.epochs=zero")
    assert r.returncode == 2 and "train.epochs" in r.stderr
    r = factory(project, "run", "--until", "nope")
    assert r.returncode == 2 and "--until" in r.stderr


@pytest.mark.full  # plain `dvc exp run` (~100 s); factory's own experiments: the tests above
def test_dvc_exp_run_with_a_param_override(project: Path, runs: dict) -> None:
    """`dvc exp run -S train.lr=...` in the project, against a baseline commit of the root's current state
    (its dvc.lock and metrics: a run's outputs checked out, then `dvc repro`)."""
    git_identity = GIT_IDENTITY
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "the root's outputs")
    target = "evaluate" if "evaluate" in _stages_present(project) else "optimize"
    r = dvc(
        project, "exp", "run", "-S", "train.lr=0.005", "--name", "lr5", target, timeout=900, env=git_identity
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    show = dvc(project, "exp", "show", "--json", env=git_identity)
    assert show.returncode == 0, show.stderr
    assert "lr5" in show.stdout and "0.005" in show.stdout
    if target == "evaluate":  # the KPIs of the experiment vs the committed baseline
        diff = dvc(project, "metrics", "diff", "--all", "--json", env=git_identity)  # unchanged ones too
        assert diff.returncode == 0, diff.stderr
        out = json.loads(diff.stdout)
        kpis = out.get("diff", out)["artifacts/eval/metrics.json"]  # {path: {metric: {old, new, diff}}}
        assert "mAP" in kpis and kpis["mAP"]["old"] is not None and kpis["mAP"]["new"] is not None, kpis


# A DVC that words its console differently: every line DVC itself prints is reversed and tagged (the stage
# processes write to the log directly and are untouched). Loaded by `site` into `python -m dvc` only.
REWORDED_DVC = """
import sys

if sys.orig_argv[1:3] == ["-m", "dvc"]:

    class _Reworded:
        def __init__(self, stream):
            self._stream = stream

        def write(self, text):
            lines = text.split("\\n")
            return self._stream.write("\\n".join(f"[other dvc] {ln[::-1]}" if ln else ln for ln in lines))

        def __getattr__(self, name):
            return getattr(self._stream, name)

    sys.stdout, sys.stderr = _Reworded(sys.stdout), _Reworded(sys.stderr)
"""


def test_a_deterministic_stage_failure_is_one_screen_and_not_retried(project: Path, tmp_path: Path) -> None:
    """...with a DVC that prints its console in other words: the screen does not read it (the stage's
    outcome JSON says stage, reason, hint and exit code)."""
    (tmp_path / "sitecustomize.py").write_text(REWORDED_DVC)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    r = factory(project, "run", *tiny_args(), "-S", "prepare.min_points=10000000", "--name", "fails",
                env={"PYTHONPATH": path})  # fmt: skip
    lines = r.stderr.splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) <= 15, r.stderr  # the whole terminal output of the failed run
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert "failed at stage prepare (2 of 6)" in r.stderr and "not retried" in r.stderr, r.stderr
    assert "frames refused" in r.stderr, r.stderr
    # The log path opens from where the user stands (the project root here), and so does rejected.jsonl.
    log = next(ln.split()[1] for ln in lines if ln.startswith("log:"))
    assert not Path(log).is_absolute() and (project / log).is_file(), log
    rejected = next(w for w in r.stderr.split() if w.endswith("rejected.jsonl"))
    assert (project / rejected).is_file(), rejected
    assert (project / log).read_text().count("$ dvc repro --single-item prepare") == 1  # one attempt: not retried
    assert "[other dvc] " in (project / log).read_text()  # DVC's own lines were reworded
    prefect_log = (project / log).parent / "prefect.log"
    assert "Traceback" in prefect_log.read_text()  # Prefect's own output went to the file


@pytest.mark.full  # a third pipeline run in this project (~50-80 s)
def test_a_partial_run_until_a_stage_is_an_experiment_of_the_stages_it_ran(project: Path, runs: dict) -> None:
    """`factory run --until prepare` in a git project: `dvc exp save` once failed the finished run because
    the later stages' outputs (artifacts/model/model.pt, ...) do not exist; the experiment now commits
    the stages that ran, and the other stages' entries as its baseline commit has them (none when the
    baseline has no dvc.lock; all of them after `test_dvc_exp_run_with_a_param_override` committed the root)."""
    r = factory(project, "run", *tiny_args(), "--until", "prepare", "--name", "upto-prepare", "--json",
                timeout=900, env=GIT_IDENTITY)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout[r.stdout.index("{") :])
    assert set(result["stages"]) == {"synth", "prepare"}
    assert result["experiment"]["name"] == "upto-prepare"
    lock = yaml.safe_load(_git(project, "show", f"{result['experiment']['rev']}:dvc.lock"))["stages"]
    base = result["experiment"]["baseline"]
    in_base = "dvc.lock" in _git(project, "ls-tree", "--name-only", base).split()
    base_lock = yaml.safe_load(_git(project, "show", f"{base}:dvc.lock"))["stages"] if in_base else {}
    assert set(lock) == {"synth", "prepare"} | set(base_lock), sorted(lock)
    ws_lock = yaml.safe_load((Path(result["workspace"]) / "dvc.lock").read_text())["stages"]
    for stage in lock:
        assert lock[stage] == (ws_lock[stage] if stage in ("synth", "prepare") else base_lock[stage]), stage
