"""The one error every reader and check raises: a problem with one dataset file, naming the file, the
field and what was expected (DESIGN.md §4: strict validation)."""

from __future__ import annotations

from pathlib import Path


class DatasetError(ValueError):
    """A problem with one dataset file: names the file, the field and what was expected."""

    def __init__(self, file: str | Path, field: str, expected: str, frame_id: str | None = None):
        self.file = str(file)
        self.field = field
        self.expected = expected
        self.frame_id = frame_id
        super().__init__(f"{self.file}: {field}: {expected}")

    def as_dict(self) -> dict[str, str | None]:
        """JSON-friendly form: `{"frame_id", "file", "field", "reason"}`."""
        return {"frame_id": self.frame_id, "file": self.file, "field": self.field, "reason": self.expected}
