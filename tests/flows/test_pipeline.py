"""The pipeline flow end to end on a tiny dataset, in a throw-away copy of the project.

Every test here runs the real thing: `factory run` (Prefect flow -> `dvc repro <stage>` in a run
workspace -> the stage processes -> MLflow), `dvc repro` without Prefect, `dvc exp run -S`, and two
`factory run` at the same moment. The project copy has its own `.dvc` (cache), MLflow store and Prefect
home, so nothing touches the developer's `artifacts/`. One module-scoped project: later tests reuse the
DVC cache the first run filled (that reuse is itself under test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.flows.pipeline_project import STAGES, TINY, clean_env, dvc, factory, make_project, tiny_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project (code, dvc.yaml, params.yaml, a fresh `.dvc/`), shared by this module; no Prefect
    database yet: its first run is a newcomer's first run (the other pipeline tests start from a migrated one)."""
    return make_project(tmp_path_factory.mktemp("project"), first_start=True)


def _changed(status_json: str) -> dict:
    """`dvc status --json` without the promote stage's `always changed` (it always runs, by design)."""
    return {k: v for k, v in json.loads(status_json).items() if v != ["always changed"]}


def _mlflow_client(project: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{project / 'artifacts' / 'mlflow' / 'mlflow.db'}")


def _stages_present(project: Path) -> list[str]:
    declared = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    return [s for s in STAGES if s in declared]


def _run(project: Path, name: str, *extra: str) -> dict:
    r = factory(project, "run", *tiny_args(), *extra, "--name", name, "--json")
    assert r.returncode == 0, f"factory run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout[r.stdout.index("{") :])


def test_factory_run_end_to_end(project: Path) -> None:
    result = _run(project, "first")
    assert result["startup"]["prefect_first_start"] and result["startup"]["mlflow_first_start"], result["startup"]
    stages = _stages_present(project)
    assert sorted(result["stages"]) == sorted(stages)
    assert all(result["stages"][s]["ran"] for s in stages), result["stages"]

    ws = Path(result["workspace"])
    assert ws.parent == project / "artifacts" / "runs"
    lock = yaml.safe_load((ws / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(stages)
    # The workspace's params are the project's + the overrides.
    ws_params = yaml.safe_load((ws / "params.yaml").read_text())
    assert ws_params["synth"]["frames"] == 12 and ws_params["train"]["epochs"] == 1
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


def test_second_run_is_restored_from_the_run_cache(project: Path) -> None:
    t0 = time.perf_counter()
    result = _run(project, "again")
    seconds = time.perf_counter() - t0
    assert not result["startup"]["prefect_first_start"], result["startup"]
    compute = [
        s for s in _stages_present(project) if s != "promote"
    ]  # promote always runs (the registry moves)
    for s in compute:
        assert result["stages"][s]["restored_from_run_cache"], (s, result["stages"][s])
    assert seconds < 120
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
        r = factory(project, "report", "again", "--vs", "none", "--out", "again.html")
        assert r.returncode == 0 and (project / "again.html").is_file(), r.stdout[-2000:] + r.stderr[-2000:]


def test_dvc_repro_without_prefect_then_nothing_to_do(project: Path) -> None:
    # The same DAG at the project root, no Prefect: tiny params written the DVC way.
    params = yaml.safe_load((project / "params.yaml").read_text())
    for o in TINY:
        key, value = o.split("=", 1)
        section, *rest = key.split(".")
        if section not in params:
            continue
        node = params[section]
        for k in rest[:-1]:
            node = node[k]
        node[rest[-1]] = yaml.safe_load(value)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    targets = [s for s in _stages_present(project) if s != "promote"]
    first = dvc(project, "repro", *targets)
    assert first.returncode == 0, first.stdout + first.stderr
    second = dvc(project, "repro", *targets)
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout
    assert "up to date" in second.stdout


@pytest.mark.full  # ~4 min; test_experiments.py runs two at once in the default tier and checks isolation
def test_two_runs_at_the_same_moment_do_not_clobber(project: Path) -> None:
    def start(name: str, lr: str) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "run",
                *tiny_args(),
                "-S",
                f"train.lr={lr}",
                "--name",
                name,
                "--json",
            ],
            cwd=project,
            env=clean_env(project),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    procs = {"lr-a": start("lr-a", "0.002"), "lr-b": start("lr-b", "0.004")}
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, f"{name} failed:\n{out[-2000:]}\n{err[-3000:]}"
        results[name] = json.loads(out[out.index("{") :])
    a, b = results["lr-a"], results["lr-b"]
    assert a["run_id"] != b["run_id"] and a["mlflow_run_id"] != b["mlflow_run_id"]
    client = _mlflow_client(project)
    for name, lr in (("lr-a", 0.002), ("lr-b", 0.004)):
        r = results[name]
        ws = Path(r["workspace"])
        assert yaml.safe_load((ws / "params.yaml").read_text())["train"]["lr"] == lr
        assert client.get_run(r["mlflow_run_id"]).data.params["train.lr"] == str(lr)
        st = dvc(ws, "status", "--json")  # every output matches its own dvc.lock
        assert st.returncode == 0 and _changed(st.stdout) == {}, st.stdout + st.stderr
    lock_a = yaml.safe_load((Path(a["workspace"]) / "dvc.lock").read_text())["stages"]
    lock_b = yaml.safe_load((Path(b["workspace"]) / "dvc.lock").read_text())["stages"]
    md5 = lambda lock: next(o["md5"] for o in lock["train"]["outs"] if o["path"].endswith("model.pt"))  # noqa: E731
    assert md5(lock_a) != md5(lock_b)  # different lr -> different weights, each kept
    assert lock_a["prepare"]["outs"] == lock_b["prepare"]["outs"]  # same data, shared


def test_bad_override_is_refused_before_anything_runs(project: Path) -> None:
    r = factory(project, "run", "-S", "train.epochs=zero")
    assert r.returncode == 2 and "train.epochs" in r.stderr
    r = factory(project, "run", "--until", "nope")
    assert r.returncode == 2 and "--until" in r.stderr


@pytest.mark.full  # plain `dvc exp run` (~100 s); factory's own experiments: test_experiments.py
def test_dvc_exp_run_with_a_param_override(project: Path) -> None:
    """`dvc exp run -S train.lr=...` (needs git: the project copy becomes a repo with one commit)."""
    git_identity = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    (project / ".dvc" / "config").write_text("[core]\n    analytics = false\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "baseline"]):
        subprocess.run(
            cmd, cwd=project, env={**clean_env(project), **git_identity}, check=True, capture_output=True
        )
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
    assert (project / log).read_text().count("$ dvc repro prepare") == 1  # one attempt: not retried
    assert "[other dvc] " in (project / log).read_text()  # DVC's own lines were reworded
    prefect_log = (project / log).parent / "prefect.log"
    assert "Traceback" in prefect_log.read_text()  # Prefect's own output went to the file


FLAKY_ONCE = """

import os as _os

_run_once_flaky = run


def run(params, out):  # test: the first attempt loses its connection (a transient failure)
    marker = _os.environ["PFACTORY_TEST_FLAKY_ONCE"]
    if not _os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionResetError("simulated: connection reset by peer")
    return _run_once_flaky(params, out)
"""


def test_a_transient_stage_failure_is_retried(tmp_path: Path) -> None:
    proj = make_project(tmp_path / "flaky")
    synth = proj / "tasks" / "synth.py"
    code = synth.read_text()
    synth.write_text(code.replace("\ndef main(", FLAKY_ONCE + "\n\ndef main(", 1))
    marker = tmp_path / "failed-once"
    r = factory(
        proj, "run", *tiny_args(), "--until", "synth", "--json", env={"PFACTORY_TEST_FLAKY_ONCE": str(marker)}
    )
    assert r.returncode == 0, r.stderr
    assert marker.exists()
    assert "synth: transient failure (exit 75); retrying" in r.stderr, r.stderr
    ws = Path(json.loads(r.stdout[r.stdout.index("{") :])["workspace"])
    log = (ws / "logs" / "synth.log").read_text()
    assert log.count("$ dvc repro synth") == 2 and "simulated: connection reset by peer" in log
