"""The native CPU kernels (kernels/native.py, kernels/_native.c) against their PyTorch specs.

GroupNorm + ReLU is tested through the model's `GroupNormReLU` (tests/archs/painted_pillars/test_detector.py, with and
without the C kernels); here: the scatter-max against `pillar_scatter_max_reference` and the PyTorch
compact path (bit for bit: maxima, winners, gradients), GroupNorm on a strided gradient and odd sizes,
run-to-run determinism, and the fallback when no compiler is found or the kernels are turned off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import native
from kernels.pillar_scatter import (
    _pillar_scatter_max_backward_compact,
    _pillar_scatter_max_compact,
    pillar_scatter_argmax_reference,
    pillar_scatter_max_reference,
)

ROOT = Path(__file__).resolve().parents[2]
needs_native = pytest.mark.skipif(not native.available(), reason=f"native CPU kernels: {native.status()}")


def _points(
    n: int, c: int, cells: int, seed: int, special: bool, ties: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, c, generator=g)
    if ties:
        feats[torch.rand(n, c, generator=g) < 0.3] = 0.5  # ties inside a cell
    cell = torch.randint(-1, cells + 2, (n,), generator=g)  # -1 and >= cells: dropped
    if special:
        feats[0, 0], feats[1, 1], feats[2, 2] = float("inf"), -float("inf"), -0.0
        feats[3, 3], feats[7, 3] = float("nan"), float("nan")
    return feats, cell


def _torch_compact(monkeypatch: pytest.MonkeyPatch, *args):
    with monkeypatch.context() as m:
        m.setattr(native, "scatter_max_supported", lambda *a: False)
        return _pillar_scatter_max_compact(*args)


@needs_native
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf-signed-zero"])
@pytest.mark.parametrize("n,c,cells", [(0, 4, 9), (1, 3, 1), (500, 8, 40), (3000, 32, 700)])
def test_scatter_max_equals_the_reference_and_the_torch_compact_path(
    n: int, c: int, cells: int, special: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Canvas (fp32 and bf16), winner table and M: bit for bit the PyTorch compact path; canvas = the
    reference's, winners = the reference argmax (lowest point index holding the max, NaN the largest)."""
    if special and n < 8:
        pytest.skip("needs 8 points")
    feats, cell = _points(n, c, cells, seed=n + c, special=special)
    for dtype in (torch.float32, torch.bfloat16):
        got = native.scatter_max_forward(feats, cell, cells, True, dtype)
        want = _torch_compact(monkeypatch, feats, cell, cells, True, dtype)
        for a, e in zip(got, want):
            assert a.dtype == e.dtype and a.shape == e.shape
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
    canvas, wcell, wpoint, rows = native.scatter_max_forward(feats, cell, cells, True, torch.float32)
    ref = pillar_scatter_max_reference(feats, cell, cells)
    torch.testing.assert_close(canvas, ref, rtol=0, atol=0, equal_nan=True)
    argmax = pillar_scatter_argmax_reference(feats, cell, cells, ref)
    m = int(rows[0])
    occupied = (argmax[:, 0] >= 0).nonzero().squeeze(1)
    assert m == occupied.numel()
    assert torch.equal(wcell[:m], occupied) and bool((wcell[m:] == -1).all())
    assert torch.equal(wpoint[:m].long(), argmax[occupied]) and bool((wpoint[m:] == -1).all())
    no_table = native.scatter_max_forward(feats, cell, cells, False, torch.float32)
    torch.testing.assert_close(no_table[0], canvas, rtol=0, atol=0, equal_nan=True)
    assert no_table[1].numel() == 0 and int(no_table[3][0]) == 0


@needs_native
@pytest.mark.parametrize("canvas_dtype", [torch.float32, torch.bfloat16])
def test_scatter_max_backward_equals_the_torch_compact_path(
    canvas_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grad_features: bit for bit the PyTorch compact backward, also from a strided gradient canvas."""
    feats, cell = _points(4000, 32, 900, seed=3, special=False)
    _, wcell, wpoint, rows = native.scatter_max_forward(feats, cell, 900, True, canvas_dtype)
    wide = torch.randn(900, 40).to(canvas_dtype)
    for grad in (wide[:, :32].contiguous(), wide[:, 4:36]):  # contiguous, and rows of stride 40
        got = native.scatter_max_backward(grad, wcell, wpoint, rows, torch.float32)
        with monkeypatch.context() as m:
            m.setattr(native, "scatter_max_backward_supported", lambda *a: False)
            want = _pillar_scatter_max_backward_compact(grad, wcell, wpoint, rows, torch.float32)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_native
def test_the_op_forward_and_backward_equal_the_reference_autograd() -> None:
    """`kernels.pillar_scatter_max` (its CPU path is the C kernel) vs autograd of the reference (no ties:
    autograd shares a tied max's gradient, the op gives it to the lowest point index)."""
    feats, cell = _points(2000, 16, 300, seed=5, special=False, ties=False)
    cell = cell.clamp(max=299)  # the public op refuses indices >= num_cells (-1 drops)
    feats.requires_grad_(True)
    grad = torch.randn(300, 16)
    (want,) = torch.autograd.grad(pillar_scatter_max_reference(feats, cell, 300), feats, grad)
    out = kernels.pillar_scatter_max(feats, cell, 300)
    torch.testing.assert_close(out, pillar_scatter_max_reference(feats.detach(), cell, 300), rtol=0, atol=0)
    (got,) = torch.autograd.grad(out, feats, grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("shape,groups", [((1, 8, 3, 5), 2), ((3, 24, 40, 31), 8), ((2, 64, 33, 40), 1)])
def test_group_norm_relu_odd_sizes_and_a_channel_slice_gradient(shape: tuple, groups: int) -> None:
    """Forward and backward against float64 autograd for odd batch sizes and pixel counts (one and two
    chunks per sample), with the gradient a channel slice of a wider channels-last tensor (the neck's
    concatenation), in fp32 and bf16."""
    torch.manual_seed(1)
    b, c, h, w = shape
    weight, bias = torch.rand(c) + 0.5, torch.rand(c) - 0.5
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        x = (torch.randn(shape) * 3 + 1).to(dtype).contiguous(memory_format=torch.channels_last)
        wide = torch.randn(b, c + 8, h, w).to(dtype).contiguous(memory_format=torch.channels_last)
        g = wide[:, 3 : 3 + c]  # channels contiguous, pixel stride c + 8
        out, mean, rstd = native.group_norm_relu_forward(x, weight, bias, groups, 1e-5, dtype)
        dx, dw, db = native.group_norm_relu_backward(g, x, mean, rstd, weight, bias, groups)
        # The backward's recomputed ReLU mask is the forward's: pre-masking the gradient changes nothing.
        masked = native.group_norm_relu_backward(g * (out > 0), x, mean, rstd, weight, bias, groups)
        for p, q in zip(masked, (dx, dw, db)):
            assert torch.equal(p, q)
        x64 = x.double().requires_grad_(True)
        w64, b64 = weight.double().requires_grad_(True), bias.double().requires_grad_(True)
        y64 = F.relu(F.group_norm(x64, groups, w64, b64, 1e-5))
        torch.testing.assert_close(out.double(), y64, atol=1e-5, rtol=rtol)
        # the reference's mask is its own output's: compare where both agree on the sign
        g64 = g.double() * (out > 0)
        want = torch.autograd.grad(y64, [x64, w64, b64], g64)
        scale = want[0].abs().max()
        torch.testing.assert_close(dx.double() / scale, want[0] / scale, atol=rtol, rtol=0)
        torch.testing.assert_close(dw.double(), want[1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(db.double(), want[2], atol=1e-4, rtol=1e-4)


@needs_native
def test_group_norm_relu_is_bitwise_reproducible() -> None:
    x = torch.randn(4, 32, 50, 44).bfloat16().contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(32), torch.rand(32)
    a = native.group_norm_relu_forward(x, w, b, 8, 1e-5, torch.bfloat16)
    e = native.group_norm_relu_forward(x, w, b, 8, 1e-5, torch.bfloat16)
    for p, q in zip(a, e):
        assert torch.equal(p, q)
    g = torch.randn_like(x)
    assert all(
        torch.equal(p, q)
        for p, q in zip(
            native.group_norm_relu_backward(g, x, a[1], a[2], w, b, 8),
            native.group_norm_relu_backward(g, x, a[1], a[2], w, b, 8),
        )
    )


def _status_in_subprocess(env: dict[str, str]) -> str:
    code = (
        "import torch\nfrom kernels import native\nfrom pfactory.archs.painted_pillars.layers import GroupNormReLU\n"
        "gn = GroupNormReLU(2, 4)\nx = torch.randn(2, 4, 40, 40).contiguous(memory_format=torch.channels_last)\n"
        "gn(x.requires_grad_()).sum().backward()\nprint('STATUS', native.status())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split("STATUS", 1)[1].strip()


def test_no_compiler_or_turned_off_falls_back_to_the_torch_ops(tmp_path: Path) -> None:
    """Without a C compiler (or with PFK_NATIVE=0) training still runs, on the PyTorch ops, and
    `status()` says why; a fresh cache directory gets a build when a compiler is there."""
    off = _status_in_subprocess({"PFK_NATIVE": "0"})
    assert off.startswith("off")
    missing = _status_in_subprocess(
        {"CC": str(tmp_path / "no-such-cc"), "PFK_NATIVE_CACHE_DIR": str(tmp_path / "empty")}
    )
    assert missing.startswith("unavailable") and "no-such-cc" in missing
    if native.available():
        built = _status_in_subprocess({"PFK_NATIVE_CACHE_DIR": str(tmp_path / "fresh")})
        assert built == "native"
        assert len(list((tmp_path / "fresh").glob("pfk_native_*.so"))) == 1


def _stem_case(seed: int, b: int, h: int, w: int, c: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cell = torch.randint(-1, b * h * w, (n,), generator=g)  # -1: dropped
    feats = torch.relu(torch.randn(n, c, generator=g))  # >= 0, many exact zeros (the MLP's ReLU)
    feats[: n // 10] = 0.25  # ties
    return feats, cell


@needs_native
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(
    "b,h,w,c,cout,n",
    [(2, 12, 10, 8, 16, 300), (3, 9, 7, 5, 40, 200), (1, 40, 36, 32, 32, 2000), (2, 8, 8, 4, 4, 0)],
)
def test_pillar_stem_is_the_dense_conv_of_the_scatter_max_canvas(
    b: int, h: int, w: int, c: int, cout: int, n: int, bf16: bool
) -> None:
    """The sparse stem == conv2d(pillar_scatter_max canvas, weight, stride 2, padding 1): output, the
    point features' gradient and the weight's; odd grids (a last output row/column fed by one input row),
    channel counts that are not multiples of 16, dropped points, ties, no points. fp32 to float
    rounding; under bf16 autocast within bf16 rounding of the dense bf16 conv."""
    feats, cell = _stem_case(b * h + c, b, h, w, c, n)
    weight = torch.randn(cout, c, 3, 3) * 0.2
    ho, wo = (h - 1) // 2 + 1, (w - 1) // 2 + 1
    fr, wr = feats.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        canvas = kernels.pillar_scatter_max(
            fr, cell, b * h * w, canvas_dtype=torch.bfloat16 if bf16 else None
        )
        dense = F.conv2d(canvas.view(b, h, w, c).permute(0, 3, 1, 2), wr, stride=2, padding=1)
    out, *saved = native.pillar_stem_forward(
        feats, cell, weight, b, (h, w), (ho, wo), bf16, torch.bfloat16 if bf16 else torch.float32
    )
    assert out.shape == dense.shape == (b, cout, ho, wo) and out.dtype == dense.dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    tol = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.float(), dense.float(), **tol)
    g = torch.randn(dense.shape).to(dense.dtype)
    want_f, want_w = torch.autograd.grad(dense, [fr, wr], g)
    got_f, got_w = native.pillar_stem_backward(g, weight, *saved, (h, w), bf16)
    scale_f, scale_w = (
        torch.cat([t.abs().flatten().float(), torch.full((1,), 1e-6)]).max() for t in (want_f, want_w)
    )
    rel = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(got_f / scale_f, want_f.float() / scale_f, atol=rel, rtol=0)
    torch.testing.assert_close(got_w / scale_w, want_w.float() / scale_w, atol=rel, rtol=0)
    # only the points holding a max get a gradient, as the scatter-max's backward gives it. The winners come
    # from the fp32 scatter-max's own backward (a 1 per winner): the dense bf16 conv's gradient is no mask,
    # it rounds some winners' small gradients to exact zeros on CPUs without AVX512-BF16 (seen on Zen 3).
    fw = feats.clone().requires_grad_(True)
    (winners,) = torch.autograd.grad(kernels.pillar_scatter_max(fw, cell, b * h * w).sum(), [fw])
    assert bool(((got_f != 0) <= (winners != 0)).all())


@needs_native
def test_pillar_stem_is_bitwise_reproducible() -> None:
    """Forward and backward twice: the same bits (samples run on any thread; partials add in sample order)."""
    feats, cell = _stem_case(7, 4, 40, 36, 32, 3000)
    weight = torch.randn(32, 32, 3, 3)
    g = torch.randn(4, 32, 20, 18).bfloat16()
    runs = []
    for _ in range(3):
        out, *saved = native.pillar_stem_forward(
            feats, cell, weight, 4, (40, 36), (20, 18), True, torch.bfloat16
        )
        runs.append((out, *native.pillar_stem_backward(g, weight, *saved, (40, 36), True)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


# --------------------------------------------------------------------------------------------------
# the typed binding: a C signature and its Python call that disagree are an error, never a bad pointer
# --------------------------------------------------------------------------------------------------
@needs_native
def test_a_missing_extra_or_mistyped_argument_is_a_type_error() -> None:
    lib = native._library()
    grad_canvas, winner_cell = torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64)
    ok = dict(grad_canvas=grad_canvas, row_stride=2, winner_cell=winner_cell,
              winner_point=torch.zeros(3, 2, dtype=torch.int32), M=0, N=3, C=2, grad_features=torch.zeros(3, 2))  # fmt: skip
    assert lib.call("pfk_scatter_max_bwd", **ok) == 0
    with pytest.raises(TypeError, match=r"missing argument for `int64_t M`"):
        lib.call("pfk_scatter_max_bwd", **{k: v for k, v in ok.items() if k != "M"})
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['stride'\]"):
        lib.call("pfk_scatter_max_bwd", **ok, stride=1)
    with pytest.raises(
        TypeError, match=r"`const int32_t \*winner_point` takes a CPU int32 tensor, got torch.int64"
    ):
        lib.call("pfk_scatter_max_bwd", **{**ok, "winner_point": torch.zeros(3, 2, dtype=torch.int64)})
    with pytest.raises(TypeError, match=r"`int64_t N` takes an int in range, got 3.0"):
        lib.call("pfk_scatter_max_bwd", **{**ok, "N": 3.0})
    with pytest.raises(TypeError, match=r"grad_features_dt is filled in"):
        lib.call("pfk_scatter_max_bwd", **ok, grad_features_dt=0)


@needs_native
def test_a_c_signature_changed_without_its_python_call_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deliberately wrong signature: kernels/_native.c with one kernel's C prototype gaining a parameter
    (and another retyping one), built for real; the unchanged Python wrappers then raise a TypeError
    naming the parameter instead of passing shifted arguments into C."""
    source = (ROOT / "kernels" / "_native.c").read_text()
    old = "int pfk_scatter_max_bwd(const void *grad_canvas, int grad_canvas_dt, int64_t row_stride,"
    assert old in source
    wrong = source.replace(old, old.replace("int64_t row_stride,", "int64_t row_stride, int64_t col_stride,"))
    wrong = wrong.replace("float *mean, float *rstd, int64_t B,", "double *mean, float *rstd, int64_t B,", 1)
    with pytest.raises(ValueError, match=r"pfk_group_norm_relu_fwd: parameter 'double \*mean'"):
        native.parse_prototypes(wrong)  # a type the binding cannot check: refused before any build
    wrong = wrong.replace("double *mean, float *rstd, int64_t B,", "float *mean, float *rstd, int64_t B,", 1)
    (tmp_path / "_native.c").write_text(wrong)
    lib = native.build(tmp_path / "_native.c", tmp_path / "cache")
    monkeypatch.setattr(native, "_library", lambda: lib)
    feats, cell = _points(50, 4, 9, seed=0, special=False)
    canvas, wc, wp, rows = native.scatter_max_forward(feats, cell, 9, True, torch.float32)  # unchanged: fine
    with pytest.raises(TypeError, match=r"pfk_scatter_max_bwd: missing argument for `int64_t col_stride`"):
        native.scatter_max_backward(torch.ones_like(canvas), wc, wp, rows, torch.float32)


def test_every_kernel_in_the_source_is_declared_and_checked() -> None:
    """Each `pfk_*` definition in kernels/_native.c parses (none is callable unchecked), and every
    `void *` buffer has its `_dt` code."""
    source = (ROOT / "kernels" / "_native.c").read_text()
    kernels_ = native.parse_prototypes(source)
    assert set(kernels_) == {"pfk_group_norm_relu_fwd", "pfk_group_norm_relu_bwd", "pfk_scatter_max_fwd",
                             "pfk_scatter_max_bwd", "pfk_pillar_stem_fwd", "pfk_pillar_stem_bwd"}  # fmt: skip
    with pytest.raises(ValueError, match="could not parse"):
        native.parse_prototypes(source + "\nvoid pfk_extra(int x) {}\n")
