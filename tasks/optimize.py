"""The `optimize` stage: a trained detector -> production artifacts + evidence of parity and speed.

Files in:  `model_dir` (`paths.model`: model.pt + model_config.json), `data` (`paths.prepared`: the train
           split feeds INT8 calibration, the held-out split feeds parity and latency).
Files out (`out` = `paths.optimized`, built in a temporary sibling and renamed into place on success):
    model.onnx                    whole detector, padded points -> decoded boxes (scatter + decode inside)
    onnxruntime/model.fp32.onnx   graph-optimized FP32
    onnxruntime/model.int8.onnx   static INT8 QDQ (precision int8), + onnxruntime/calibration.json
    aoti/model.fp32.pt2           AOTInductor package (optimize.aoti.enabled, backend auto | aoti)
    tensorrt/model.<prec>.plan    TensorRT engine (backend tensorrt), + timing.cache, calibration.cache
    parity.json                   every artifact vs PyTorch on held-out frames; the gate verdicts
    latency.json                  p50/p95/p99 + throughput at each batch size, PyTorch eager included
    backend.json                  manifest: artifacts, sha256 of every file, I/O, versions
Metrics back: parity and latency figures, speedups vs eager, step timings (also logged to MLflow with the
files and their sha256).
An artifact outside `optimize.parity` while the ONNX Runtime FP32 artifact passes is refused (not shipped) and
the stage ships what passed, saying so (stderr, backend.json "selection"."fallback", parity.json "refused",
MLflow tags `optimize.shipped` / `optimize.fallback`). Fails with `ParityError` (exit 1 from the CLI) only when
no artifact passes (FP32 failing: the export itself is wrong); nothing is written to `out` then, and the report
is kept next to it as `<out>.parity-failed.json`.

Run: `python -m tasks.optimize [-S optimize.precision=fp32 ...]` (DVC; paths from params.yaml) or
`factory optimize --model DIR --data DIR --out DIR [--backend ...] [--precision ...]`.
The work: `pfactory.optimize.stage`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks._command import Command, Option

STAGE = "optimize"


def sections() -> Mapping[str, type]:
    """What this stage reads of params.yaml (besides `paths`): `evaluate` only through its view (the score cut)."""
    from pfactory.metrics.cut import DetectionCut
    from pfactory.optimize.params import OptimizeParams

    return {"optimize": OptimizeParams, "evaluate": DetectionCut}


def run(
    params: Any,
    model_dir: Path,
    data: Path,
    out: Path,
    backend: str = "auto",
    precision: str | None = None,
    track: bool = True,
) -> dict[str, Any]:
    """Build `out` from `model_dir` (module docstring); returns the metrics. Raises ParityError on a failed gate.

    `backend`/`precision` override `optimize.backend`/`optimize.precision` (None/"auto" = from params).
    """
    from pfactory.config.section import section_of
    from pfactory.metrics.cut import DetectionCut
    from pfactory.optimize.params import OptimizeParams
    from pfactory.optimize.stage import optimize
    from pfactory.storage.fsutil import check_output_dir

    opt = section_of(params, STAGE, OptimizeParams)
    cut = DetectionCut() if opt is params else section_of(params, "evaluate", DetectionCut)  # bare: the default
    check_output_dir(out, STAGE, (model_dir, data))  # refuse a foreign --out before any work
    if not track:
        return optimize(opt, Path(model_dir), Path(data), Path(out), backend, precision, None, cut.score_threshold)
    from pfactory.tracking.runs import stage_run

    with stage_run(STAGE, opt.model_dump(mode="json")) as active:
        return optimize(opt, Path(model_dir), Path(data), Path(out), backend, precision, active, cut.score_threshold)


def body(p: Any, o: Any) -> dict:
    """The stage's work (`tasks._stage.run_stage`); `o`: the values of `COMMAND.options`."""
    paths = p.paths
    return run(
        p, o.model or Path(paths.model), o.data or Path(paths.prepared), o.out or Path(paths.optimized),
        backend=o.backend, precision=o.precision,
    )  # fmt: skip


COMMAND = Command(
    STAGE,
    "Export one ONNX graph (points + images -> boxes), build the backend, gate on parity, time it.\n\n"
    "An artifact outside optimize.parity is not shipped (FP32 ships instead of a failed INT8, said on stderr); "
    "exit 1 when no artifact passes.\n"
    "Example: factory optimize --backend onnxruntime --precision int8",
    (
        Option("model", "Trained model directory. Default: paths.model.", Path),
        Option("data", "Prepared shards (calibration + parity frames). Default: paths.prepared.", Path),
        Option("out", "Output directory. Default: paths.optimized.", Path),
        Option("backend", "auto (optimize.backend) | onnxruntime | tensorrt | aoti.", str, "auto",
               choices=("auto", "onnxruntime", "tensorrt", "aoti")),
        Option("precision", "fp32 | fp16 | int8. Default: optimize.precision.", choices=("fp32", "fp16", "int8")),
    ),
    body,
    sections,
)


def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.optimize [--model DIR] [--data DIR] [--out DIR] [--backend B] [--precision P]`
    (= `factory optimize`; directories default to paths.*, backend/precision to the optimize section)."""
    from tasks._stage import stage_main

    stage_main(COMMAND, argv)


if __name__ == "__main__":
    main()
