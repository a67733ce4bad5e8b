"""Self-checks of the fast kernel paths (kernels/selfcheck.py): a wrong kernel is caught and bypassed.

On CPU here: the C kernels (compiled from a planted, wrong copy of kernels/_native.c) and a Triton kernel
under the interpreter (a planted, wrong copy of kernels/_focal_loss_triton.py). Each must be detected at
its first use, said in one warning line naming the path and the figures, and bypassed: the op's results
equal the reference afterwards. Also: verdicts stored 0600 in a 0700 folder and read back instead of
rerun; the build cache and the verdict store refuse a folder another user owns or others can write.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from kernels._testing import enable_triton_interpreter

enable_triton_interpreter()  # before anything imports the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import native, selfcheck  # noqa: E402
from kernels._dispatch import force_triton, interpreter_requested, triton_available  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(not native.available(), reason=f"native CPU kernels: {native.status()}")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "pfk.selfcheck" and r.levelno == logging.WARNING
    ]


def _planted_native(tmp_path: Path) -> native.NativeLibrary:
    """The C kernels with one wrong line: the fp32 scatter-max backward sends twice the gradient."""
    source = (ROOT / "kernels" / "_native.c").read_text()
    right = "for (int64_t c = 0; c < C; ++c) g[(int64_t)w[c] * C + c] = row[c];"
    assert source.count(right) == 1
    planted = tmp_path / "_native.c"
    planted.write_text(source.replace(right, right.replace("= row[c];", "= 2.0f * row[c];")))
    return native.build(planted, tmp_path / "build")


@needs_native
def test_a_planted_wrong_c_kernel_is_caught_and_bypassed(
    tmp_path: Path, selfcheck_store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    planted = _planted_native(tmp_path)
    monkeypatch.setattr(native, "_library", lambda: planted)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(400, 8, generator=g)
    cell = torch.randint(-1, 50, (400,), generator=g)
    caplog.set_level(logging.WARNING, logger="pfk.selfcheck")
    for _ in range(2):  # the second use reads the verdict: no second line
        f = feats.clone().requires_grad_(True)
        canvas = kernels.pillar_scatter_max(f, cell, 50)
        canvas.backward(torch.ones_like(canvas))
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("pfk self-check: native.pillar_scatter_max on cpu: ")
    assert "FAILED (float32 bwd: max|err| " in lines[0] and "using the reference path" in lines[0]
    # bypassed: the values and the gradient are the reference's
    fr = feats.clone().requires_grad_(True)
    want = kernels.pillar_scatter_max_reference(fr, cell, 50)
    want.backward(torch.ones_like(want))
    torch.testing.assert_close(canvas, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(f.grad, fr.grad, rtol=0, atol=0)
    # recorded: the failed verdict, 0600 in a 0700 folder, keyed by the planted library's build
    verdict = selfcheck.verify("native.pillar_scatter_max", "cpu")
    assert verdict.status == selfcheck.FAILED and verdict.figures["float32 fwd"] == 0.0
    assert verdict.figures["float32 bwd"] > 0 and Path(verdict.recorded).parent == selfcheck_store
    assert oct(Path(verdict.recorded).stat().st_mode & 0o777) == "0o600"
    assert oct(selfcheck_store.stat().st_mode & 0o777) == "0o700"
    # the kernels the planted line does not touch still verify, and run
    assert selfcheck.verify("native.group_norm_relu", "cpu").status == selfcheck.VERIFIED


@needs_native
def test_the_real_c_kernels_verify_once_and_the_verdict_is_read_back(
    selfcheck_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in ("native.pillar_scatter_max", "native.group_norm_relu", "native.pillar_stem"):
        first = selfcheck.verify(path, "cpu")
        assert first.status == selfcheck.VERIFIED, first
        assert first.key["source"] and first.key["device"].startswith("cpu: ")
    calls: list[str] = []
    check = selfcheck.checks()["native.pillar_stem"]
    monkeypatch.setitem(
        selfcheck._CHECKS,
        check.path,
        selfcheck.Check(check.path, lambda d: calls.append(d) or {}, check.fingerprint, ("cpu",)),
    )
    selfcheck.forget()  # a new process, as far as verdicts go: the stored one is used, not rerun
    assert selfcheck.trusted("native.pillar_stem", torch.device("cpu")) and calls == []
    assert selfcheck.verify("native.pillar_stem", "cpu", rerun=True).status == selfcheck.VERIFIED and calls


@needs_native
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast"])
def test_a_first_use_inside_no_grad_or_autocast_still_verifies(selfcheck_store: Path, mode: str) -> None:
    """Evaluation's first use of a kernel comes inside torch.no_grad / inference_mode, AMP training's inside
    autocast: the check must judge the kernel, not the caller's modes (it once failed there with 'element 0
    of tensors does not require grad', and under bf16 autocast with 'float32 fwd: rel|err| 0.00213', which
    sent the default run's training to the reference path and changed its model.pt)."""
    modes = {"autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    with modes.get(mode, getattr(torch, mode))():
        verdict = selfcheck.verify("native.pillar_stem", "cpu")
    assert verdict.status == selfcheck.VERIFIED, verdict
    assert any(" bwd" in k for k in verdict.figures), verdict.figures


def _ran_in_a_fresh_process(test: str) -> bool:
    """Run this module's `test` in a fresh Python and assert it passed (True), unless this is that process
    (False: run the body). torch.compile earlier in the same process (another module on this pytest-xdist
    worker, e.g. tests/train/test_compile.py) leaves the Triton interpreter unable to run the self-check's
    launches ("Cannot call @triton.jit'd outside of the scope of a kernel"): a test-order effect, not a
    fault of the self-check, which these two tests are about."""
    if os.environ.get("PFK_TEST_FRESH_PROCESS") == "1":
        return False
    env = {**os.environ, "PFK_TEST_FRESH_PROCESS": "1", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{Path(__file__).resolve()}::{test}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
    return True


_PLANTED_TRITON = "kernels._focal_loss_triton"


@pytest.mark.skipif(
    not (triton_available() and interpreter_requested()), reason="needs triton and TRITON_INTERPRET=1"
)
def test_a_planted_wrong_triton_kernel_is_caught_and_bypassed(
    tmp_path: Path, selfcheck_store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy of the focal loss' Triton module whose backward kernel is off by 10%, run by the interpreter."""
    if _ran_in_a_fresh_process("test_a_planted_wrong_triton_kernel_is_caught_and_bypassed"):
        return
    source = (ROOT / "kernels" / "_focal_loss_triton.py").read_text()
    right = "grad = scale * tl.where(t == 1.0, d_pos, d_neg)"
    assert source.count(right) == 1, "the planted line moved: update the test"
    planted = tmp_path / "_focal_loss_triton.py"
    planted.write_text(source.replace(right, right.replace("grad = scale", "grad = 1.1 * scale")))
    spec = importlib.util.spec_from_file_location(_PLANTED_TRITON, planted)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, _PLANTED_TRITON, module)
    x = (torch.randn(2, 3, 6, 5, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_(True)
    t = torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) ** 4
    t.view(-1)[:3] = 1.0
    caplog.set_level(logging.WARNING, logger="pfk.selfcheck")
    with force_triton():
        loss = kernels.focal_loss(x, t)
        (grad,) = torch.autograd.grad(loss, [x])
        kernels.focal_loss(x, t)
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].startswith("pfk self-check: triton.focal_loss on cpu: ")
    assert "FAILED (float32 bwd: rel|err| 0.1 > tol 1e-05)" in lines[0], lines[0]
    xr = x.detach().clone().requires_grad_(True)
    want = kernels.focal_loss_reference(xr, t)
    (want_grad,) = torch.autograd.grad(want, [xr])
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(
    not (triton_available() and interpreter_requested()), reason="needs triton and TRITON_INTERPRET=1"
)
def test_the_real_triton_kernels_verify_under_the_interpreter(selfcheck_store: Path) -> None:
    if _ran_in_a_fresh_process("test_the_real_triton_kernels_verify_under_the_interpreter"):
        return
    for path in ("triton.focal_loss", "triton.pillar_scatter_max", "triton.render_heatmap"):
        verdict = selfcheck.verify(path, "cpu")
        assert verdict.status == selfcheck.VERIFIED, verdict
        assert verdict.figures and all(v <= 2**-6 for v in verdict.figures.values())


def test_a_store_folder_that_others_can_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("PFK_SELFCHECK_DIR", str(shared))
    caplog.set_level(logging.WARNING, logger="pfk.selfcheck")
    assert selfcheck.store_dir() is None
    assert _warnings(caplog) == [
        f"self-check verdicts: refusing {shared}: others can write to it (mode 777; `chmod go-w` it if it is yours)"
    ]


@pytest.mark.skipif(
    not hasattr(os, "getuid") or os.getuid() != 0, reason="making a folder of another user needs root"
)
def test_a_folder_another_user_owns_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 4242, 4242)
    assert selfcheck.folder_problem(theirs) == "it is owned by uid 4242, not by you (uid 0)"
    assert selfcheck.private_dir([theirs, tmp_path / "mine"], "test") == tmp_path / "mine"


def _native_status(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from kernels import native; print(native.status())"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
        timeout=120,
    )


def test_the_c_kernel_cache_refuses_a_folder_others_can_write(tmp_path: Path) -> None:
    """A predictable /tmp-style folder someone else could have planted a library in: never loaded from,
    one line on stderr, the PyTorch ops instead."""
    planted = tmp_path / "pfk-native-0"
    planted.mkdir()
    planted.chmod(0o777)
    res = _native_status({"PFK_NATIVE_CACHE_DIR": str(planted)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("unavailable (no private build cache: none of ")
    assert res.stderr.strip().splitlines() == [
        f"C kernel build cache: refusing {planted}: others can write to it (mode 777; `chmod go-w` it if it is yours)"
    ]
    assert not list(planted.iterdir())


def test_the_default_c_kernel_cache_is_private_and_in_the_project(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PFK_NATIVE_CACHE_DIR"}
    candidates = subprocess.run(
        [sys.executable, "-c", "from kernels import selfcheck; print(selfcheck.cache_candidates('native', 'PFK_NATIVE_CACHE_DIR')[0])"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert candidates.stdout.strip() == str(ROOT / "artifacts" / ".state" / "native")
    built = tmp_path / "fresh" / "native"
    res = _native_status({"PFK_NATIVE_CACHE_DIR": str(built)})
    if res.stdout.strip() == "native":
        assert oct(built.stat().st_mode & 0o777) == "0o700"
        assert all(f.stat().st_mode & 0o022 == 0 for f in built.iterdir())
