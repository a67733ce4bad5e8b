"""The ledger's rendering: slices of the matrix (one ledger per `--stage` run) merge into one table whose
header names every slice, its size and load; a later ledger's case replaces the same case of an earlier one."""

from __future__ import annotations

from pathlib import Path

from tests.faults.ledger import Ledger
from tests.faults.run import main


def _ledger(path: Path, full: bool, command: str, trials: list[tuple[str, str, bool]]) -> Path:
    led = Ledger()
    for cls, case, ok in trials:
        led.record(cls, case, ok, detail=f"{case} {ok}")
    meta = {"when": "t", "commit": "abc1234", "machine": "CPU, 2 cores, load 3.10", "load_start": 1.5,
            "full": full, "seconds": 60.0, "exitstatus": 0, "command": command}  # fmt: skip
    led.save(path, meta)
    return path


def test_slices_render_into_one_table(tmp_path: Path, capsys) -> None:
    ci = _ledger(tmp_path / "ci.json", False, "ci run",
                 [("crash", "SIGKILL in train", True), ("params", "alias bomb", True)])  # fmt: skip
    train = _ledger(tmp_path / "train.json", True, "slice train", [("crash", "SIGKILL in train", True)] * 2
                    + [("crash", "SIGKILL in train", False)])  # fmt: skip
    synth = _ledger(tmp_path / "synth.json", True, "slice synth", [("crash", "SIGKILL in synth", True)] * 3)
    out = tmp_path / "R.md"
    assert main(["--render", str(ci), str(train), str(synth), "--report", str(out)]) == 0
    text = out.read_text()
    # CI's single train trial replaced by the slice's 3; synth's 3 added; params kept.
    assert "| `SIGKILL in train` | 3 | 2 | 0 |" in text
    assert "| `SIGKILL in synth` | 3 | 3 | 0 |" in text
    assert "| **all** | **3** | **7** | **6** | **0** |" in text
    header = text.split("\n\n")[2]
    assert "`ci run`" in header and "CI size" in header and "load 1.5" in header
    assert "`slice train`" in header and "replacing the rows of 1 earlier case(s)" in header
    assert "`slice synth`" in header and "full size" in header and "3 trial(s)" in header
    assert "load 3.10 at its end" in header
    assert "SIGKILL trials per stage: synth 3, prepare 0, train 3," in text
    assert "not run to full size here: prepare, optimize, evaluate, promote" in text
    capsys.readouterr()


def test_the_document_names_no_path_of_the_machine(tmp_path: Path) -> None:
    from tests.faults.conftest import REPO

    led = tmp_path / "l.json"
    _ledger(led, False, "ci run", [("params", "x", True)])
    doc = __import__("json").loads(led.read_text())
    doc["entries"][0]["detail"] = f"{REPO}/params.yaml: bad; /tmp/pytest-of-x/test_a0/out: disk full"
    led.write_text(__import__("json").dumps(doc))
    out = tmp_path / "R.md"
    main(["--render", str(led), "--report", str(out)])
    text = out.read_text()
    assert str(REPO) not in text and "/tmp/" not in text
    assert "<repo>/params.yaml: bad; <tmp>/test_a0/out: disk full" in text
