"""The one error every reader and check raises: a problem with one dataset file, naming the file, the
field and what was expected (DESIGN.md §4: strict validation)."""

from __future__ import annotations

import re
from pathlib import Path

from pfactory.runtime.failures import EXIT_FAILED, UserError

_ADDRESS = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")


def error_text(e: BaseException) -> str:
    """`Type: message` of a library error, without memory addresses (PIL names the buffer it read as
    `<_io.BytesIO object at 0x7f...>`, which made refusal reasons -- and rejected.jsonl, the manifest and
    the prepared hash -- differ between two identical runs) and on one line."""
    text = _ADDRESS.sub("the data", " ".join(str(e).split()))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class DatasetError(UserError, ValueError):
    """A problem with one dataset file: names the file, the field and what was expected."""

    exit_code = EXIT_FAILED

    def __init__(self, file: str | Path, field: str, expected: str, frame_id: str | None = None):
        self.file = str(file)
        self.field = field
        self.expected = expected
        self.frame_id = frame_id
        super().__init__(f"{self.file}: {field}: {expected}")

    def as_dict(self) -> dict[str, str | None]:
        """JSON-friendly form: `{"frame_id", "file", "field", "reason"}`."""
        return {"frame_id": self.frame_id, "file": self.file, "field": self.field, "reason": self.expected}
