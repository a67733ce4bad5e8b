"""Run the fault-injection suite and publish its figures.

    python -m tests.faults.run --full          # the full matrix; writes docs/RELIABILITY.md
    python -m tests.faults.run                 # the CI-size subset; prints the table
    python -m tests.faults.run -- -k crash     # extra pytest arguments after --
    python -m tests.faults.run --render LEDGER [RERUN_LEDGER ...] --report docs/RELIABILITY.md
                                               # the table of a ledger another pytest run wrote (the full
                                               # suite with PFACTORY_FAULTS_LEDGER=LEDGER set)

The table is generated from the ledger the tests record (tests/faults/ledger.py), so the published figures
are those of the run that wrote them: fault class, cases, trials, survived, lost or wrongly kept.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.faults.ledger import LEDGER_ENV, load, render

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "docs" / "RELIABILITY.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full matrix (every kill point x 3 trials)")
    parser.add_argument("--report", type=Path, default=None, help=f"write the table here (--full: {REPORT})")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        default=None,
        metavar="LEDGER",
        help="no pytest run: render the ledger a run wrote ($PFACTORY_FAULTS_LEDGER); a later ledger's "
        "cases (a rerun of some tests) replace the same cases of the earlier ones, and the header says so",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.render is not None:
        meta, entries = load(args.render[0])
        for later in args.render[1:]:
            m2, e2 = load(later)
            redone = {(e.fault_class, e.case) for e in e2}
            entries = [e for e in entries if (e.fault_class, e.case) not in redone] + e2
            meta = {**meta, "rerun": [*meta.get("rerun", []), {**m2, "cases": len(redone)}]}
        text = render(meta, entries)
        if args.report is None:
            print(text)
        else:
            args.report.write_text(text)
            print(f"wrote {args.report} ({len(entries)} trials)")
        return 0
    report = args.report or (REPORT if args.full else None)
    command = "python -m tests.faults.run" + (" --full" if args.full else "")
    with tempfile.TemporaryDirectory(prefix="pfactory-faults-") as tmp:
        ledger = Path(tmp) / "ledger.json"
        env = {**os.environ, LEDGER_ENV: str(ledger), "PFACTORY_FAULTS_COMMAND": command}
        if args.full:
            env["PFACTORY_FAULTS_FULL"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "tests/faults",
            "-p",
            "no:cacheprovider",
            "-q",
            *args.pytest_args,
        ]
        code = subprocess.call(cmd, cwd=REPO, env=env)
        if not ledger.is_file():
            print("no ledger written (no fault test ran)", file=sys.stderr)
            return code or 1
        meta, entries = load(ledger)
    text = render(meta, entries)
    if report is not None:
        report.write_text(text)
        print(f"wrote {report} ({len(entries)} trials)")
    else:
        print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
