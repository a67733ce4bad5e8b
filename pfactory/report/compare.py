"""Compare pipeline runs: KPIs, changed params and stage timings, with regressions flagged.

In: MLflow pipeline runs (the parent run of each `factory run`, tagged `pipeline=true`),
named by run id or run name, or by default the latest finished ones of the experiment and of its
per-user experiments `<experiment>/<user>` (a team's: `pfactory.tracking.runs.experiment_ids`).
Out: a `ComparisonResult` — one row per KPI / latency / stage time / changed param, a value
per run, the delta against the baseline run, and the regressions beyond the tolerances —
rendered as a rich table, JSON, or a PNG chart.

Run: `factory compare [RUN ...] [--baseline RUN] [--last N] [--png FILE] [--json]`.

Conventions (also in docs/OPERATIONS.md):
- runs are shown oldest first (by start time); the baseline is the oldest shown unless
  `baseline=` names one (a baseline outside the list is added to it);
- a KPI row is "higher is better" (mAP, NDS, per-class mean AP) and regresses when it drops
  by more than `kpi_tolerance` (absolute); TP errors (ATE/ASE/AOE) and `eval/delta/mAP` are
  shown, not flagged (the errors feed NDS, which is flagged);
- a stage time or latency regresses when it is more than `time_tolerance` x the baseline;
  stage times also need to grow by more than `min_time_s` seconds, because sub-second stages
  are dominated by noise on a shared CPU.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pfactory.detectors.params import DEFAULT_ARCH  # records from before architectures had names
from pfactory.storage.dag import stage_names
from pfactory.tracking.runs import EXPERIMENT, experiment_ids

STAGES = stage_names()  # declared once, in dvc.yaml
HEADLINE_KPIS = ("eval/mAP", "eval/NDS")
TP_ERRORS = ("ate", "ase", "aoe")
LATENCY_KEYS = ("latency/p50_ms", "latency/p99_ms", "artifact/primary_mb")  # the size is shown, not flagged
SECTIONS = ("run", "kpi", "latency", "time", "param")
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_CLASS_AP = re.compile(r"eval/([^/]+)/mean_ap")


class CompareError(ValueError):
    """A run, experiment or argument that cannot be compared (the message says which)."""


class NoRunsError(CompareError):
    """The experiment holds no pipeline run to compare."""


@dataclass(frozen=True)
class RunRef:
    """One compared run: its MLflow id, name, start time (ms since epoch) and status."""

    run_id: str
    name: str
    start_time_ms: int
    status: str

    @property
    def label(self) -> str:
        """The column header: the run name, else the first 8 characters of the id."""
        return self.name or self.run_id[:8]


@dataclass
class Row:
    """One table row: a value per run (in `ComparisonResult.runs` order) and its delta.

    `deltas[i]` is `value - baseline` for KPIs, `value / baseline` for times and latencies,
    None for params, run facts, the baseline itself and missing values.
    """

    section: str  # one of SECTIONS
    key: str
    values: list[Any]
    deltas: list[float | None]
    regressed: list[bool]


@dataclass(frozen=True)
class Regression:
    """A value worse than the baseline's beyond its tolerance."""

    run_id: str
    run_label: str
    section: str  # "kpi" | "latency" | "time"
    key: str
    baseline: float
    value: float
    change: float  # KPI: value - baseline; time/latency: value / baseline
    tolerance: float

    @property
    def message(self) -> str:
        if self.section == "kpi":
            return (
                f"{self.run_label}: {self.key} dropped {self.baseline:.4f} -> {self.value:.4f} "
                f"({self.change:+.4f}, tolerance {self.tolerance:g})"
            )
        return (
            f"{self.run_label}: {self.key} slowed {self.baseline:.3g} -> {self.value:.3g} "
            f"(x{self.change:.2f}, tolerance x{self.tolerance:g})"
        )


@dataclass
class ComparisonResult:
    """Runs (oldest first), the baseline, the table rows and the regressions found."""

    experiment: str
    runs: list[RunRef]
    baseline: RunRef
    table: list[Row]
    regressions: list[Regression]
    tolerances: dict[str, float] = field(default_factory=dict)

    def section(self, name: str) -> list[Row]:
        """The rows of one section ("run", "kpi", "latency", "time" or "param")."""
        return [r for r in self.table if r.section == name]

    def row(self, key: str) -> Row:
        """The row for a metric/param key; KeyError naming the key if absent."""
        for r in self.table:
            if r.key == key:
                return r
        raise KeyError(f"no row {key!r} in the comparison")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: runs, baseline id, rows, regressions (with messages), tolerances."""
        return {
            "experiment": self.experiment,
            "runs": [asdict(r) | {"label": r.label} for r in self.runs],
            "baseline": self.baseline.run_id,
            "rows": [asdict(r) for r in self.table],
            "regressions": [asdict(g) | {"message": g.message} for g in self.regressions],
            "tolerances": self.tolerances,
        }

    def to_json(self, indent: int = 2) -> str:
        """`to_dict()` as a JSON string (NaN/inf become null)."""
        return json.dumps(_finite(self.to_dict()), indent=indent, sort_keys=False)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------
# Finding the runs


def _client(tracking_uri: str | None):
    from mlflow.tracking import MlflowClient

    if tracking_uri is None:
        from pfactory.runtime.project import configure_environment

        configure_environment()
        tracking_uri = os.environ["MLFLOW_TRACKING_URI"]
    return MlflowClient(tracking_uri=tracking_uri), tracking_uri


def _quote(value: str) -> str:
    """A value for an MLflow filter string (single or double quotes, whichever is absent)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise CompareError(f"run name {value!r}: cannot contain both ' and \" (MLflow filter syntax)")


def _where(experiment: str) -> str:
    """How an error names the experiments searched."""
    return f"experiment {experiment!r} (and {experiment}/<user>)"


def _resolve(client: Any, experiment_ids: list[str], experiment: str, ref: str) -> Any:
    """A run by id (any run) or by name (the latest pipeline run with that name in `experiment_ids`)."""
    from mlflow.exceptions import MlflowException

    if _RUN_ID.fullmatch(ref):
        try:
            return client.get_run(ref)
        except MlflowException:
            pass  # a 32-hex name is possible: try it as a name
    found = client.search_runs(
        experiment_ids,
        filter_string=f"attributes.run_name = {_quote(ref)} and tags.pipeline = 'true'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not found:
        raise CompareError(
            f"run {ref!r}: no run with that id, and no pipeline run (tag pipeline=true) with that "
            f"name in {_where(experiment)}; list runs with `mlflow ui` or `factory compare`"
        )
    return found[0]


def _latest(client: Any, experiment_ids: list[str], experiment: str, last: int) -> list[Any]:
    """The latest `last` finished pipeline runs of `experiment_ids`, newest first; `NoRunsError` for none."""
    runs = client.search_runs(
        experiment_ids,
        filter_string="tags.pipeline = 'true' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=last,
    )
    if not runs:
        raise NoRunsError(
            f"{_where(experiment)} has no finished pipeline run (tag pipeline=true) to compare; "
            "run `factory run` first"
        )
    return runs


# ---------------------------------------------------------------------------------------------
# Building the table


def _kpi_keys(metric_keys: set[str]) -> tuple[list[str], list[str], set[str]]:
    """(KPI rows in display order, latency rows, the KPI keys that are flagged)."""
    classes = sorted({m.group(1) for k in metric_keys if (m := _CLASS_AP.fullmatch(k))})
    headline = [k for k in HEADLINE_KPIS if k in metric_keys]
    class_ap = [f"eval/{c}/mean_ap" for c in classes]
    delta = ["eval/delta/mAP"] if "eval/delta/mAP" in metric_keys else []
    errors = [f"eval/{c}/{e}" for c in classes for e in TP_ERRORS if f"eval/{c}/{e}" in metric_keys]
    shown = [*headline, *delta, *class_ap, *errors]
    flagged = {*headline, *class_ap}
    latency = [k for k in LATENCY_KEYS if k in metric_keys]
    return shown, latency, flagged


def _time_keys(metric_keys: set[str]) -> list[str]:
    known = [f"time/{s}_s" for s in STAGES]
    extra = sorted(k for k in metric_keys if k.startswith("time/") and k not in known and k != "time/total_s")
    keys = [k for k in (*known, *extra) if k in metric_keys]
    return [*keys, "time/total_s"] if "time/total_s" in metric_keys else keys


def _fmt_time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _check_arguments(last: int, kpi_tolerance: float, time_tolerance: float, min_time_s: float) -> None:
    """`CompareError` naming the first of `compare_runs`'s count and tolerances that is out of range."""
    if last < 1:
        raise CompareError(f"last: expected a run count >= 1, got {last}")
    if not kpi_tolerance >= 0:
        raise CompareError(f"kpi_tolerance: expected an absolute KPI drop >= 0, got {kpi_tolerance}")
    if not time_tolerance >= 1:
        raise CompareError(f"time_tolerance: expected a slow-down ratio >= 1, got {time_tolerance}")
    if not min_time_s >= 0:
        raise CompareError(f"min_time_s: expected seconds >= 0, got {min_time_s}")


def _ordered_runs(
    client: Any,
    experiment: str,
    uri: str,
    run_ids_or_names: Sequence[str] | None,
    baseline: str | None,
    last: int,
) -> tuple[list[Any], int]:
    """The MLflow runs to compare, oldest first (each once, the baseline among them), and the baseline's
    index: the run `baseline` names, else the oldest. Runs named or listed are searched in `experiment` and
    its per-user experiments (`experiment_ids`). `CompareError` for an unknown experiment or run."""
    eid = experiment_ids(client, experiment)
    if not eid:
        raise CompareError(f"experiment {experiment!r}: not found at tracking URI {uri}")

    if run_ids_or_names:
        runs = [_resolve(client, eid, experiment, r) for r in run_ids_or_names]
    else:
        runs = _latest(client, eid, experiment, last)
    base_run = _resolve(client, eid, experiment, baseline) if baseline else None
    by_id = {r.info.run_id: r for r in runs}  # a run named twice is shown once
    if base_run is not None:
        by_id.setdefault(base_run.info.run_id, base_run)
    ordered = sorted(by_id.values(), key=lambda r: (r.info.start_time or 0, r.info.run_id))
    if base_run is None:
        base_run = ordered[0]
    return ordered, [r.info.run_id for r in ordered].index(base_run.info.run_id)


def _fact_rows(refs: list[RunRef], params: list[dict[str, Any]], tags: list[dict[str, Any]]) -> list[Row]:
    """The "run" section: id, start time, user, status, commit, architecture and its source, promotion."""
    n = len(refs)
    table: list[Row] = []

    def facts(key: str, values: list[Any]) -> None:
        table.append(Row("run", key, values, [None] * n, [False] * n))

    facts("run_id", [r.run_id for r in refs])
    facts("started (UTC)", [_fmt_time(r.start_time_ms) for r in refs])
    facts("user", [t.get("pfactory.user") or t.get("mlflow.user") or "-" for t in tags])  # who ran it
    facts("status", [r.status for r in refs])
    commits = []
    for t in tags:
        c = t.get("git.commit")
        commits.append(
            None if c in (None, "None") else c[:10] + ("+dirty" if t.get("git.dirty") == "True" else "")
        )
    facts("git.commit", commits)
    # The architecture and where it came from (built-in, or a plugin's distribution and version): runs of
    # different architectures compare side by side on the same rows.
    facts("model.arch", [p.get("model.arch") or DEFAULT_ARCH for p in params])
    facts("model.source", [p.get("model.plugin.source") or "built-in" for p in params])
    facts("promotion.decision", [t.get("promotion.decision") for t in tags])
    return table


def _section_rows(
    section: str,
    keys: list[str],
    metrics: list[dict[str, float]],
    b: int,
    refs: list[RunRef],
    delta: Callable[[float, float], float | None],
    regressed: Callable[[str, float, float], bool],
    tolerance: float,
) -> tuple[list[Row], list[Regression]]:
    """One section's rows (`b` the baseline's index): per key the values, `delta(value, baseline)` (None: not
    comparable) and the runs `regressed(key, value, baseline)` flags, each also a `Regression`."""
    n = len(refs)
    table: list[Row] = []
    regressions: list[Regression] = []
    for key in keys:
        values = [m.get(key) for m in metrics]
        base = values[b]
        deltas: list[float | None] = [None] * n
        bad = [False] * n
        for i, v in enumerate(values):
            if i == b or v is None or base is None or (d := delta(v, base)) is None:
                continue
            deltas[i] = d
            if regressed(key, v, base):
                bad[i] = True
                regressions.append(Regression(refs[i].run_id, refs[i].label, section, key, base, v, d, tolerance))
        table.append(Row(section, key, values, deltas, bad))
    return table, regressions


def _kpi_rows(
    keys: list[str],
    flagged: set[str],
    metrics: list[dict[str, float]],
    b: int,
    refs: list[RunRef],
    kpi_tolerance: float,
) -> tuple[list[Row], list[Regression]]:
    """The "kpi" section (delta: value - baseline) and its regressions: a `flagged` KPI more than
    `kpi_tolerance` below the baseline's."""
    return _section_rows(
        "kpi", keys, metrics, b, refs,
        delta=lambda v, base: v - base,
        regressed=lambda key, v, base: key in flagged and v < base - kpi_tolerance,
        tolerance=kpi_tolerance,
    )  # fmt: skip


def _ratio_rows(
    section: str,
    keys: list[str],
    floor: float,
    metrics: list[dict[str, float]],
    b: int,
    refs: list[RunRef],
    time_tolerance: float,
) -> tuple[list[Row], list[Regression]]:
    """A "latency" or "time" section (delta: value / baseline, none against a baseline <= 0) and its
    regressions: a duration over `time_tolerance` x the baseline's that also grew by more than `floor`. Only
    durations (`..._s`, `..._ms`) regress; e.g. time/orchestration_fraction is shown."""
    return _section_rows(
        section, keys, metrics, b, refs,
        delta=lambda v, base: v / base if base > 0 else None,
        regressed=lambda key, v, base: key.endswith(("_s", "_ms")) and v > base * time_tolerance and v - base > floor,
        tolerance=time_tolerance,
    )  # fmt: skip


def _param_rows(params: list[dict[str, Any]]) -> list[Row]:
    """The "param" section: the params whose values differ between the runs, sorted by key."""
    n = len(params)
    table: list[Row] = []
    for key in sorted(set().union(*params)):
        values = [p.get(key) for p in params]
        if len(set(values)) > 1:
            table.append(Row("param", key, values, [None] * n, [False] * n))
    return table


def compare_runs(
    run_ids_or_names: Sequence[str] | None = None,
    baseline: str | None = None,
    *,
    last: int = 5,
    experiment: str = EXPERIMENT,
    kpi_tolerance: float = 0.01,
    time_tolerance: float = 1.25,
    min_time_s: float = 1.0,
    tracking_uri: str | None = None,
) -> ComparisonResult:
    """Compare pipeline runs of `experiment` against a baseline run.

    `run_ids_or_names`: MLflow run ids or run names (a name means the latest pipeline run with
    that name); empty/None -> the latest `last` finished pipeline runs. `baseline`: an id or
    name (default: the oldest run shown). Tolerances: a flagged KPI regresses when it drops
    by more than `kpi_tolerance` (absolute); a stage time or latency when it exceeds
    `time_tolerance` x the baseline (stage times also by more than `min_time_s` seconds).
    `tracking_uri`: default `MLFLOW_TRACKING_URI`, else the project's sqlite store.
    Raises `CompareError` naming the run, experiment or argument that is wrong.
    """
    _check_arguments(last, kpi_tolerance, time_tolerance, min_time_s)
    client, uri = _client(tracking_uri)
    ordered, b = _ordered_runs(client, experiment, uri, run_ids_or_names, baseline, last)
    refs = [
        RunRef(r.info.run_id, r.info.run_name or "", int(r.info.start_time or 0), r.info.status)
        for r in ordered
    ]
    metrics = [dict(r.data.metrics) for r in ordered]
    params = [dict(r.data.params) for r in ordered]
    tags = [dict(r.data.tags) for r in ordered]
    metric_keys = set().union(*metrics)

    table = _fact_rows(refs, params, tags)
    kpi_names, latency_names, flagged = _kpi_keys(metric_keys)
    kpi_table, regressions = _kpi_rows(kpi_names, flagged, metrics, b, refs, kpi_tolerance)
    table += kpi_table
    for section, keys, floor in (
        ("latency", latency_names, 0.0),
        ("time", _time_keys(metric_keys), min_time_s),
    ):
        rows, found = _ratio_rows(section, keys, floor, metrics, b, refs, time_tolerance)
        table += rows
        regressions += found
    table += _param_rows(params)

    return ComparisonResult(
        experiment=experiment,
        runs=refs,
        baseline=refs[b],
        table=table,
        regressions=regressions,
        tolerances={"kpi": kpi_tolerance, "time": time_tolerance, "min_time_s": min_time_s},
    )


# ---------------------------------------------------------------------------------------------
# Rendering


def _cell(row: Row, i: int, baseline_index: int) -> str:
    v = row.values[i]
    if v is None:
        return "—"
    if row.section == "run":
        return str(v)[:8] if row.key == "run_id" else str(v)
    if row.section == "param":
        s = str(v)
        return s if len(s) <= 28 else s[:27] + "…"
    if row.section == "kpi":
        text = f"{v:.4f}"
        d = row.deltas[i]
        return text + (f" ({d:+.4f})" if d is not None else " (base)" if i == baseline_index else "")
    unit = " ms" if row.key.endswith("_ms") else " s" if row.key.endswith("_s") else " MiB" if row.key.endswith("_mb") else ""
    text = f"{v:.3g}{unit}" if v < 100 else f"{v:.0f}{unit}"
    d = row.deltas[i]
    return text + (f" (x{d:.2f})" if d is not None else " (base)" if i == baseline_index else "")


def render_table(result: ComparisonResult) -> Any:
    """A `rich.table.Table`: one column per run, sections run/KPIs/latency/stage times/params.

    Regressed cells are bold red; the baseline column is marked "(base)" in its header.
    """
    from rich.table import Table

    b = result.runs.index(result.baseline)
    t = Table(title=f"{result.experiment}: {len(result.runs)} runs vs baseline {result.baseline.label}")
    t.add_column("", style="bold", no_wrap=True)
    for i, r in enumerate(result.runs):
        t.add_column(r.label + (" (base)" if i == b else ""), no_wrap=True)
    titles = {"kpi": "KPIs", "latency": "latency", "time": "stage times", "param": "changed params"}
    for section in SECTIONS:
        rows = result.section(section)
        if not rows:
            continue
        if section != "run":
            t.add_section()
            t.add_row(f"[dim]{titles[section]}[/]", *[""] * len(result.runs))
        for row in rows:
            cells = [
                f"[bold red]{_cell(row, i, b)}[/]" if row.regressed[i] else _cell(row, i, b)
                for i in range(len(result.runs))
            ]
            t.add_row(row.key, *cells)
    return t


def write_chart(result: ComparisonResult, path: str | os.PathLike[str]) -> Path:
    """Write a PNG (atomically): flagged KPIs per run, stage times stacked per run, latency.

    Regressed values get a red edge. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from pfactory.storage.fsutil import atomic_write_bytes

    labels = [r.label for r in result.runs]
    n = len(labels)
    kpis = [r for r in result.section("kpi") if r.key in HEADLINE_KPIS or _CLASS_AP.fullmatch(r.key)]
    # stack the stages only; the total is a marker above, the gap is orchestration overhead
    times = [r for r in result.section("time") if r.key in {f"time/{s}_s" for s in STAGES}]
    total = next((r for r in result.section("time") if r.key == "time/total_s"), None)
    latency = result.section("latency")

    fig, axes = plt.subplots(1, 3, figsize=(6 + 2.2 * n, 4.5), constrained_layout=True)
    cmap = plt.get_cmap("tab10")

    def grouped(ax: Any, rows: list[Row], title: str, ylabel: str) -> None:
        width = 0.8 / max(n, 1)
        for i in range(n):
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(rows))]
            ys = [r.values[i] if r.values[i] is not None else 0.0 for r in rows]
            edges = ["red" if r.regressed[i] else "none" for r in rows]
            ax.bar(xs, ys, width, label=labels[i], color=cmap(i % 10), edgecolor=edges, linewidth=2)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(
            [r.key.removeprefix("eval/").removeprefix("latency/") for r in rows], rotation=30, ha="right"
        )
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if not rows:
            ax.text(0.5, 0.5, "not logged in these runs", ha="center", transform=ax.transAxes)

    grouped(axes[0], kpis, "KPIs (higher is better)", "value")
    # legend patches without the per-bar red edges
    handles = [Patch(color=cmap(i % 10), label=lab) for i, lab in enumerate(labels)]
    axes[0].legend(handles=handles, fontsize="small")

    ax = axes[1]
    bottom = [0.0] * n
    for k, row in enumerate(times):
        ys = [v if v is not None else 0.0 for v in row.values]
        edges = ["red" if f else "none" for f in row.regressed]
        ax.bar(
            range(n),
            ys,
            0.6,
            bottom=bottom,
            color=cmap(k % 10),
            edgecolor=edges,
            linewidth=2,
            label=row.key.removeprefix("time/").removesuffix("_s"),
        )
        bottom = [a + y for a, y in zip(bottom, ys)]
    if total is not None:
        xs = [i for i in range(n) if total.values[i] is not None]
        ax.scatter(xs, [total.values[i] for i in xs], marker="_", s=900, color="black", zorder=3)
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_title("stage times (stacked; bar = total)")
    ax.set_ylabel("s")
    if times:
        stage_handles = [
            Patch(color=cmap(k % 10), label=r.key.removeprefix("time/").removesuffix("_s"))
            for k, r in enumerate(times)
        ]
        ax.legend(handles=stage_handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))

    grouped(axes[2], latency, "latency, batch 1", "ms")
    fig.suptitle(f"{result.experiment} — baseline {result.baseline.label}; red edge = regression")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
