"""The release folder (`paths.release`, a DVC out): what is in production, and why.

Layout (written with `atomic_directory`: built in a temporary sibling, renamed into place):
```
optimized/        the champion's optimized directory (backend.json, model.onnx, backend artifacts, evidence)
kpis.json         the champion's evaluation
MODEL_CARD.md     KPIs, gates, lineage, data hashes, intended use
release.json      the same, machine-readable: model, version, alias, run, gates, data, files + sha256
audit.jsonl       the registry's audit trail of the model, one JSON record per alias move, oldest first
```
`audit.jsonl` keeps every record already in the previous release folder and adds the registry's records
it lacks (by id), so the log only ever grows even when the folder is rebuilt.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pfactory.detectors.params import DEFAULT_ARCH  # records from before architectures had names
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import atomic_directory, atomic_write_json, atomic_write_text, sha256_file

CARD = af.MODEL_CARD
RELEASE_JSON = af.RELEASE_JSON
AUDIT_LOG = af.AUDIT_LOG


def merged_audit(previous_log: Path, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The records of an existing audit.jsonl plus `records` not in it (by id), sorted by id."""
    by_id: dict[Any, dict[str, Any]] = {}
    if previous_log.is_file():
        for line in previous_log.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                by_id[r.get("id")] = r
    for r in records:
        by_id.setdefault(r["id"], dict(r))
    return sorted(by_id.values(), key=lambda r: (r.get("id") is None, r.get("id") or 0))


def fill_release(
    tmp: Path,
    previous: Path,
    optimized: Path,
    kpis_file: Path,
    info: Mapping[str, Any],
    audit: Sequence[Mapping[str, Any]],
) -> None:
    """Write the release folder's contents into `tmp` (the temporary sibling of `previous`). `optimized`'s
    files are checked against its backend.json first (`manifest.verify_directory`), and again in the copy."""
    from pfactory.optimize.manifest import verify_directory

    verify_directory(optimized)
    shutil.copytree(optimized, tmp / "optimized", ignore=shutil.ignore_patterns(".*"))
    verify_directory(tmp / "optimized")
    shutil.copy2(kpis_file, tmp / af.KPIS)
    files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    release = {**info, "files": files}
    atomic_write_json(tmp / RELEASE_JSON, release)
    lines = merged_audit(previous / AUDIT_LOG, audit)
    atomic_write_text(tmp / AUDIT_LOG, "".join(json.dumps(r, sort_keys=True) + "\n" for r in lines))
    atomic_write_text(tmp / CARD, model_card(release, lines))


def _f(x: Any, digits: int = 4) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int | float):
        return f"{x:.{digits}g}"
    return str(x)


def _card_summary(release: Mapping[str, Any]) -> list[str]:
    """The card's title, the promotion line, the intended use and the KPI headline (through the blank line
    before the class table)."""
    k = release["kpis"]
    ev = release["evidence"]
    return [
        f"# {release['model']} v{release['version']} (`{release['alias']}`)",
        "",
        f"Promoted {release['at']} by {release['by']} ({release['action']}): {release['reason']}",
        "",
        "## Intended use",
        "",
        release.get("intended_use", ""),
        "",
        "## KPIs",
        "",
        f"Evaluation data: prepared hash `{ev['data']['prepared_hash']}`, split `{ev['data']['split']}`"
        + (f", {ev['data']['frames']} frames" if "frames" in ev["data"] else "")
        + ". nuScenes-style AP over BEV centre-distance thresholds (docs/KPIS.md).",
        "",
        f"mAP **{_f(k['mAP'])}**"
        + (f", NDS **{_f(k['NDS'])}**" if "NDS" in k else "")
        + (
            f"; optimized - PyTorch mAP delta {_f(ev['delta_map'])}"
            if ev.get("delta_map") is not None
            else ""
        ),
        "",
    ]


def _card_class_table(k: Mapping[str, Any], ev: Mapping[str, Any]) -> list[str]:
    """The per-class AP table of KPI summary `k` (a column per distance threshold), then the mAP by range
    when the evidence `ev` has it."""
    ths = sorted({th for c in k["classes"].values() for th in c["ap"]}, key=float)
    out = ["| class | AP (mean) | " + " | ".join(f"AP@{t} m" for t in ths) + " | ATE | ASE | AOE |"]
    out.append("|---" * (5 + len(ths)) + "|")
    for name, c in k["classes"].items():
        cells = [
            _f(c["mean_ap"]),
            *(_f(c["ap"].get(t)) for t in ths),
            *(_f(c.get(m)) for m in ("ate", "ase", "aoe")),
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if ev.get("by_range_mAP"):
        out += ["", "mAP by range: " + ", ".join(f"{r} m {_f(v)}" for r, v in ev["by_range_mAP"].items())]
    return out


def _card_artifact(ev: Mapping[str, Any]) -> list[str]:
    """The "## Optimized artifact" section: the primary artifact's latency and parity, and the optimize
    stage's fallback when it shipped another artifact than the one asked."""
    lat = ev["latency"]
    par = ev["parity"]
    out = [
        "",
        "## Optimized artifact",
        "",
        f"Primary artifact `{lat['artifact']}`: latency batch {lat['batch']} p50 {_f(lat['p50_ms'])} ms, "
        f"p99 {_f(lat['p99_ms'])} ms. Parity vs PyTorch: {'passed' if par['passed'] else 'FAILED'} "
        f"({', '.join(par['artifacts'])}); worst: "
        + ", ".join(f"{m} {_f(v)}" for m, v in sorted(par["worst"].items())),
        "",
    ]
    fallback = ((ev.get("backend") or {}).get("selection") or {}).get("fallback")
    if fallback:  # the optimize stage refused an artifact and shipped the one that passed
        out += [
            f"**Shipped `{fallback.get('primary', lat['artifact'])}` instead of the asked `{fallback['asked']}`**: "
            f"{fallback['why']}.",
            "",
        ]
    return out


def _card_gates(gates: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The "## Gates" section: one row per gate (`Gate.to_json()`), or one row saying the release was not
    gated."""
    out = [
        "## Gates",
        "",
        "| gate | value | threshold | margin | result |",
        "|---|---|---|---|---|",
    ]
    for g in gates or []:
        out.append(
            f"| {g['name']} | {_f(g['value'])} | {_f(g['threshold'])} | {_f(g['margin'])} | "
            f"{'pass' if g['passed'] else 'FAIL'} |"
        )
    if not gates:
        out.append("| (none: this release was not gated, see the reason above) | | | | |")
    return out


def _card_lineage(release: Mapping[str, Any], audit: Sequence[Mapping[str, Any]]) -> list[str]:
    """The "## Lineage" (registry, architecture, run, commit, data, hashes), "## Files" and "## Audit trail"
    sections, ending with the card's final empty line."""
    ev = release["evidence"]
    lin = release["lineage"]
    plugin = ev["backend"].get("plugin")
    origin = (
        f"plugin {plugin.get('source')}, files sha256 `{plugin.get('files_sha256')}`"
        if plugin
        else "built-in"
    )
    return [
        "",
        "## Lineage",
        "",
        f"- registry: `models:/{release['model']}/{release['version']}` (alias `{release['alias']}`), "
        f"previous champion: {release['from'] if release['from'] is not None else 'none'}",
        f"- architecture: `{ev['backend'].get('arch', DEFAULT_ARCH)}` ({origin})",
        f"- MLflow run: `{lin.get('run_id')}`",
        f"- git commit: `{lin.get('git_commit')}` (dirty: {lin.get('git_dirty')})",
        f"- data: prepared `{ev['data']['prepared_hash']}`"
        + "".join(f", {k2} `{v}`" for k2, v in sorted((lin.get("prepared") or {}).items())),
        f"- model weights sha256: `{ev['backend'].get('weights_sha256')}`; backend.json sha256 "
        f"`{ev['backend']['manifest_sha256']}`",
        "",
        "## Files",
        "",
        *(f"- `{p}` sha256 `{h}`" for p, h in release["files"].items()),
        "",
        "## Audit trail",
        "",
        "| id | when | by | action | from | to | reason |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['id']} | {r['at']} | {r['by']} | {r['action']} | {r['from']} | {r['to']} | {r['reason']} |"
            for r in audit
        ),
        "",
    ]


def model_card(release: Mapping[str, Any], audit: Sequence[Mapping[str, Any]]) -> str:
    """MODEL_CARD.md from release.json's content (`release`) and the audit trail (records oldest first): the
    summary and KPIs, the class table, the optimized artifact, the gates, then lineage, files and audit."""
    ev = release["evidence"]
    out = [
        *_card_summary(release),
        *_card_class_table(release["kpis"], ev),
        *_card_artifact(ev),
        *_card_gates(release.get("gates")),
        *_card_lineage(release, audit),
    ]
    return "\n".join(out)


def write_empty_release(release: Path, prm: Any, result: Mapping[str, Any]) -> None:
    """DVC requires a declared out to exist after its stage. When this run released nothing (refused, dry
    run) the folder says which version is the champion (None before any promotion) and where its files
    are: the champion's release was written by the run that promoted it, and the registry has its files."""
    champion = result.get("champion_after")
    with atomic_directory(release, stage="promote") as tmp:
        atomic_write_json(
            tmp / af.RELEASE_JSON,
            {
                "model": prm.model_name,
                "alias": prm.alias,
                "version": champion,
                "released_by_this_run": False,
                "decision": result.get("decision"),
                "reason": result.get("reason"),
                "files": f"models:/{prm.model_name}@{prm.alias}" if champion is not None else None,
            },
        )


def record_decision(
    result: Mapping[str, Any], artifacts: Path, release: Path, prm: Any, fail_if_refused: bool
) -> None:
    """What the promote stage does with a decision, whatever the candidate was: unless it is a dry run, an
    empty `release` when none exists (DVC needs its declared out) and the result at `<artifacts>/promotion.json`
    (the decision record the flow, `factory lineage` and `factory promote last` read); the gate table on stderr;
    then, when the gates refused it and `fail_if_refused`, the result as JSON on stdout and `PromotionRefused`
    (exit 1) naming the failed gates."""
    from rich.console import Console

    from pfactory.promote.errors import PromotionRefused
    from pfactory.promote.gates import refused
    from pfactory.promote.report import promotion_view

    if result["decision"] != "dry-run":  # a dry run changes nothing: the last decision stays the record
        if not release.exists():
            write_empty_release(release, prm, result)
        atomic_write_json(Path(artifacts) / af.PROMOTION, dict(result))
    Console(stderr=True).print(promotion_view(result))
    if fail_if_refused and refused(result):
        print(json.dumps(result, indent=2, sort_keys=True, default=str))  # the result, as on a pass
        failed = ", ".join(g["name"] for g in result["gates"] if not g["passed"]) or "see the gate table"
        raise PromotionRefused(f"the gates refused v{result['version']} ({failed})")
