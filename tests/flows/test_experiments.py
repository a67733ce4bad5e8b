"""`factory run` in a git project: each run is a DVC experiment of the project (git worktree workspace +
`dvc exp save`), DVC's own commands at the root see and compare them, the run's outputs land at the
project's paths, and every follow-up command works on its defaults right after.

One module-scoped git project; two `factory run` started at the same moment (isolated workspaces, one shared
cache and run-cache, serialized experiment saves), then DVC's commands and the follow-up commands.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.flows.pipeline_project import clean_env, dvc, factory, make_project, tiny_args, write_tiny_params

pytestmark = pytest.mark.slow

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}
RUNS = {"lr-a": "0.002", "lr-b": "0.004"}


def _git(project: Path, *args: str) -> str:
    env = {**clean_env(project), **GIT_IDENTITY}
    return subprocess.run(["git", *args], cwd=project, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project committed to a fresh git repository (DVC with git, not no_scm)."""
    root = make_project(tmp_path_factory.mktemp("gitproject"))
    (root / ".dvc" / "config").write_text("[core]\n    analytics = false\n")
    # The follow-up commands run on the project's defaults: tiny ones (a default-size `factory optimize` on
    # the tiny model took ~170 s of the default test tier).
    write_tiny_params(root)
    (root / "docs").mkdir()
    (root / "docs" / "NOTES.md").write_text("a subfolder to run commands from\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "baseline")
    return root


@pytest.fixture(scope="module")
def runs(project: Path) -> dict[str, dict]:
    """Two `factory run` at the same moment, different train.lr; their --json results by name."""
    # The MLflow store is created first: two processes creating one sqlite store at the same moment race in
    # its migrations (the command's service start-up creates it before the flow; not what is tested here).
    db = project / "artifacts" / "mlflow" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-c", f"import mlflow; mlflow.MlflowClient('sqlite:///{db}').search_experiments()"],
        cwd=project, env=clean_env(project), check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", *tiny_args(), "-S", f"train.lr={lr}", "--name", name,
             "--json"],
            cwd=project, env={**clean_env(project), **GIT_IDENTITY}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )
        for name, lr in RUNS.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=1500)
        assert p.returncode == 0, f"{name} failed:\n{stdout[-2000:]}\n{stderr[-3000:]}"
        out[name] = json.loads(stdout[stdout.index("{") :])
    return out


def _dvc_ok(project: Path, *args: str) -> str:
    r = dvc(project, *args, env=GIT_IDENTITY)
    assert r.returncode == 0, f"dvc {' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout


def test_each_run_is_a_dvc_experiment_dvc_exp_show_lists_with_map(project: Path, runs: dict) -> None:
    for name, r in runs.items():
        assert r["experiment"]["name"] == name and r["experiment"]["baseline"] == _git(project, "rev-parse", "HEAD").strip()
        ws = Path(r["workspace"])
        assert (ws / ".git").is_file(), "the workspace is a git worktree of the project"
    shown = json.loads(_dvc_ok(project, "exp", "show", "--json"))
    exps = {
        rev["name"]: rev["data"]
        for base in shown
        for exp in base.get("experiments") or []
        for rev in exp["revs"]
    }
    assert set(RUNS) <= set(exps), sorted(exps)
    for name, lr in RUNS.items():
        data = exps[name]
        head = data["metrics"]["artifacts/eval/metrics.json"]["data"]
        assert head["mAP"] == pytest.approx(runs[name]["kpis"]["mAP"])
        assert data["params"]["params.yaml"]["data"]["train"]["lr"] == float(lr)
    # The metrics DVC shows are the headline (tens of numbers), not kpis.json's detail.
    flat = _dvc_ok(project, "metrics", "show", "--json")
    assert "artifacts/eval/kpis.json" not in flat and len(flat) < 6000, len(flat)


def test_dvc_metrics_diff_and_exp_diff_compare_two_runs(project: Path, runs: dict) -> None:
    diff = json.loads(_dvc_ok(project, "metrics", "diff", "lr-a", "lr-b", "--json"))
    diff = diff.get("diff", diff)
    # The learning rate moves the training loss for sure; the tiny runs' mAP may tie (DVC leaves an unchanged
    # metric out of the diff).
    loss = diff["artifacts/model/metrics.json"]["final_loss"]
    assert loss["old"] != loss["new"], loss
    a, b = runs["lr-a"]["kpis"]["mAP"], runs["lr-b"]["kpis"]["mAP"]
    ev = diff.get("artifacts/eval/metrics.json", {})
    if a != b:
        assert ev["mAP"]["old"] == pytest.approx(a) and ev["mAP"]["new"] == pytest.approx(b), ev
    else:
        assert "mAP" not in ev, ev
    ediff = json.loads(_dvc_ok(project, "exp", "diff", "lr-a", "lr-b", "--json"))
    assert ediff["params"]["params.yaml"]["train.lr"] == {"old": 0.002, "new": 0.004, "diff": pytest.approx(0.002)}
    pdiff = _dvc_ok(project, "params", "diff", "lr-a", "lr-b")
    assert "train.lr" in pdiff and "0.002" in pdiff and "0.004" in pdiff


def test_runs_stay_isolated_share_the_cache_and_leave_the_project_params_alone(project: Path, runs: dict) -> None:
    a, b = (Path(runs[n]["workspace"]) for n in RUNS)
    for ws, lr in ((a, 0.002), (b, 0.004)):
        assert yaml.safe_load((ws / "params.yaml").read_text())["train"]["lr"] == lr
        # the override written the way `dvc exp run -S` writes it: the file's comments are kept
        assert "# perception-factory parameters" in (ws / "params.yaml").read_text()
    assert _git(project, "status", "--porcelain", "--", "params.yaml", "pfactory", "tasks") == ""
    lock_a = yaml.safe_load((a / "dvc.lock").read_text())["stages"]
    lock_b = yaml.safe_load((b / "dvc.lock").read_text())["stages"]
    assert lock_a["prepare"]["outs"] == lock_b["prepare"]["outs"]  # same data: one copy in the shared cache
    assert not list((a / ".dvc").glob("cache")) and (project / ".dvc" / "cache" / "runs").is_dir()


def test_outputs_brought_to_the_project_root_match_a_run(project: Path, runs: dict) -> None:
    root_lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    src = next(r for r in runs.values() if yaml.safe_load((Path(r["workspace"]) / "dvc.lock").read_text())["stages"]["train"] == root_lock["train"])
    assert src["checked_out"], src.get("checked_out")
    ws = Path(src["workspace"])
    for rel in ("artifacts/model/model.pt", "artifacts/eval/kpis.json", "artifacts/optimized/backend.json",
                "artifacts/eval/kitti_frames.txt"):  # fmt: skip
        assert (project / rel).read_bytes() == (ws / rel).read_bytes(), rel
    # The KITTI benchmark's files came too: the documented re-scoring gives kpis.json's numbers.
    r = factory(project, "kpi", "--gt", "artifacts/data/raw/synth/training/label_2", "--pred",
                "artifacts/eval/kitti_results", "--frames", "artifacts/eval/kitti_frames.txt", "--metrics", "kitti",
                "--out", "rescored.json")  # fmt: skip
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
        # the same generated stage command (flows/stage_cli.py) as evaluate's; the stage: tests/tasks/test_optimize.py
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
    at_root = factory(project, "params")
    in_docs = factory(project / "docs", "params")
    assert at_root.returncode == 0 and in_docs.returncode == 0, in_docs.stderr
    root_p, docs_p = yaml.safe_load(at_root.stdout), yaml.safe_load(in_docs.stdout)
    assert docs_p["paths"]["model"] == str(project / "artifacts" / "model")  # the project's paths, anchored
    docs_p["paths"] = root_p["paths"]
    assert docs_p == root_p
    r = factory(project / "docs", "data", "show", "--out", "f.png")
    assert r.returncode == 0 and (project / "docs" / "f.png").is_file(), r.stderr


@pytest.mark.full  # a third pipeline run in this project (~50-80 s)
def test_a_partial_run_until_a_stage_is_an_experiment_of_the_stages_it_ran(project: Path, runs: dict) -> None:
    """`factory run --until prepare` in a git project: `dvc exp save` once failed the finished run because
    the later stages' outputs (artifacts/model/model.pt, ...) do not exist; the experiment now commits
    the stages that ran."""
    r = factory(project, "run", *tiny_args(), "--until", "prepare", "--name", "upto-prepare", "--json",
                timeout=900, env=GIT_IDENTITY)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout[r.stdout.index("{") :])
    assert set(result["stages"]) == {"synth", "prepare"}
    assert result["experiment"]["name"] == "upto-prepare"
    lock = yaml.safe_load(_git(project, "show", f"{result['experiment']['rev']}:dvc.lock"))
    assert set(lock["stages"]) == {"synth", "prepare"}, sorted(lock["stages"])
