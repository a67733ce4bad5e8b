"""`factory bench newcomer`'s variant syntax and its clone of another revision (the A/B against main)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from benchmarks.bench_newcomer import _clone_at, parse_variant, split_ref
from tests.newcomer import REPO, is_git_checkout


def test_variants_carry_overrides_and_an_optional_revision() -> None:
    assert parse_variant("seed1=synth.seed=1,prepare.image_size=[104,32]") == (
        "seed1",
        ["synth.seed=1", "prepare.image_size=[104,32]"],
    )
    assert parse_variant("main@origin/main=") == ("main@origin/main", [])
    assert split_ref("main@origin/main") == ("main", "origin/main")
    assert split_ref("mine") == ("mine", None)
    for bad in ("nolabel", "=x=1", "@ref=", "main@="):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL"):
            parse_variant(bad)


@pytest.mark.skipif(not is_git_checkout(), reason="needs the repository's git history")
def test_a_variant_at_a_revision_runs_that_commit_without_the_working_tree(tmp_path: Path) -> None:
    parent = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD~1"], capture_output=True, text=True)
    if parent.returncode != 0:
        pytest.skip("a shallow clone: no parent commit")
    clone = _clone_at(tmp_path / "clone", "HEAD~1")
    assert clone.commit == parent.stdout.strip()
    assert clone.dirty == []
    status = subprocess.run(["git", "-C", str(clone.path), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout.strip() == ""  # nothing of this checkout's uncommitted work
    with pytest.raises(SystemExit, match="no-such-revision"):
        _clone_at(tmp_path / "other", "no-such-revision")
