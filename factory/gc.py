"""`factory gc` and `factory disk`: what runs cost on disk, and retention that keeps every registered model's
lineage (pfactory/storage/retention.py; docs/OPERATIONS.md, "Disk and retention").

    factory disk [--json]                                   per run, per stage, per user; the cache
    factory gc --keep-last N [--keep-days D]                the table: what would go, why each kept thing stays
    factory gc --keep-last N [--keep-days D] --yes          ... and remove it

Registered in `factory/cli.py` with `register(app)`; imports only Typer until a command runs.
Exit codes: 0 done (or nothing to do); 1 the registry could not be read (nothing removed) or a removal failed
(a full disk: what is already removed stays consistent); 2 bad usage; 3 another gc holds the cache's lock.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, NoReturn

import typer


def _mib(n: int | None) -> str:
    """A byte count -> "1,234.5 MiB" ("" for None: not measured)."""
    return "" if n is None else f"{n / 2**20:,.1f} MiB"


def _fail(message: str, code: int) -> NoReturn:
    """Print `message` in red on stderr and end the command with exit `code` (the module docstring's codes);
    the exception being handled, if any, is not chained (the message says what happened)."""
    typer.secho(message, fg="red", err=True)
    raise typer.Exit(code) from None


def _registry_reader(root: Any) -> Any:
    """`registry_lineage` on the project's MLflow registry (its configured tracking URI)."""
    from pfactory.promote import registry as reg
    from pfactory.runtime.project import configure_environment
    from pfactory.storage.retention import registry_lineage

    configure_environment(root)
    return lambda: registry_lineage(reg.client())


def _stopped_message(e: OSError) -> str:
    """A removal that failed with `e` -> gc's one-line error: `pfactory.runtime.failures.explain`'s reason (a full
    disk, a path and what is wrong with it) or else the error's own text, and that what is removed so far
    stays consistent."""
    from pfactory.runtime.failures import explain

    known = explain(e)
    return (
        f"factory gc stopped: {known.reason if known else e}. What it removed so far is consistent (run-cache "
        "entries before their objects); run it again to finish."
    )


def gc_cmd(
    keep_last: Annotated[
        int | None, typer.Option("--keep-last", min=1, help="Keep the N newest run workspaces.")
    ] = None,
    keep_days: Annotated[
        float | None, typer.Option("--keep-days", min=0.0, help="Keep runs younger than D days.")
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", help="Remove what the table lists (default: only show it).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan (and what was removed) as JSON.")
    ] = False,
) -> None:
    """Free disk: old run workspaces and the DVC cache entries nothing kept refers to.

    Never removes what the champion, any registered model version (its data, shards, model, optimized
    artifacts, release), a kept run, the project's own paths or a run in progress need. Without --yes it
    only prints the table: what would be freed, and why each kept thing is kept.
    Examples: factory gc --keep-last 3  |  factory gc --keep-last 1 --keep-days 7 --yes
    """
    from rich.console import Console
    from rich.table import Table

    from pfactory.runtime.project import project_root
    from pfactory.storage.retention import collect, gc_lock, plan

    if keep_last is None and keep_days is None:
        _fail("factory gc: give a policy: --keep-last N and/or --keep-days D", 2)
    root = project_root()
    try:
        p = plan(root, keep_last, keep_days, _registry_reader(root))
    except Exception as e:  # the registry unreachable: nothing can be decided safely
        _fail(
            f"factory gc: cannot read the model registry ({type(e).__name__}: {str(e)[:200]}); nothing removed. "
            "gc keeps what registered models need, so it will not guess.",
            1,
        )
    out: dict[str, Any] = {"plan": p.summary(), "table": p.table(), "removed": None}
    console = Console()
    if not as_json:
        table = Table(title=f"factory gc ({'removing' if yes else 'dry run: add --yes to remove'})")
        for col in ("what", "name", "action", "frees", "why"):
            table.add_column(col, overflow="fold")
        for row in out["table"]:
            style = "red" if row["action"] == "remove" else None
            table.add_row(
                row["what"], row["name"], row["action"], _mib(row["bytes"]), row["why"], style=style
            )
        console.print(table)
        console.print(
            f"cache {p.cache.dir}: {len(p.kept_objects)} objects kept, {len(p.removed_objects)} to remove; "
            f"{len(p.removed_entries)} run-cache entries to remove; "
            f"{'frees' if yes else 'would free'} {_mib(p.frees_bytes)}",
            highlight=False,
        )
    if yes:
        try:
            with gc_lock(p.cache, wait=False):
                pass
        except BlockingIOError:
            _fail("factory gc: another gc is running on this cache; try again when it ends", 3)
        t0 = time.perf_counter()
        try:
            done = collect(root, p, echo=(lambda s: None) if as_json else console.print)
        except OSError as e:
            _fail(_stopped_message(e), 1)
        out["removed"] = {
            "runs": done.runs,
            "objects": done.objects,
            "run_cache_entries": done.entries,
            "skipped": done.skipped,
            "freed_bytes": done.freed_bytes,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        if not as_json:
            console.print(
                f"removed {len(done.runs)} runs, {done.objects} objects, {done.entries} run-cache entries: "
                f"{_mib(done.freed_bytes)} freed (file system free space before/after)"
                + (f"; skipped {len(done.skipped)} (a run started meanwhile)" if done.skipped else ""),
                highlight=False,
            )
    if as_json:
        typer.echo(json.dumps(out, indent=2, default=str))


def disk_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Disk use of this project's runs: per run (its own bytes vs links into the cache), per stage (cache
    bytes of its outputs), per user, the DVC cache and runs in progress. A file linked N times counts once.

    Example: factory disk  |  factory disk --json
    """
    from rich.console import Console
    from rich.table import Table

    from pfactory.runtime.project import project_root
    from pfactory.storage.retention import disk_usage

    usage = disk_usage(project_root())
    if as_json:
        typer.echo(json.dumps(usage, indent=2, default=str))
        return
    console = Console()
    runs = Table(title="runs (artifacts/runs/)")
    for col in ("run", "user", "created (UTC)", "apparent", "own", "stages"):
        runs.add_column(col, overflow="fold")
    for r in usage["runs"]:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["created"]))
        runs.add_row(
            r["run_id"],
            r["user"],
            when,
            _mib(r["apparent_bytes"]),
            _mib(r["own_bytes"]),
            str(len(r["stages"])),
        )
    console.print(runs)
    stages = Table(title=f"stages (objects in the cache {usage['cache']})")
    for col in ("stage", "cache", "objects"):
        stages.add_column(col)
    for stage, s in usage["stages"].items():
        stages.add_row(stage, _mib(s["cache_bytes"]), str(s["objects"]))
    console.print(stages)
    users = Table(title="users")
    for col in ("user", "runs", "run workspaces (own)", "cache (files owned)"):
        users.add_column(col)
    for user, u in sorted(usage["users"].items()):
        users.add_row(user, str(u["runs"]), _mib(u["run_bytes"]), _mib(u["cache_bytes"]))
    console.print(users)
    console.print(
        f"cache: {_mib(usage['cache_bytes'])} in {usage['cache_objects']} objects, "
        f"{usage['run_cache_entries']} run-cache entries; runs in progress: "
        + (", ".join(a.get("run_id", "?") for a in usage["in_progress"]) or "none"),
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    """Add `gc` and `disk` to the `factory` app."""
    app.command("gc")(gc_cmd)
    app.command("disk")(disk_cmd)
