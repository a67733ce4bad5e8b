"""`factory gc`'s error when a removal fails (factory/gc.py): it says why, never a traceback."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest

from factory.gc import _stopped_message


@pytest.mark.parametrize(
    "make_error, reason",
    [
        (lambda d: OSError(errno.ENOSPC, "No space left on device", str(d / "obj")), "disk full writing"),
        (
            lambda d: PermissionError(errno.EACCES, "Permission denied", str(d / "run")),
            "run: permission denied",
        ),
        (lambda d: OSError("the device went away"), "the device went away"),
    ],
    ids=["disk-full", "permission-denied", "unexplained"],
)
def test_a_failed_removal_says_why_and_that_what_is_removed_stays_consistent(
    tmp_path: Path, make_error: Callable[[Path], OSError], reason: str
) -> None:
    """An OSError from `collect` (one `explain` knows, or not) -> "factory gc stopped: <reason>. ... run it
    again to finish." (this used to be a TypeError: `explain` returns an `Explained`, not a tuple)."""
    message = _stopped_message(make_error(tmp_path))
    assert message.startswith("factory gc stopped: ") and reason in message
    assert "consistent" in message and message.endswith("run it again to finish.")
