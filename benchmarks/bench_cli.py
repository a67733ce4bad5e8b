"""`factory --help` latency (target < 1 s): median of N cold subprocess runs.

Run: python benchmarks/bench_cli.py [--runs 7]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    exe = shutil.which("factory")
    cmd = [exe, "--help"] if exe else [sys.executable, "-m", "factory.cli", "--help"]
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    result = {
        "command": " ".join(cmd),
        "runs": args.runs,
        "median_s": statistics.median(times),
        "max_s": max(times),
    }
    print(
        f"factory --help: median {result['median_s']:.3f} s, max {result['max_s']:.3f} s over {args.runs} runs"
    )
    return result


if __name__ == "__main__":
    main()
