"""The `factory` command line (Typer). Every heavy import happens inside a command.

`factory --help` must answer in well under a second (DESIGN.md §2), so this module imports
only Typer and the standard library at import time; each command imports what it needs.
Exit codes: 0 success, 1 the command ran and found a problem (e.g. a dataset with errors,
a failed gate), 2 bad usage or bad parameters.
"""

from __future__ import annotations

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

SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set-param", "-S", help="Override a parameter, DVC syntax: -S section.key=value (repeatable)."
    ),
]
ParamsOpt = Annotated[Path, typer.Option("--params", help="The params file.")]


def _params(params_file: Path, overrides: list[str] | None):
    """Load params or exit 2 with the validation message (names the key and the expectation)."""
    from pfactory.config import ParamsError, load_params

    try:
        return load_params(params_file, overrides or [])
    except ParamsError as e:
        _fail(str(e), code=2)


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(message, fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _console():
    from rich.console import Console

    return Console(stderr=True)


@app.command("params")
def params_cmd(set_param: SetOpt = None, params_file: ParamsOpt = Path("params.yaml")) -> None:
    """Print the resolved parameters (params.yaml + overrides) as YAML.

    Example: factory params -S prepare.val_fraction=0.25
    """
    from pfactory.config import params_to_yaml

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

    from pfactory.sensors.synth import generate_dataset

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
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the report as JSON here.")
    ] = None,
) -> None:
    """Validate a dataset: every problem with its file, field and what was expected.

    Exit 0 when clean, 1 when not. Example: factory data check ../shared/data/real/kitti
    """
    from pfactory.fsutil import atomic_write_text
    from pfactory.sensors.frame import DatasetError
    from pfactory.sensors.validate import check_dataset, format_report

    try:
        report = check_dataset(root)
    except DatasetError as e:
        _fail(str(e))
    typer.echo(format_report(report))
    if json_out is not None:
        atomic_write_text(json_out, report.to_json())
    raise typer.Exit(0 if report.ok else 1)


@data_app.command("show")
def data_show(
    root: Annotated[Path, typer.Argument(help="Dataset directory.")],
    frame_id: Annotated[str, typer.Argument(help="Frame id (KITTI: 000123; nuScenes: sample token).")],
    out: Annotated[Path, typer.Option(help="Output PNG.")] = Path("frame.png"),
) -> None:
    """Render a frame: camera image(s) with projected 3D boxes and a bird's-eye view.

    Example: factory data show ../shared/data/real/kitti 000001 --out frame.png
    """
    from pfactory.sensors import DatasetError, open_dataset
    from pfactory.sensors.show import render_frame

    try:
        frame = open_dataset(root).read(frame_id)
    except DatasetError as e:
        _fail(str(e))
    typer.echo(str(render_frame(frame, out)))


@app.command("run")
def run_cmd(
    set_param: SetOpt = None,
    name: Annotated[str | None, typer.Option(help="Run name (MLflow run and Prefect flow run).")] = None,
) -> None:
    """Run the whole pipeline (Prefect flow) on params.yaml + overrides, embedded defaults.

    Example: factory run -S data.frames=100 --name smoke
    """
    _params(Path("params.yaml"), set_param)  # refuse bad overrides before anything starts
    from flows.pipeline import pipeline

    result = pipeline(overrides=set_param or [], name=name)
    typer.echo(json.dumps(result, indent=2, sort_keys=True, default=str))


@app.command("prepare")
def prepare_cmd(
    raw: Annotated[
        Path | None, typer.Option(help="Raw dataset (KITTI or nuScenes layout). Default: paths.raw.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output directory for shards. Default: paths.prepared.")
    ] = None,
    set_param: SetOpt = None,
    params_file: ParamsOpt = Path("params.yaml"),
) -> None:
    """Prepare a raw dataset into Parquet shards (+ manifest.json, rejected.jsonl).

    Exit 1 when more than prepare.max_reject_fraction of the frames are refused.
    Example: factory prepare --raw ../shared/data/real/kitti --out /tmp/prepared
    """
    params = _params(params_file, set_param)
    from pfactory.tracking import configure_environment

    configure_environment()
    import tasks.prepare
    from pfactory.data.errors import RejectFractionExceeded
    from pfactory.sensors.frame import DatasetError

    try:
        metrics = tasks.prepare.run(params, raw or Path(params.paths.raw), out or Path(params.paths.prepared))
    except (DatasetError, RejectFractionExceeded) as e:
        _fail(str(e))
    typer.echo(json.dumps(metrics, indent=2, sort_keys=True, default=str))


@app.command("train")
def train_cmd(
    data: Annotated[Path | None, typer.Option(help="Prepared shards. Default: paths.prepared.")] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Model output directory (resumes from its checkpoint). Default: paths.model."),
    ] = None,
    set_param: SetOpt = None,
    params_file: ParamsOpt = Path("params.yaml"),
) -> None:
    """Train the detector; resumes when OUT holds a checkpoint. Multi-process: torchrun -m tasks.train.

    Example: factory train --data artifacts/prepared --out artifacts/model -S train.epochs=2
    """
    params = _params(params_file, set_param)
    from pfactory.tracking import configure_environment

    configure_environment()
    import tasks.train

    summary = tasks.train.run(params, data or Path(params.paths.prepared), out or Path(params.paths.model))
    typer.echo(
        json.dumps({k: v for k, v in summary.items() if k != "val"}, indent=2, sort_keys=True, default=str)
    )


@app.command("profile")
def profile_cmd(
    what: Annotated[str, typer.Argument(help="What to profile: train.")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps to trace.")] = 5,
    data: Annotated[Path | None, typer.Option(help="Prepared shards. Default: paths.prepared.")] = None,
    out: Annotated[Path, typer.Option(help="Trace output directory.")] = Path("artifacts/profile"),
    set_param: SetOpt = None,
    params_file: ParamsOpt = Path("params.yaml"),
) -> None:
    """Write a torch.profiler trace (Chrome/Perfetto JSON) and print the top ops.

    Example: factory profile train --steps 5
    """
    if what != "train":
        _fail(f"can only profile 'train', got {what!r}", code=2)
    params = _params(params_file, set_param)
    from pfactory.tracking import configure_environment

    configure_environment()
    import tasks.train

    typer.echo(str(tasks.train.profile_train(params, data or Path(params.paths.prepared), steps, out)))


@app.command("optimize")
def optimize_cmd(
    model: Annotated[Path | None, typer.Option(help="Trained model directory. Default: paths.model.")] = None,
    data: Annotated[
        Path | None,
        typer.Option(help="Prepared shards (calibration + parity frames). Default: paths.prepared."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory. Default: paths.optimized.")] = None,
    backend: Annotated[str, typer.Option(help="auto | onnxruntime | tensorrt")] = "auto",
    precision: Annotated[
        str | None, typer.Option(help="fp32 | fp16 | int8 (default: optimize.precision)")
    ] = None,
    set_param: SetOpt = None,
    params_file: ParamsOpt = Path("params.yaml"),
) -> None:
    """Export one ONNX graph (points + images -> boxes), build the backend, gate on parity, time it.

    Exit 1 when parity is outside optimize.parity. Example: factory optimize --backend onnxruntime --precision int8
    """
    params = _params(params_file, set_param)
    from pfactory.tracking import configure_environment

    configure_environment()
    import tasks.optimize
    from pfactory.inference import BackendUnavailable, ParityError

    try:
        metrics = tasks.optimize.run(
            params,
            model or Path(params.paths.model),
            data or Path(params.paths.prepared),
            out or Path(params.paths.optimized),
            backend=backend,
            precision=precision,
        )
    except ParityError as e:
        _fail(f"optimize: {e}")
    except BackendUnavailable as e:
        _fail(f"optimize: {e}", code=2)
    typer.echo(json.dumps(metrics, indent=2, sort_keys=True, default=str))


@app.command("kpi")
def kpi_cmd(
    gt: Annotated[Path, typer.Option(help="KITTI label_2 directory (ground truth).")],
    pred: Annotated[Path, typer.Option(help="KITTI result directory (label_2 columns + score).")],
    out: Annotated[Path | None, typer.Option(help="Write the KPI JSON here.")] = None,
    set_param: SetOpt = None,
    params_file: ParamsOpt = Path("params.yaml"),
) -> None:
    """Detection KPIs (nuScenes AP at 0.5/1/2/4 m, ATE/ASE/AOE, per class and range) from KITTI files.

    Example: factory kpi --gt data/label_2 --pred results/ --out kpis.json
    """
    from pfactory.metrics.kpi_cli import format_kpi_table, run_kpi
    from pfactory.sensors.frame import DatasetError

    _params(params_file, set_param)  # validates overrides even though kpi uses library defaults
    try:
        result = run_kpi(gt, pred, out)
    except DatasetError as e:
        _fail(str(e))
    typer.echo(format_kpi_table(result))


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_cmd(
    ctx: typer.Context,
    name: Annotated[
        str,
        typer.Argument(
            help="Benchmark: benchmarks/bench_<name>.py (cli, kernels, kpi, prepare, synth, ...)."
        ),
    ],
) -> None:
    """Run a side-by-side benchmark (extra arguments go to it; see its --help).

    Example: factory bench kernels --device cpu --quick
    """
    import subprocess

    from pfactory.tracking import configure_environment, project_root

    root = project_root()
    script = root / "benchmarks" / f"bench_{name}.py"
    if not script.is_file():
        known = sorted(p.stem.removeprefix("bench_") for p in (root / "benchmarks").glob("bench_*.py"))
        _fail(f"no benchmark {name!r} in {root / 'benchmarks'}; known: {', '.join(known)}", code=2)
    configure_environment(root)
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args], cwd=root))


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
