"""`pfk::pillar_stem` (kernels/pillar_stem.py): the scatter-max canvas' 3x3 stride-2 conv from the
occupied pillars, against `pillar_stem_reference` (dense canvas + conv2d) forward and backward, on the C
kernels and on the PyTorch fallback; `torch.library.opcheck` on the op and its backward op.
(The model with and without it: tests/archs/painted_pillars/test_detector.py; bitwise determinism: test_native.py.)"""

from __future__ import annotations

import pytest
import torch

from kernels import native, pillar_stem, pillar_stem_reference

PATHS = ["native", "torch-ops"]


def _use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "native" and not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    if path == "torch-ops":
        monkeypatch.setattr(native, "pillar_stem_supported", lambda *a: False)
        monkeypatch.setattr(native, "available", lambda: False)


def _case(b: int, h: int, w: int, c: int, cout: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # [N, C] > 0 and distinct: no ties (the reference's autograd splits a tie's gradient, the op gives it
    # to the lowest point index, as `pillar_scatter_max`: tests/kernels/test_pillar_scatter.py)
    feats = torch.rand(n, c, generator=g).requires_grad_()
    cell = torch.randint(-1, b * h * w + 3, (n,), generator=g)  # [N], some dropped (-1, >= cells)
    weight = torch.randn(cout, c, 3, 3, generator=g).requires_grad_()
    return feats, cell, weight


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("round_bf16", [False, True], ids=["fp32", "bf16-canvas"])
@pytest.mark.parametrize("b,h,w,c,cout,n", [(2, 7, 9, 5, 6, 60), (1, 10, 6, 17, 33, 200)])
def test_op_forward_and_backward_equal_the_reference(
    path: str,
    round_bf16: bool,
    b: int,
    h: int,
    w: int,
    c: int,
    cout: int,
    n: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Odd grids (padded to the conv's output), channel counts off the 16-float blocks, dropped points:
    output, feature gradient and weight gradient vs the reference's autograd."""
    _use(path, monkeypatch)
    feats, cell, weight = _case(b, h, w, c, cout, n, seed=n)
    out_hw = ((h + 1) // 2, (w + 1) // 2)
    out_dtype = torch.bfloat16 if round_bf16 else torch.float32
    out = pillar_stem(feats, cell, weight, b, (h, w), out_hw, round_bf16, out_dtype)
    ref = pillar_stem_reference(feats, cell, weight, b, (h, w), out_hw, round_bf16, out_dtype)
    assert out.shape == ref.shape == (b, cout, *out_hw) and out.dtype == out_dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    tol = {"rtol": 2**-7, "atol": 1e-2} if round_bf16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out_dtype)
    got = torch.autograd.grad(out, (feats, weight), g)
    want = torch.autograd.grad(ref, (feats, weight), g)
    torch.testing.assert_close(got[0], want[0], **tol)
    # The reference rounds the weight's gradient to bf16 (its `.to(bfloat16)` backward); the op sums in fp32.
    torch.testing.assert_close(
        got[1], want[1], rtol=2**-7 if round_bf16 else 1e-4, atol=3e-2 if round_bf16 else 1e-4
    )


@pytest.mark.parametrize("path", PATHS)
def test_opcheck(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every point in a cell of its own (M = N): seg's and win's rows >= M, which the op leaves
    unspecified, do not exist, so opcheck's output comparisons see only defined values."""
    _use(path, monkeypatch)
    feats, _cell, weight = _case(2, 7, 9, 5, 6, 60, seed=0)
    cell = torch.randperm(2 * 7 * 9, generator=torch.Generator().manual_seed(0))[:60]  # [60] distinct cells
    for round_bf16, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        args = (feats, cell, weight, 2, 7, 9, 4, 5, round_bf16, dtype)
        torch.library.opcheck(torch.ops.pfk.pillar_stem.default, args)
        _out, *saved = torch.ops.pfk.pillar_stem(feats.detach(), cell, weight.detach(), *args[3:])
        grad = torch.randn(2, 6, 4, 5).to(dtype)
        bwd = (grad, weight.detach(), *saved, 7, 9, round_bf16)
        torch.library.opcheck(torch.ops.pfk.pillar_stem_backward.default, bwd)


def test_bad_input_is_refused_with_the_argument_named() -> None:
    feats, cell, weight = _case(1, 4, 4, 3, 2, 10, seed=0)
    with pytest.raises(ValueError, match="pillar_stem: weight must be \\[Cout, 3, 3, 3\\]"):
        pillar_stem(feats, cell, weight[:, :2], 1, (4, 4), (2, 2))
    with pytest.raises(ValueError, match="pillar_stem: cell_index must have dtype"):
        pillar_stem(feats, cell.int(), weight, 1, (4, 4), (2, 2))
