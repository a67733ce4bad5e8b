"""The promote stage against a real MLflow registry (sqlite in tmp_path) with a real optimized model:
first promotion, better promoted, worse refused (gate named, champion unchanged), dry run, rollback,
champion re-evaluation on other data, and two promotions racing in two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pfactory.storage.fsutil import sha256_file

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`, not tests/'s namespace packages
    sys.path.insert(0, str(ROOT))


from tests.promote import helpers as H  # noqa: E402


@pytest.fixture(scope="session")
def bench(tmp_path_factory) -> dict[str, Path]:
    return H.build_bench(tmp_path_factory.getbasetemp() / "promote-bench")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fresh sqlite tracking + registry store in tmp_path; the cwd is a scratch project."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.delenv("PFACTORY_PARENT_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    from pfactory.promote import registry as reg

    return reg.client()


def _promote(bench, tmp_path, name, jitter, params=None, prepared="prepared_a", **kw):
    import tasks.promote

    cand = H.candidate(tmp_path, bench, name, jitter, prepared)
    result = tasks.promote.run(
        params or H.promote_params(),
        cand["optimized"],
        cand["eval"],
        bench[prepared],
        tmp_path / "release",
        **kw,
    )
    return result, cand


def _alias(c, name="test-detector", alias="champion"):
    from pfactory.promote import registry as reg

    return reg.champion(c, name, alias)


def test_first_promotion_registers_tags_and_writes_the_release(bench, tmp_path, registry) -> None:
    import mlflow

    result, cand = _promote(bench, tmp_path, "c1", 0.3)
    assert result["decision"] == "promoted", result["reason"]
    assert (result["version"], result["champion_before"], result["champion_after"]) == (1, None, 1)
    assert not result["reevaluated_champion"]
    names = [g["name"] for g in result["gates"]]
    classes = sorted(cand["kpis"]["classes"])
    buckets = sorted(cand["kpis"]["delta"]["by_range"])
    assert classes == ["Car", "Cyclist", "Pedestrian"] and buckets  # the evidence the parity gates read
    assert names[:4] == ["min_map", "p99_latency_ms", "optimize_parity", "parity_map_delta"]
    assert names[-2:] == ["parity_agreement", "parity_scores_p99"]
    aoe = sorted(c for c, d in cand["kpis"]["delta"]["classes"].items() if d.get("aoe") is not None)
    assert sorted(names[4:-2]) == sorted(
        [*(f"parity_class_ap_delta/{c}" for c in classes), *(f"parity_class_aoe_delta/{c}" for c in aoe),
         *(f"parity_range_map_delta/{b}" for b in buckets)]
    )  # absolute gates only: no champion yet, so no regression gate
    assert all(
        g["passed"] and set(g) >= {"name", "value", "threshold", "passed", "margin"} for g in result["gates"]
    )
    assert _alias(registry) == 1

    mv = registry.get_model_version("test-detector", "1")
    t = mv.tags
    assert float(t["kpi.mAP"]) == pytest.approx(cand["kpis"]["mAP"])
    assert float(t["kpi.Car.ap"]) == pytest.approx(cand["kpis"]["classes"]["Car"]["mean_ap"])
    assert t["parity.passed"] == "true" and "parity.worst.match_rate" in t
    assert float(t["latency.batch_1.p99_ms"]) > 0 and t["latency.artifact"] == "onnxruntime/fp32"
    assert t["data.prepared_hash"] == cand["kpis"]["data"]["prepared_hash"] and t["data.split"] == "val"
    assert t["data.prepared.manifest_sha256"] == sha256_file(bench["prepared_a"] / "manifest.json")
    assert t["run_id"] == mv.run_id == result["mlflow_run_id"]  # no pipeline run: the stage's own run
    from pfactory.runtime.lineage import git_info

    assert t["git.commit"] == str(git_info(tmp_path)["commit"])  # the scratch project is not a git checkout
    assert t["promotion.decision"] == "promoted" and t["promotion.status"] == "champion"

    # The registry serves the files back (what rollback and re-evaluation download).
    got = Path(
        mlflow.artifacts.download_artifacts("models:/test-detector@champion", dst_path=str(tmp_path / "dl"))
    )
    assert sha256_file(got / "optimized" / "backend.json") == sha256_file(cand["optimized"] / "backend.json")
    assert json.loads((got / "eval" / "kpis.json").read_text())["mAP"] == cand["kpis"]["mAP"]

    release = tmp_path / "release"
    info = json.loads((release / "release.json").read_text())
    assert info["version"] == 1 and info["from"] is None and info["action"] == "promote"
    assert info["files"]["optimized/model.onnx"] == sha256_file(cand["optimized"] / "model.onnx")
    card = (release / "MODEL_CARD.md").read_text()
    for section in ("## Intended use", "## KPIs", "## Gates", "## Lineage", "## Audit trail", mv.run_id):
        assert section in card
    audit = [json.loads(line) for line in (release / "audit.jsonl").read_text().splitlines()]
    assert len(audit) == 1 and (audit[0]["from"], audit[0]["to"], audit[0]["action"]) == (None, 1, "promote")
    assert "@" in audit[0]["by"] and audit[0]["gates"][0]["name"] == "min_map"
    rm_tags = registry.get_registered_model("test-detector").tags
    # The registry's tag is one readable line (not JSON) that reads back as the record's alias move.
    line = rm_tags["audit.000001"]
    assert line.startswith("promote none -> v1 | ") and audit[0]["by"] in line and not line.startswith("{")
    from pfactory.promote import registry as reg

    back = reg.parse_audit("audit.000001", line)
    assert {k: back[k] for k in ("id", "action", "from", "to", "at", "by", "reason")} == {
        k: audit[0][k] for k in ("id", "action", "from", "to", "at", "by", "reason")
    }
    assert rm_tags["audit.head"] == "1"
    desc = registry.get_registered_model("test-detector").description
    assert "**`champion`: version 1**" in desc and "| 1 |" in desc and "promote - → v1" in desc
    assert not list(tmp_path.glob(".release.*")), "the temporary release folder must be gone"


def test_better_promoted_worse_refused_then_rollback_and_back(bench, tmp_path, registry) -> None:
    from pfactory.promote.promotion import rollback

    r1, _ = _promote(bench, tmp_path, "c1", 0.6)
    r2, c2 = _promote(bench, tmp_path, "c2", 0.3)  # better: less position noise
    assert (r1["decision"], r2["decision"]) == ("promoted", "promoted"), r2["reason"]
    assert (r2["champion_before"], r2["champion_after"]) == (1, 2)
    assert {g["name"] for g in r2["gates"]} >= {"map_regression", "class_ap_regression/Car"}

    release = tmp_path / "release"
    before = {p.name: sha256_file(p) for p in release.iterdir() if p.is_file()}
    r3, _ = _promote(bench, tmp_path, "c3", 1.5)  # worse
    assert r3["decision"] == "refused" and r3["version"] == 3
    assert (r3["champion_before"], r3["champion_after"]) == (2, 2) and _alias(registry) == 2
    bad = {g["name"]: g for g in r3["gates"] if not g["passed"]}
    assert "class_ap_regression/Car" in bad and "map_regression" in bad
    car = bad["class_ap_regression/Car"]
    assert car["margin"] < 0 and car["margin"] == pytest.approx(car["threshold"] - car["value"])
    assert (
        f"FAILED by {-car['margin']:.4g}" in car["detail"]
        and "class_ap_regression/Car: Car AP drop" in r3["reason"]
    )
    assert {p.name: sha256_file(p) for p in release.iterdir() if p.is_file()} == before  # release untouched
    assert registry.get_model_version("test-detector", "3").tags["promotion.decision"] == "refused"

    back = rollback(H.promote_params(), release)
    assert (back["champion_before"], back["champion_after"]) == (2, 1) and _alias(registry) == 1
    info = json.loads((release / "release.json").read_text())
    assert (info["version"], info["action"], info["from"]) == (1, "rollback", 2)
    audit = [json.loads(line) for line in (release / "audit.jsonl").read_text().splitlines()]
    assert [(a["action"], a["from"], a["to"]) for a in audit] == [
        ("promote", None, 1), ("promote", 1, 2), ("rollback", 2, 1)
    ]  # fmt: skip

    again = rollback(H.promote_params(), release)  # a rollback is itself reversible
    assert (again["champion_before"], again["champion_after"]) == (1, 2) and _alias(registry) == 2
    assert json.loads((release / "release.json").read_text())["files"][
        "optimized/backend.json"
    ] == sha256_file(c2["optimized"] / "backend.json")


def test_dry_run_changes_nothing(bench, tmp_path, registry) -> None:
    _promote(bench, tmp_path, "c1", 0.6)
    release = tmp_path / "release"
    state = (
        registry.get_registered_model("test-detector").tags,
        len(registry.search_model_versions("name = 'test-detector'")),
        {p.name: sha256_file(p) for p in release.iterdir() if p.is_file()},
    )
    better, _ = _promote(bench, tmp_path, "c2", 0.3, dry_run=True)
    worse, _ = _promote(bench, tmp_path, "c3", 1.5, dry_run=True)
    assert (better["decision"], better["would_promote"], better["version"]) == ("dry-run", True, None)
    assert (worse["decision"], worse["would_promote"]) == ("dry-run", False)
    assert state == (
        registry.get_registered_model("test-detector").tags,
        len(registry.search_model_versions("name = 'test-detector'")),
        {p.name: sha256_file(p) for p in release.iterdir() if p.is_file()},
    )
    assert _alias(registry) == 1


def test_champion_reevaluated_on_other_data(bench, tmp_path, registry) -> None:
    # Champion: evaluated on data version A with near-perfect predictions (mAP 1.0).
    r1, c1 = _promote(bench, tmp_path, "c1", 0.0)
    assert r1["decision"] == "promoted"
    calls: list[tuple[Path, Path]] = []

    def evaluate(optimized: Path, data: Path) -> dict:
        calls.append((optimized, data))
        assert sha256_file(optimized / "backend.json") == sha256_file(c1["optimized"] / "backend.json")
        return H.real_evaluate(optimized, data)  # ONNX Runtime inference + the KPI library

    # Candidate evaluated on data version B: compared against the champion re-evaluated on B.
    params = H.promote_params(min_map=0.05, parity_map_tolerance=0.1)
    r2, c2 = _promote(bench, tmp_path, "c2", 1.0, params, "prepared_b", evaluate_fn=evaluate)
    assert len(calls) == 1 and calls[0][1] == bench["prepared_b"]
    assert r2["reevaluated_champion"] and r2["champion_kpis_source"] == "re-evaluated"
    reeval = H.real_evaluate(c1["optimized"], bench["prepared_b"])
    gate = next(g for g in r2["gates"] if g["name"] == "map_regression")
    assert gate["value"] == pytest.approx(reeval["mAP"] - c2["kpis"]["mAP"])  # not 1.0 - candidate
    key = f"kpis.reeval.{c2['kpis']['data']['prepared_hash'][:16]}.val"
    assert key in registry.get_model_version("test-detector", "1").tags  # cached on the champion's version
    assert r2["decision"] == ("promoted" if all(g["passed"] for g in r2["gates"]) else "refused")


RACER = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import tasks.promote
from tests.promote.helpers import promote_params
a = json.loads(sys.argv[1])
r = tasks.promote.run(promote_params(), Path(a["optimized"]), Path(a["eval"]), Path(a["data"]), Path(a["release"]))
print("RESULT " + json.dumps(r))
"""


def test_racing_promotions_exactly_one_wins(bench, tmp_path, registry) -> None:
    import mlflow

    from pfactory.promote import registry as reg
    from pfactory.tracking.runs import EXPERIMENT, artifact_location

    # The schema and the experiment exist before two processes open them (as in a pipeline run; two
    # first-ever stage runs racing to create the experiment is tracking.stage_run's concern, not this test's).
    mlflow.create_experiment(EXPERIMENT, artifact_location=artifact_location(tmp_path))
    cands = [H.candidate(tmp_path, bench, f"racer{i}", 0.3 + 0.1 * i) for i in range(2)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Both processes register and gate while this test holds the registry lock, so both gate against
    # "no champion" and then meet at the compare-and-set: a real race with a known start.
    with reg.registry_lock(reg.registry_uri(), timeout_s=5):
        args = [
            {"optimized": str(c["optimized"]), "eval": str(c["eval"]), "data": str(bench["prepared_a"]),
             "release": str(tmp_path / "release")}
            for c in cands
        ]  # fmt: skip
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACER.format(root=str(ROOT)), json.dumps(a)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for a in args
        ]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            waiting = [
                v for v in registry.search_model_versions("name = 'test-detector'")
                if v.tags.get("promotion.status") == "awaiting-lock"
            ]  # fmt: skip
            if len(waiting) == 2 or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        assert len(waiting) == 2, [p.communicate() for p in procs if p.poll() is not None]
    outs = [p.communicate(timeout=120) for p in procs]
    results = []
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    decisions = sorted(r["decision"] for r in results)
    assert decisions == ["promoted", "refused"], results
    winner = next(r for r in results if r["decision"] == "promoted")
    loser = next(r for r in results if r["decision"] == "refused")
    assert loser["gates"][-1]["name"] == "champion_unchanged" and loser["champion_after"] == winner["version"]
    assert _alias(registry) == winner["version"]
    trail = reg.audit_trail(registry, "test-detector")
    assert [(a["from"], a["to"]) for a in trail] == [(None, winner["version"])]
    assert json.loads((tmp_path / "release" / "release.json").read_text())["version"] == winner["version"]


def test_default_reevaluation_runs_the_evaluate_stage(bench, tmp_path, registry) -> None:
    """evaluate_fn=None: the champion's files, downloaded from the registry, go through pfactory.evaluate (what the evaluate stage runs)."""
    from flows.params import Params

    base = H.promote_params(min_map=0.05, parity_map_tolerance=0.1).model_dump()
    params = Params.model_validate({"promote": base, "evaluate": {"workers": 1, "reference": False}})
    assert _promote(bench, tmp_path, "c1", 0.0, params)[0]["decision"] == "promoted"
    r2, c2 = _promote(bench, tmp_path, "c2", 1.0, params, "prepared_b")
    assert r2["reevaluated_champion"] and r2["champion_kpis_source"] == "re-evaluated"
    key = f"kpis.reeval.{c2['kpis']['data']['prepared_hash'][:16]}.val"
    cached = json.loads(registry.get_model_version("test-detector", "1").tags[key])
    # The evaluate stage's KPIs of the champion's ONNX model equal an independent inference + KPI run.
    assert cached["mAP"] == pytest.approx(H.real_evaluate(bench["optimized"], bench["prepared_b"])["mAP"])


def test_dvc_entry_refusal_exits_0_and_leaves_a_declared_release(bench, tmp_path, registry, capsys) -> None:
    """`python -m tasks.promote` as dvc.yaml runs it (`--no-fail-if-refused`): a refused first candidate is an
    outcome (exit 0, metrics printed); the release out DVC expects exists and says there is no champion.
    Without the flag (`factory promote`, a person's command) the same refusal exits 1 with the same result."""
    import shlex

    import yaml

    import tasks.promote

    dvc_args = shlex.split(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["promote"]["cmd"])[3:]
    assert dvc_args == ["--no-fail-if-refused"]

    c = H.candidate(tmp_path, bench, "c1", 0.3)
    params_file = tmp_path / "params.yaml"
    promote = H.promote_params(min_map=0.99).model_dump(mode="json")
    paths = {"optimized": str(c["optimized"]), "eval": str(c["eval"]), "prepared": str(bench["prepared_a"]),
             "release": str(tmp_path / "release")}  # fmt: skip
    params_file.write_text(yaml.safe_dump({"paths": paths, "promote": promote}))
    tasks.promote.main(["--params", str(params_file), *dvc_args])
    out = json.loads(capsys.readouterr().out)
    assert (
        out["decision"] == "refused"
        and out["gates"][0]["name"] == "min_map"
        and not out["gates"][0]["passed"]
    )
    assert "1 gate(s) failed vs no champion (absolute gates only): min_map: mAP " in out["reason"]
    assert "FAILED by" in out["reason"]
    assert _alias(registry) is None
    assert json.loads((tmp_path / "release" / "release.json").read_text())["version"] is None
    assert json.loads((tmp_path / "artifacts" / "promotion.json").read_text())["decision"] == "refused"

    with pytest.raises(SystemExit) as refused:
        tasks.promote.main(["--params", str(params_file)])
    assert refused.value.code == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["decision"] == "refused"
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("promote: the gates refused v") and last.endswith(" (min_map)"), last
