"""Shared entry point of `python -m tasks.<stage>` (what `dvc.yaml` runs).

Parses `[-S section.key=value ...] [--params FILE]`, loads and validates params (exit 2 with
a message naming the key on a bad value), configures the offline environment, runs the
stage and prints its metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def stage_main(stage: str, argv: list[str] | None, body: Callable[[Any], dict]) -> None:
    from pfactory.config import ParamsError, load_params
    from pfactory.tracking import configure_environment

    parser = argparse.ArgumentParser(prog=f"python -m tasks.{stage}")
    parser.add_argument("-S", "--set-param", action="append", default=[], help="section.key=value override")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    configure_environment()
    try:
        params = load_params(args.params, args.set_param)
    except ParamsError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    metrics = body(params)
    print(json.dumps(metrics, indent=2, sort_keys=True, default=str))
