"""Reading a params file: the YAML safety checks, DVC-style overrides, validation messages naming the key,
and the sections of one stage (`load_sections`).

A stage reads only its own sections (DESIGN.md §3): `python -m tasks.train` validates `train`, `model` and
`paths`, plus a view of another stage's section when it uses one of its values (`SectionView`: train and
optimize read `evaluate.score_threshold`), and imports no other section's module, so editing a promotion-gate
default does not change what DVC hashes as train's code. The whole file (every section, `flows.params.Params`)
is for the flow and the CLI.

Every value has one home: a field is declared in one section only (a value several stages use is read from its
home through a view, never copied into a second section; tests/config/test_one_home.py fails on a name declared
in two sections unless it is listed there with what each section's field means).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import Field, ValidationError, create_model

from pfactory.config.paths import PathsParams
from pfactory.config.section import Section, is_view
from pfactory.runtime.failures import EXIT_USAGE, UserError

# Keys a stage's section does not hold because the value lives in another section (its one home): a file or an
# override that sets one there is refused with the home named, not as a bare unknown key.
ELSEWHERE: dict[tuple[str, ...], str] = {
    ("train", "score_threshold"): "evaluate.score_threshold",
    ("optimize", "parity", "score_threshold"): "evaluate.score_threshold",
}

P = TypeVar("P", bound=Section)


class ParamsError(UserError, ValueError):
    """A parameter file or override is invalid; the message names the key and the expectation."""

    exit_code = EXIT_USAGE


class Sections(Section):
    """Base of a params document made of sections (the whole file, or one stage's sections)."""


@cache
def sections_model(sections: tuple[tuple[str, type[Section]], ...]) -> type[Sections]:
    """The params document of one stage: `paths` and `sections` (name, model), each defaulting to its own
    defaults; unknown keys of these sections are refused, other sections of the file are not read."""
    fields: dict[str, Any] = {"paths": (PathsParams, Field(default_factory=PathsParams))}
    fields.update({name: (cls, Field(default_factory=cls)) for name, cls in sections})
    name = "".join(n.title() for n, _ in sections) + "StageParams"
    return create_model(name, __base__=Sections, **fields)


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
        if not err["loc"]:  # a rule of the whole document: its message names the keys
            lines.append(f"{source}: {err['msg'].removeprefix('Value error, ')}")
            continue
        key = ".".join(str(p) for p in err["loc"])
        home = ELSEWHERE.get(tuple(str(p) for p in err["loc"]))
        if err["type"] == "extra_forbidden" and home:
            lines.append(f"{source}: {key} is not set here: it is {home} (one home; the stages that use it read it there)")
            continue
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


def read_params(
    path: str | Path | None, overrides: list[str] | None, sections: Mapping[str, Collection[str] | None] | None = None
) -> tuple[dict[str, Any], str]:
    """The params file as a dict (`{}` and "(embedded defaults)" when missing) with `overrides` applied, and
    its name for messages. `sections`: a stage's, name -> the keys it reads of that section (None: all of it;
    a view's keys for another stage's section). Only these are kept (the rest of the file is other stages'),
    and an override of anything else is refused: it would change nothing this stage does."""
    if sections is not None:
        for text in overrides or []:
            name, _, rest = parse_override(text)[0].partition(".")
            keys = sections.get(name, ())
            if name not in sections or (keys is not None and rest.split(".")[0] not in keys):
                reads = ", ".join(n if k is None else ", ".join(f"{n}.{x}" for x in k) for n, k in sections.items())
                raise ParamsError(f"override {text!r}: not a parameter this stage reads (it reads {reads})")
    raw: dict[str, Any] = {}
    source = "params.yaml (embedded defaults)"
    if path is not None and Path(path).exists():
        source = str(path)
        raw = read_yaml_file(path) or {}
        if not isinstance(raw, dict):
            raise ParamsError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    if sections is not None:
        raw = {name: _only(value, sections[name]) for name, value in raw.items() if name in sections}
    return raw, source


def _only(section: Any, keys: Collection[str] | None) -> Any:
    """`section` with just `keys` (None: all; a section that is not a mapping is left for validation to name)."""
    if keys is None or not isinstance(section, dict):
        return section
    return {k: v for k, v in section.items() if k in keys}


def validate(model: type[Section], raw: dict[str, Any], source: str, pin: bool = False) -> Any:
    """`model.model_validate(raw)`, a ValidationError as one ParamsError naming each key. A section with an
    `after_validation(source, pin)` method (`model`: the architecture's own section, checked against the
    installed plugins) is then resolved by it; its errors name the key too. `pin`: the whole file as the
    flow and the CLI read it (record the installed plugin); else a stage's (verify what the file pins)."""
    try:
        doc = model.model_validate(raw)
    except ValidationError as e:
        raise ParamsError(_format_validation_error(e, source)) from None
    for name in type(doc).model_fields:
        hook = getattr(getattr(doc, name), "after_validation", None)
        if callable(hook):
            hook(source, pin)
    return doc


def load_sections(
    path: str | Path | None, overrides: list[str] | None, sections: dict[str, type[Section]]
) -> Any:
    """A stage's params: `paths` and its `sections` of the file (+ `overrides`); a section given as a view
    (`SectionView`) is read for the view's keys only (module docstring). Other sections, and overrides of
    them, are other stages' to validate (an override is still checked to be `section.key=value`)."""
    model = sections_model(tuple(sections.items()))
    reads = {name: (frozenset(cls.model_fields) if is_view(cls) else None) for name, cls in sections.items()}
    raw, source = read_params(path, overrides, {"paths": None, **reads})
    return validate(model, raw, source)


def anchored(params: P, base: str | Path) -> P:
    """`params` with its relative `paths` made absolute under `base` (the folder of the params file: the
    project root), so a command run from another folder finds the project's files; unchanged when `base` is
    the current folder (`dvc repro`, a run workspace, `factory` at the root)."""
    base = Path(base).resolve()
    if base == Path.cwd().resolve():
        return params
    paths = {k: v if Path(v).is_absolute() else str(base / v) for k, v in params.paths.model_dump().items()}
    return params.model_copy(update={"paths": params.paths.model_copy(update=paths)})


