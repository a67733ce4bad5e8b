"""The `factory` command line (Typer), the top of the stack (cli -> flows -> tasks -> pfactory -> kernels).

Every heavy import happens inside a command. The stage commands (`prepare`, `train`, `optimize`, `evaluate`,
`promote`) are built from the stage's declared options (`tasks/_command.py`, `factory/stage_cli.py`) and run the
stage's own body through `tasks._stage.run_stage`, which decides the default paths, what is printed and the
exit code, exactly as `python -m tasks.<stage>` (dvc.yaml) does.

`factory --help` must answer in well under a second (DESIGN.md §2), so this module imports
only Typer and the standard library at import time; each command imports what it needs.
Exit codes: 0 success, 1 the command ran and found a problem (e.g. a dataset with errors,
a failed gate), 2 bad usage or bad parameters.
"""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="factory",
    help="perception-factory: annotated camera + lidar logs in, a verified 3D detector out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
data_app = typer.Typer(
    help="Make, validate and look at raw datasets (KITTI / nuScenes layouts).", no_args_is_help=True
)
app.add_typer(data_app, name="data")
from factory.team import team_app  # noqa: E402 (Typer only: `factory team ...`, factory/team.py)

app.add_typer(team_app, name="team")
from factory.worker import worker_app  # noqa: E402 (`factory worker start --pool NAME`, factory/worker.py)

app.add_typer(worker_app, name="worker")

from factory.stage_cli import ParamsOpt, SetOpt  # noqa: E402 (every command's -S and --params, declared once)


def _stage_names() -> tuple[str, ...]:
    """The stages the project's dvc.yaml declares (found from the cwd; else the installed one's), so that
    `--until` is a choice list checked before anything heavy is imported."""
    from pfactory.runtime.project import project_root
    from pfactory.storage.dag import stage_names

    try:
        return stage_names(project_root())
    except FileNotFoundError:
        return stage_names()


Stage = enum.Enum("Stage", {name: name for name in _stage_names()}, type=str)


def _params(params_file: Path | None, overrides: list[str] | None):
    """Load params (`--params`, else the project's params.yaml: `tracking.params_path`, the stage entries'
    resolver too) or exit 2 with the validation message (names the key and the expectation). Their `paths`
    are made relative to the params file's folder (the project root) when the command runs elsewhere."""
    from flows.params import ParamsError, anchored, load_params
    from pfactory.runtime.project import params_path

    path = params_path(params_file)
    try:
        return anchored(load_params(path, overrides or []), path.parent)
    except ParamsError as e:
        _fail(str(e), code=2)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _console():
    from rich.console import Console

    return Console(stderr=True)


@app.command("params")
def params_cmd(set_param: SetOpt = None, params_file: ParamsOpt = None) -> None:
    """Print the resolved parameters (params.yaml + overrides) as YAML.

    Example: factory params -S prepare.val_fraction=0.25
    """
    from flows.params import params_to_yaml

    typer.echo(params_to_yaml(_params(params_file, set_param)), nl=False)


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, typer.Option(help="Output dataset directory.")],
    frames: Annotated[int, typer.Option(min=1, help="Number of frames.")] = 250,
    seed: Annotated[int, typer.Option(help="Random seed: same seed -> byte-identical files.")] = 0,
    cameras: Annotated[int, typer.Option(min=1, max=6, help="1: KITTI layout; >1: nuScenes layout.")] = 1,
    workers: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 2,
) -> None:
    """Generate a synthetic camera + lidar dataset (KITTI layout, or nuScenes with --cameras > 1).

    Example: factory data synth --out artifacts/data/raw/synth --frames 200 --seed 0
    """
    from rich.progress import Progress

    from pfactory.synth.dataset import generate_dataset

    with Progress(console=_console(), transient=True) as bar:
        task = bar.add_task("synth", total=frames)
        summary = generate_dataset(
            out,
            frames=frames,
            seed=seed,
            cameras=cameras,
            workers=workers,
            progress=lambda n: bar.update(task, completed=n),
        )
    typer.echo(json.dumps(summary, indent=2, sort_keys=True, default=str))


@data_app.command("check")
def data_check(
    root: Annotated[Path, typer.Argument(help="Dataset directory (KITTI or nuScenes layout).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of text.")] = False,
    set_param: SetOpt = None,
    params_file: ParamsOpt = None,
) -> None:
    """Validate a dataset: every problem with its file, field and what was expected.

    Also refuses what `factory prepare` would, with the same prepare parameters (params.yaml and -S):
    fewer than prepare.min_points points, or fewer inside prepare.pc_range.
    Exit 0 when clean, 1 when not. Examples: factory data check ../shared/data/real/kitti  |
    factory data check DIR --json > report.json
    """
    from pfactory.sensors.errors import DatasetError
    from pfactory.sensors.validate import check_dataset, format_report

    prepare = _params(params_file, set_param).prepare
    try:
        report = check_dataset(root, min_points=prepare.min_points)
        if report.frames_ok:
            from pfactory.prepare.stage import roi_problems
            from pfactory.sensors.datasets import open_dataset

            roi = roi_problems(open_dataset(root), report.frames_ok, prepare)
            report.problems += roi
            report.frames_ok = [f for f in report.frames_ok if f not in {p["frame_id"] for p in roi}]
    except DatasetError as e:
        _fail(str(e))
    typer.echo(report.to_json() if json_out else format_report(report))
    raise typer.Exit(0 if report.ok else 1)


@data_app.command("show")
def data_show(
    root: Annotated[
        Path | None, typer.Argument(help="Dataset directory. Default: paths.raw (the project's dataset).")
    ] = None,
    frame_id: Annotated[
        str | None,
        typer.Argument(help="Frame id (KITTI: 000123; nuScenes: sample token). Default: the first frame."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Output PNG.")] = Path("frame.png"),
) -> None:
    """Render a frame: camera image(s) with projected 3D boxes and a bird's-eye view.

    Examples: factory data show  |  factory data show ../shared/data/real/kitti 000001 --out frame.png
    """
    from pfactory.sensors.datasets import open_dataset
    from pfactory.sensors.errors import DatasetError
    from pfactory.sensors.show import render_frame

    if root is None:
        root = Path(_params(None, None).paths.raw)
        if not root.is_dir():
            _fail(f"data show: no dataset at {root} (paths.raw); run `factory run` or pass DIR [FRAME_ID]", code=2)
    try:
        dataset = open_dataset(root)
        if frame_id is None:
            ids = dataset.frame_ids()
            if not ids:
                _fail(f"data show: {root} has no frames", code=2)
            frame_id = ids[0]
        frame = dataset.read(frame_id)
    except DatasetError as e:
        _fail(str(e))
    typer.echo(str(render_frame(frame, out)))


@app.command("run")
def run_cmd(
    set_param: SetOpt = None,
    name: Annotated[str | None, typer.Option(help="Run name (MLflow run and Prefect flow run).")] = None,
    until: Annotated[
        Stage | None, typer.Option(help="Stop after this stage (the stages dvc.yaml declares).")
    ] = None,
    checkout: Annotated[
        bool,
        typer.Option(
            "--checkout/--no-checkout",
            help="On success, copy the run's outputs to the project's own paths (params.yaml paths), so "
            "follow-up commands (factory evaluate, data show, ...) use them by default.",
        ),
    ] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the full result as JSON.")] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue an interrupted run in its own workspace (finished stages stay, train resumes from "
            "its checkpoint, its MLflow run and DVC experiment): RUN (a run id or --name), else the newest.",
        ),
    ] = False,
    run: Annotated[
        str | None, typer.Argument(help="With --resume: the run to continue (id or name).")
    ] = None,
) -> None:
    """Run the whole pipeline: a Prefect flow running the dvc.yaml stages in a fresh run workspace
    (artifacts/runs/<run id>), one MLflow run with lineage, gated promotion. Embedded defaults: synthetic
    data, local Prefect, sqlite MLflow, local DVC cache, local Dask. Live progress on stderr.

    Exit codes: 0 done (a refused promotion is a result, not a failure); 1 a stage failed; 2 bad usage or
    parameters; 3 a local service (Prefect API, MLflow store) did not start; 75 a transient failure that
    outlived its retries. A failure prints one screen: stage, reason, log path, what to try.
    Example: factory run -S train.epochs=5 --name five-epochs;  factory run --resume  (the newest interrupted run)
    """
    import time

    t0 = time.perf_counter()
    _params(None, set_param)  # refuse bad overrides before anything starts
    from factory.run import run_command

    declared = list(_stage_names())  # not flows.pipeline's STAGES: Prefect is imported once its API is booting
    stages = declared[: declared.index(until.value) + 1] if until is not None else None
    if run is not None and not resume:
        _fail(f"run: {run!r}: a run to continue is given with --resume (factory run --resume {run})", code=2)
    if resume and set_param:
        _fail("run --resume: continues the run with its own params; -S overrides are refused", code=2)
    code = run_command(
        set_param or [], name=name, stages=stages, json_out=json_out, started=t0, checkout=checkout,
        resume=(run or "") if resume else None,
    )  # fmt: skip
    raise typer.Exit(code)


from factory import stage_cli as _stage_cli  # noqa: E402 - `factory prepare|train|optimize|evaluate|promote`

_stage_cli.register(app)


@app.command("profile")
def profile_cmd(
    what: Annotated[str, typer.Argument(help="What to profile: train.")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps to trace.")] = 5,
    data: Annotated[Path | None, typer.Option(help="Prepared shards. Default: paths.prepared.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Trace output directory. Default: <paths.artifacts>/profile.")
    ] = None,
    set_param: SetOpt = None,
    params_file: ParamsOpt = None,
) -> None:
    """Write a torch.profiler trace (Chrome/Perfetto JSON) and print the top ops.

    Example: factory profile train --steps 5
    """
    if what != "train":
        _fail(f"can only profile 'train', got {what!r}", code=2)
    params = _params(params_file, set_param)
    data = data or Path(params.paths.prepared)
    if not (data / "manifest.json").is_file():
        _fail(
            f"profile: no prepared data at {data} (manifest.json); run `factory run` (or `factory run --until "
            "prepare`) first, or pass --data DIR",
            code=2,
        )
    from pfactory.runtime.project import configure_environment

    configure_environment()
    from pfactory.train.profile import profile_train

    out = out or Path(params.paths.artifacts) / "profile"
    typer.echo(str(profile_train(params, data, steps, out)))


@app.command("kpi")
def kpi_cmd(
    gt: Annotated[Path, typer.Option(help="KITTI label_2 directory (ground truth).")],
    pred: Annotated[Path, typer.Option(help="KITTI result directory (label_2 columns + score).")],
    out: Annotated[Path | None, typer.Option(help="Write the KPI JSON here.")] = None,
    frame_score_threshold: Annotated[
        float | None,
        typer.Option(
            "--frame-score-threshold",
            help="Per-frame counts and the error breakdown use detections scoring >= this "
            "(evaluate.frame_score_threshold; default 0.3).",
        ),
    ] = None,
    metrics: Annotated[
        str, typer.Option(help="nuscenes | kitti (KITTI's official AP) | all | auto: nuscenes, + kitti when the labels have 2D boxes.")
    ] = "auto",
    frames: Annotated[Path | None, typer.Option(help="Score only the frame ids listed here (one a line, like KITTI's val.txt).")] = None,
    set_param: SetOpt = None,
    params_file: ParamsOpt = None,
) -> None:
    """Detection KPIs (nuScenes AP at 0.5/1/2/4 m, ATE/ASE/AOE, per class and range) and the error
    breakdown (tp, duplicate, classification, localization, both, background, missed) from KITTI files;
    KITTI's official metric (3D / BEV / 2D AP and AOS, R40 and R11, easy / moderate / hard: docs/KPIS.md).

    Scored as the evaluate stage scores: its range buckets (evaluate.range_edges_m) and frame score threshold,
    from params.yaml when -S or --params is given (else their defaults, without loading params).
    Example: factory kpi --gt data/label_2 --pred results/ --out kpis.json --frame-score-threshold 0.5
    Example: factory kpi --gt raw/training/label_2 --pred artifacts/eval/kitti_results --frames artifacts/eval/kitti_frames.txt --metrics kitti
    """
    from pfactory.metrics.kpi_cli import format_kpi_table, run_kpi
    from pfactory.sensors.errors import DatasetError

    scoring: dict[str, object] = {}
    if set_param or params_file is not None:  # only then: loading params costs ~0.3 s of imports
        ev = _params(params_file, set_param).evaluate
        scoring = {"range_buckets_m": ev.range_buckets_m, "frame_score_threshold": ev.frame_score_threshold}
    if frame_score_threshold is not None:
        scoring["frame_score_threshold"] = frame_score_threshold
    try:
        result = run_kpi(gt, pred, out, **scoring, metrics=metrics, frames=frames)
    except DatasetError as e:
        _fail(str(e))
    except ValueError as e:  # bad KpiParams (e.g. a non-finite threshold)
        _fail(str(e), code=2)
    typer.echo(format_kpi_table(result))


@app.command("report")
def report_cmd(
    source: Annotated[
        str | None,
        typer.Argument(help="RUN_ID | pipeline run name | MODEL@ALIAS | EVAL_DIR (default: paths.eval)."),
    ] = None,
    out: Annotated[Path, typer.Option(help="The HTML file to write.")] = Path("report.html"),
    vs: Annotated[
        str,
        typer.Option(
            help="Deltas against: champion (the registry's), none, or a RUN / MODEL@ALIAS / EVAL_DIR."
        ),
    ] = "champion",
    optimized: Annotated[
        Path | None, typer.Option(help="Optimize output (default: beside EVAL_DIR).")
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="Prepared data, for the worst frames (default: beside EVAL_DIR).")
    ] = None,
    worst: Annotated[int, typer.Option(min=0, help="How many worst frames to draw.")] = 6,
    set_param: SetOpt = None,
    params_file: ParamsOpt = None,
) -> None:
    """Write one self-contained HTML run report: KPIs and deltas vs the champion, per-class x range tables,
    the error breakdown, PR curves, the worst frames (camera + BEV), calibration, parity and latency.

    Examples: factory report --out report.html  |  factory report pfactory-detector@champion --vs none
    """
    params = _params(params_file, set_param)
    from pfactory.report.run import ReportError, make_report

    try:
        inputs, _ = make_report(
            source or str(params.paths.eval), out, vs, optimized, data,
            params.promote.model_name, params.promote.alias, worst,
        )  # fmt: skip
    except ReportError as e:
        _fail(f"report: {e}", code=2)
    for note in inputs.notes:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    typer.echo(f"report: {out} ({out.stat().st_size / 1e6:.1f} MB; baseline: "
               f"{inputs.baseline.label if inputs.baseline else 'none'})")  # fmt: skip


@app.command("compare")
def compare_cmd(
    runs: Annotated[
        list[str] | None,
        typer.Argument(help="Run ids or run names (default: the latest --last finished pipeline runs)."),
    ] = None,
    baseline: Annotated[
        str | None, typer.Option(help="Run id or name to compare against (default: the oldest shown).")
    ] = None,
    last: Annotated[int, typer.Option(min=1, help="How many recent runs when no RUN is given.")] = 5,
    experiment: Annotated[str, typer.Option(help="MLflow experiment.")] = "perception-factory",
    kpi_tolerance: Annotated[
        float, typer.Option(min=0.0, help="Flag a KPI (mAP, NDS, class AP) drop beyond this (absolute).")
    ] = 0.01,
    time_tolerance: Annotated[
        float, typer.Option(min=1.0, help="Flag a stage time / latency beyond this x the baseline.")
    ] = 1.25,
    png: Annotated[Path | None, typer.Option(help="Also write a PNG chart of KPIs and stage times.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of the table.")] = False,
    fail_on_regression: Annotated[
        bool, typer.Option(help="Exit 1 when a regression is flagged (for CI / schedules).")
    ] = False,
) -> None:
    """Compare pipeline runs: KPIs, changed params, stage timings, deltas vs a baseline, regressions.

    Examples: factory compare  |  factory compare smoke tuned --baseline smoke --png cmp.png
    """
    from pfactory.report.compare import CompareError, NoRunsError, compare_runs, render_table, write_chart

    try:
        result = compare_runs(
            runs or None,
            baseline,
            last=last,
            experiment=experiment,
            kpi_tolerance=kpi_tolerance,
            time_tolerance=time_tolerance,
        )
    except NoRunsError as e:
        _fail(str(e), code=1)
    except CompareError as e:
        _fail(str(e), code=2)
    if png is not None:
        write_chart(result, png)
    if as_json:
        typer.echo(result.to_json())
    else:
        from rich.console import Console

        console = Console()
        console.print(render_table(result))
        for r in result.regressions:
            console.print(f"[bold red]regression[/] {r.message}", highlight=False)
        if not result.regressions:
            console.print("no regressions beyond the tolerances")
        if png is not None:
            console.print(f"chart: {png}")
    if fail_on_regression and result.regressions:
        raise typer.Exit(1)


@app.command("deploy")
def deploy_cmd(
    cron: Annotated[
        str | None,
        typer.Option(help='Cron schedule: "minute hour day month weekday", e.g. "0 3 * * *" (optional with --pool).'),
    ] = None,
    name: Annotated[
        str, typer.Option(help="Deployment name (address: FLOW/NAME; the pipeline's: perception-factory/NAME).")
    ] = "nightly",
    timezone: Annotated[str, typer.Option(help="IANA time zone the cron is read in.")] = "UTC",
    set_param: SetOpt = None,
    flow: Annotated[
        str | None,
        typer.Option(
            "--flow",
            metavar="ENTRYPOINT",
            help="The flow to schedule, path/to/file.py:flow_fn (or module.path:flow_fn). "
            "Default: the pipeline, flows/pipeline.py:pipeline.",
        ),
    ] = None,
    parameters: Annotated[
        str | None,
        typer.Option(
            "--parameters",
            metavar="JSON",
            help="The flow's default parameters as a JSON object, e.g. '{\"checkout\": false}'. For the "
            "pipeline, its overrides come from -S, not from here; -S is for the pipeline only.",
        ),
    ] = None,
    serve: Annotated[
        bool,
        typer.Option("--serve/--print-only", help="Serve (long-running) or only print the deployment."),
    ] = True,
    pool: Annotated[
        str | None,
        typer.Option(help="Deploy to this work pool (workers: factory worker start), code from git at HEAD."),
    ] = None,
    git_remote: Annotated[str, typer.Option(help="With --pool: the git remote workers clone.")] = "origin",
    run_now: Annotated[bool, typer.Option("--run-now", help="With --pool: also start one run now.")] = False,
) -> None:
    """Schedule the pipeline (or any flow: --flow): a Prefect deployment on a cron schedule, served from here.

    Needs a Prefect server (PREFECT_API_URL). --pool NAME: deploy to a work pool instead (workers: `factory worker
    start`), code from git at HEAD (docs/OPERATIONS.md, "Workers on other hosts"); or prefect.yaml.
    Example: factory deploy --cron "0 3 * * *" -S train.epochs=20
    """
    from flows.deploy import (
        PIPELINE_ENTRYPOINT,
        DeployError,
        deployment_parameters,
        is_pipeline,
        load_flow,
        make_spec,
        parse_parameters,
    )
    from flows.deploy import serve as serve_flow

    try:
        if flow is None or flow == PIPELINE_ENTRYPOINT:
            from flows.pipeline import pipeline as the_flow  # imported: works from any folder of the project
        else:
            the_flow = load_flow(flow)
        if is_pipeline(the_flow):
            _params(None, set_param)  # refuse bad overrides before deploying them
        spec = make_spec(
            the_flow,
            name=name,
            cron=cron,
            timezone=timezone,
            parameters=deployment_parameters(
                the_flow, overrides=set_param, parameters=parse_parameters(parameters)
            ),
            entrypoint=flow or PIPELINE_ENTRYPOINT,
        )
        if pool is not None or run_now:  # a work pool, code from git (flows/deploy.py: deploy_to_pool)
            from flows.deploy import deploy_to_pool, git_source
            from pfactory.runtime.project import project_root

            if pool is None:
                raise DeployError("--run-now: only with --pool NAME (a served deployment runs here)")
            source = git_source(project_root(), git_remote)
            out = spec.to_dict() | {"pool": pool, "remote": source.url, "commit": source.commit}
            typer.echo(json.dumps(deploy_to_pool(spec, source, pool, run_now) if serve else out, indent=2))
            return
        if not serve:
            typer.echo(json.dumps(spec.to_dict(), indent=2))
            return
        serve_flow(the_flow, spec)
    except DeployError as e:
        _fail(str(e), code=2)


@app.command("rollback")
def rollback_cmd(
    to: Annotated[
        int | None,
        typer.Option(help="Version to restore (default: the previous champion per the audit trail)."),
    ] = None,
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the audit record).")] = None,
    release: Annotated[Path | None, typer.Option(help="Release folder. Default: paths.release.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    set_param: SetOpt = None,
    params_file: ParamsOpt = None,
) -> None:
    """Move the champion alias back to the previous champion (audited; a second rollback undoes it).

    Exit 1 when there is nothing to roll back to. Examples: factory rollback --reason "pedestrian misses"  |
    factory rollback --to 2 --json
    """
    params = _params(params_file, set_param)
    from pfactory.promote import RegistryError
    from pfactory.promote.promotion import rollback

    try:
        result = rollback(params.promote, release or Path(params.paths.release), to=to, reason=reason)
    except RegistryError as e:
        _fail(f"rollback: {e}")
    if as_json:
        typer.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
        return
    from rich.console import Console

    from pfactory.promote.report import rollback_view

    Console().print(rollback_view(result))


@app.command("lineage")
def lineage_cmd(
    ref: Annotated[
        str | None,
        typer.Argument(
            help="MODEL[@ALIAS], MODEL/VERSION or a version number. Default: promote.model_name@alias, else "
            "(no champion yet) the version the last `factory run` registered."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    set_param: SetOpt = None,
    params_file: ParamsOpt = None,
) -> None:
    """Where a registered model came from: version -> run -> commit, data hashes, params, KPIs, audit.

    Examples: factory lineage  |  factory lineage pfactory-detector@champion --json  |  factory lineage 3
    """
    params = _params(params_file, set_param)
    from pfactory.promote import RegistryError
    from pfactory.promote.promotion import lineage

    p = params.promote
    try:
        result = lineage(ref or f"{p.model_name}@{p.alias}", p.model_name, p.alias)
    except RegistryError as e:
        from pfactory.storage import artifacts as af

        last = (af.promotion(Path(params.paths.artifacts)) or {}).get("version")
        if ref is not None or last is None:
            _fail(f"lineage: {e}; pass MODEL/VERSION or a version number", code=2)
        # No champion yet: the version the last `factory run` registered (<paths.artifacts>/promotion.json).
        _console().print(f"no {p.alias} yet: showing v{last}, registered by the last factory run", highlight=False)
        result = lineage(str(last), p.model_name, p.alias)
    if as_json:
        typer.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
        return
    from rich.console import Console

    from pfactory.promote.report import lineage_view

    console = Console()
    for table in lineage_view(result):
        console.print(table)


@app.command("models")
def models_cmd(
    name: Annotated[
        str | None, typer.Argument(help="An architecture: print its params section's defaults as YAML.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The installed detector architectures (`model.arch`): name, entry point, where it comes from.

    Built-ins and installed plugin packages register through the entry-point group `pfactory.models`
    (docs/MODELS.md); a plugin that fails to load is listed with its error. Examples: factory models  |
    factory models painted_pillars  |  factory run -S model.arch=NAME
    """
    from pfactory.detectors import registry

    if name is not None:
        import yaml

        arch, info = registry.architecture(name)  # a broken or unknown one: one line, exit 2 (main)
        section = {"model": {"arch": name, name: arch.params().model_dump(mode="json")}}
        typer.echo(f"# {info.label}\n# {arch.description}\n" + yaml.safe_dump(section, sort_keys=False), nl=False)
        return
    _print_listing(registry.listing(), "pfactory.models", as_json)


@app.command("doctor")
def doctor_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Run every self-check of the fast paths on this machine (Triton and C kernels, DALI's GPU decode, a
    CUDA bf16 step) and print path, device, verified / failed / skipped and why, with the figures.

    A failed path is bypassed wherever the factory would use it (docs/GPU.md). Exit 1 when one failed.
    Examples: factory doctor  |  factory doctor --json
    """
    import json

    from factory import doctor

    rows = doctor.run_checks(rerun=True)
    typer.echo(json.dumps(rows, indent=2) if as_json else doctor.table(rows))
    if any(r["status"] == "failed" for r in rows):
        raise typer.Exit(1)


def _print_listing(rows: list, group: str, as_json: bool) -> None:
    """`factory models` / `factory datasets`: JSON, or one aligned line a plugin (`plugins.format_rows`)."""
    from pfactory.config import plugins

    if as_json:
        typer.echo(json.dumps([vars(r) for r in rows], indent=2))
        return
    for line in plugins.format_rows(rows, group):
        typer.echo(line)


@app.command("datasets")
def datasets_cmd(
    name: Annotated[str | None, typer.Argument(help="A layout: load it and print what a root of it holds.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The installed raw dataset layouts, in the order a root is offered to them: name, entry point, source.

    Built-ins and installed plugin packages register through the entry-point group `pfactory.datasets`
    (docs/DATASETS.md); a plugin that fails to load is listed with its error. Examples: factory datasets  |
    factory datasets folder
    """
    from pfactory.sensors import datasets

    if name is not None:
        cls, info = datasets.reader_class(name)  # a broken or unknown one: one line, exit 2 (main)
        typer.echo(f"{info.name}  {info.target}  {info.source}\n{cls.describe}")
        return
    _print_listing(datasets.listing(), "pfactory.datasets", as_json)


@app.command(
    "bench",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def bench_cmd(
    ctx: typer.Context,
    name: Annotated[
        str | None,
        typer.Argument(
            help="Benchmark: benchmarks/bench_<name>.py (cli, kernels, kpi, prepare, synth, ...)."
        ),
    ] = None,
) -> None:
    """Run a side-by-side benchmark; every other argument goes to it (`factory bench NAME --help`: its options).

    Example: factory bench kernels --device cpu --quick
    """
    import subprocess

    from pfactory.runtime.project import configure_environment, project_root

    root = project_root()
    known = sorted(p.stem.removeprefix("bench_") for p in (root / "benchmarks").glob("bench_*.py"))
    if name is None or name in ("--help", "-h"):
        typer.echo(ctx.get_help())
        typer.echo(f"\nBenchmarks: {', '.join(known)} (factory bench NAME --help shows each one's options)")
        raise typer.Exit(0 if name else 2)
    script = root / "benchmarks" / f"bench_{name}.py"
    if not script.is_file():
        _fail(f"no benchmark {name!r} in {root / 'benchmarks'}; known: {', '.join(known)}", code=2)
    configure_environment(root)
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args], cwd=root))


from factory import gc as _gc  # noqa: E402 - `factory gc`, `factory disk` (imports only Typer here)

_gc.register(app)


def main() -> None:
    """Console-script entry point: an error the user can act on (a bad input, parameter or output path, a
    full disk: `pfactory.runtime.failures.explain`) is one red line and its exit code, not a traceback. As the
    process's own entry, a command that succeeded exits without the interpreter's teardown, after its `atexit`
    handlers (`pfactory.runtime.quick_exit`: ~1.5 s after `factory run`)."""
    from pfactory.runtime.quick_exit import for_program

    quick = for_program(main)  # first: its handler runs after those of whatever the command imports
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit as e:  # a command that succeeded ends without the interpreter's teardown
        if quick is not None and e.code in (0, None):
            quick.finished()
        raise
    except Exception as e:
        from pfactory.runtime.failures import explain

        known = explain(e)
        if known is None:
            raise
        typer.secho(known.reason, fg=typer.colors.RED, err=True)
        sys.exit(known.code)


if __name__ == "__main__":
    main()
