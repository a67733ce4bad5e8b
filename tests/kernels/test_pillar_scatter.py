"""points_to_cells and pillar_scatter_max: conventions, reference semantics, Triton == reference.

Triton runs under TRITON_INTERPRET=1 on CPU (set below, before any Triton kernel is imported) and
for real on CUDA (`pytest -m gpu`). Max and its argmax are exact in every dtype, so canvas and
gradient are compared bitwise (atol = rtol = 0) for float32, float16 and bfloat16 alike.
"""

from __future__ import annotations

import math

from kernels._testing import enable_triton_interpreter, triton_cpu_skip_reason, triton_device_params

enable_triton_interpreter()  # before anything imports the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import (  # noqa: E402
    native,
    pillar_scatter,
    pillar_scatter_argmax_reference,
    pillar_scatter_max,
    pillar_scatter_max_reference,
    points_to_cells,
)
from kernels._dispatch import force_triton  # noqa: E402
from kernels.pillar_scatter import (  # noqa: E402
    _pillar_scatter_max_backward_compact,
    _pillar_scatter_max_backward_reference,
    _pillar_scatter_max_compact,
    _winner_from_argmax,
)


@pytest.fixture(autouse=True, params=["native", "torch-ops"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice on CPU: the C kernels (kernels/native.py) and the PyTorch compact path."""
    if request.param == "native" and not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    if request.param == "torch-ops":
        monkeypatch.setattr(native, "scatter_max_supported", lambda *a: False)
        monkeypatch.setattr(native, "scatter_max_backward_supported", lambda *a: False)
    return request.param


PC_RANGE = (0.0, -4.0, -3.0, 8.0, 4.0, 1.0)  # x in [0, 8), y in [-4, 4), z in [-3, 1)
CELL = (0.5, 1.0)  # dx, dy
GRID = (8, 16)  # H rows along y, W cols along x


# --------------------------------------------------------------------------------------------------
# points_to_cells
# --------------------------------------------------------------------------------------------------
def _cells(xyz: list[list[float]], batch: list[int] | None = None) -> list[int]:
    points = torch.tensor(xyz, dtype=torch.float32)  # [N, 3]
    b = torch.tensor(batch if batch is not None else [0] * len(xyz), dtype=torch.int64)
    return points_to_cells(points, b, PC_RANGE, CELL, GRID).tolist()


def test_points_to_cells_row_col_convention() -> None:
    # x = 1.2 -> col floor(1.2 / 0.5) = 2; y = -1.5 -> row floor(2.5 / 1) = 2 -> 2 * 16 + 2
    assert _cells([[1.2, -1.5, 0.0]]) == [2 * 16 + 2]
    # batch 1 shifts by H * W = 128
    assert _cells([[1.2, -1.5, 0.0]], [1]) == [128 + 2 * 16 + 2]


def test_points_to_cells_boundaries_are_half_open() -> None:
    cells = _cells(
        [
            [0.0, -4.0, -3.0],  # all minima: kept, first cell
            [7.999, 3.999, 0.999],  # just below all maxima: last cell of batch 0
            [8.0, 0.0, 0.0],  # x == x_max
            [0.0, 4.0, 0.0],  # y == y_max
            [0.0, 0.0, 1.0],  # z == z_max
            [-1e-4, 0.0, 0.0],  # x just below x_min
            [0.0, 0.0, -3.0001],  # z below z_min
        ]
    )
    assert cells == [0, 7 * 16 + 15, -1, -1, -1, -1, -1]


def test_points_to_cells_drops_nan_inf_and_negative_batch() -> None:
    nan, inf = math.nan, math.inf
    cells = _cells(
        [[nan, 0, 0], [0, nan, 0], [0, 0, nan], [inf, 0, 0], [-inf, 0, 0], [1, 0, 0]], [0, 0, 0, 0, 0, -1]
    )
    assert cells == [-1] * 6


def test_points_to_cells_grid_smaller_than_range_drops_overflow() -> None:
    points = torch.tensor([[7.9, 0.0, 0.0], [1.0, 0.0, 0.0]])  # col 15 and col 2
    cells = points_to_cells(points, torch.zeros(2, dtype=torch.int64), PC_RANGE, CELL, (8, 10)).tolist()
    assert cells == [-1, 4 * 10 + 2]


def test_points_to_cells_extra_columns_ignored_and_float64() -> None:
    points = torch.tensor([[1.2, -1.5, 0.0, 99.0, -7.0]], dtype=torch.float64)  # intensity etc. ignored
    assert points_to_cells(points, torch.zeros(1, dtype=torch.int64), PC_RANGE, CELL, GRID).tolist() == [34]


def test_points_to_cells_validation() -> None:
    b = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="points must be"):
        points_to_cells(torch.zeros(2, 2), b, PC_RANGE, CELL, GRID)
    with pytest.raises(ValueError, match="batch_index must have dtype"):
        points_to_cells(torch.zeros(2, 3), b.int(), PC_RANGE, CELL, GRID)
    with pytest.raises(ValueError, match="pc_range must have min < max"):
        points_to_cells(torch.zeros(2, 3), b, (1, 0, 0, 0, 1, 1), CELL, GRID)


# --------------------------------------------------------------------------------------------------
# reference semantics
# --------------------------------------------------------------------------------------------------
def test_reference_hand_example() -> None:
    features = torch.tensor([[1.0, -5.0], [3.0, -7.0], [2.0, -6.0], [9.0, 9.0], [-2.0, -3.0]])  # [5, 2]
    cell = torch.tensor([0, 0, 2, -1, 2])
    canvas = pillar_scatter_max_reference(features, cell, 4)
    # cell 0: max(1, 3), max(-5, -7); cell 1, 3: empty -> 0 (not -inf); cell 2: max(2, -2), max(-6, -3);
    # the dropped point (9, 9) contributes nowhere.
    expected = torch.tensor([[3.0, -5.0], [0.0, 0.0], [2.0, -3.0], [0.0, 0.0]])
    torch.testing.assert_close(canvas, expected, rtol=0, atol=0)
    argmax = pillar_scatter_argmax_reference(features, cell, 4, canvas)
    assert argmax.tolist() == [[1, 0], [-1, -1], [2, 4], [-1, -1]]


def test_reference_ties_go_to_lowest_index() -> None:
    features = torch.tensor([[1.0], [4.0], [4.0], [4.0]])
    cell = torch.tensor([0, 0, 0, 0])
    canvas = pillar_scatter_max_reference(features, cell, 1)
    argmax = pillar_scatter_argmax_reference(features, cell, 1, canvas)
    assert argmax.tolist() == [[1]]
    grad = _pillar_scatter_max_backward_reference(
        torch.tensor([[10.0]]), cell, _winner_from_argmax(argmax, cell, 1), 1
    )
    assert grad.flatten().tolist() == [0.0, 10.0, 0.0, 0.0]


def test_reference_all_minus_inf_cell_keeps_minus_inf() -> None:
    features = torch.tensor([[-math.inf], [-math.inf]])
    canvas = pillar_scatter_max_reference(features, torch.tensor([0, 0]), 2)
    assert canvas.flatten().tolist() == [-math.inf, 0.0]  # occupied cell: its true max; empty cell: 0


def test_reference_gradcheck_float64() -> None:
    torch.manual_seed(0)
    features = torch.randn(40, 3, dtype=torch.float64, requires_grad=True)  # continuous: no ties
    cell = torch.randint(-1, 9, (40,))
    assert torch.autograd.gradcheck(lambda f: pillar_scatter_max_reference(f, cell, 9), (features,))


def test_op_backward_matches_autograd_of_reference_without_ties() -> None:
    torch.manual_seed(1)
    features = torch.randn(64, 5, dtype=torch.float64, requires_grad=True)
    cell = torch.randint(-1, 11, (64,))
    grad_out = torch.randn(11, 5, dtype=torch.float64)
    (expected,) = torch.autograd.grad(pillar_scatter_max_reference(features, cell, 11), features, grad_out)
    (actual,) = torch.autograd.grad(pillar_scatter_max(features, cell, 11), features, grad_out)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_opcheck() -> None:
    torch.manual_seed(2)
    features = torch.randn(30, 5, requires_grad=True)
    cell = torch.randint(-1, 8, (30,))
    f32, bf16 = torch.float32, torch.bfloat16
    torch.library.opcheck(torch.ops.pfk.pillar_scatter_max.default, (features, cell, 8, True, f32))
    torch.library.opcheck(torch.ops.pfk.pillar_scatter_max.default, (features, cell, 8, True, bf16))
    torch.library.opcheck(torch.ops.pfk.pillar_scatter_max.default, (features.detach(), cell, 8, False, f32))
    _, winner_cell, winner_point, winner_rows = torch.ops.pfk.pillar_scatter_max(
        features.detach(), cell, 8, True, f32
    )
    for grad in (torch.randn(8, 5), torch.randn(8, 5).to(bf16)):
        torch.library.opcheck(
            torch.ops.pfk.pillar_scatter_max_backward.default,
            (grad, winner_cell, winner_point, winner_rows, f32),
        )


def test_bf16_canvas_is_the_rounded_canvas_and_the_gradient_stays_in_the_features_dtype() -> None:
    """canvas_dtype=bf16: the fp32 canvas rounded once (what a bf16-autocast conv makes of it); the
    features' gradient is fp32 and equals the reference gradient of the (exactly representable) bf16
    canvas gradient."""
    torch.manual_seed(3)
    features = torch.randn(200, 7, requires_grad=True)
    cell = torch.randint(-1, 40, (200,))
    canvas = pillar_scatter_max(features, cell, 40, canvas_dtype=torch.bfloat16)
    expected = pillar_scatter_max_reference(features, cell, 40)
    assert canvas.dtype == torch.bfloat16
    assert torch.equal(canvas, expected.to(torch.bfloat16))
    grad_out = torch.randn(40, 7).to(torch.bfloat16)
    (actual,) = torch.autograd.grad(canvas, features, grad_out)
    (reference,) = torch.autograd.grad(expected, features, grad_out.float())
    assert actual.dtype == torch.float32
    assert torch.equal(actual, reference)
    with pytest.raises(ValueError, match="canvas_dtype"):
        pillar_scatter_max(features, cell, 40, canvas_dtype=torch.int32)


def test_validation_errors() -> None:
    f = torch.randn(4, 2)
    with pytest.raises(ValueError, match="features must have dtype"):
        pillar_scatter_max(f.long(), torch.zeros(4, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="cell_index must have dtype"):
        pillar_scatter_max(f, torch.zeros(4, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="cell_index must be \\[N\\] with N = 4"):
        pillar_scatter_max(f, torch.zeros(5, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="cell_index values must lie in \\[-1, 3\\), got min 0, max 3"):
        pillar_scatter_max(f, torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="num_cells must be an int"):
        pillar_scatter_max(f, torch.zeros(4, dtype=torch.int64), -1)


# --------------------------------------------------------------------------------------------------
# Triton == reference, forward and backward, on odd shapes
# --------------------------------------------------------------------------------------------------
def _expected(features: torch.Tensor, cell: torch.Tensor, num_cells: int, grad_canvas: torch.Tensor):
    """(canvas, grad_features) from the reference functions (no dispatch involved)."""
    canvas = pillar_scatter_max_reference(features, cell, num_cells)
    argmax = pillar_scatter_argmax_reference(features, cell, num_cells, canvas)
    winner = _winner_from_argmax(argmax, cell, num_cells)
    return canvas, _pillar_scatter_max_backward_reference(grad_canvas, cell, winner, num_cells)


def _triton(features: torch.Tensor, cell: torch.Tensor, num_cells: int, grad_canvas: torch.Tensor):
    """(canvas, grad_features) through the public op on its Triton path."""
    features = features.detach().requires_grad_(True)
    with force_triton():
        canvas = pillar_scatter_max(features, cell, num_cells)
        (grad,) = torch.autograd.grad(canvas, features, grad_canvas, allow_unused=True)
    return canvas.detach(), grad if grad is not None else torch.zeros_like(features)


# (name, N, C, num_cells, how the cell index is drawn)
CASES = [
    ("N0", 0, 3, 5, "random"),
    ("N1_C1", 1, 1, 4, "random"),
    ("C37_1000pts_5cells_ties", 1000, 37, 5, "random"),
    ("all_dropped", 50, 4, 6, "dropped"),
    ("C130_split_over_grid_axis1", 40, 130, 9, "random"),
    ("sparse_grid", 60, 16, 400, "random"),
    ("one_cell_many_points", 300, 2, 3, "one"),
]


def _case(n: int, c: int, num_cells: int, how: str, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Small integers make ties common, exercising the lowest-index rule; exact in fp16/bf16 too.
    features = torch.randint(-4, 5, (n, c), generator=g).to(dtype)
    if how == "random":
        cell = torch.randint(-1, num_cells, (n,), generator=g)
    elif how == "dropped":
        cell = torch.full((n,), -1, dtype=torch.int64)
    else:
        cell = torch.full((n,), 1, dtype=torch.int64)
    grad = torch.randn(num_cells, c, generator=g).to(dtype)
    return features.to(device), cell.to(device), grad.to(device)


@pytest.mark.parametrize("device", triton_device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "n", "c", "num_cells", "how"), CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(
    device: str, dtype: torch.dtype, name: str, n: int, c: int, num_cells: int, how: str
) -> None:
    features, cell, grad = _case(n, c, num_cells, how, dtype, device)
    canvas_ref, grad_ref = _expected(features, cell, num_cells, grad)
    canvas_tri, grad_tri = _triton(features, cell, num_cells, grad)
    torch.testing.assert_close(canvas_tri, canvas_ref, rtol=0, atol=0, msg=lambda m: f"canvas {name}: {m}")
    torch.testing.assert_close(grad_tri, grad_ref, rtol=0, atol=0, msg=lambda m: f"grad {name}: {m}")
    assert canvas_tri.dtype == dtype and grad_tri.dtype == dtype


@pytest.mark.parametrize("device", triton_device_params())
def test_triton_strided_grad_inf_nan(device: str) -> None:
    # The model reads the canvas as [B, C, H, W]; the gradient coming back is a transposed view.
    features, cell, _ = _case(200, 6, 24, "random", torch.float32, device, seed=3)
    cell = torch.where(cell >= 22, -1, cell)  # cells 22 and 23 get only the points set below
    features[:5] = -math.inf  # all--inf cells must keep -inf and still route their gradient
    cell[:5] = 23
    if device == "cpu":
        # NaN propagates like torch.amax and the lowest NaN point wins. Checked against the CPU
        # reference only: CUDA's scatter_reduce(amax) combines with fmaxf, which drops NaN.
        features[7, 2] = features[9, 2] = math.nan
        cell[7] = cell[9] = 22
    grad = torch.randn(6, 24, device=device).t()  # [24, 6], stride (1, 24)
    canvas_ref, grad_ref = _expected(features, cell, 24, grad)
    canvas_tri, grad_tri = _triton(features, cell, 24, grad)
    assert canvas_ref[23, 0] == -math.inf and (device != "cpu" or canvas_ref[22, 2].isnan())
    torch.testing.assert_close(canvas_tri, canvas_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(grad_tri, grad_ref, rtol=0, atol=0)


@pytest.mark.skipif(triton_cpu_skip_reason() is not None, reason=triton_cpu_skip_reason() or "")
def test_triton_without_grad_skips_winner_and_drops_out_of_range() -> None:
    features, cell, _ = _case(50, 3, 7, "random", torch.float32, "cpu", seed=4)
    cell[0] = 99  # out of range: with checks off the kernels drop it rather than write out of bounds
    with torch.no_grad(), force_triton():
        canvas = pillar_scatter_max(features, cell, 7, check_indices=False)
    expected = pillar_scatter_max_reference(features, torch.where(cell == 99, -1, cell), 7)
    torch.testing.assert_close(canvas, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# the op's CPU path (compact winner table) == the reference, forward and backward
# --------------------------------------------------------------------------------------------------
def _compact(features: torch.Tensor, cell: torch.Tensor, num_cells: int, grad_canvas: torch.Tensor):
    """(canvas, grad_features, winner table) through the compact path the op runs off CUDA."""
    canvas, winner_cell, winner_point, winner_rows = _pillar_scatter_max_compact(
        features, cell, num_cells, True, features.dtype
    )
    grad = _pillar_scatter_max_backward_compact(
        grad_canvas, winner_cell, winner_point, winner_rows, features.dtype
    )
    return canvas, grad, (winner_cell, winner_point, int(winner_rows[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "n", "c", "num_cells", "how"), CASES, ids=[c[0] for c in CASES])
def test_compact_path_matches_reference(
    dtype: torch.dtype, name: str, n: int, c: int, num_cells: int, how: str
) -> None:
    features, cell, grad = _case(n, c, num_cells, how, dtype, "cpu")  # small integers: many ties
    canvas_ref, grad_ref = _expected(features, cell, num_cells, grad)
    canvas, grad_c, (winner_cell, winner_point, m) = _compact(features, cell, num_cells, grad)
    torch.testing.assert_close(canvas, canvas_ref, rtol=0, atol=0, msg=lambda e: f"canvas {name}: {e}")
    torch.testing.assert_close(grad_c, grad_ref, rtol=0, atol=0, msg=lambda e: f"grad {name}: {e}")
    # The table: the occupied cells in increasing order, then -1 padding up to N rows.
    occupied = torch.unique(cell[(cell >= 0) & (cell < num_cells)])
    assert m == occupied.numel()
    assert torch.equal(winner_cell[:m], occupied) and bool((winner_cell[m:] == -1).all())
    argmax = pillar_scatter_argmax_reference(features, cell, num_cells, canvas_ref)
    assert torch.equal(winner_point[:m].long(), argmax[occupied]) and bool((winner_point[m:] == -1).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compact_path_float_and_int_winner_paths_agree(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float32-candidate winner (the fast path) and the int32 one (NaN maxima, N > 2**23) give the same
    table bit for bit, on ties (small integers), signed zeros and infinities."""
    features, cell, grad = _case(1000, 37, 5, "random", dtype, "cpu")
    features[::7, 0] = -0.0
    features[3::11, 1] = 0.0
    features[::13, 2] = math.inf
    features[5::17, 3] = -math.inf
    fast = _compact(features, cell, 5, grad)
    monkeypatch.setattr(pillar_scatter, "_FLOAT_CANDIDATES_MAX_N", 0)  # forces the int32 path
    slow = _compact(features, cell, 5, grad)
    for a, b in zip([fast[0], fast[1], *fast[2][:2]], [slow[0], slow[1], *slow[2][:2]]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fast[2][2] == slow[2][2]


def test_compact_path_nan_inf_and_out_of_range() -> None:
    features, cell, _ = _case(200, 6, 24, "random", torch.float32, "cpu", seed=3)
    cell = torch.where(cell >= 22, -1, cell)
    features[:5] = -math.inf  # an all--inf cell keeps -inf and still routes its gradient
    cell[:5] = 23
    features[7, 2] = features[9, 2] = math.nan  # NaN is the largest value: the lowest NaN point wins
    cell[7] = cell[9] = 22
    cell[11] = 99  # out of range: dropped (only reachable with check_indices=False)
    grad = torch.randn(6, 24).t()  # [24, 6] strided, as the [B, C, H, W] view's gradient arrives
    canvas_ref, grad_ref = _expected(features, torch.where(cell == 99, -1, cell), 24, grad)
    canvas, grad_c, _ = _compact(features, cell, 24, grad)
    assert canvas[23, 0] == -math.inf and canvas[22, 2].isnan()
    torch.testing.assert_close(canvas, canvas_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(grad_c, grad_ref, rtol=0, atol=0)
    assert grad_c[9, 2] == 0 and grad_c[7, 2] == grad[22, 2]


# --------------------------------------------------------------------------------------------------
# GPU: realistic size (300k points x 64 channels into 4 x 496 x 432 cells)
# --------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_realistic_size_matches_reference_and_is_deterministic() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    n, c, num_cells = 300_000, 64, 4 * 496 * 432
    features = torch.randn(n, c, device="cuda", generator=g)
    # Points cluster like lidar: ~40k occupied cells with ~7 points each, plus 5% dropped.
    occupied = torch.randint(0, num_cells, (40_000,), device="cuda", generator=g)
    cell = occupied[torch.randint(0, 40_000, (n,), device="cuda", generator=g)]
    cell[torch.rand(n, device="cuda", generator=g) < 0.05] = -1
    features[:1000] = features[1000:2000]  # exact ties across points
    cell[:1000] = cell[1000:2000]
    grad = torch.randn(num_cells, c, device="cuda", generator=g)
    canvas_ref, grad_ref = _expected(features, cell, num_cells, grad)
    canvas_a, grad_a = _triton(features, cell, num_cells, grad)
    canvas_b, grad_b = _triton(features, cell, num_cells, grad)
    torch.testing.assert_close(canvas_a, canvas_ref, rtol=0, atol=0)
    torch.testing.assert_close(grad_a, grad_ref, rtol=0, atol=0)
    assert torch.equal(canvas_a, canvas_b) and torch.equal(grad_a, grad_b), "not deterministic"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_opcheck() -> None:
    features = torch.randn(500, 37, device="cuda", requires_grad=True)
    cell = torch.randint(-1, 50, (500,), device="cuda")
    torch.library.opcheck(torch.ops.pfk.pillar_scatter_max.default, (features, cell, 50, True, torch.float32))
    torch.library.opcheck(
        torch.ops.pfk.pillar_scatter_max.default, (features, cell, 50, True, torch.bfloat16)
    )
