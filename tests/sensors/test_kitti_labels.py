"""The columnar KITTI label reader against the line parser: the same table, or the same error, on every
input a line parser meets (odd whitespace, odd numbers, wrong field counts, unreadable files)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pfactory.sensors.errors import DatasetError
from pfactory.sensors.kitti import parse_label_file
from pfactory.sensors.kitti_labels import LabelTable, read_label_table

GOOD = "Car 0.00 0 -1.57 10.0 20.0 50.0 60.0 1.50 1.80 4.20 -3.10 1.70 22.40 -1.59"
GOOD_SCORE = GOOD + " 0.875"

# (name, text of the middle file): each lies between two good files.
CASES = [
    ("plain", f"{GOOD}\n{GOOD}\n"),
    ("no final newline", f"{GOOD}\n{GOOD}"),
    ("empty file", ""),
    ("only a newline", "\n"),
    ("blank line", f"{GOOD}\n\n{GOOD}\n"),
    ("double space", GOOD.replace(" 0 ", "  0 ") + "\n"),
    ("trailing space", GOOD + " \n"),
    ("leading space", " " + GOOD + "\n"),
    ("CR LF", f"{GOOD}\r\n{GOOD}\r\n"),
    ("tabs", GOOD.replace(" ", "\t") + "\n"),
    ("vertical tab", GOOD.replace(" 0 ", " 0\x0b") + "\n"),
    ("unit separator", GOOD.replace(" 0 ", " 0\x1f") + "\n"),
    ("non-ASCII type", GOOD.replace("Car", "Caŕ") + "\n"),
    ("number forms", "Cyclist +0.5 1 .5 5. 1e1 1E-1 -0 0.0 1.5 0.6 1.8 5 1.6 8 -0.4\n"),
    ("underscore digits", GOOD.replace("10.0", "1_0.0") + "\n"),
    ("Infinity", GOOD.replace("10.0", "Infinity") + "\n"),
    ("nan", GOOD.replace("10.0", "nan") + "\n"),
    ("inf", GOOD.replace("10.0", "-inf") + "\n"),
    ("overflow", GOOD.replace("10.0", "1e999") + "\n"),
    ("not a number", GOOD.replace("4.20", "four") + "\n"),
    ("NA token", GOOD.replace("4.20", "NA") + "\n"),
    ("quoted number", GOOD.replace("4.20", '"4.20"') + "\n"),
    ("14 fields", " ".join(GOOD.split()[:-1]) + "\n"),
    ("one more field", GOOD + " 7 7\n"),
    ("numeric type", GOOD.replace("Car", "1") + "\n"),
    ("CR only", f"{GOOD}\r{GOOD}\r"),
    ("form feed", f"{GOOD}\x0c{GOOD}\n"),
    ("byte-order mark", f"\ufeff{GOOD}\n"),
    ("blank CR LF lines, tabs, spaces", f" \t\r\n{GOOD} \t\r\n \r\n\t{GOOD.replace(' ', '  ')}  \r\n\r\n"),
    ("spaces at the end, no newline", f"{GOOD}\n{GOOD}   "),
    ("whitespace only", " \t\r\n \x0b\n"),
    ("CR LF and a bad number", f"{GOOD}\r\n{GOOD.replace('4.20', 'four')}\r\n"),
    ("DontCare sentinels", "DontCare -1 -1 -10 503.89 169.71 590.61 190.13 -1 -1 -1 -1000 -1000 -1000 -10\n"),
]


def _write(tmp: Path, middle: str, with_score: bool) -> list[Path]:
    good = (GOOD_SCORE if with_score else GOOD) + "\n"
    if with_score:  # the same cases with the score column: one more field on every full line
        middle = "\n".join(line + " 0.5" if len(line.split()) >= 15 else line for line in middle.split("\n"))
    paths = []
    for i, text in enumerate((good, middle, good + good)):
        p = tmp / f"{i:06d}.txt"
        p.write_bytes(text.encode("utf-8"))
        paths.append(p)
    return paths


def _reference(paths: list[Path], with_score: bool) -> LabelTable:
    return LabelTable.from_objects(paths, [parse_label_file(p, with_score) for p in paths], with_score)


@pytest.mark.parametrize("with_score", [False, True])
@pytest.mark.parametrize("name,middle", CASES, ids=[c[0] for c in CASES])
def test_same_table_or_same_error_as_the_line_parser(
    tmp_path: Path, name: str, middle: str, with_score: bool
) -> None:
    paths = _write(tmp_path, middle, with_score)
    try:
        want = _reference(paths, with_score)
    except DatasetError as e:
        with pytest.raises(DatasetError) as got:
            read_label_table(paths, with_score)
        assert str(got.value) == str(e)
        return
    got = read_label_table(paths, with_score)
    assert got.files == paths
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_array_equal(got.type, want.type)
    assert got.values.shape == want.values.shape
    assert np.array_equal(got.values, want.values), np.argwhere(got.values != want.values)[:5]


def test_first_bad_file_in_order_and_unreadable_files(tmp_path: Path) -> None:
    paths = []
    for i, text in enumerate([GOOD, GOOD.replace("4.20", "x"), GOOD.replace("1.50", "nan")]):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(text + "\n")
    with pytest.raises(DatasetError, match=r"1\.txt: line 1 length: a number, got 'x'"):
        read_label_table(paths, False)
    with pytest.raises(DatasetError, match=r"2\.txt: line 1 height: a finite number, got 'nan'"):
        read_label_table(paths[::2], False)
    with pytest.raises(DatasetError, match=r"missing\.txt: label: a readable UTF-8 text file"):
        read_label_table([paths[0], tmp_path / "missing.txt"], False)
    bad_utf8 = tmp_path / "b.txt"
    bad_utf8.write_bytes(b"\xff\xfe" + GOOD.encode())
    with pytest.raises(DatasetError, match=r"b\.txt: label: a readable UTF-8 text file"):
        read_label_table([bad_utf8], False)


def test_many_files_and_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(40):
        n = int(rng.integers(0, 6))
        vals = rng.normal(size=(n, 15)) * 10
        lines = [" ".join(["Pedestrian", *(repr(float(v)) for v in row)]) for row in vals]
        paths.append(tmp_path / f"{i:03d}.txt")
        paths[-1].write_text("".join(line + "\n" for line in lines))
    got, want = read_label_table(paths, True), _reference(paths, True)
    assert np.array_equal(got.values, want.values) and np.array_equal(got.counts, want.counts)
    assert got.column("score").tolist() == want.values[:, 14].tolist()
    assert got.file.tolist() == np.repeat(np.arange(40), want.counts).tolist()


# Files other tools write (CR LF, tabs, trailing spaces, a byte-order mark): read on the fast path, as
# canonical text, with the line parser's values (the test above); here: the line parser is never called.
WHITESPACE_CASES = [c for c in CASES if c[0] in (
    "CR LF", "tabs", "trailing space", "leading space", "double space", "CR only", "form feed",
    "byte-order mark", "blank CR LF lines, tabs, spaces", "spaces at the end, no newline", "whitespace only",
)]  # fmt: skip


@pytest.mark.parametrize("name,middle", WHITESPACE_CASES, ids=[c[0] for c in WHITESPACE_CASES])
def test_odd_whitespace_stays_on_the_columnar_path(tmp_path: Path, monkeypatch, name: str, middle: str) -> None:
    import pfactory.sensors.kitti_labels as kl

    paths = _write(tmp_path, middle, False)
    want = _reference(paths, False)

    def refuse(*a, **k):
        raise AssertionError("the line parser was called")

    monkeypatch.setattr(kl, "parse_label_file", refuse)
    got = read_label_table(paths, False)
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_array_equal(got.type, want.type)
    assert np.array_equal(got.values, want.values)
