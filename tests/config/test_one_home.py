"""Every parameter has one home: a field name is declared in one section of params.yaml only.

A value several stages use is declared in its home section and read by the others through a view
(`pfactory.config.section.SectionView`: train and optimize read `evaluate.score_threshold`), never declared
again in a second section. A name that two sections declare with different meanings is listed in
`DIFFERENT_MEANINGS`, with the sections and what each one's field means; any other name declared in two
sections fails, and so does a listed name that a further section starts to declare.
"""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel

from flows.params import Params
from pfactory.config.section import SectionView

# name -> {section: what that section's field means}. Per-stage resources (each stage sizes its own work)
# and names whose meaning differs; a value that is the same for two stages does not belong here.
DIFFERENT_MEANINGS: dict[str, dict[str, str]] = {
    "batch_size": {
        "prepare": "frames per DALI batch and per Parquet row group written",
        "train": "frames per optimizer step",
        "optimize": "frames per runner call of the parity comparison (optimize.parity)",
        "evaluate": "frames per inference call inside a task",
    },
    "device": {s: f"where the {s} stage runs" for s in ("prepare", "train", "optimize", "evaluate")},
    "num_threads": {s: f"the {s} stage's CPU threads" for s in ("prepare", "train", "optimize")},
    "workers": {
        "synth": "processes generating frames",
        "prepare": "LocalCluster workers of a Dask prepare",
        "evaluate": "LocalCluster workers of the distributed evaluation",
    },
    "threads_per_worker": {s: f"Dask threads per worker of the {s} stage" for s in ("prepare", "evaluate")},
    "dask_address": {s: f"the Dask scheduler the {s} stage uses" for s in ("prepare", "evaluate")},
    "seed": {"synth": "the generated scenes", "train": "initialisation, shuffling and augmentation"},
    "frames": {"synth": "frames generated", "optimize": "held-out frames the parity gate compares"},
    "split": {"optimize": "split of the parity gate's frames", "evaluate": "split scored"},
    "backend": {"optimize": "artifacts built", "evaluate": "which built artifact is evaluated"},
    "precision": {"optimize": "precision built", "evaluate": "which built precision is evaluated"},
    "min_points": {
        "prepare": "a sweep with fewer points is refused",
        "optimize": "the TensorRT profile's smallest padded point count (optimize.tensorrt)",
    },
    "rate_min_support": {"optimize": "optimize's parity rate gates", "promote": "promote's parity_agreement gate"},
    "rate_confidence": {"optimize": "optimize's parity rate gates", "promote": "promote's parity_agreement gate"},
}


def _model_of(annotation: typing.Any) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def declared_names(params: type[BaseModel] = Params) -> dict[str, set[str]]:
    """Field name -> the top-level sections declaring it (at any depth: `optimize.parity.frames` is optimize's).
    The architectures' own sections (`model.<arch>`) count as `model`."""
    found: dict[str, set[str]] = {}

    def walk(model: type[BaseModel], section: str) -> None:
        for name, field in model.model_fields.items():
            sub = _model_of(field.annotation)
            if sub is not None:
                walk(sub, section)
            else:
                found.setdefault(name, set()).add(section)

    for section, field in params.model_fields.items():
        model = _model_of(field.annotation)
        assert model is not None, f"params section {section!r} is not a model"
        walk(model, section)
    return found


def test_each_name_has_one_home() -> None:
    twice = {n: sorted(s) for n, s in declared_names().items() if len(s) > 1}
    unexplained = {n: s for n, s in twice.items() if n not in DIFFERENT_MEANINGS}
    assert not unexplained, (
        f"declared in more than one section: {unexplained}. A value several stages use is declared in its "
        "home and read by the others through a SectionView; names with different meanings go in DIFFERENT_MEANINGS"
    )
    drifted = {n: (s, sorted(DIFFERENT_MEANINGS[n])) for n, s in twice.items() if set(s) != set(DIFFERENT_MEANINGS[n])}
    assert not drifted, f"declared in other sections than DIFFERENT_MEANINGS explains (found, listed): {drifted}"
    stale = sorted(set(DIFFERENT_MEANINGS) - set(twice))
    assert not stale, f"DIFFERENT_MEANINGS lists names no longer declared twice: {stale}"


def test_the_check_sees_a_second_declaration() -> None:
    """The check itself: a section that declares a field of another section's again is caught."""
    from pydantic import Field, create_model

    from pfactory.train.params import TrainParams

    copied = create_model("TrainWithACopy", __base__=TrainParams, score_threshold=(float, 0.05))
    doc = create_model("ParamsWithACopy", __base__=Params, train=(copied, Field(default_factory=copied)))
    assert declared_names(doc)["score_threshold"] == {"train", "evaluate"}
    assert declared_names()["score_threshold"] == {"evaluate"}


@pytest.mark.parametrize("stage", ["train", "optimize"])
def test_a_stage_reads_the_score_cut_through_a_view(stage: str) -> None:
    """The stages that use evaluate's score cut read it as a view, whose field the home section inherits."""
    import importlib

    from pfactory.evaluate.params import EvaluateParams

    sections = importlib.import_module(f"tasks.{stage}").sections()
    view = sections["evaluate"]
    assert SectionView in view.__bases__ and issubclass(EvaluateParams, view)
    assert set(view.model_fields) == {"score_threshold"}
