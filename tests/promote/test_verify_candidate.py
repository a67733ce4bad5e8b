"""Promotion verifies what it promotes (`promote.verify_candidate`): the candidate's files against the sha256
recorded at registration, and its KPIs recomputed from its artifact on the evaluation data (real ONNX
Runtime inference + the KPI library, the champion re-evaluation of the registry tests). A candidate whose
recorded KPIs were edited through the MLflow API (its run's mAP metric and kpis.json) is refused with both
figures and the refusal is audited; an honest one is promoted; a registered artifact changed after its
registration is refused. sqlite registry, no team (`verify_candidate: always`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import helpers as H

FORGED_MAP = 0.99


def _full_params(**over):
    from flows.params import Params

    base = H.promote_params(**{"min_map": 0.0, **over}).model_dump()
    return Params.model_validate({"promote": base, "evaluate": {"workers": 1, "reference": False}})


def _logged_run(c, tmp: Path, bench: dict, name: str) -> tuple[str, dict]:
    """An MLflow run holding a candidate as the pipeline logs it: `candidate/optimized/`, `candidate/eval/`
    kpis.json, and the metric mAP."""
    import shutil

    optimized = tmp / name / "optimized"
    shutil.copytree(bench["optimized"], optimized)
    doc = H.real_evaluate(optimized, bench["prepared_a"])
    metrics = {k: v for k, v in doc.items() if k != "data"}
    kpis = H._document(metrics, metrics, doc["data"])
    (tmp / name / "eval").mkdir(parents=True)
    (tmp / name / "eval" / "kpis.json").write_text(json.dumps(kpis))
    exp = c.get_experiment_by_name("verify") or None
    exp_id = (
        exp.experiment_id
        if exp
        else c.create_experiment("verify", artifact_location=str(tmp / "mlartifacts"))
    )
    run_id = c.create_run(exp_id).info.run_id
    c.log_artifacts(run_id, str(optimized), "candidate/optimized")
    c.log_artifact(run_id, str(tmp / name / "eval" / "kpis.json"), "candidate/eval")
    c.log_metric(run_id, "mAP", kpis["mAP"])
    c.set_terminated(run_id)
    return run_id, kpis


def _forge(c, run_id: str, tmp: Path, kpis: dict) -> None:
    """What an engineer with EDIT on the experiment can do through the MLflow API: rewrite the run's mAP
    metric and upload an edited kpis.json over the logged one."""
    forged = {**kpis, "mAP": FORGED_MAP}
    (tmp / "forged").mkdir(exist_ok=True)
    (tmp / "forged" / "kpis.json").write_text(json.dumps(forged))
    c.log_metric(run_id, "mAP", FORGED_MAP)
    c.log_artifact(run_id, str(tmp / "forged" / "kpis.json"), "candidate/eval")


def test_forged_kpis_refused_with_both_figures_and_audited_honest_promoted(bench, tmp_path, registry) -> None:
    from pfactory.promote import registry as reg
    from pfactory.promote.candidates import promote_ref

    evaluate = H.real_evaluate
    params = _full_params(verify_candidate="always")
    forged_run, honest_kpis = _logged_run(registry, tmp_path, bench, "forged")
    _forge(registry, forged_run, tmp_path, honest_kpis)
    recomputed = honest_kpis["mAP"]
    assert recomputed < 0.9  # the bench's tiny model: far from the forged figure

    # Without verification (the default outside a team) the forged figure would be gated as it is.
    trusting = promote_ref(_full_params(verify_candidate="never"), forged_run, bench["prepared_a"],
                           tmp_path / "release", dry_run=True, evaluate_fn=evaluate)  # fmt: skip
    assert trusting["would_promote"], trusting["reason"]

    r = promote_ref(params, forged_run, bench["prepared_a"], tmp_path / "release", evaluate_fn=evaluate)
    assert r["decision"] == "refused"
    assert r["gates"] == [pytest.approx(r["gates"][0])] and r["gates"][0]["name"] == "candidate_verified"
    line = f"recorded mAP {FORGED_MAP:g}, recomputed {round(recomputed, 4):g}"
    print(f"\nforged candidate: {r['decision']}: {r['reason']}")  # the figures, with -s
    assert line in r["reason"] and "\n" not in r["reason"], r["reason"]
    assert reg.champion(registry, "test-detector", "champion") is None
    mv = registry.get_model_version("test-detector", str(r["version"]))
    assert (
        mv.tags["promotion.status"] == "refused" and mv.tags["promotion.failed_gates"] == "candidate_verified"
    )
    trail = reg.audit_trail(registry, "test-detector")
    assert [(a["action"], a["to"]) for a in trail] == [("refused-verify", r["version"])]
    assert line in trail[0]["reason"] and trail[0]["run_id"] == forged_run

    honest_run, _ = _logged_run(registry, tmp_path, bench, "honest")
    ok = promote_ref(params, honest_run, bench["prepared_a"], tmp_path / "release", evaluate_fn=evaluate)
    assert ok["decision"] == "promoted", ok["reason"]
    assert reg.champion(registry, "test-detector", "champion") == ok["version"]
    trail = reg.audit_trail(registry, "test-detector")
    assert [(a["action"], a["to"]) for a in trail] == [
        ("refused-verify", r["version"]),
        ("promote", ok["version"]),
    ]
    gated = {g["name"]: g for g in ok["gates"]}
    assert gated["min_map"]["value"] == pytest.approx(recomputed)  # the gates read the recomputed mAP


def test_a_registered_artifact_changed_after_registration_is_refused(bench, tmp_path, registry) -> None:
    """The version's files in the artifact store no longer hash to what registration recorded."""
    from pfactory.promote import registry as reg
    from pfactory.promote.candidates import promote_ref

    run_id, _ = _logged_run(registry, tmp_path, bench, "c1")
    # Registered, then refused by a gate it cannot pass (nothing verified: verify_candidate never).
    first = promote_ref(_full_params(verify_candidate="never", min_map=1.0), run_id, bench["prepared_a"],
                        tmp_path / "release", evaluate_fn=H.real_evaluate)  # fmt: skip
    assert first["decision"] == "refused" and first["version"] == 1
    store = Path(registry.get_model_version_download_uri("test-detector", "1").removeprefix("file://"))
    manifest = store / "optimized" / "backend.json"
    doc = json.loads(manifest.read_text())
    doc["note"] = "edited after registration"
    manifest.write_text(json.dumps(doc))  # every file it lists still matches: only its own hash differs

    r = promote_ref(_full_params(verify_candidate="always"), "1", bench["prepared_a"], tmp_path / "release",
                    evaluate_fn=H.real_evaluate)  # fmt: skip
    assert r["decision"] == "refused" and r["gates"][0]["name"] == "candidate_verified"
    assert "registration recorded" in r["reason"] and "not the artifact its run produced" in r["reason"]
    assert reg.champion(registry, "test-detector", "champion") is None
    assert [a["action"] for a in reg.audit_trail(registry, "test-detector")] == ["refused-verify"]
