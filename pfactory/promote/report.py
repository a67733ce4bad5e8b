"""Human-readable views of promotion results and lineage (rich renderables; `factory promote|lineage`).

In:  the dicts of `promotion.promote` / `rollback` / `lineage`.
Out: rich `Table`s / text, printed by the CLI; `--json` prints the dicts themselves instead.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any


def _f(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def promotion_view(result: Mapping[str, Any]) -> Any:
    """A table of the gates with a title line: decision, version, champion before -> after."""
    from rich.table import Table

    d = result["decision"]
    colour = {"promoted": "green", "refused": "red", "dry-run": "yellow", "awaiting-maintainer": "yellow"}.get(d, "white")
    extra = ""
    if d == "dry-run":
        extra = " (would promote)" if result.get("would_promote") else " (would be refused)"
    title = (
        f"[bold {colour}]{d}[/]{extra}: version {result['version']}, champion "
        f"{result['champion_before']} -> {result['champion_after']}"
        + (", champion re-evaluated on the candidate's data" if result.get("reevaluated_champion") else "")
    )
    table = Table(title=title, title_justify="left")
    table.add_column("gate", no_wrap=True)  # the name a user greps for stays whole on a narrow terminal
    for col in ("value", "threshold", "margin", "result"):  # the failing gates' sentences go in the caption
        table.add_column(col, justify="right")
    for g in result["gates"]:
        table.add_row(
            g["name"], _f(g["value"]), _f(g["threshold"]), _f(g["margin"]),
            "[green]pass[/]" if g["passed"] else "[bold red]FAIL[/]",
        )  # fmt: skip
    table.caption = result.get("reason", "") + (
        f"\nrelease: {result['release']}" if result.get("release") else ""
    )
    table.caption_justify = "left"
    return table


def rollback_view(result: Mapping[str, Any]) -> Any:
    """One readable block for `factory rollback`: the alias move, the audit record, the release folder."""
    from rich.text import Text

    return Text.assemble(
        ("rolled back", "bold yellow"),
        f": champion v{result['champion_before']} -> v{result['champion_after']} (audit record "
        f"{result['audit_id']})\nreason: {result.get('reason') or '-'}\nrelease: {result.get('release')}",
    )


def _ts(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return str(ms)
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).isoformat(timespec="seconds")


def lineage_view(lin: Mapping[str, Any]) -> list[Any]:
    """Tables: the version and its run/commit/data, the KPIs, the audit records, the params."""
    from rich.table import Table

    head = Table(title=f"{lin['model']} v{lin['version']}", title_justify="left", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value", overflow="fold")
    run = lin.get("run") or {}
    rows = [
        ("aliases", ", ".join(lin["aliases"]) or "-"),
        ("registered", _ts(lin["created"])),
        ("registered by", lin.get("user") or "-"),
        ("candidate", f"{lin['candidate']['model']}/{lin['candidate']['version']}" if lin.get("candidate") else "-"),
        ("source", lin["source"]),
        ("run", f"{run.get('id')} ({run.get('name')}, {run.get('status')})" if run else "-"),
        ("stage runs", ", ".join(f"{s['name']} {s['id'][:8]}" for s in run.get("stages", [])) or "-"),
        ("git commit", f"{lin['git']['commit']} (dirty: {lin['git']['dirty']})"),
        *((f"model.{k}", v) for k, v in sorted((lin.get("model_arch") or {}).items())),
        *((f"data.{k}", v) for k, v in sorted(lin["data"].items())),
        *((f"latency.{k}", v) for k, v in sorted(lin["latency"].items())),
        (
            "parity",
            f"passed: {lin['parity'].get('passed')}; failures: {lin['parity'].get('failures', 'none')}",
        ),
        *((f"promotion.{k}", v) for k, v in sorted(lin["promotion"].items())),
    ]
    for k, v in rows:
        head.add_row(k, _f(v))
    out = [head]
    kpis = lin.get("kpis")
    if kpis:
        t = Table(title=f"KPIs: mAP {_f(kpis['mAP'])}, NDS {_f(kpis.get('NDS'))}", title_justify="left")
        ths = sorted({th for c in kpis["classes"].values() for th in c["ap"]}, key=float)
        for col in ("class", "AP", *(f"AP@{t_}" for t_ in ths), "ATE", "ASE", "AOE"):
            t.add_column(col)
        for name, c in kpis["classes"].items():
            t.add_row(
                name, _f(c["mean_ap"]), *(_f(c["ap"].get(t_)) for t_ in ths),
                *(_f(c.get(m)) for m in ("ate", "ase", "aoe")),
            )  # fmt: skip
        out.append(t)
    if lin["audit"]:
        t = Table(title="audit records (alias moves to or from this version)", title_justify="left")
        for col in ("id", "when", "by", "action", "from", "to", "reason"):
            t.add_column(col, overflow="fold")
        for r in lin["audit"]:
            t.add_row(*(_f(r.get(k)) for k in ("id", "at", "by", "action", "from", "to", "reason")))
        out.append(t)
    if lin["params"]:
        t = Table(title=f"params of the run and its stage runs ({len(lin['params'])})", title_justify="left")
        t.add_column("param")
        t.add_column("value", overflow="fold")
        for k, v in lin["params"].items():
            t.add_row(k, str(v))
        out.append(t)
    return out


def log_result(result: Mapping[str, Any]) -> None:
    """Log a promotion result to the active MLflow run: `promote/promoted`, `promote/version`,
    `gate/<name>/{value,margin,passed}`, the decision tags and `promote/result.json`."""
    import mlflow

    metrics = {"promote/promoted": float(result["decision"] == "promoted")}
    if result["version"] is not None:
        metrics["promote/version"] = float(result["version"])
    for g in result["gates"]:
        key = g["name"].replace("/", "_").replace("+", "-inf")  # MLflow names allow no "+" (range "40+")
        for field in ("value", "margin"):
            v = g[field]
            if isinstance(v, int | float) and not isinstance(v, bool):
                metrics[f"gate/{key}/{field}"] = float(v)
        metrics[f"gate/{key}/passed"] = float(bool(g["passed"]))
    mlflow.log_metrics(metrics)
    mlflow.set_tags({"promote.decision": result["decision"], "promote.version": str(result["version"])})
    mlflow.log_dict(dict(result), "promote/result.json")
