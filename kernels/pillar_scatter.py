"""Pillar scatter-max: per-point features -> dense BEV canvas, plus the point -> cell index that feeds it.

    points_to_cells(points [N, >=3], batch_index [N] int64, pc_range, cell_size, grid) -> cell_index [N] int64
    pillar_scatter_max(features [N, C] float, cell_index [N] int64, num_cells) -> canvas [num_cells, C]

Conventions (docs/KERNELS.md, "Conventions"):
- points are in the lidar frame, metres: x forward, y left, z up; columns 3.. are ignored.
- pc_range = (x_min, y_min, z_min, x_max, y_max, z_max), half-open: x_min <= x < x_max (same for y, z).
- cell_size = (dx, dy) metres; grid = (H, W): H rows along y, W columns along x.
- row = floor((y - y_min) / dy), col = floor((x - x_min) / dx), cell = b * H * W + row * W + col, so
  `canvas.view(B, H, W, C)` is the BEV image with row 0 at y_min and column 0 at x_min.
- cell_index == -1 means "dropped" (outside the range, NaN/inf coordinates, batch_index < 0).

canvas[cell, c] = max over the points n in `cell` of features[n, c]; 0 for a cell with no point.
Backward sends grad_canvas[cell, c] to the one point holding that max (the lowest point index on a
tie) and 0 to every other point: a sparse, deterministic gradient.

Backends: `pfk::pillar_scatter_max` runs the Triton kernels (kernels/_pillar_scatter_triton.py) on
CUDA, the C kernels (kernels/native.py) on CPU where they are built, else `_pillar_scatter_max_compact`
(PyTorch ops, the same values bit for bit); the Triton and the C kernels each once their self-check
("triton.pillar_scatter_max", "native.pillar_scatter_max": kernels/selfcheck.py) has verified them here; ONNX export always traces the reference, which lowers to
ScatterElements(reduction="max") + Where: no custom op in the exported graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels import native, selfcheck
from kernels._checks import (
    FLOAT_DTYPES,
    describe,
    require,
    require_range,
    require_same_device,
    require_tensor,
)
from kernels._dispatch import checks_enabled, triton_for_check, triton_module, triton_source, use_triton

_OP = "pillar_scatter_max"
_TRITON, _NATIVE = "triton.pillar_scatter_max", "native.pillar_scatter_max"


# --------------------------------------------------------------------------------------------------
# points -> cells (plain tensor ops: compiles, exports, needs no kernel)
# --------------------------------------------------------------------------------------------------
def points_to_cells(
    points: Tensor,
    batch_index: Tensor,
    pc_range: Sequence[float],
    cell_size: Sequence[float],
    grid: Sequence[int],
) -> Tensor:
    """Flattened BEV cell `b * H * W + row * W + col` of every point, -1 for points not in any cell.

    points [N, >=3] float (x, y, z in metres, lidar frame); batch_index [N] int64 (< 0: padding,
    dropped). Returns [N] int64. A point is kept iff x_min <= x < x_max, y_min <= y < y_max,
    z_min <= z < z_max, its row < H and col < W, and batch_index >= 0. NaN and inf are dropped.
    Arithmetic runs in the points' dtype (pc_range values are rounded to it).
    """
    op = "points_to_cells"
    require_tensor(points, op, "points", dtypes=FLOAT_DTYPES, ndim=2)
    require(
        points.shape[1] >= 3, op, lambda: f"points must be [N, >=3] (x, y, z, ...), got {describe(points)}"
    )
    require_tensor(batch_index, op, "batch_index", dtypes=(torch.int64,), ndim=1)
    require(
        batch_index.shape[0] == points.shape[0],
        op,
        lambda: f"batch_index must be [N] with N = {points.shape[0]}, got {describe(batch_index)}",
    )
    require_same_device(op, points=points, batch_index=batch_index)
    require(
        len(pc_range) == 6, op, f"pc_range must be (x_min, y_min, z_min, x_max, y_max, z_max), got {pc_range}"
    )
    require(len(cell_size) == 2, op, f"cell_size must be (dx, dy), got {cell_size}")
    require(len(grid) == 2, op, f"grid must be (H, W), got {grid}")
    x_min, y_min, z_min, x_max, y_max, z_max = (float(v) for v in pc_range)
    dx, dy = (float(v) for v in cell_size)
    height, width = (int(v) for v in grid)
    require(
        x_min < x_max and y_min < y_max and z_min < z_max, op, f"pc_range must have min < max, got {pc_range}"
    )
    require(dx > 0 and dy > 0, op, f"cell_size must be positive, got {cell_size}")
    require(height > 0 and width > 0, op, f"grid must be positive, got {grid}")

    x, y, z = points[:, 0], points[:, 1], points[:, 2]  # [N] each
    col_f = torch.floor((x - x_min) / dx)  # [N], >= 0 wherever x >= x_min
    row_f = torch.floor((y - y_min) / dy)  # [N]
    # Every comparison with NaN is False, so NaN coordinates fall out here with no special case.
    kept = (
        (x >= x_min)
        & (x < x_max)
        & (y >= y_min)
        & (y < y_max)
        & (z >= z_min)
        & (z < z_max)
        & (col_f < width)
        & (row_f < height)  # rounding can put x just below x_max into column W
        & (batch_index >= 0)
    )  # [N] bool
    col = torch.where(kept, col_f, 0).long()  # [N]; zeroed first: casting NaN/inf to int is undefined
    row = torch.where(kept, row_f, 0).long()  # [N]
    cell = batch_index * (height * width) + row * width + col  # [N]
    return torch.where(kept, cell, -1)  # [N] int64


# --------------------------------------------------------------------------------------------------
# reference (the spec)
# --------------------------------------------------------------------------------------------------
def _trash_row_index(cell_index: Tensor, num_cells: int) -> Tensor:
    """cell_index with every dropped or out-of-range point sent to an extra row `num_cells`. [N]"""
    kept = (cell_index >= 0) & (cell_index < num_cells)  # [N]
    return torch.where(kept, cell_index, num_cells)  # [N]


def pillar_scatter_max_reference(features: Tensor, cell_index: Tensor, num_cells: int) -> Tensor:
    """canvas [num_cells, C]: per-cell, per-channel max of features [N, C]; 0 for empty cells.

    cell_index [N] int64; -1 (or any value outside [0, num_cells)) drops the point. Written with
    `scatter_reduce(amax, include_self=True)` on a -inf canvas, which ONNX export turns into
    ScatterElements(reduction="max") (opset >= 18); ONNX has no include_self=False, hence the -inf
    start and the separate occupancy scatter that puts 0 (not -inf) in empty cells.
    """
    n, c = features.shape
    assert cell_index.shape == (n,), f"cell_index {tuple(cell_index.shape)} != ({n},)"
    row = _trash_row_index(cell_index, num_cells)  # [N], dropped -> row num_cells
    # Zeros computed from the input (a sum over no points) rather than torch.full/zeros: ONNX exporters
    # constant-fold a fill of constant shape into the file (55 MB for 4 x 496 x 432 cells x 64 channels
    # with the TorchScript exporter); a fill that depends on an input stays a runtime Expand.
    zero_row = features[:0].sum(0, keepdim=True)  # [1, C] zeros
    canvas = (zero_row - float("inf")).expand(num_cells + 1, c)  # [cells+1, C] -inf
    canvas = canvas.scatter_reduce(0, row[:, None].expand(n, c), features, "amax", include_self=True)
    occupied = zero_row[0, :1].expand(num_cells + 1)  # [cells+1] zeros
    occupied = occupied.scatter_reduce(0, row, torch.ones_like(features[:, 0]), "amax", include_self=True)
    return torch.where(occupied[:num_cells, None] > 0, canvas[:num_cells], 0.0)  # [num_cells, C]


def pillar_scatter_argmax_reference(
    features: Tensor, cell_index: Tensor, num_cells: int, canvas: Tensor
) -> Tensor:
    """argmax [num_cells, C] int64: lowest point n with features[n, c] == canvas[cell, c]; -1 if empty.

    A NaN feature counts as the largest value (torch's amax propagates it), so the lowest-index NaN
    point of a cell wins that channel. This is the tie-break rule the Triton kernel must reproduce;
    the op itself stores the equivalent per-point `winner` mask ([N, C] bool, 8x fewer bytes than
    this int64 canvas: docs/KERNELS.md).
    """
    n, c = features.shape
    assert canvas.shape == (num_cells, c), f"canvas {tuple(canvas.shape)} != ({num_cells}, {c})"
    row = _trash_row_index(cell_index, num_cells)  # [N]
    # [cells+1, C]; the trash row is never compared with a kept point
    canvas_ext = torch.cat([canvas, canvas.new_zeros(1, c)])
    kept = (row < num_cells)[:, None]  # [N, 1]
    held = canvas_ext[row]  # [N, C] the max of each point's cell
    # NaN propagates through amax, so a NaN point "holds" a NaN max.
    is_max = kept & ((features == held) | (features.isnan() & held.isnan()))  # [N, C]
    point = torch.arange(n, device=features.device)[:, None].expand(n, c)  # [N, C]
    candidate = torch.where(is_max, point, n)  # [N, C]; n = "no candidate"
    first = torch.full((num_cells + 1, c), n, dtype=torch.int64, device=features.device)
    first = first.scatter_reduce(0, row[:, None].expand(n, c), candidate, "amin", include_self=True)
    return torch.where(first[:num_cells] < n, first[:num_cells], -1)  # [num_cells, C]


def _winner_from_argmax(argmax: Tensor, cell_index: Tensor, num_cells: int) -> Tensor:
    """winner [N, C] bool: point n holds the max of its cell in channel c (the spec's per-point view)."""
    n = cell_index.shape[0]
    c = argmax.shape[1]
    row = _trash_row_index(cell_index, num_cells)  # [N]
    argmax_ext = torch.cat([argmax, argmax.new_full((1, c), -1)])  # [cells+1, C]; trash row: nobody wins
    point = torch.arange(n, device=argmax.device)[:, None]  # [N, 1]
    return argmax_ext[row] == point  # [N, C]


def _pillar_scatter_max_backward_reference(
    grad_canvas: Tensor, cell_index: Tensor, winner: Tensor, num_cells: int
) -> Tensor:
    """grad_features [N, C] = grad_canvas[cell_index[n], c] where winner[n, c], else 0 (the spec)."""
    n, c = winner.shape
    assert grad_canvas.shape == (num_cells, c), f"grad_canvas {tuple(grad_canvas.shape)} != {(num_cells, c)}"
    if n == 0 or num_cells == 0:
        return grad_canvas.new_zeros(n, c)
    row = cell_index.clamp(0, num_cells - 1)  # [N]; dropped points never win, so any row will do
    return torch.where(winner, grad_canvas[row], 0.0)  # [N, C]


# --------------------------------------------------------------------------------------------------
# the op's implementation off CUDA: compact pillars, no [num_cells, C] intermediate but the canvas
# --------------------------------------------------------------------------------------------------
def _compact_rows(cell_index: Tensor, num_cells: int) -> tuple[Tensor, Tensor, int]:
    """(row [N], occupied [M] int64, M): compact row of every point and the cell of every row.

    Rows 0..M-1 are the occupied cells in increasing cell order; a dropped or out-of-range point gets
    row M (a trash row). Costs a pass over the [num_cells] occupancy, none over [num_cells, C].
    """
    kept = (cell_index >= 0) & (cell_index < num_cells)  # [N]
    key = torch.where(kept, cell_index, num_cells)  # [N], dropped -> num_cells
    flag = torch.zeros(num_cells + 1, dtype=torch.bool, device=cell_index.device)  # [cells+1]
    flag[key] = True
    flag[num_cells] = True  # the trash cell always gets the last row, M
    rank = flag.cumsum(0) - 1  # [cells+1] compact row of each occupied cell
    m = int(rank[num_cells])  # a host sync: fine on CPU, where this path runs
    occupied = flag[:num_cells].nonzero().squeeze(1)  # [M] increasing cell indices
    return rank[key], occupied, m


_FLOAT_CANDIDATES_MAX_N = 2**23  # candidates < 2N <= 2**24: exact in float32


def _pillar_scatter_max_compact(
    features: Tensor, cell_index: Tensor, num_cells: int, with_winner: bool, canvas_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`pfk::pillar_scatter_max` off CUDA: the reference's canvas and the compact winner table.

    Per occupied cell (compact row m, `_compact_rows`): `seg[m] = max` over its points
    (scatter_reduce into [M + 1, C], cache-sized), then the winner = the lowest point index whose
    value equals it (`amin` over candidate indices), then the canvas = zeros + one row copy per
    occupied cell. The [N, C] passes are elementwise or arithmetic (a `torch.where` over [N, C] int
    costs ~6x the multiply-add used below on CPU). Measured at N = 80k, C = 32, 4 x 200 x 176 cells,
    1 thread: 140 ms (reference + dense argmax + winner mask) -> ~20 ms; backward 15 -> 5.6 ms.
    The winner's `amin` runs on float32 candidates when they are exact (2N <= 2**24) and no max is NaN:
    the same winners bit for bit, fwd+bwd at N = 90k, 2 threads 28.2 -> 20.5 ms (docs/KERNELS.md).
    """
    if native.scatter_max_supported(features, cell_index) and selfcheck.trusted(_NATIVE, features.device):
        # the same values in one C pass
        return native.scatter_max_forward(features, cell_index, num_cells, with_winner, canvas_dtype)
    n, c = features.shape
    device = features.device
    row, occupied, m = _compact_rows(cell_index, num_cells)  # [N], [M]
    row_nc = row[:, None].expand(n, c)  # [N, C]
    seg = features.new_empty(m + 1, c).scatter_reduce_(0, row_nc, features, "amax", include_self=False)
    canvas = features.new_zeros(num_cells, c, dtype=canvas_dtype)  # [num_cells, C]
    canvas.index_copy_(0, occupied, seg[:m].to(canvas_dtype))  # the maxima rounded once (if bf16)
    winner_cell = torch.full((n if with_winner else 0,), -1, dtype=torch.int64, device=device)
    winner_point = torch.full((n if with_winner else 0, c), -1, dtype=torch.int32, device=device)
    if not with_winner or m == 0:
        return canvas, winner_cell, winner_point, torch.full((1,), m if with_winner else 0, device=device)
    held = seg.index_select(0, row)  # [N, C] the max of each point's cell
    if n <= _FLOAT_CANDIDATES_MAX_N and not bool(seg.isnan().any()):
        # The candidates as float32, exact below 2**24: CPU scatter_reduce(amin) is ~3x faster on float32
        # than on int32 (1.9 vs 6.4 ms at 90k x 32), and `ne` + a multiply-add are two cheap passes where
        # the int32 multiply-add with a bool is not. candidate = n + own index where not the max, the own
        # index where it is; every occupied cell holds a max, so its amin is always < n. `ne` is False
        # exactly where `==` is True for non-NaN values (+-0 and +-inf included); NaN takes the int path.
        point = torch.arange(n, dtype=torch.float32, device=device)[:, None]  # [N, 1]
        # `ne` written straight into float32 (0/1): a bool [N, C] and its cast cost ~3x more (CPU); then
        # point + n * ne in one pass over [N, C] (in place).
        candidate = torch.ne(features, held, out=torch.empty(n, c, device=device))  # [N, C] 0/1
        candidate = torch.add(point, candidate, alpha=n, out=candidate)  # [N, C]
        first = torch.empty(m + 1, c, dtype=torch.float32, device=device)
        first = first.scatter_reduce_(0, row_nc, candidate, "amin", include_self=False)  # [M + 1, C]
    else:
        # NaN counts as the largest value (amax propagates it): a NaN point is a candidate in its cell.
        is_max = (features == held) | features.isnan()  # [N, C]
        point_i = torch.arange(n, dtype=torch.int32, device=device)[:, None]  # [N, 1]
        candidate_i = (point_i - n) * is_max + n  # [N, C] int32: own index where max, else n ("none")
        first = torch.full((m + 1, c), n, dtype=torch.int32, device=device)
        first = first.scatter_reduce_(0, row_nc, candidate_i, "amin", include_self=True)  # [M + 1, C]
    winner_cell[:m] = occupied
    winner_point[:m] = first[:m].to(torch.int32)
    return canvas, winner_cell, winner_point, torch.full((1,), m, device=device)


def _pillar_scatter_max_backward_compact(
    grad_canvas: Tensor,
    winner_cell: Tensor,
    winner_point: Tensor,
    winner_rows: Tensor,
    grad_dtype: torch.dtype,
) -> Tensor:
    """grad_features [N, C]: row m of the winner table sends grad_canvas[cell_m, c] to its point.

    Touches M x C elements (occupied cells), not N x C: one gather, one scatter into zeros. Each
    (point, channel) wins at most one cell, so the scatter has no duplicate targets: deterministic.
    """
    if native.scatter_max_backward_supported(grad_canvas, winner_point, grad_dtype) and selfcheck.trusted(
        _NATIVE, grad_canvas.device
    ):
        return native.scatter_max_backward(grad_canvas, winner_cell, winner_point, winner_rows, grad_dtype)
    n, c = winner_point.shape
    m = int(winner_rows[0])
    grad_features = grad_canvas.new_zeros(n, c, dtype=grad_dtype)  # [N, C]
    if m == 0:
        return grad_features
    gathered = grad_canvas.index_select(0, winner_cell[:m]).to(grad_dtype)  # [M, C], reads through strides
    return grad_features.scatter_(0, winner_point[:m].long(), gathered)


# --------------------------------------------------------------------------------------------------
# custom op: pfk::pillar_scatter_max (+ its backward), Triton on CUDA, the compact path elsewhere
# --------------------------------------------------------------------------------------------------
@torch.library.custom_op("pfk::pillar_scatter_max", mutates_args=())
def _pillar_scatter_max_op(
    features: Tensor, cell_index: Tensor, num_cells: int, with_winner: bool, canvas_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(canvas [num_cells, C] canvas_dtype, winner_cell [N] int64, winner_point [N, C] int32, winner_rows
    [1] int64).

    The winner table (empty, [0] and [0, C], when with_winner is False): rows 0..M-1 (M =
    winner_rows[0] occupied cells) hold an occupied cell and, per channel, the point holding its max;
    rows M.. are -1. M <= N, so [N]-sized buffers hold it with static shapes (compile, fake tensors).
    """
    if use_triton(features, _TRITON):
        canvas, *table = triton_module("_pillar_scatter_triton").pillar_scatter_max_fwd(
            features, cell_index, num_cells, with_winner
        )
        return canvas.to(canvas_dtype), *table
    return _pillar_scatter_max_compact(features, cell_index, num_cells, with_winner, canvas_dtype)


@_pillar_scatter_max_op.register_fake
def _(
    features: Tensor, cell_index: Tensor, num_cells: int, with_winner: bool, canvas_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, c = features.shape
    rows = n if with_winner else 0
    return (
        features.new_empty((num_cells, c), dtype=canvas_dtype),
        features.new_empty((rows,), dtype=torch.int64),
        features.new_empty((rows, c), dtype=torch.int32),
        features.new_empty((1,), dtype=torch.int64),
    )


@torch.library.custom_op("pfk::pillar_scatter_max_backward", mutates_args=())
def _pillar_scatter_max_backward_op(
    grad_canvas: Tensor,
    winner_cell: Tensor,
    winner_point: Tensor,
    winner_rows: Tensor,
    grad_dtype: torch.dtype,
) -> Tensor:
    """grad_features [N, C] grad_dtype (the features') from grad_canvas [num_cells, C] (the canvas' dtype)
    and the forward's winner table."""
    if use_triton(grad_canvas, _TRITON):
        return triton_module("_pillar_scatter_triton").pillar_scatter_max_bwd(
            grad_canvas.to(grad_dtype), winner_cell, winner_point, winner_rows
        )
    return _pillar_scatter_max_backward_compact(
        grad_canvas, winner_cell, winner_point, winner_rows, grad_dtype
    )


@_pillar_scatter_max_backward_op.register_fake
def _(
    grad_canvas: Tensor,
    winner_cell: Tensor,
    winner_point: Tensor,
    winner_rows: Tensor,
    grad_dtype: torch.dtype,
) -> Tensor:
    return grad_canvas.new_empty(winner_point.shape, dtype=grad_dtype)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    features, _cell_index, _num_cells, with_winner, _canvas_dtype = inputs
    _canvas, winner_cell, winner_point, winner_rows = output
    ctx.save_for_backward(winner_cell, winner_point, winner_rows)
    ctx.with_winner = with_winner
    ctx.features_dtype = features.dtype


def _backward(
    ctx: torch.autograd.function.FunctionCtx, grad_canvas: Tensor, *_grad_table: Tensor | None
) -> tuple[Tensor, None, None, None, None]:
    if not ctx.with_winner:
        raise RuntimeError(
            "pfk::pillar_scatter_max ran with with_winner=False (grad disabled at forward time); "
            "its backward needs the winner table"
        )
    winner_cell, winner_point, winner_rows = ctx.saved_tensors
    grad_features = _pillar_scatter_max_backward_op(
        grad_canvas, winner_cell, winner_point, winner_rows, ctx.features_dtype
    )
    return grad_features, None, None, None, None


_pillar_scatter_max_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------
def pillar_scatter_max(
    features: Tensor,
    cell_index: Tensor,
    num_cells: int,
    *,
    check_indices: bool = True,
    canvas_dtype: torch.dtype | None = None,
) -> Tensor:
    """canvas [num_cells, C]: max of features [N, C] over the points of each cell, 0 for empty cells.

    `canvas_dtype` (default: the features') rounds the maxima once into a narrower canvas, e.g. bf16 for
    a convolution under bf16 autocast, which would cast the canvas to bf16 anyway: the same values, without
    a full-precision [num_cells, C] canvas and its cast (and their gradients' cast). The gradient is
    returned in the features' dtype.

    cell_index [N] int64 in [-1, num_cells); -1 drops the point. `check_indices` verifies that range
    (one device sync; skipped automatically under torch.compile and ONNX export, where the kernels
    drop any out-of-range index instead of failing). Differentiable w.r.t. features.
    """
    require_tensor(features, _OP, "features", dtypes=FLOAT_DTYPES, ndim=2)
    require_tensor(cell_index, _OP, "cell_index", dtypes=(torch.int64,), ndim=1)
    require_same_device(_OP, features=features, cell_index=cell_index)
    n, c = features.shape
    require(c >= 1, _OP, lambda: f"features must have at least one channel, got {describe(features)}")
    require(
        cell_index.shape[0] == n,
        _OP,
        lambda: f"cell_index must be [N] with N = {n}, got {describe(cell_index)}",
    )
    require(
        isinstance(num_cells, int) and num_cells >= 0,
        _OP,
        f"num_cells must be an int >= 0, got {num_cells!r}",
    )
    # The Triton path stores point and cell indices as int32 (docs/KERNELS.md, "Limits").
    require(
        n < 2**31 and num_cells < 2**31, _OP, lambda: f"N ({n}) and num_cells ({num_cells}) must be < 2**31"
    )
    require(
        canvas_dtype is None or canvas_dtype in FLOAT_DTYPES,
        _OP,
        f"canvas_dtype must be a float dtype or None, got {canvas_dtype}",
    )
    if check_indices and checks_enabled():
        require_range(cell_index, _OP, "cell_index", -1, num_cells)
    if torch.onnx.is_in_onnx_export():
        # Export traces the reference: ScatterElements(max) + Where, runnable without plugins.
        return pillar_scatter_max_reference(features, cell_index, num_cells)
    with_winner = torch.is_grad_enabled() and features.requires_grad  # the mask is only for backward
    canvas, *_winner_table = _pillar_scatter_max_op(
        features.contiguous(), cell_index.contiguous(), num_cells, with_winner, canvas_dtype or features.dtype
    )
    return canvas


# --------------------------------------------------------------------------------------------------
# self-checks (kernels/selfcheck.py): the Triton and the C kernels against the reference, bit for bit
# --------------------------------------------------------------------------------------------------
def _check_case(
    dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, int, Tensor, Tensor, Tensor]:
    """(features [300, 16], cell_index [300] with dropped points, num_cells 60, the reference canvas, a
    canvas gradient, the reference's feature gradient: to each cell's lowest-index max, as the op's)."""
    g = torch.Generator().manual_seed(0)
    n, c, cells = 300, 16, 60
    features = torch.randn(n, c, generator=g).to(device=device, dtype=dtype)
    cell_index = torch.randint(-1, cells, (n,), generator=g).to(device)
    canvas = pillar_scatter_max_reference(features, cell_index, cells)
    grad_canvas = torch.randn(cells, c, generator=g).to(device)
    winner = pillar_scatter_argmax_reference(features, cell_index, cells, canvas)  # [cells, C], -1: empty
    rows, chans = (winner >= 0).nonzero(as_tuple=True)
    grad = torch.zeros(n, c, device=device)
    grad[winner[rows, chans], chans] = grad_canvas[rows, chans]
    return features, cell_index, cells, canvas, grad_canvas, grad


def _check_triton(device: torch.device) -> selfcheck.Figures:
    """Triton forward and backward, float32 and bfloat16 features: max |err| 0 (a max and a copy)."""
    triton = triton_for_check("_pillar_scatter_triton", device)
    figures: selfcheck.Figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        features, cell_index, cells, want, grad_canvas, want_grad = _check_case(dtype, device)
        canvas, *table = triton.pillar_scatter_max_fwd(features, cell_index, cells, True)
        selfcheck.compare(figures, f"{name} fwd", canvas, want, 0.0)
        grad = triton.pillar_scatter_max_bwd(grad_canvas.to(dtype), *table)
        selfcheck.compare(figures, f"{name} bwd", grad, want_grad.to(dtype), 0.0)
    return figures


def _check_native(device: torch.device) -> selfcheck.Figures:
    """The C forward (float32 features; float32 and bfloat16 canvases) and backward (float32 and bfloat16
    gradients): max |err| 0 against the reference rounded once to the dtype."""
    if not native.available():
        raise selfcheck.Skip(f"C kernels {native.status()}")
    features, cell_index, cells, want, grad_canvas, want_grad = _check_case(torch.float32, device)
    figures: selfcheck.Figures = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        canvas, *table = native.scatter_max_forward(features, cell_index, cells, True, dtype)
        selfcheck.compare(figures, f"{name} fwd", canvas, want.to(dtype), 0.0)
        grad = native.scatter_max_backward(grad_canvas.to(dtype), *table, dtype)
        selfcheck.compare(figures, f"{name} bwd", grad, want_grad.to(dtype), 0.0)
    return figures


selfcheck.register(
    selfcheck.Check(
        _TRITON,
        _check_triton,
        lambda: selfcheck.sources_hash([triton_source("_pillar_scatter_triton"), __file__]),
        ("cuda", "cpu"),
        "Triton scatter-max fwd+bwd vs the reference, fp32/bf16, bit for bit",
    )
)
native.register_check(_NATIVE, _check_native, __file__, "C scatter-max fwd+bwd vs the reference, fp32/bf16, bit for bit")
