"""Run the fault-injection suite and publish its figures.

    python -m tests.faults.run --full          # the full matrix; writes docs/RELIABILITY.md
    python -m tests.faults.run                 # the CI-size subset; prints the table
    python -m tests.faults.run -- -k crash     # extra pytest arguments after --
    python -m tests.faults.run --full --stage train --ledger L.json --baseline DIR
                                               # one slice of the matrix: the SIGKILL trials in train only,
                                               # the ledger kept in L.json, the undisturbed baseline run kept
                                               # in DIR for the next slice (same commit)
    python -m tests.faults.run --render LEDGER [LEDGER ...] --report docs/RELIABILITY.md
                                               # the table of ledgers earlier runs wrote (slices of the
                                               # matrix, or a pytest run with PFACTORY_FAULTS_LEDGER set);
                                               # a later ledger's cases replace the same cases of earlier ones

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
from tests.flows.pipeline_project import STAGES

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
    parser.add_argument(
        "--stage",
        action="append",
        choices=STAGES,
        default=None,
        help="only the SIGKILL trials in this stage (repeatable): the matrix run in slices",
    )
    parser.add_argument("--ledger", type=Path, default=None, help="keep the ledger (JSON) in this file")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep the undisturbed baseline run in DIR and reuse it in later slices at the same commit",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.render is not None:
        meta, entries = load(args.render[0])
        for later in args.render[1:]:
            m2, e2 = load(later)
            new_cases = {(e.fault_class, e.case) for e in e2}
            replaced = len({(e.fault_class, e.case) for e in entries} & new_cases)
            entries = [e for e in entries if (e.fault_class, e.case) not in new_cases] + e2
            part = {**m2, "cases": len(new_cases), "replaced": replaced, "trials": len(e2)}
            meta = {**meta, "parts": [*meta.get("parts", []), part]}
        text = render(meta, entries)
        if args.report is None:
            print(text)
        else:
            args.report.write_text(text)
            print(f"wrote {args.report} ({len(entries)} trials)")
        return 0
    report = args.report or (REPORT if args.full and not args.stage else None)
    command = "python -m tests.faults.run" + (" --full" if args.full else "")
    command += "".join(f" --stage {st}" for st in args.stage or [])
    shown = [a for a in args.pytest_args if not a.startswith(("--basetemp", "-r", "--durations"))]
    if shown:  # what selects or sizes the tests (not where their temp files went)
        command += " -- " + " ".join(shown)
    with tempfile.TemporaryDirectory(prefix="pfactory-faults-") as tmp:
        ledger = args.ledger or Path(tmp) / "ledger.json"
        env = {**os.environ, LEDGER_ENV: str(ledger.resolve()), "PFACTORY_FAULTS_COMMAND": command}
        # Every fault test runs here, those of pytest's full tier too (`--full`); the matrix size is this
        # command's own switch (an explicit "0" keeps pytest's --full from widening it).
        env["PFACTORY_FAULTS_FULL"] = "1" if args.full else "0"
        if args.stage:
            env["PFACTORY_FAULTS_STAGES"] = ",".join(args.stage)
        if args.baseline:
            args.baseline.mkdir(parents=True, exist_ok=True)
            env["PFACTORY_FAULTS_BASELINE"] = str(args.baseline.resolve())
        target = ["tests/faults/test_crashes.py", "-k", "sigkill"] if args.stage else ["tests/faults"]
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *target,
            "-p",
            "no:cacheprovider",
            "-q",
            "--full",
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
