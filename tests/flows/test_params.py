"""params.yaml schema: defaults, overrides with DVC syntax, and refusals that name the key."""

import re
from pathlib import Path

import pytest
import yaml

from flows.params import Params, ParamsError, apply_overrides, load_params, parse_override

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_params_equal_embedded_defaults():
    # `factory run` on a machine without params.yaml must run the same pipeline.
    assert load_params(ROOT / "params.yaml").to_file_dict() == load_params(None).to_file_dict()


def test_every_schema_section_is_in_params_yaml():
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(shipped) == set(Params.model_fields)


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("prepare.val_fraction=0.3", "prepare.val_fraction", 0.3),
        ("params.yaml:synth.seed=7", "synth.seed", 7),
        ("prepare.voxel_size=[0.1,0.1,0.2]", "prepare.voxel_size", [0.1, 0.1, 0.2]),
        ("prepare.voxel_size=null", "prepare.voxel_size", None),
        ("synth.name=night-drive", "synth.name", "night-drive"),
    ],
)
def test_overrides_parse_yaml_values(override, key, value):
    assert parse_override(override) == (key, value)
    p = load_params(None, [override])
    section, field = key.split(".")
    assert getattr(getattr(p, section), field) == value


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("prepare.val_fraction=2", "prepare.val_fraction: expected less than or equal to 1, got 2"),
        ("prepare.bogus=1", "prepare.bogus: unknown key"),
        ("nosuchsection.x=1", "nosuchsection: unknown key"),
        ("prepare.pc_range=[1,2]", "prepare.pc_range: expected 6 numbers"),
        ("synth.frames=0", "synth.frames: expected greater than 0"),
        ("prepare.class_map={Car: Truck}", "class_map targets ['Truck'] are not in classes"),
        ("prepare", "expected section.key=value"),
        ("prepare.dask_address=local:0", "prepare.dask_address: expected 'local:N' with N >= 1 workers"),
        ("prepare.unit_frames=0", "prepare.unit_frames: expected greater than 0"),
        ("other.yaml:synth.seed=1", "only params.yaml is supported"),
    ],
)
def test_bad_values_are_refused_with_the_key(override, needle):
    with pytest.raises(ParamsError) as e:
        load_params(None, [override])
    assert needle in str(e.value)


def test_bad_file_is_refused_with_its_name(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("prepare:\n  shard_max_frames: -3\n")
    with pytest.raises(
        ParamsError, match=r"params.yaml: prepare.shard_max_frames: expected greater than 0, got -3"
    ):
        load_params(f)
    f.write_text("- just\n- a list\n")
    with pytest.raises(ParamsError, match="expected a mapping of sections"):
        load_params(f)


def test_override_cannot_descend_into_a_value():
    with pytest.raises(ParamsError, match="is a value, not a section"):
        apply_overrides({"synth": {"seed": 1}}, ["synth.seed.x=2"])


@pytest.mark.parametrize(
    "override, home",
    [
        ("train.score_threshold=0.1", "evaluate.score_threshold"),
        ("optimize.parity.score_threshold=0.1", "evaluate.score_threshold"),
    ],
)
def test_a_shared_value_is_set_only_in_its_home(override, home):
    """The detection score cut has one home, `evaluate`: setting it in a stage that uses it is refused,
    naming the home, whatever the value (the section does not hold it)."""
    key = override.split("=")[0]
    with pytest.raises(ParamsError, match=rf"{re.escape(key)} is not set here: it is {home} "):
        load_params(None, [override])
    default = load_params(None)
    with pytest.raises(ParamsError, match=rf"{re.escape(key)} is not set here"):
        load_params(None, [f"{key}={default.evaluate.score_threshold}"])


@pytest.mark.parametrize(
    "override", ["model.classes=[Car]", "model.painted_pillars.pc_range=[0, -40, -3, 60.8, 40, 1]"]
)
def test_the_data_facts_are_not_model_params(override):
    """The classes and the point-cloud range are the prepared data's (prepare.*): a detector is built for its
    manifest, so setting them under `model` is refused, naming the home."""
    key = override.split("=")[0]
    home = "prepare." + key.rsplit(".", 1)[1]
    with pytest.raises(ParamsError, match=rf"{re.escape(key)} is not set here: it is {re.escape(home)}"):
        load_params(None, [override])


def test_shared_values_flow_from_their_home_and_round_trip(tmp_path):
    """A stage that uses the score cut reads evaluate's value (its view); the file round-trips."""
    from flows.params import params_to_yaml
    from pfactory.config.params_file import load_sections
    from tasks import optimize, train

    p = load_params(None, ["evaluate.score_threshold=0.2", "prepare.pc_range=[0, -20, -3, 40, 20, 1]"])
    again = Params.model_validate(yaml.safe_load(params_to_yaml(p)))  # a workspace's params.yaml
    assert again.to_file_dict() == p.to_file_dict()
    f = tmp_path / "params.yaml"
    f.write_text(params_to_yaml(p))
    for stage in (train, optimize):
        doc = load_sections(f, [], dict(stage.sections()))
        assert doc.evaluate.score_threshold == 0.2, stage.STAGE
    assert "score_threshold" not in yaml.safe_load(params_to_yaml(p))["train"]


def test_a_stage_loads_only_its_own_sections(tmp_path) -> None:
    """`load_sections` (what `python -m tasks.<stage>` uses): the stage's sections and `paths`, the keys of
    a view (train's `evaluate`: its score cut) and nothing else of that section, the rest of the file left to
    the stages it belongs to; an override of a key it does not read is refused (it would change nothing it does)."""
    from pfactory.config.params_file import load_sections
    from pfactory.detectors.params import ModelSection as ModelParams
    from pfactory.metrics.cut import DetectionCut
    from pfactory.optimize.params import OptimizeParams
    from pfactory.train.params import TrainParams

    f = tmp_path / "params.yaml"
    # evaluate.workers -3 is invalid: evaluate's to refuse, not a stage that reads its score cut only
    f.write_text("evaluate: {score_threshold: 0.2, workers: -3}\nprepare: {classes: [Car]}\npromote: {bogus: 1}\n")
    sections = {"train": TrainParams, "model": ModelParams, "evaluate": DetectionCut}
    train = load_sections(f, ["train.lr=0.002"], sections)
    assert set(type(train).model_fields) == {"paths", "train", "model", "evaluate"}
    assert train.evaluate.score_threshold == 0.2 and train.train.lr == 0.002
    assert train.model.selected.pillar_size_m == 0.4  # the selected architecture's section, resolved
    opt = load_sections(f, ["evaluate.score_threshold=0.1"], {"optimize": OptimizeParams, "evaluate": DetectionCut})
    assert opt.evaluate.score_threshold == 0.1
    with pytest.raises(ParamsError, match="not a parameter this stage reads"):
        load_sections(f, ["promote.min_map=0.5"], sections)
    with pytest.raises(ParamsError, match=r"override 'evaluate.batch_size=2': not a parameter this stage reads"):
        load_sections(f, ["evaluate.batch_size=2"], sections)
    with pytest.raises(ParamsError, match=r"train\.score_threshold is not set here: it is evaluate\.score_threshold"):
        load_sections(f, ["train.score_threshold=0.3"], sections)
    with pytest.raises(ParamsError, match=r"train\.lr"):
        load_sections(f, ["train.lr=-1"], sections)
