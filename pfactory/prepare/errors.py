"""Errors of the data layer that callers (the CLI, the stage) turn into exit codes."""

from __future__ import annotations

from typing import Any

from pfactory.runtime.failures import EXIT_FAILED, EXIT_USAGE, UserError


class RejectFractionExceeded(UserError, RuntimeError):
    """More than `prepare.max_reject_fraction` of the frames were refused.

    The shards, `manifest.json` and `rejected.jsonl` are still written (atomically), so the
    refusals can be inspected; the stage exits non-zero.
    """

    exit_code = EXIT_FAILED
    hint = (
        "each refused frame and why is in rejected.jsonl (above); check the raw data "
        "(`factory data check DIR`) or relax prepare.min_points / prepare.max_reject_fraction"
    )

    def __init__(
        self, rejected: int, total: int, max_fraction: float, rejected_file: str, result: Any = None
    ):
        self.result = result  # the PrepareResult of the run (metrics, manifest), for logging
        self.rejected = rejected
        self.total = total
        self.max_fraction = max_fraction
        self.rejected_file = rejected_file
        share = rejected / total if total else 1.0
        super().__init__(
            f"{rejected} of {total} frames refused ({share:.1%}), more than "
            f"prepare.max_reject_fraction = {max_fraction:.1%}; the reasons are in {rejected_file}"
        )


class SchemaError(UserError, ValueError):
    """Prepared data this version of pfactory cannot use: not a prepared directory (a raw dataset, a
    missing path), a newer schema, the output of a failed prepare run, an empty split."""

    exit_code = EXIT_USAGE
