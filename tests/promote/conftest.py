"""Fixtures of the registry tests: the shared promotion bench (built once per session) and a fresh
sqlite MLflow registry per test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import ROOT, build_bench

if str(ROOT) not in sys.path:  # the repo's `tasks`
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def bench(tmp_path_factory) -> dict[str, Path]:
    return build_bench(tmp_path_factory.getbasetemp() / "promote-bench")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fresh sqlite tracking + registry store in tmp_path; the cwd is a scratch project."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    monkeypatch.delenv("PFACTORY_PARENT_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    from pfactory.promote import registry as reg

    return reg.client()
