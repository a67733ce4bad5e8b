"""A candidate's evidence: what the optimize and evaluate stages wrote, checked and condensed.

In:  `optimized/` (`backend.json` manifest, `parity.json`, `latency.json`) and the evaluate stage's
     `kpis.json` (`{"mAP", "NDS", "classes": {name: {"ap": {th: ..}, "mean_ap", "ate", "ase", "aoe"}},
     "delta": {"mAP": optimized - PyTorch}, "data": {"prepared_hash", "split", "frames"}, ...}`).
Out: `Evidence` (KPI summary, parity verdict + worst figures, the KPI delta optimized - PyTorch (mAP, per
     class AP, per range bucket) and the primary artifact's confident-detection agreement, latency of the
     primary artifact at the gated batch, data identity, artifact hashes) and `Evidence.tags()`: the model-version tags (strings) that
     make a registered version self-describing in the MLflow UI and searchable
     (`search_model_versions("tags.`kpi.mAP` > '0.5'")` compares strings; read them back with `kpis_from_tags`).
A malformed or missing file raises `EvidenceError` naming the file, the field and the expectation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfactory.detectors.params import DEFAULT_ARCH  # records from before architectures had names
from pfactory.promote.errors import EvidenceError
from pfactory.storage import artifacts as af

KPIS = af.KPIS
MANIFEST = af.BACKEND
PARITY = af.PARITY
LATENCY = af.LATENCY
SUMMARY_TAG = "kpis.summary"  # JSON of `kpi_summary`, what the gates read back for a champion


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`; `what` says which stage writes it (for the error message)."""
    if not path.is_file():
        raise EvidenceError(f"{path}: missing; expected {what}")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EvidenceError(f"{path}: not valid JSON ({e}); expected {what}") from None
    if not isinstance(obj, dict):
        raise EvidenceError(f"{path}: expected a JSON object ({what}), got {type(obj).__name__}")
    return obj


def _number(obj: Mapping[str, Any], key: str, source: str, where: str = "") -> float:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise EvidenceError(f"{source}: field '{where}{key}': expected a finite number, got {value!r}")
    return float(value)


def kpi_summary(kpis: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The part of kpis.json the gates and the model card use: mAP, NDS, per-class AP, TP errors and
    ground-truth counts (`classes.<C>.num_gt`, `by_range_num_gt.<bucket>.<C>`: the KPI-delta gates'
    resolution).

    `source` names the file (or version) in error messages. A class without `mean_ap` gets the mean of
    its `ap` thresholds (the KPI library's definition).
    """
    classes = kpis.get("classes")
    if not isinstance(classes, Mapping) or not classes:
        raise EvidenceError(f"{source}: field 'classes': expected a non-empty object of per-class KPIs")
    out_classes: dict[str, Any] = {}
    for name, c in classes.items():
        if not isinstance(c, Mapping):
            raise EvidenceError(f"{source}: field 'classes.{name}': expected an object, got {c!r}")
        ap = c.get("ap", {})
        if not isinstance(ap, Mapping):
            raise EvidenceError(
                f"{source}: field 'classes.{name}.ap': expected {{threshold: AP}}, got {ap!r}"
            )
        ap_f = {str(k): _number(ap, k, source, f"classes.{name}.ap.") for k in ap}
        if "mean_ap" in c:
            mean_ap = _number(c, "mean_ap", source, f"classes.{name}.")
        elif ap_f:
            mean_ap = sum(ap_f.values()) / len(ap_f)
        else:
            raise EvidenceError(
                f"{source}: field 'classes.{name}.mean_ap': expected a number (or an 'ap' object)"
            )
        entry: dict[str, Any] = {"mean_ap": mean_ap, "ap": ap_f}
        for m in ("ate", "ase", "aoe"):
            if isinstance(c.get(m), int | float):
                entry[m] = float(c[m])
        if isinstance(c.get("num_gt"), int):
            entry["num_gt"] = c["num_gt"]
        out_classes[str(name)] = entry
    summary: dict[str, Any] = {"mAP": _number(kpis, "mAP", source), "classes": out_classes}
    support = {
        str(bucket): {
            str(k): v["num_gt"]
            for k, v in (b.get("classes") or {}).items()
            if isinstance(v, Mapping) and isinstance(v.get("num_gt"), int)
        }
        for bucket, b in (kpis.get("by_range") or {}).items()
        if isinstance(b, Mapping)
    }
    if support:
        summary["by_range_num_gt"] = support  # ground-truth objects per range bucket and class
    if "NDS" in kpis:
        summary["NDS"] = _number(kpis, "NDS", source)
    if isinstance(kpis.get("kitti"), Mapping):
        summary["kitti"] = kpis["kitti"]  # KITTI's AP R40 (strict) [Class][metric][difficulty]: gate metrics
    return summary


def data_identity(kpis: Mapping[str, Any], source: str) -> dict[str, Any]:
    """kpis.json's `"data"` block: which prepared data (hash) and split the KPIs were computed on."""
    data = kpis.get("data")
    if not isinstance(data, Mapping):
        raise EvidenceError(
            f"{source}: field 'data': expected {{'prepared_hash', 'split', 'frames'}} (the evaluation data "
            "version; promotion compares candidate and champion on the same one), got missing"
        )
    h = data.get("prepared_hash")
    if not isinstance(h, str) or not h:
        raise EvidenceError(f"{source}: field 'data.prepared_hash': expected a non-empty string, got {h!r}")
    out = {"prepared_hash": h, "split": str(data.get("split", "val"))}
    if isinstance(data.get("frames"), int):
        out["frames"] = data["frames"]
    return out


def same_data(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """True when two data identities name the same evaluation data (hash and split)."""
    return a.get("prepared_hash") == b.get("prepared_hash") and a.get("split") == b.get("split")


def data_key(data: Mapping[str, Any]) -> str:
    """A short tag-key-safe name of a data identity: `<first 16 hex of the hash>.<split>`."""
    h = "".join(ch for ch in str(data["prepared_hash"]) if ch.isalnum())[:16]
    return f"{h}.{data.get('split', 'val')}"


def parity_summary(parity: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Verdict, failures and the worst figure of each metric over all artifacts of parity.json."""
    if not isinstance(parity.get("passed"), bool) or not isinstance(parity.get("artifacts"), Mapping):
        raise EvidenceError(
            f"{source}: fields 'passed' (bool) and 'artifacts' (object) expected (optimize's parity report)"
        )
    worst: dict[str, float] = {}

    def keep(name: str, value: Any, fn: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            worst[name] = fn(worst.get(name, value), float(value))

    failures: list[str] = []
    for art, a in parity["artifacts"].items():
        m = a.get("metrics", {}) if isinstance(a, Mapping) else {}
        keep("match_rate", m.get("match_rate"), min)
        for part in ("boxes", "yaw", "scores"):
            sub = m.get(part) or {}
            keep(f"{part}_tolerance_ratio", sub.get("tolerance_ratio"), max)
            keep(f"{part}_max_abs_diff", sub.get("max_abs_diff"), max)
        keep("scores_cosine", (m.get("scores") or {}).get("cosine"), min)
        keep("boxes_cosine", (m.get("boxes") or {}).get("cosine"), min)
        failures += [f"{art}: {f}" for f in (a.get("failures") or [])]
    return {
        "passed": parity["passed"],
        "artifacts": sorted(parity["artifacts"]),
        "failures": failures,
        "worst": worst,
    }


def delta_summary(delta: Any, source: str) -> dict[str, Any] | None:
    """kpis.json "delta" (optimized - PyTorch on the same frames) condensed: {"mAP", "classes": {C: {th:
    AP delta}}, "aoe": {C: AOE delta, rad}, "by_range": {bucket: mAP delta}, "by_range_classes": {bucket:
    {C: mean AP delta}}}; None
    when evaluate ran without the reference. A null delta (a class or bucket without ground truth in the
    evaluated frames) is left out."""
    if not isinstance(delta, Mapping) or "mAP" not in delta:
        return None
    out: dict[str, Any] = {
        "mAP": _number(delta, "mAP", source, "delta."), "classes": {}, "aoe": {}, "by_range": {}
    }  # fmt: skip
    for name, c in (delta.get("classes") or {}).items():
        if isinstance(c, Mapping) and c.get("aoe") is not None:
            out["aoe"][str(name)] = _number(c, "aoe", source, f"delta.classes.{name}.")
        ap = c.get("ap") if isinstance(c, Mapping) else None
        if not isinstance(ap, Mapping):
            raise EvidenceError(
                f"{source}: field 'delta.classes.{name}.ap': expected {{threshold: AP delta}}"
            )
        out["classes"][str(name)] = {
            str(k): _number(ap, k, source, f"delta.classes.{name}.ap.") for k in ap if ap[k] is not None
        }
    out["by_range_classes"] = {}
    for bucket, b in (delta.get("by_range") or {}).items():
        if isinstance(b, Mapping) and b.get("mAP") is not None:
            out["by_range"][str(bucket)] = _number(b, "mAP", source, f"delta.by_range.{bucket}.")
            out["by_range_classes"][str(bucket)] = {
                str(name): _number(c, "mean_ap", source, f"delta.by_range.{bucket}.classes.{name}.")
                for name, c in (b.get("classes") or {}).items()
                if isinstance(c, Mapping) and c.get("mean_ap") is not None
            }
    return out


def agreement_summary(parity: Mapping[str, Any], artifact: str, source: str) -> dict[str, Any] | None:
    """The confident-detection agreement of `artifact` in parity.json (None: a report without it)."""
    a = ((parity.get("artifacts") or {}).get(artifact) or {}).get("metrics", {}).get("agreement")
    if not isinstance(a, Mapping):
        return None
    scores = a.get("scores_abs_diff") or {}
    return {
        "artifact": artifact,
        "score_threshold": _number(a, "score_threshold", source, f"artifacts.{artifact}.metrics.agreement."),
        "match_rate": _number(a, "match_rate", source, f"artifacts.{artifact}.metrics.agreement."),
        "scores_p99": None if scores.get("p99") is None else float(scores["p99"]),
        "matched": int(a.get("matched", 0)),
        "frames": int(a.get("frames", 0)),
        # the rate's support: n = max(reference, candidate) confident detections (gates.judge_rate)
        "support": max(int(a.get("reference_detections", 0)), int(a.get("candidate_detections", 0))),
    }


def latency_summary(latency: Mapping[str, Any], runner: str, batch: int, source: str) -> dict[str, Any]:
    """p50/p99 of `runner` at `batch_<batch>` of latency.json."""
    key = f"batch_{batch}"
    table = latency.get(key)
    if not isinstance(table, Mapping):
        have = sorted(k for k in latency if k.startswith("batch_"))
        raise EvidenceError(f"{source}: field '{key}': expected the timings at batch {batch}; have {have}")
    stats = table.get(runner)
    if not isinstance(stats, Mapping):
        raise EvidenceError(
            f"{source}: field '{key}.{runner}': no timings of the primary artifact; have {sorted(table)}"
        )
    return {
        "artifact": runner,
        "batch": batch,
        "p50_ms": _number(stats, "p50_ms", source, f"{key}.{runner}."),
        "p99_ms": _number(stats, "p99_ms", source, f"{key}.{runner}."),
    }


@dataclass
class Evidence:
    """Everything the gates, the version tags and the model card need about one candidate."""

    kpis: dict[str, Any]
    """`kpi_summary` of kpis.json."""
    data: dict[str, Any]
    """`data_identity` of kpis.json: the evaluation data the KPIs were computed on."""
    delta_map: float | None
    """mAP(optimized) - mAP(PyTorch reference) from kpis.json "delta"; None when evaluate had no reference."""
    parity: dict[str, Any]
    latency: dict[str, Any]
    backend: dict[str, Any]
    """`primary` ("<backend>/<precision>"), `manifest_sha256`, `weights_sha256`, `files` {path: sha256}."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Optional context (by-range mAP) for the model card."""
    delta: dict[str, Any] | None = None
    """`delta_summary` of kpis.json: the optimized artifact's KPIs minus PyTorch's (mAP, class AP, range)."""
    agreement: dict[str, Any] | None = None
    """`agreement_summary` of the primary artifact in parity.json (confident detections vs PyTorch)."""

    def tags(self) -> dict[str, str]:
        """Model-version tags (strings): KPIs, parity, latency, data identity, artifact hashes."""
        t: dict[str, str] = {
            "kpi.mAP": _fmt(self.kpis["mAP"]),
            SUMMARY_TAG: json.dumps(self.kpis, sort_keys=True),
            "parity.passed": str(self.parity["passed"]).lower(),
            "parity.worst": json.dumps(self.parity["worst"], sort_keys=True),
            "latency.artifact": self.latency["artifact"],
            f"latency.batch_{self.latency['batch']}.p50_ms": _fmt(self.latency["p50_ms"]),
            f"latency.batch_{self.latency['batch']}.p99_ms": _fmt(self.latency["p99_ms"]),
            "data.prepared_hash": self.data["prepared_hash"],
            "data.split": self.data["split"],
            "backend.primary": self.backend["primary"],
            "backend.manifest_sha256": self.backend["manifest_sha256"],
        }
        if "NDS" in self.kpis:
            t["kpi.NDS"] = _fmt(self.kpis["NDS"])
        for name, c in self.kpis["classes"].items():
            t[f"kpi.{name}.ap"] = _fmt(c["mean_ap"])
        if self.delta_map is not None:
            t["kpi.delta_mAP_vs_pytorch"] = _fmt(self.delta_map)
        for name, ap in (self.delta or {}).get("classes", {}).items():
            if "2.0" in ap:
                t[f"kpi.{name}.delta_ap_2m_vs_pytorch"] = _fmt(ap["2.0"])
        if self.agreement is not None:
            t["parity.agreement.match_rate"] = _fmt(self.agreement["match_rate"])
            if self.agreement["scores_p99"] is not None:
                t["parity.agreement.scores_p99"] = _fmt(self.agreement["scores_p99"])
        if self.parity["failures"]:
            t["parity.failures"] = "; ".join(self.parity["failures"])[:5000]
        for k, v in self.parity["worst"].items():
            t[f"parity.worst.{k}"] = _fmt(v)
        if "frames" in self.data:
            t["data.frames"] = str(self.data["frames"])
        for k in ("manifest_sha256", "source_sha256"):
            if k in self.extra.get("prepared", {}):
                t[f"data.prepared.{k}"] = self.extra["prepared"][k]
        if self.backend.get("weights_sha256"):
            t["model.weights_sha256"] = self.backend["weights_sha256"]
        t.update(arch_tags(self.backend.get("arch"), self.backend.get("plugin")))
        return t


def arch_tags(arch: str | None, plugin: Mapping[str, Any] | None) -> dict[str, str]:
    """The architecture and, for an installed plugin, its distribution, version and files hash (what made
    the model: lineage, `factory compare`, the model card)."""
    t = {"model.arch": arch or DEFAULT_ARCH, "model.source": "built-in"}
    if plugin:
        t.update({"model.source": str(plugin.get("source")), "model.plugin.dist": str(plugin.get("dist")),
                  "model.plugin.version": str(plugin.get("version")),
                  "model.plugin.files_sha256": str(plugin.get("files_sha256"))})  # fmt: skip
    return t


def _fmt(x: float) -> str:
    return repr(float(x))


def _check_gated_files(optimized: Path, manifest: dict[str, Any]) -> None:
    """Every file backend.json lists has the sha256 optimize recorded (`manifest.verify_directory`): a
    replaced `model.onnx` or artifact is refused with one line naming it."""
    from pfactory.optimize.errors import ArtifactError
    from pfactory.optimize.manifest import verify_directory

    try:
        verify_directory(optimized, manifest)
    except ArtifactError as e:
        raise EvidenceError(str(e)) from None


def read_evidence(optimized: Path, kpis_file: Path, latency_batch: int = 1) -> Evidence:
    """Read and check the evidence of the candidate in `optimized/` evaluated into `kpis_file`."""
    from pfactory.storage.fsutil import sha256_file

    optimized, kpis_file = Path(optimized), Path(kpis_file)
    manifest = read_json(optimized / MANIFEST, "the optimize stage's manifest (backend.json)")
    _check_gated_files(optimized, manifest)
    primary = manifest.get("primary")
    if not isinstance(primary, Mapping) or not {"backend", "precision"} <= set(primary):
        raise EvidenceError(
            f"{optimized / MANIFEST}: field 'primary': expected {{'backend', 'precision'}}, got {primary!r}"
        )
    runner = f"{primary['backend']}/{primary['precision']}"
    kpis = read_json(kpis_file, "the evaluate stage's KPIs (kpis.json)")
    src = str(kpis_file)
    evaluated = kpis["model"].get("artifact_sha256") if isinstance(kpis.get("model"), Mapping) else None
    built = {str(a.get("sha256")) for a in manifest.get("artifacts") or [] if isinstance(a, Mapping)}
    if evaluated is not None and str(evaluated) not in built:
        raise EvidenceError(
            f"{kpis_file}: field 'model.artifact_sha256': {str(evaluated)[:12]}... is no artifact of "
            f"{optimized / MANIFEST}: these KPIs were computed on another model (re-run `factory evaluate`)"
        )
    delta = kpis.get("delta")
    delta_map = None
    if isinstance(delta, Mapping) and "mAP" in delta:
        delta_map = _number(delta, "mAP", src, "delta.")
    parity_doc = read_json(optimized / PARITY, "the optimize stage's parity report")
    parity = parity_summary(parity_doc, str(optimized / PARITY))
    latency = latency_summary(
        read_json(optimized / LATENCY, "the optimize stage's latency report"), runner, latency_batch,
        str(optimized / LATENCY),
    )  # fmt: skip
    extra: dict[str, Any] = {}
    if isinstance(kpis.get("by_range"), Mapping):
        extra["by_range_mAP"] = {
            k: float(v["mAP"]) for k, v in kpis["by_range"].items() if isinstance(v, Mapping) and "mAP" in v
        }
    return Evidence(
        kpis=kpi_summary(kpis, src),
        data=data_identity(kpis, src),
        delta_map=delta_map,
        parity=parity,
        latency=latency,
        backend={
            "primary": runner,
            "manifest_sha256": sha256_file(optimized / MANIFEST),
            "weights_sha256": (manifest.get("model") or {}).get("weights_sha256"),
            "arch": (manifest.get("model") or {}).get("arch") or DEFAULT_ARCH,
            "plugin": (manifest.get("model") or {}).get("plugin"),
            "selection": manifest.get("selection") or {},  # why this primary (a parity fallback says so)
            "files": dict(manifest.get("files") or {}),
        },
        extra=extra,
        delta=delta_summary(delta, src),
        agreement=agreement_summary(parity_doc, runner, str(optimized / PARITY)),
    )


def prepared_lineage(prepared: Path) -> dict[str, str]:
    """sha256 of a prepared directory's manifest.json and the raw-input digest it records (empty if absent)."""
    from pfactory.storage.fsutil import sha256_file

    path = Path(prepared) / af.PREPARED_MANIFEST
    if not path.is_file():
        return {}
    out = {"manifest_sha256": sha256_file(path)}
    try:
        source = json.loads(path.read_text()).get("source", {})
    except json.JSONDecodeError:
        return out
    if isinstance(source, Mapping) and isinstance(source.get("sha256"), str):
        out["source_sha256"] = source["sha256"]
    return out


def kpis_from_tags(tags: Mapping[str, str], source: str, key: str = SUMMARY_TAG) -> dict[str, Any]:
    """The KPI summary stored on a model version (`kpis.summary`, or a cached re-evaluation's key)."""
    raw = tags.get(key)
    if raw is None:
        raise EvidenceError(f"{source}: no '{key}' tag; it was not registered by `factory promote`")
    try:
        return kpi_summary(json.loads(raw), f"{source} tag '{key}'")
    except json.JSONDecodeError as e:
        raise EvidenceError(f"{source}: tag '{key}' is not JSON ({e})") from None
