"""Errors of the optimize stage and the inference runtime.

`ParityError`: an optimized artifact does not compute what the PyTorch model computes, within the
`optimize.parity` tolerances; the message names the artifact, the metric, its value and the limit.
`BackendUnavailable`: a backend was asked for but cannot run here (no `tensorrt`, no CUDA, ...).
`ArtifactError`: an optimized directory is missing a file, or a file's sha256 does not match.
"""

from __future__ import annotations

from pfactory.runtime.failures import EXIT_FAILED, EXIT_USAGE, UserError


class OptimizeError(RuntimeError):
    """Base of the optimize stage's errors."""


class ParityError(UserError, OptimizeError):
    """Parity of one or more artifacts vs PyTorch is outside `optimize.parity`.

    `failures` holds one line per failing gate ("onnxruntime/int8: scores.max_abs_diff = 0.31 > 0.1").
    """

    exit_code = EXIT_FAILED
    hint = (
        "the per-gate figures are in the report named above (docs/OPTIMIZE.md, Parity); "
        "-S optimize.precision=fp32 ships the FP32 artifact instead"
    )

    def __init__(self, failures: list[str], report_path: str | None = None) -> None:
        self.failures = list(failures)
        self.report_path = report_path
        where = f" (full report: {report_path})" if report_path else ""
        super().__init__("parity vs PyTorch failed" + where + ":\n  " + "\n  ".join(self.failures))


class BackendUnavailable(UserError, OptimizeError):
    """The requested backend/precision cannot be built or run on this machine."""

    exit_code = EXIT_USAGE


class ArtifactError(OptimizeError):
    """An optimized directory is incomplete or its files do not match `backend.json`."""
