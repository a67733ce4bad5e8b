"""Typed pipeline parameters: `params.yaml` (one section per stage, plus `model` and `paths`) and overrides.

Each section is declared beside the code that owns it and named like its stage; this module only
assembles them:

    paths     pfactory/artifacts.py          PathsParams
    synth     pfactory/sensors/synth/params.py  SynthParams
    prepare   pfactory/data/params.py        PrepareParams
    model     pfactory/model/params.py       ModelParams
    train     pfactory/train/params.py       TrainParams
    optimize  pfactory/inference/params.py   OptimizeParams
    evaluate  pfactory/evaluate/params.py    EvaluateParams
    promote   pfactory/registry/params.py    PromoteParams

Values more than one stage uses are declared once (`SHARED`) and flow to the others: the training
classes and point-cloud range live in `prepare` (the model takes them from the prepared manifest),
the detection score threshold in `evaluate` (train's validation and optimize's parity use it).
Setting one of them in a second place to another value is an error that names the one home.

`load_params(path, overrides)` reads the YAML, applies DVC-style overrides
(`-S section.key=value`, value parsed as YAML, optional `params.yaml:` prefix) and validates
it against `Params`. Unknown keys and bad values are refused with a message that names the
key and what was expected. The defaults of `Params` are the embedded defaults: a missing
`params.yaml` gives the same pipeline as the shipped one (a test keeps the two equal).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pfactory.artifacts import PathsParams
from pfactory.data.params import PrepareParams
from pfactory.evaluate.params import EvaluateParams
from pfactory.inference.params import OptimizeParams
from pfactory.model.params import ModelParams
from pfactory.registry.params import PromoteParams
from pfactory.section import Section
from pfactory.sensors.synth.params import SynthParams
from pfactory.train.params import TrainParams

# Where a shared value is used -> its one home. The users keep a field of that name (the code reads
# `params.model.classes`, `tp.score_threshold`, ...), filled from the home; params.yaml sets only the home.
SHARED: dict[tuple[str, ...], tuple[str, ...]] = {
    ("model", "classes"): ("prepare", "classes"),
    ("model", "pc_range"): ("prepare", "pc_range"),
    ("train", "score_threshold"): ("evaluate", "score_threshold"),
    ("optimize", "parity", "score_threshold"): ("evaluate", "score_threshold"),
}


class ParamsError(ValueError):
    """A parameter file or override is invalid; the message names the key and the expectation."""


def _get(node: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


class GcParams(Section):
    """Retention after a `factory run` (`factory gc`'s policy, pfactory/retention.py; docs/OPERATIONS.md
    "Disk and retention"). Both None (the default): a run deletes nothing. No stage reads this section."""

    keep_last: int | None = Field(default=None, ge=1)
    """After a successful run, keep this many newest run workspaces (plus everything a registered model or
    the champion needs) and collect the rest, as `factory gc --keep-last N --yes` does."""
    keep_days: float | None = Field(default=None, gt=0)
    """... and keep every run younger than this many days."""


class Params(Section):
    """The whole `params.yaml`."""

    paths: PathsParams = Field(default_factory=PathsParams)
    synth: SynthParams = Field(default_factory=SynthParams)
    prepare: PrepareParams = Field(default_factory=PrepareParams)
    model: ModelParams = Field(default_factory=ModelParams)
    train: TrainParams = Field(default_factory=TrainParams)
    optimize: OptimizeParams = Field(default_factory=OptimizeParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    promote: PromoteParams = Field(default_factory=PromoteParams)
    gc: GcParams = Field(default_factory=GcParams)

    @model_validator(mode="before")
    @classmethod
    def _shared_set_once(cls, data: Any) -> Any:
        # A copy that repeats its home's value is harmless (a dumped section written back); a copy that
        # differs would silently lose to the home: refuse it, naming both.
        if isinstance(data, dict):
            for used, home in SHARED.items():
                value = _get(data, used)
                if value is None:
                    continue
                expected = _get(data, home)
                if expected is None:
                    expected = _get(cls.model_fields[home[0]].default_factory(), home[1:])
                if value != expected:
                    raise ValueError(
                        f"{'.'.join(used)} = {value!r} is not set here: it is {'.'.join(home)} = {expected!r} "
                        "(declared once, shared by the stages that use it)"
                    )
        return data

    @model_validator(mode="after")
    def _share(self) -> Params:
        for used, home in SHARED.items():
            *parents, key = used
            node: Any = self
            for part in parents:
                node = getattr(node, part)
            value = _get(self, home)
            if getattr(node, key) != value:
                setattr(node, key, copy.deepcopy(value))
        return self

    def to_file_dict(self) -> dict[str, Any]:
        """What `params.yaml` holds: every section, without the shared values' copies."""
        raw = self.model_dump(mode="json")
        for used in SHARED:
            node = raw
            for part in used[:-1]:
                node = node[part]
            node.pop(used[-1], None)
        return raw


# A params document is a few hundred values; anything far larger once YAML aliases are expanded is an
# alias bomb (a 400-byte file that expands to 10^9 nodes) or not a params file: refused before validation.
MAX_PARAMS_NODES = 100_000
MAX_PARAMS_BYTES = 1 << 20


def short_repr(value: Any, limit: int = 120) -> str:
    """A bounded repr (at most `limit` characters; nested containers elided): never the expanded input."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 2, 6, 6, limit, limit
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_size(doc: Any, source: str, limit: int = MAX_PARAMS_NODES) -> None:
    """ParamsError when `doc` holds more than `limit` values counted as expanded (an alias counts as many
    times as it is used). The walk stops at the limit, so it is bounded in time and memory."""
    count, stack = 0, [doc]
    while stack:
        node = stack.pop()
        count += 1
        if count > limit:
            raise ParamsError(
                f"{source}: more than {limit} values once YAML aliases (*name) are expanded; a params file "
                "holds a few hundred (an alias bomb?)"
            )
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def yaml_problem(e: yaml.YAMLError) -> str:
    """One line: where and what, e.g. "line 2, column 1: expected ',' or ']', but got '<stream end>'"."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return short_repr(" ".join(str(e).split()), 200)


def read_yaml_file(path: str | Path) -> Any:
    """Parse a params-like YAML file safely: bounded size, UTF-8 checked, aliases bounded; ParamsError
    naming the file otherwise."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ParamsError(f"{path}: is a directory, expected a YAML file") from None
    except OSError as e:
        raise ParamsError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_PARAMS_BYTES:
        raise ParamsError(
            f"{path}: {len(data)} bytes, more than a params file ({MAX_PARAMS_BYTES} bytes at most)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParamsError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({yaml_problem(e)})") from None
    check_size(doc, str(path))
    return doc


def _format_validation_error(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        if not err["loc"]:  # a whole-file rule (a shared value set twice): the message names the keys
            lines.append(f"{source}: {err['msg'].removeprefix('Value error, ')}")
            continue
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not a parameter of this section)"
        else:
            msg = "expected " + err["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
        got = err.get("input")
        got_s = "" if err["type"] == "missing" or isinstance(got, dict) else f", got {short_repr(got)}"
        lines.append(f"{source}: {key}: {msg}{got_s}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[str, Any]:
    """`[params.yaml:]section.key=value` -> ("section.key", parsed YAML value)."""
    spec = text
    if ":" in spec.split("=", 1)[0]:
        fname, spec = spec.split(":", 1)
        if Path(fname).name != "params.yaml":
            raise ParamsError(f"override {text!r}: only params.yaml is supported, got {fname!r}")
    key, sep, value = spec.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ParamsError(f"override {text!r}: expected section.key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ParamsError(f"override {short_repr(text)}: value is not valid YAML ({yaml_problem(e)})") from None
    check_size(parsed, f"override {short_repr(text)}")
    return key, parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `section.key=value` override applied."""
    out = copy.deepcopy(raw)
    for text in overrides:
        key, value = parse_override(text)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ParamsError(f"override {text!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def load_params(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    """Read, override and validate `params.yaml`; a missing file means the embedded defaults."""
    raw: dict[str, Any] = {}
    source = "params.yaml (embedded defaults)"
    if path is not None and Path(path).exists():
        source = str(path)
        raw = read_yaml_file(path) or {}
        if not isinstance(raw, dict):
            raise ParamsError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_validation_error(e, source)) from None


def anchored(params: Params, base: str | Path) -> Params:
    """`params` with its relative `paths` made absolute under `base` (the folder of the params file: the
    project root), so a command run from another folder finds the project's files; unchanged when `base` is
    the current folder (`dvc repro`, a run workspace, `factory` at the root)."""
    base = Path(base).resolve()
    if base == Path.cwd().resolve():
        return params
    paths = {k: v if Path(v).is_absolute() else str(base / v) for k, v in params.paths.model_dump().items()}
    return params.model_copy(update={"paths": params.paths.model_copy(update=paths)})


def params_to_yaml(params: Params) -> str:
    """The resolved params as YAML, as `params.yaml` holds them (what a run workspace gets and `factory
    params` shows): each shared value once, in its home section."""
    return yaml.safe_dump(params.to_file_dict(), sort_keys=False)
