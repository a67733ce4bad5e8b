"""`factory doctor`, `native_bf16` by compute capability, and scripts/gpu_check.sh's coverage.

The self-check mechanism itself (planted wrong kernels caught and bypassed, the store's modes, refused
folders) is tested in tests/kernels/test_selfcheck.py; here: the command a user runs, its JSON, the bf16
rule, and that the GPU owner's one command runs every gpu-marked test file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pfactory.train.runtime import cuda_bf16_native, native_bf16

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "capability,native",
    [
        ((6, 1), False),
        ((7, 0), False),
        ((7, 5), False),
        ((8, 0), True),
        ((8, 6), True),
        ((9, 0), True),
        ((10, 0), True),
    ],
)
def test_native_bf16_follows_the_compute_capability(capability: tuple[int, int], native: bool) -> None:
    """bf16 tensor cores from Ampere (8.0): a V100 (7.0) or a T4 (7.5) trains in fp32."""
    assert cuda_bf16_native(capability) is native
    assert native_bf16(torch.device("cuda", 0), capability) is native


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from factory.cli import main; main()", "doctor", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        # Not the interpreter another test module of this process may have asked for (kernels/_testing.py):
        # on a machine without a GPU, doctor skips the Triton paths unless TRITON_INTERPRET=1 is set.
        env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})},
    )  # fmt: skip


def test_factory_doctor_prints_every_path_and_its_json(tmp_path: Path) -> None:
    env = {"PFK_SELFCHECK_DIR": str(tmp_path / "verdicts")}
    table = _doctor(env=env)
    assert table.returncode == 0, table.stderr[-2000:]
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["path", "device", "status"]
    paths = {ln.split()[0] for ln in lines[1:]}
    assert {"native.pillar_scatter_max", "native.group_norm_relu", "native.pillar_stem", "triton.focal_loss",
            "triton.pillar_scatter_max", "triton.render_heatmap", "dali.gpu_decode",
            "cuda.bf16_train_step"} <= paths  # fmt: skip
    rows = json.loads(_doctor("--json", env=env).stdout)
    by = {(r["path"], r["device"].split(":")[0]): r for r in rows}
    for r in rows:
        assert r["status"] in ("verified", "failed", "skipped") and (r["status"] == "verified" or r["reason"])
    if not torch.cuda.is_available():
        assert by[("dali.gpu_decode", "cuda")]["reason"] == "no CUDA device here"
        assert by[("triton.focal_loss", "cpu")]["status"] == "skipped"
    from kernels import native

    if native.available():
        scatter = by[("native.pillar_scatter_max", "cpu")]
        assert scatter["status"] == "verified" and scatter["figures"]["float32 bwd"] == 0.0
        assert Path(scatter["recorded"]).parent == tmp_path / "verdicts"


def test_a_stage_records_the_verdicts_it_used() -> None:
    """What `tracking.stage_run` logs as the run's param `selfcheck`: the paths this process trusted."""
    code = (
        "import torch, kernels\n"
        "from kernels import selfcheck\n"
        "kernels.group_norm_relu(torch.randn(1, 8, 4, 4).contiguous(memory_format=torch.channels_last),"
        " torch.ones(8), torch.zeros(8), 2)\n"
        "print(selfcheck.used_json())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    used = json.loads(res.stdout.splitlines()[-1])
    from kernels import native

    if native.available():
        assert [k.split("@")[0] for k in used] == ["native.group_norm_relu"]
        assert list(used.values()) == ["verified"]


def test_gpu_check_runs_every_gpu_marked_test_file() -> None:
    res = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    marked = sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("*.py")
        if re.search(r"mark\.gpu|triton_device_params\(", p.read_text())
    )
    assert "tests/factory/test_doctor.py" in marked and "tests/prepare/test_camera.py" in marked
    listed = [ln.strip() for ln in res.stdout.split("would run:")[0].splitlines()[1:]]
    assert listed == marked
    pytest_line = next(ln for ln in res.stdout.splitlines() if " -m pytest -m gpu " in ln)
    assert all(f" {f} " in pytest_line for f in marked)
    assert any(ln.strip().endswith("doctor") or " doctor " in ln for ln in res.stdout.splitlines())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_fast_path_verifies_on_this_gpu(tmp_path: Path) -> None:
    """On a GPU machine: the Triton kernels, DALI's GPU decode and a bf16 training step verify (or are
    skipped for a stated reason that is not a failure); none fails."""
    from factory import doctor

    os.environ.setdefault("PFK_SELFCHECK_DIR", str(tmp_path / "verdicts"))
    rows = doctor.run_checks(rerun=True)
    failed = [r for r in rows if r["status"] == "failed"]
    assert not failed, doctor.table(failed)
    cuda = {r["path"]: r for r in rows if r["device"] != "cuda" and not r["device"].startswith("cpu")}
    for path in (
        "triton.focal_loss",
        "triton.pillar_scatter_max",
        "triton.render_heatmap",
        "dali.gpu_decode",
    ):
        assert cuda[path]["status"] == "verified", cuda[path]
