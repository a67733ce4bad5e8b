"""The score below which a detection does not count: `evaluate.score_threshold`, the part of the `evaluate:`
section other stages read.

Declared once, here, below the stages that use it: `EvaluateParams` derives from it (the field belongs to the
`evaluate` section); train's validation KPIs and optimize's parity read it through this view
(`pfactory.config.section.SectionView`) without importing evaluate's params.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pfactory.config.section import SectionView


class DetectionCut(SectionView):
    """`evaluate.score_threshold`, as train and optimize read it."""

    score_threshold: Annotated[float, Field(gt=0, lt=1)] = 0.05
    """Detections scoring below this are dropped: before the KPIs (evaluate), the validation KPIs (train) and
    the parity comparison (optimize)."""


DEFAULT_SCORE_THRESHOLD: float = DetectionCut.model_fields["score_threshold"].default
"""The field's default, for functions that take the cut as an argument (the value itself is the field's)."""
