"""Promotion, rollback and lineage: the registry side of DESIGN.md §9.

`promote(params, candidate, data, release, ...)`:
 1. read and check the candidate's evidence (`evidence.read_evidence`);
 2. register it (unless it is already a version, or `dry_run`): files logged to its run under `candidate/`,
    a new version of `params.model_name` tagged with KPIs, parity, latency, data identity, run, commit;
    a retried stage finds its earlier version (same run, same backend.json) instead of adding one;
 3. the champion's KPIs on the candidate's evaluation data: its registered KPIs when the data identity
    (prepared hash + split) matches, a cached re-evaluation tag, or a fresh `evaluate_fn(champion
    optimized dir, data)` on the champion's files downloaded from the registry;
 4. the gates (`gates.apply_gates`), with the latency of candidate and champion timed side by side here
    (`_latency_vs_champion`); any failure: the version is tagged refused, nothing else changes;
 5. under the registry lock, compare-and-set: the alias must still point where it pointed in step 3
    (else refused: another promotion won the race); the release folder is built, the audit record written
    (registry tag + release/audit.jsonl), the alias moved. The audit record is
    withdrawn when the alias move fails, and the release folder is only renamed into place at the end.
`rollback(params, release, to=None)`: the alias goes back to the previous champion found in the audit
trail (the `from` of the record that made the current champion), audited like a promotion, so a second
rollback undoes the first. `lineage(name, ref)`: version -> run -> commit, data, params, KPIs, audit.

A team's registry (`access.team()`: MLflow's basic-auth app): step 2 registers into `<model>-candidates`; the
caller's permission on `<model>` is checked before anything starts (`access.require`: one line, exit 77, the
refusal audited on the candidates model) -- or, for the pipeline's promote stage (`require_permission=False`),
a candidate that passes is left "awaiting-maintainer" and the result says who may promote it; step 5 copies
the candidate into `<model>` (`copy_model_version`, its tags with it, `candidate.model` / `candidate.version`
pointing back) and moves the alias to the copy. Every version records `pfactory.user`, the authenticated user,
and for a run a person triggered on a worker, `pfactory.triggered_by` and whether the MLflow server backed that
claim (`pfactory.triggered_by.verified`: `pfactory.tracking.trigger`).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pfactory.promote import access
from pfactory.promote import registry as reg
from pfactory.promote.errors import EvidenceError, RegistryError, UnknownRef
from pfactory.promote.evidence import (
    Evidence,
    data_identity,
    data_key,
    kpi_summary,
    kpis_from_tags,
    prepared_lineage,
    read_evidence,
    same_data,
)
from pfactory.promote.gates import Gate, apply_gates, failed
from pfactory.promote.params import PromoteParams
from pfactory.promote.release import fill_release
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import atomic_directory
from pfactory.tracking.trigger import parent_trigger_tags

EvaluateFn = Callable[[Path, Path], dict]
REEVAL_TAG = "kpis.reeval."  # + data_key: a champion's KPI summary re-computed on other evaluation data


@dataclass
class Candidate:
    """What is being promoted: local files (`optimized/`, `kpis.json`) and where they are tracked."""

    optimized: Path
    kpis_file: Path
    run_id: str | None
    """The MLflow run the files are logged to (and the version points at)."""
    version: int | None = None
    """Set when the candidate is already a registered version (`factory promote VERSION`)."""
    lineage: Mapping[str, Any] | None = None
    """`{"git_commit", "git_dirty"}` of the code that produced it (default: the run's tags, else this repo)."""
    model: str | None = None
    """The registered model `version` belongs to (default: where new candidates go, `access.registering_model`)."""


def _git_lineage(c: Any, run_id: str | None) -> dict[str, Any]:
    """Commit + dirty flag: the run's lineage tags (set by `stage_run`), else this checkout's."""
    if run_id:
        tags = c.get_run(run_id).data.tags
        if tags.get("git.commit") not in (None, "None"):
            return {"git_commit": tags["git.commit"], "git_dirty": tags.get("git.dirty")}
    from pfactory.runtime.lineage import git_info
    from pfactory.runtime.project import project_root

    g = git_info(project_root())
    return {"git_commit": g["commit"], "git_dirty": g["dirty"]}


def _champion_kpis(
    c: Any,
    params: PromoteParams,
    version: int,
    ev: Evidence,
    data: Path,
    evaluate_fn: EvaluateFn | None,
    dry_run: bool,
) -> tuple[dict[str, Any], str]:
    """The champion's KPI summary on the candidate's evaluation data, and where it came from."""
    name = params.model_name
    tags = reg.get_version(c, name, version).tags
    source = f"models:/{name}/{version}"
    champ_data = {"prepared_hash": tags.get("data.prepared_hash"), "split": tags.get("data.split")}
    if same_data(champ_data, ev.data):
        return kpis_from_tags(tags, source), "registered"
    cache_key = REEVAL_TAG + data_key(ev.data)
    if cache_key in tags:
        return kpis_from_tags(tags, source, cache_key), "re-evaluated (cached)"
    if evaluate_fn is None:
        raise RegistryError(
            f"champion {source} was evaluated on data {champ_data}, the candidate on {ev.data}: "
            "re-evaluating it needs an evaluate function"
        )
    with tempfile.TemporaryDirectory(prefix="pfactory-champion-") as tmp:
        files = reg.download_version(c, name, version, Path(tmp))
        kpis = evaluate_fn(files / "optimized", data)
    got = data_identity(kpis, f"re-evaluation of {source} on {data}")
    if not same_data(got, ev.data):
        raise EvidenceError(
            f"{data}: re-evaluating champion {source} there gave data {got}, but the candidate was evaluated "
            f"on {ev.data}; pass the candidate's evaluation data (--data) or re-evaluate the candidate"
        )
    summary = kpi_summary(kpis, f"re-evaluation of {source}")
    if not dry_run:  # a cache, not a change of the champion: the next promotion on this data reuses it
        reg.set_version_tags(c, name, version, {cache_key: json.dumps(summary, sort_keys=True)})
    return summary, "re-evaluated"


VERIFY_GATE = "candidate_verified"


def _verify_candidate(
    c: Any, params: PromoteParams, model: str, version: int | None, candidate: Candidate, ev: Evidence,
    data: Path, evaluate_fn: EvaluateFn | None,
) -> Gate | None:  # fmt: skip
    """Check that the candidate is what its run produced and that its KPIs are what it says; None when it is
    (then `ev.kpis` holds the recomputed KPI summary, the recorded one in `ev.extra["recorded_kpis"]`), else
    the failed gate, whose detail is the one-line reason.

    1. Its files: `read_evidence` already checked every file against backend.json's sha256s; backend.json's own
       sha256 must equal the `backend.manifest_sha256` recorded when the version was registered.
    2. Its KPIs: `evaluate_fn(candidate optimized dir, data)` (what re-evaluates a champion) recomputes them on
       the evaluation data its kpis.json names; the recorded mAP must be within `verify_map_tolerance`."""
    where = f"{model} v{version}" if version is not None else f"run {candidate.run_id}"
    if version is not None:
        recorded = reg.get_version(c, model, version).tags.get("backend.manifest_sha256")
        have = ev.backend["manifest_sha256"]
        if recorded is not None and recorded != have:
            return Gate(VERIFY_GATE, have[:12], recorded[:12], False, None,
                        f"{where}: its files' backend.json has sha256 {have[:12]}..., registration recorded "
                        f"{recorded[:12]}...: not the artifact its run produced")  # fmt: skip
    if evaluate_fn is None:
        raise RegistryError(f"verifying candidate {where} re-evaluates it: that needs an evaluate function")
    kpis = evaluate_fn(candidate.optimized, data)
    got = data_identity(kpis, f"re-evaluation of candidate {where} on {data}")
    if not same_data(got, ev.data):
        raise EvidenceError(
            f"{data}: re-evaluating candidate {where} there gave data {got}, but its kpis.json names {ev.data}; "
            "pass the candidate's evaluation data (--data)"
        )
    summary = kpi_summary(kpis, f"re-evaluation of candidate {where}")
    recorded_map, recomputed = ev.kpis["mAP"], summary["mAP"]
    if abs(recorded_map - recomputed) > params.verify_map_tolerance:
        return Gate(VERIFY_GATE, recomputed, recorded_map, False, None,
                    f"{where}: recorded mAP {round(recorded_map, 4):g}, recomputed {round(recomputed, 4):g} "
                    f"(from its artifact on {got['split']} of {got['prepared_hash'][:12]}; "
                    f"promote.verify_map_tolerance {params.verify_map_tolerance:g})")  # fmt: skip
    ev.extra["recorded_kpis"] = ev.kpis
    ev.kpis = summary  # the gates read the recomputed numbers
    return None


def _refuse_unverified(
    c: Any, params: PromoteParams, model: str, version: int | None, candidate: Candidate, gate: Gate,
    dry_run: bool,
) -> dict[str, Any]:  # fmt: skip
    """The result of a candidate that failed verification; unless `dry_run`, its version is tagged refused and
    the refusal is an audit record `refused-verify` of `model` (where it is registered), written under the lock."""
    champ = reg.champion(c, params.model_name, params.alias)
    if not dry_run and version is not None:
        reg.set_version_tags(
            c, model, version,
            {"promotion.decision": "refused", "promotion.at": reg.now_iso(), "promotion.by": reg.actor(),
             "promotion.failed_gates": gate.name, reg.STATUS_TAG: "refused"},
        )  # fmt: skip
        with reg.registry_lock(reg.registry_uri(), params.lock_timeout_s, model=params.model_name):
            record = {"id": reg.next_audit_id(c, model), "action": "refused-verify", "from": champ, "to": version,
                      "at": reg.now_iso(), "by": reg.actor(), "run_id": candidate.run_id, "reason": gate.detail}  # fmt: skip
            reg.write_audit(c, model, record)
            if model == params.model_name:
                reg.describe_model(c, model, params.alias)
    decision = "dry-run" if dry_run else "refused"
    extra = {"would_promote": False} if dry_run else {}
    return _result(decision, version, champ, champ, [gate], False, None, gate.detail, model=model,
                   champion_kpis_source="not read (the candidate failed verification)", **extra)  # fmt: skip


def _latency_vs_champion(
    c: Any, params: PromoteParams, version: int, candidate: Path, data: Path, split: str
) -> dict[str, Any]:
    """Candidate and champion `version` (its files downloaded from the registry) timed side by side in this
    process (`inference.latency.compare_directories`) on frames of `data`'s `split`; a measurement over a
    ratio limit is repeated once ("rounds": both; the gates read the smaller ratio)."""
    from pfactory.optimize.calibration import load_feeds
    from pfactory.optimize.latency import compare_directories

    feeds = load_feeds(data, split, params.latency_batch, params.latency_batch * params.latency_frames).feeds
    with tempfile.TemporaryDirectory(prefix="pfactory-champion-latency-") as tmp:
        champion = reg.download_version(c, params.model_name, version, Path(tmp)) / "optimized"
        rounds: list[dict[str, Any]] = []
        for _ in range(2):
            rounds.append(compare_directories(
                candidate, champion, feeds, params.latency_warmup, params.latency_iterations
            ))  # fmt: skip
            r = rounds[-1]
            if r["ratio_p50"] <= params.max_latency_ratio and r["ratio_p99"] <= params.max_p99_latency_ratio:
                break
    return {"champion_version": version, "rounds": rounds}


def _result(decision: str, version: int | None, before: int | None, after: int | None, gates: list[Gate],
            reeval: bool, release: Path | None, reason: str, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "decision": decision,
        "version": version,
        "champion_before": before,
        "champion_after": after,
        "gates": [g.to_json() for g in gates],
        "reevaluated_champion": reeval,
        "release": str(release) if release is not None else None,
        "reason": reason,
        **extra,
    }


def _release_info(
    params: PromoteParams, version: int, before: int | None, ev: Evidence, gates: list[Gate], action: str,
    reason: str, lineage: Mapping[str, Any], record: Mapping[str, Any],
) -> dict[str, Any]:  # fmt: skip
    backend = {k: v for k, v in ev.backend.items() if k != "files"}
    return {
        "model": params.model_name,
        "version": version,
        "alias": params.alias,
        "action": action,
        "reason": reason,
        "at": record["at"],
        "by": record["by"],
        "from": before,
        "audit_id": record["id"],
        "gates": [g.to_json() for g in gates],
        "intended_use": params.intended_use,
        "kpis": ev.kpis,
        "evidence": {
            "data": ev.data,
            "delta_map": ev.delta_map,
            "parity": ev.parity,
            "latency": ev.latency,
            "backend": backend,
            "by_range_mAP": ev.extra.get("by_range_mAP", {}),
        },
        "lineage": dict(lineage),
    }


def _publish(
    c: Any, params: PromoteParams, version: int, before: int | None, files: tuple[Path, Path], ev: Evidence,
    gates: list[Gate], action: str, reason: str, release: Path, lineage: Mapping[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """Release folder + alias move + audit record (call under the registry lock); returns the record."""
    name = params.model_name
    record = {
        "id": reg.next_audit_id(c, name),
        "action": action,
        "model": name,
        "alias": params.alias,
        "from": before,
        "to": version,
        "at": reg.now_iso(),
        "by": reg.actor(),
        "reason": reason,
        "gates": [{k: v for k, v in g.to_json().items() if k != "detail"} for g in gates],
        "run_id": lineage.get("run_id"),
        "data": ev.data,
    }
    info = _release_info(params, version, before, ev, gates, action, reason, lineage, record)
    with atomic_directory(release, stage="promote") as tmp:
        fill_release(tmp, release, files[0], files[1], info, [*reg.audit_trail(c, name), record])
        # Audit first: a crash in between leaves a record of a move that did not happen (visible: the
        # alias differs from the last record's "to"), never an unaudited move.
        reg.write_audit(c, name, record)
        try:
            reg.move_alias(c, name, params.alias, version)
        except BaseException:
            reg.delete_audit(c, name, record)
            raise
    reg.set_version_tags(
        c, name, version,
        {"promotion.decision": "promoted" if action == "promote" else action, "promotion.at": record["at"],
         "promotion.by": record["by"], "promotion.audit_id": record["id"], reg.STATUS_TAG: params.alias},
    )  # fmt: skip
    if before is not None and before != version:
        reg.set_version_tags(c, name, before, {reg.STATUS_TAG: f"replaced by v{version} ({action})"})
    reg.describe_model(c, name, params.alias)  # the registry page: champion + audit trail, readable
    return record


def copy_to_production(c: Any, source_model: str, version: int, model: str) -> int:
    """Copy candidate `source_model/version` into `model` (MLflow's `copy_model_version`) with its tags and
    description, plus `candidate.model` / `candidate.version` (lineage back); returns the new version."""
    src = reg.get_version(c, source_model, version)
    mv = c.copy_model_version(f"models:/{source_model}/{version}", model)
    new = int(mv.version)
    tags = {k: v for k, v in src.tags.items() if not k.startswith("promotion.") and k != reg.STATUS_TAG}
    reg.set_version_tags(
        c, model, new, {**tags, "candidate.model": source_model, "candidate.version": version}
    )
    if src.description:
        c.update_model_version(model, str(new), description=src.description)
    return new


@dataclass
class _Promotion:
    """One call of `promote`: its arguments, who is calling, and the candidate's evidence and lineage. The
    steps of `promote` read it; `version` is set once the candidate is registered."""

    c: Any
    params: PromoteParams
    candidate: Candidate
    data: Path
    release: Path
    dry_run: bool
    evaluate_fn: EvaluateFn | None
    ident: Any
    """The caller's `access.team()` identity; None without a team."""
    reg_name: str
    """The registered model the candidate's version is (or will be) in."""
    allowed: bool
    """Whether the caller may move the alias of `params.model_name`."""
    has: str
    """The permission the caller has on `params.model_name`."""
    ev: Evidence
    lineage: dict[str, Any]
    version: int | None = None


def _start(
    c: Any, params: PromoteParams, candidate: Candidate, data: Path, release: Path, dry_run: bool,
    evaluate_fn: EvaluateFn | None, require_permission: bool,
) -> _Promotion:  # fmt: skip
    """Step 1 of `promote`: who is calling and where the candidate is registered (with `require_permission`,
    `access.require` refuses a caller who may not promote before anything starts), then the candidate's
    evidence (`read_evidence`) and lineage (run, commit, prepared data)."""
    name = params.model_name
    ident = access.team()
    reg_name = candidate.model or (access.candidates_model(name) if ident is not None else name)
    allowed, has = (True, "MANAGE") if ident is None or dry_run else access.may(ident, name)
    if not allowed and require_permission:  # checked before anything starts (module docstring)
        access.require(c, ident, name, "promote", reg.champion(c, name, params.alias), candidate.version,
                       candidate.run_id)  # fmt: skip
    ev = read_evidence(candidate.optimized, candidate.kpis_file, params.latency_batch)
    ev.extra["prepared"] = prepared_lineage(data)
    lineage = {
        "run_id": candidate.run_id,
        **(candidate.lineage or _git_lineage(c, candidate.run_id)),
        "prepared": ev.extra["prepared"],
    }
    return _Promotion(c, params, candidate, data, release, dry_run, evaluate_fn, ident, reg_name, allowed,
                      has, ev, lineage, candidate.version)  # fmt: skip


def _register(p: _Promotion) -> int:
    """Step 2 of `promote`: the candidate's version in `p.reg_name`: the one an earlier try registered (same
    run, same backend.json), else a new one (its files logged to its run, tagged with its evidence)."""
    c, params, candidate, ev, lineage = p.c, p.params, p.candidate, p.ev, p.lineage
    if candidate.run_id is None:
        raise ValueError("a candidate that is not registered yet needs the MLflow run to log it to")
    version = reg.find_version(c, p.reg_name, candidate.run_id, ev.backend["manifest_sha256"])
    if version is None:
        source, model_id = reg.log_candidate(
            c, candidate.run_id, candidate.optimized, candidate.kpis_file, p.data
        )
        tags = {
            **ev.tags(),
            "run_id": candidate.run_id,
            "git.commit": str(lineage["git_commit"]),
            "git.dirty": str(lineage["git_dirty"]),
            reg.STATUS_TAG: "registered",
            access.USER_TAG: reg.actor().rsplit("@", 1)[0],
            **parent_trigger_tags(c),  # who triggered the run on a worker, and whether the server backed it
        }
        version = reg.register_version(
            c, p.reg_name, source, candidate.run_id, tags,
            f"mAP {ev.kpis['mAP']:.4f} on {ev.data['split']} of {ev.data['prepared_hash'][:12]}; "
            f"{ev.backend['primary']} p99 {ev.latency['p99_ms']:.1f} ms", model_id,
        )  # fmt: skip
        if p.reg_name == params.model_name:
            reg.describe_model(c, params.model_name, params.alias)
    return version


def _gate(p: _Promotion, before: int | None) -> tuple[list[Gate], list[Gate], str, str]:
    """Steps 3 and 4 of `promote`: the champion `before`'s KPIs on the candidate's data and both latencies,
    then the gates. Returns (gates, the failed ones, the reason, where the champion's KPIs came from)."""
    c, params, ev = p.c, p.params, p.ev
    champ_kpis, champ_source = None, "none (no champion)"
    if before is not None:
        # The re-evaluation cache is a tag of the champion's version: written only by who may write there.
        champ_kpis, champ_source = _champion_kpis(
            c, params, before, ev, p.data, p.evaluate_fn, p.dry_run or not p.allowed
        )
    champ_latency = None
    if before is not None:
        champ_latency = _latency_vs_champion(
            c, params, before, p.candidate.optimized, p.data, ev.data["split"]
        )
    gates = apply_gates(params, ev, champ_kpis, champ_latency)
    bad = failed(gates)
    vs = f"champion v{before}" if before is not None else "no champion (absolute gates only)"
    reason = (
        f"all {len(gates)} gates passed vs {vs}"
        if not bad
        else f"{len(bad)} gate(s) failed vs {vs}: " + "; ".join(f"{g.name}: {g.detail}" for g in bad)
    )
    fallback = (ev.backend.get("selection") or {}).get("fallback")
    if fallback:  # said in the run's summary (the caption of the gate table) and on the model card
        reason += f"; optimize shipped {fallback.get('primary', ev.backend['primary'])}: {fallback['why']}"
    return gates, bad, reason, champ_source


def _refuse(p: _Promotion, version: int, failed_gates: str) -> None:
    """Tag candidate `version` (in `p.reg_name`) refused by the named gates (comma-separated)."""
    reg.set_version_tags(
        p.c, p.reg_name, version,
        {"promotion.decision": "refused", "promotion.at": reg.now_iso(), "promotion.by": reg.actor(),
         "promotion.failed_gates": failed_gates, reg.STATUS_TAG: "refused"},
    )  # fmt: skip


def _await_maintainer(
    p: _Promotion, version: int, before: int | None, gates: list[Gate], reeval: bool, reason: str,
    extra: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """A candidate that passed, from a team member who may not move the alias: tagged "awaiting-maintainer",
    and the result says who may promote it."""
    name = p.params.model_name
    who = access.who_may(p.c, name)
    reason += (f"; {p.ident.username} has {p.has} on {name} and promoting needs {access.PROMOTE_NEEDS}: "
               f"{who} can promote it (factory promote {p.reg_name}/{version})")  # fmt: skip
    reg.set_version_tags(
        p.c, p.reg_name, version,
        {"promotion.decision": "awaiting-maintainer", "promotion.at": reg.now_iso(),
         "promotion.by": reg.actor(), reg.STATUS_TAG: "awaiting-maintainer"},
    )  # fmt: skip
    return _result("awaiting-maintainer", version, before, before, gates, reeval, None, reason,
                   who_may_promote=who, **extra)  # fmt: skip


def _move_alias(
    p: _Promotion, version: int, before: int | None, gates: list[Gate], reeval: bool, reason: str,
    extra: dict[str, Any], server_lock: bool,
) -> dict[str, Any]:  # fmt: skip
    """Step 5 of `promote`, for a candidate that passed: under the registry lock (the server's, already held
    when `server_lock`), compare-and-set against the champion `before` the gates read, then the release, the
    audit record and the alias move (`_publish`); with a team, to a copy of the candidate in the model."""
    c, params, name, reg_name = p.c, p.params, p.params.model_name, p.reg_name
    reg.set_version_tags(c, reg_name, version, {reg.STATUS_TAG: "awaiting-lock"})
    lock = (
        contextlib.nullcontext()
        if server_lock
        else reg.registry_lock(reg.registry_uri(), params.lock_timeout_s)
    )
    with lock:
        now = reg.champion(c, name, params.alias)
        if now != before:  # compare-and-set: another promotion moved the alias since step 3
            lost = Gate(
                "champion_unchanged", now, before, False, None,
                f"{params.alias} moved from {before} to {now} while this promotion was gated: lost the race, "
                "re-run the promotion to gate against the new champion",
            )  # fmt: skip
            gates.append(lost)
            _refuse(p, version, lost.name)
            return _result("refused", version, before, now, gates, reeval, None, lost.detail, **extra)
        target = version if reg_name == name else copy_to_production(c, reg_name, version, name)
        _publish(c, params, target, before, (p.candidate.optimized, p.candidate.kpis_file), p.ev, gates,
                 "promote", reason, p.release, p.lineage)  # fmt: skip
        if reg_name != name:
            reg.set_version_tags(
                c, reg_name, version,
                {"promotion.decision": "promoted", "promotion.at": reg.now_iso(), "promotion.by": reg.actor(),
                 "promotion.production_version": target, reg.STATUS_TAG: f"copied to {name} v{target}"},
            )  # fmt: skip
            extra["production_version"] = target
    return _result("promoted", version, before, target, gates, reeval, p.release, reason, **extra)


def _decide(p: _Promotion, server_lock: bool) -> dict[str, Any]:
    """Steps 3 to 5 of `promote` (under the server's lock when `server_lock`): read the champion, gate the
    candidate against it, then the decision: dry-run, refused, awaiting-maintainer or promoted."""
    c, params, name, version = p.c, p.params, p.params.model_name, p.version
    before = reg.champion(c, name, params.alias)
    if version is not None and p.reg_name == name and before == version:
        return _result("promoted", version, before, before, [], False, None,
                       f"v{version} is already {params.alias}: nothing to do")  # fmt: skip
    gates, bad, reason, champ_source = _gate(p, before)
    reeval = champ_source.startswith("re-evaluated")
    extra: dict[str, Any] = {"champion_kpis_source": champ_source, "model": p.reg_name}
    if p.dry_run:
        return _result("dry-run", version, before, before, gates, reeval, None, reason, would_promote=not bad,
                       **extra)  # fmt: skip
    assert version is not None
    if bad:
        _refuse(p, version, ",".join(g.name for g in bad))
        return _result("refused", version, before, before, gates, reeval, None, reason, **extra)
    if not p.allowed:  # a team member who may not move the alias: a gated candidate, left for a maintainer
        return _await_maintainer(p, version, before, gates, reeval, reason, extra)
    return _move_alias(p, version, before, gates, reeval, reason, extra, server_lock)


def promote(
    params: PromoteParams,
    candidate: Candidate,
    data: Path,
    release: Path,
    dry_run: bool = False,
    evaluate_fn: EvaluateFn | None = None,
    require_permission: bool = True,
) -> dict[str, Any]:
    """Register `candidate`, gate it against the champion, move the alias on a pass (module docstring).

    Returns `{"decision": "promoted" | "refused" | "dry-run", "version", "champion_before", "champion_after",
    "gates": [{"name", "value", "threshold", "passed", "margin", "detail"}], "reevaluated_champion",
    "release", "reason", "champion_kpis_source", "would_promote" (dry-run)}`. `version` is None for a
    dry run of a candidate that is not registered yet (a dry run registers nothing). With a team: "model" (where
    `version` is registered), "production_version" (the copy, when promoted) and, for a caller who may not
    promote (`require_permission=False`), the decision "awaiting-maintainer" with "who_may_promote".
    """
    c = reg.client()
    name = params.model_name
    p = _start(c, params, candidate, data, release, dry_run, evaluate_fn, require_permission)
    # Verify what is promoted (docs/PROMOTE.md, "What is verified"): only a caller who may move the alias.
    verify = p.allowed and (
        params.verify_candidate == "always" or (params.verify_candidate == "team" and p.ident is not None)
    )
    if p.version is None and not dry_run:
        p.version = _register(p)
    if verify:
        refusal = _verify_candidate(c, params, p.reg_name, p.version, candidate, p.ev, data, evaluate_fn)
        if refusal is not None:
            return _refuse_unverified(c, params, p.reg_name, p.version, candidate, refusal, dry_run)
    # With a team the server's lock (`promote-<model>`) is held from reading the champion to moving the alias:
    # a promotion from another clone waits, then gates against the champion the first one set.
    server_lock = not dry_run and p.allowed and reg.server_lock_name(reg.registry_uri(), name) is not None
    held = contextlib.ExitStack()
    if server_lock:
        reg.set_version_tags(c, p.reg_name, p.version, {reg.STATUS_TAG: "awaiting-lock"})
        held.enter_context(reg.registry_lock(reg.registry_uri(), params.lock_timeout_s, model=name))
    with held:
        return _decide(p, server_lock)


def previous_champion(
    trail: list[Mapping[str, Any]], current: int
) -> tuple[int | None, Mapping[str, Any] | None]:
    """The champion before `current` per the audit trail: `from` of the last record that made it champion."""
    for r in reversed(trail):
        if r.get("to") == current:
            return r.get("from"), r
    return None, None


def _version_lineage(c: Any, name: str, version: int) -> dict[str, Any]:
    tags = reg.get_version(c, name, version).tags
    return {
        "run_id": tags.get("run_id"),
        "git_commit": tags.get("git.commit"),
        "git_dirty": tags.get("git.dirty"),
        "prepared": {
            k.removeprefix("data.prepared."): v for k, v in tags.items() if k.startswith("data.prepared.")
        },
    }


def rollback(
    params: PromoteParams, release: Path, to: int | None = None, reason: str | None = None
) -> dict[str, Any]:
    """Move the alias back to the previous champion (or to version `to`), audited; rebuilds `release`.

    Returns `{"decision": "rolled-back", "champion_before", "champion_after", "audit_id", "release"}`.
    `RegistryError` when there is no champion, no previous one in the audit trail, or `to` does not exist.
    """
    c = reg.client()
    name = params.model_name
    access.require(c, access.team(), name, "rollback", reg.champion(c, name, params.alias))
    with reg.registry_lock(reg.registry_uri(), params.lock_timeout_s, model=name):
        current = reg.champion(c, name, params.alias)
        if current is None:
            raise RegistryError(
                f"registered model {name!r} has no {params.alias!r} alias: nothing to roll back"
            )
        if to is None:
            to, rec = previous_champion(reg.audit_trail(c, name), current)
            if to is None:
                how = f"audit record {rec['id']} made it the first" if rec else "no audit record made it"
                raise RegistryError(
                    f"{name}@{params.alias} is v{current} and there is no previous champion ({how}); "
                    "pass --to VERSION to choose one"
                )
            why = reason or f"rollback of audit record {rec['id']} (v{rec['from']} -> v{rec['to']})"
        else:
            why = reason or f"rollback to v{to} requested"
        if to == current:
            raise RegistryError(f"v{to} is already {name}@{params.alias}")
        reg.get_version(c, name, to)
        with tempfile.TemporaryDirectory(prefix="pfactory-rollback-") as tmp:
            files = reg.download_version(c, name, to, Path(tmp))
            ev = read_evidence(files / "optimized", files / "eval" / af.KPIS, params.latency_batch)
            record = _publish(
                c, params, to, current, (files / "optimized", files / "eval" / af.KPIS), ev, [], "rollback",
                why, release, _version_lineage(c, name, to),
            )  # fmt: skip
    return {
        "decision": "rolled-back",
        "champion_before": current,
        "champion_after": to,
        "audit_id": record["id"],
        "release": str(release),
        "reason": why,
    }


def resolve(c: Any, ref: str, default_model: str, default_alias: str) -> tuple[str, int]:
    """`MODEL`, `MODEL@ALIAS`, `MODEL/VERSION`, `models:/...`, `VERSION` or `@ALIAS` -> (model, version)."""
    text = ref.removeprefix("models:/")
    name, alias, version = default_model, None, None
    if "@" in text:
        left, alias = text.split("@", 1)
        name = left or default_model
    elif "/" in text:
        name, v = text.rsplit("/", 1)
        version = v
    elif text.isdigit():
        version = text
    else:
        name, alias = text, default_alias
    if alias is not None:
        v = reg.champion(c, name, alias)
        if v is None:
            raise UnknownRef(f"registered model {name!r} has no alias {alias!r} (or does not exist)")
        return name, v
    if not str(version).isdigit():
        raise UnknownRef(f"{ref!r}: expected MODEL[@ALIAS], MODEL/VERSION or a version number")
    reg.get_version(c, name, int(version))
    return name, int(version)


def lineage(ref: str, default_model: str, default_alias: str = "champion") -> dict[str, Any]:
    """Version -> run (+ its stage runs) -> commit, data hashes, params, KPIs, gates, audit records."""
    c = reg.client()
    name, version = resolve(c, ref, default_model, default_alias)
    mv = reg.get_version(c, name, version)
    tags = dict(mv.tags)
    rm = c.get_registered_model(name)
    out: dict[str, Any] = {
        "model": name,
        "version": version,
        "aliases": sorted(a for a, v in (rm.aliases or {}).items() if int(v) == version),
        "source": mv.source,
        "created": mv.creation_timestamp,
        "description": mv.description,
        "git": {"commit": tags.get("git.commit"), "dirty": tags.get("git.dirty")},
        # the architecture, and for a plugin its distribution, version and files hash (evidence.arch_tags)
        "model_arch": {
            k.removeprefix("model."): v
            for k, v in tags.items()
            if k.startswith(("model.arch", "model.source", "model.plugin."))
        },
        "data": {k.removeprefix("data."): v for k, v in tags.items() if k.startswith("data.")},
        "kpis": json.loads(tags["kpis.summary"]) if "kpis.summary" in tags else None,
        "parity": {k.removeprefix("parity."): v for k, v in tags.items() if k.startswith("parity.")},
        "latency": {k.removeprefix("latency."): v for k, v in tags.items() if k.startswith("latency.")},
        "promotion": {k.removeprefix("promotion."): v for k, v in tags.items() if k.startswith("promotion.")},
        "audit": [r for r in reg.audit_trail(c, name) if version in (r.get("to"), r.get("from"))],
        "user": tags.get(access.USER_TAG),
        "candidate": (
            {"model": tags["candidate.model"], "version": int(tags["candidate.version"])}
            if "candidate.model" in tags
            else None
        ),
        "run": None,
        "params": {},
    }
    if mv.run_id:
        run = c.get_run(mv.run_id)
        out["run"] = {
            "id": mv.run_id,
            "name": run.info.run_name,
            "status": run.info.status,
            "experiment_id": run.info.experiment_id,
            "start_time": run.info.start_time,
            "parent": run.data.tags.get("mlflow.parentRunId"),
            "stages": [],
        }
        params = dict(run.data.params)
        children = c.search_runs(
            [run.info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{mv.run_id}'",
            max_results=100,
        )
        for child in children:
            out["run"]["stages"].append(
                {"id": child.info.run_id, "name": child.info.run_name, "status": child.info.status}
            )
            params.update(child.data.params)
        out["params"] = dict(sorted(params.items()))
        if out["git"]["commit"] in (None, "None"):
            out["git"] = {"commit": run.data.tags.get("git.commit"), "dirty": run.data.tags.get("git.dirty")}
    return out
