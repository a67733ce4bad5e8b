"""Many KITTI label / result files read at once, column-wise: the fast path of `factory kpi`.

In:  paths of label files (15 columns) or result files (16, the last the score) and which they are.
Out: `LabelTable`: one row per object line, files in the order given and lines in file order; `type [N]`
     and `values [N, 14 | 15]` (the numeric columns `kitti.LABEL_FIELDS`, float64), `counts [F]` rows per file.

The values and the errors are those of `kitti.parse_label_file` on each file in order, by construction:
- Files holding printable ASCII and whitespace only (tabs, CR LF line ends, trailing or repeated spaces, a
  UTF-8 byte-order mark: what other tools write) are rewritten to their canonical form when the reader
  refuses them as they are (`_canonical`:
  each line's `str.split()` tokens joined by one space, `str.splitlines()` line breaks as newlines, blank
  lines dropped; the tokens the line parser sees are unchanged). Canonical files, only printable ASCII,
  spaces and newlines, are concatenated and read by Arrow's CSV reader
  (C++, multithreaded) with the space as delimiter and quoting, null markers and type inference off: every
  row must have the file type's column count, the type column is text, every other column a double. There
  a line's fields are exactly its `str.split()` tokens, or the reader refuses the line: a double or trailing
  space makes an empty field (not a double), a blank line a one-field row; a leading space (an empty type)
  is refused here. Arrow and Python's `float` both round a decimal to the nearest double, so a value Arrow
  accepts is the value `float` gives. Any other file (non-ASCII, control bytes) goes through `parse_label_file`.
- Anything refused (a wrong field count, a token that is not a plain number, which includes what `float`
  accepts and Arrow does not, like `1_0` or `Infinity`), a non-finite value, or a file that cannot be read
  sends every file through `parse_label_file` in order: the first bad file raises the same `DatasetError`
  (file, line, field) as before, or, for the tokens only `float` accepts, the table is built from its
  objects. The error path is as slow as before; the good path is ~10x faster (docs/KPIS.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pfactory.sensors.kitti import LABEL_FIELDS, KittiObject, parse_label_file

# The fast path reads files holding only these bytes: printable ASCII, the space and the newline.
_PLAIN_BYTES = bytes(range(0x21, 0x7F)) + b" \n"
# Other ASCII whitespace that `str.split()` (tab, CR, VT, FF) and `str.splitlines()` (CR, VT, FF) treat as
# separators; files with these are made canonical first. (\x1c-\x1f also split in str: left to the parser.)
_OTHER_SPACE = b"\t\r\x0b\x0c"
_BOM = b"\xef\xbb\xbf"  # parse_label_file reads utf-8-sig: a leading byte-order mark is not text
# tab -> space; CR, VT, FF -> newline (CR LF becomes a blank line, dropped with the others)
_TO_SPACE_NEWLINE = bytes.maketrans(b"\t\r\x0b\x0c", b" \n\n\n")
_SPACE_RUNS = re.compile(rb"  +")
_NEWLINE_RUNS = re.compile(rb"\n\n+")


@dataclass
class LabelTable:
    """Object lines of many KITTI files (module docstring)."""

    files: list[Path]
    counts: np.ndarray  # [F] int64 object lines per file
    type: np.ndarray  # [N] str, the first column
    values: np.ndarray  # [N, K] float64, LABEL_FIELDS[:K] (K = 14 for labels, 15 with the score);
    # "occluded" truncated to an integer, as KittiObject.occlusion

    @property
    def file(self) -> np.ndarray:
        """[N] index into `files` of each row."""
        return np.repeat(np.arange(len(self.files)), self.counts)

    def column(self, name: str) -> np.ndarray:
        """[N] one numeric column by its `LABEL_FIELDS` name (`"height"`, `"score"`, ...)."""
        return self.values[:, LABEL_FIELDS.index(name)]

    @classmethod
    def from_objects(
        cls, files: Sequence[Path], per_file: Sequence[list[KittiObject]], with_score: bool
    ) -> LabelTable:
        """The table of already parsed files (`parse_label_file` results, one list per file)."""
        k = 15 if with_score else 14
        rows = [o for objs in per_file for o in objs]
        vals = [
            [o.truncation, o.occlusion, o.alpha, *o.bbox, *o.dimensions_hwl, *o.location, o.rotation_y]
            + ([o.score] if with_score else [])
            for o in rows
        ]
        return cls(
            list(files),
            np.array([len(objs) for objs in per_file], dtype=np.int64),
            np.array([o.type for o in rows], dtype=str),
            np.array(vals, dtype=np.float64).reshape(-1, k),
        )


def _plain(data: bytes) -> bool:
    return not data.translate(None, _PLAIN_BYTES)


def _is_canonical(data: bytes) -> bool:
    """Only printable ASCII, single spaces between tokens and newlines ending non-blank lines (module doc)."""
    return _plain(data) and not (
        b"  " in data or b" \n" in data or b"\n " in data or b"\n\n" in data
        or data.startswith((b" ", b"\n")) or data.endswith(b" ")
    )  # fmt: skip


def _canonical(data: bytes) -> bytes | None:
    """`data` in canonical form (module docstring), or None if it holds bytes other than printable ASCII and
    ASCII whitespace. Its lines are the non-blank lines of `str.splitlines()`, each the `str.split()` tokens."""
    if data.startswith(_BOM):
        data = data[len(_BOM) :]
    if data.translate(None, _PLAIN_BYTES + _OTHER_SPACE):
        return None
    data = _SPACE_RUNS.sub(b" ", data.translate(_TO_SPACE_NEWLINE))  # token separators: one space
    data = data.replace(b" \n", b"\n").replace(b"\n ", b"\n")  # no space at a line's ends
    data = _NEWLINE_RUNS.sub(b"\n", data).lstrip(b" \n")  # no blank line
    if data.endswith(b" "):
        data = data[:-1]  # a last line without a line break, ending in a space
    return data + b"\n" if data and not data.endswith(b"\n") else data


def read_label_table(paths: Sequence[str | Path], with_score: bool) -> LabelTable:
    """Parse label (`with_score=False`, 15 columns) or result files (16) into one `LabelTable`.

    Same values and same `DatasetError` as `parse_label_file(path, with_score)` on each path in order."""
    paths = [p if isinstance(p, Path) else Path(p) for p in paths]
    try:
        datas = [_read_bytes(os.fspath(p)) for p in paths]
    except OSError:
        return _one_by_one(paths, with_score)  # the unreadable file raises its error there, in order
    # The common case: every file canonical. One scan of the joined bytes for the byte set, then the CSV
    # reader, which refuses any other whitespace layout (an empty field is not a double, a blank line is a
    # one-field row): no separate scan for those.
    joined = _joined(datas)
    if _plain(joined):
        table = _arrow_table(datas, with_score, joined)
        if table is not None:
            return LabelTable(paths, *table)
    # Something is off: files in canonical form where they can be, the others through the line parser.
    slow: list[int] = []
    rewritten = False
    for i, d in enumerate(datas):
        if not _is_canonical(d):
            c = _canonical(d)
            if c is None:
                slow.append(i)
            else:
                datas[i], rewritten = c, True
    if not rewritten and not slow:
        return _one_by_one(paths, with_score)  # canonical files the reader refused: a bad field or token
    fast = [i for i in range(len(paths)) if i not in set(slow)] if slow else list(range(len(paths)))
    table = _arrow_table([datas[i] for i in fast], with_score)
    if table is None:
        return _one_by_one(paths, with_score)
    counts, types, values = table
    if not slow:
        return LabelTable(paths, counts, types, values)
    # Some files were not canonical: parse those one by one and put every file's rows in path order.
    parsed = {i: parse_label_file(paths[i], with_score) for i in slow}
    other = LabelTable.from_objects([paths[i] for i in slow], [parsed[i] for i in slow], with_score)
    all_counts = np.zeros(len(paths), dtype=np.int64)
    all_counts[fast], all_counts[slow] = counts, other.counts
    is_slow = np.zeros(len(paths), dtype=bool)
    is_slow[slow] = True
    src = np.repeat(is_slow, all_counts)  # [N] row comes from the slow files
    out_types = np.empty(int(all_counts.sum()), dtype=np.result_type(types, other.type))
    out_values = np.empty((len(out_types), values.shape[1]))
    out_types[~src], out_values[~src] = types, values
    out_types[src], out_values[src] = other.type, other.values
    return LabelTable(paths, all_counts, out_types, out_values)


def _read_bytes(path: str) -> bytes:
    """A whole file, as `Path.read_bytes` at about half its per-file cost (thousands of small files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _joined(datas: list[bytes]) -> bytes:
    """The files' bytes one after the other, each ending with a newline."""
    if all(d.endswith(b"\n") or not d for d in datas):
        return b"".join(datas)
    return b"".join(d if d.endswith(b"\n") else d + b"\n" for d in datas if d)


def _arrow_table(
    datas: list[bytes], with_score: bool, joined: bytes | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(counts, types, values) of plain files via Arrow's CSV reader (`joined`: `_joined(datas)` if the
    caller has it); None when anything is off."""
    k = 15 if with_score else 14
    counts = np.array(
        [d.count(b"\n") + (1 if d and not d.endswith(b"\n") else 0) for d in datas], dtype=np.int64
    )
    if counts.sum() == 0:
        return counts, np.zeros(0, dtype=str), np.zeros((0, k))
    import pyarrow as pa
    import pyarrow.csv as pcsv

    names = ["type", *LABEL_FIELDS[:k]]
    data = joined if joined is not None else _joined(datas)
    try:
        t = pcsv.read_csv(
            pa.py_buffer(data),
            read_options=pcsv.ReadOptions(column_names=names),
            parse_options=pcsv.ParseOptions(
                delimiter=" ", quote_char=False, double_quote=False, escape_char=False,
                newlines_in_values=False, ignore_empty_lines=False,
            ),
            convert_options=pcsv.ConvertOptions(
                # The type column dictionary-encoded: a handful of names, turned into NumPy ~5x faster.
                column_types={"type": pa.dictionary(pa.int32(), pa.string()), **{n: pa.float64() for n in names[1:]}},
                null_values=[], strings_can_be_null=False, quoted_strings_can_be_null=False,
            ),
        )  # fmt: skip
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # a field count or a token the line parser has to judge
    # Rows must be the files' lines (defensive: a blank line already failed the column count).
    if t.num_rows != int(counts.sum()) or any(t.column(n).null_count for n in names):
        return None
    values = np.empty((t.num_rows, k))  # [N, K], filled column by column from the Arrow buffers
    for j, n in enumerate(names[1:]):
        _doubles(t.column(n), values[:, j])
    if not np.isfinite(values).all():
        return None  # the line parser names the line and field of the NaN / inf
    values[:, 1] = np.trunc(values[:, 1])  # occluded: KittiObject keeps int(value)
    types = _strings(t.column("type"))
    if (types == "").any():
        return None  # a line starting with a space: its first token is not the first column
    return counts, types, values


def _doubles(col, out: np.ndarray) -> None:
    """A null-free float64 column into `out [N]`, from its buffers. (`to_numpy` would import pandas,
    ~0.3 s of a ~1 s `factory kpi`: pyarrow's pandas shim; measured with `python -X importtime`.)"""
    at = 0
    for ch in col.chunks:
        out[at : at + len(ch)] = np.frombuffer(
            ch.buffers()[1], dtype=np.float64, count=len(ch), offset=ch.offset * 8
        )
        at += len(ch)


def _strings(col) -> np.ndarray:
    """A null-free dictionary<int32, string> column as a NumPy str array (dictionary values by index)."""
    parts = []
    for ch in col.chunks:
        idx = ch.indices
        codes = np.frombuffer(idx.buffers()[1], dtype=np.int32, count=len(idx), offset=idx.offset * 4)
        parts.append(np.asarray(ch.dictionary.to_pylist(), dtype=str)[codes])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=str)


def _one_by_one(paths: list[Path], with_score: bool) -> LabelTable:
    """Every file through the line parser, in order: the first problem raises its `DatasetError`."""
    return LabelTable.from_objects(paths, [parse_label_file(p, with_score) for p in paths], with_score)
