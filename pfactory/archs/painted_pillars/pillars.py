"""The pillars: decorated points -> per-point features -> the BEV canvas, and the backbone's first block
that reads it (DESIGN.md §5, step 3).

    PillarEncoder(points [B, P, 4], num_points [B], painted) -> (point_feats [B*P, C] >= 0, cell [B*P])
    CanvasStem(point_feats, cell, B) -> [B, C1, H/2, W/2]: scatter-max canvas, pad, conv, GroupNorm + ReLU
    SparseCanvasStem: the same from the occupied pillars only (`kernels.pillar_stem`)
    ExportPillarEncoder / ExportCanvasStem: the same values as the ONNX export's graph

`cell` is each point's canvas row; any value outside [0, B*H*W) (-1, or the trash row B*H*W) drops the
point. Which variant a model runs is chosen when it is built or converted (`pfactory.archs.painted_pillars.variants`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import kernels
from pfactory.archs.painted_pillars.layers import linear_long_k
from pfactory.archs.painted_pillars.params import ModelParams


def scatter_max_nonnegative(features: Tensor, row: Tensor, num_cells: int) -> Tensor:
    """canvas [num_cells, C]: per-cell max of features [N, C] (all >= 0); 0 for empty cells. Export only.

    row [N] int64 in [0, num_cells]; row == num_cells is a trash row (dropped points), cut off at the end.
    The same values as `kernels.pillar_scatter_max` whenever features >= 0 (the pillar MLP ends in a
    ReLU): max is exact in any order, and a 0 start changes no max of non-negative values, so the
    kernels' -inf start, occupancy scatter and final Where (0 for empty cells) are not needed. One 1-D
    ScatterElements(reduction=max) over flat offsets `row * C + c`: ORT's loop then does no per-element
    multi-dim offset arithmetic (docs/OPTIMIZE.md, "The graph"). `num_cells` may be symbolic (dynamic batch).
    """
    c = features.shape[1]
    offsets = (row[:, None] * c + torch.arange(c, device=row.device)).reshape(-1)  # [N*C]
    # Zeros from the input (an empty sum), expanded at run time: a constant-shape fill would be folded
    # into the file by the exporter (kernels.pillar_scatter_max_reference says why).
    zero = features[:0, :1].sum(0)  # [1] 0.0 (rank 1: the TorchScript exporter mis-ranks a 0-d expand)
    canvas = zero.expand((num_cells + 1) * c)  # [(cells+1)*C]
    canvas = canvas.scatter_reduce(0, offsets, features.reshape(-1), "amax", include_self=True)
    return canvas[: num_cells * c].reshape(num_cells, c)  # [num_cells, C]


class PillarEncoder(nn.Module):
    """Points -> PointPillars decoration (+ painted image features) -> per-point MLP -> (point features,
    canvas cell): what the BEV backbone's `CanvasStem` scatters into the pillar canvas."""

    def __init__(self, p: ModelParams, extra_channels: int) -> None:
        super().__init__()
        self.pc_range = [float(v) for v in p.pc_range]
        self.cell = float(p.pillar_size_m)
        self.grid = p.grid  # (H, W)
        self.space_to_depth = p.bev_stem == "space_to_depth"
        # (x, y, z) normalized to [-1, 1], intensity, offset to the pillar centre (x, y), offset to the
        # pillar's point mean (x, y, z): the PointPillars decoration.
        c_in = 9 + extra_channels
        c = p.point_channels
        layers: list[nn.Module] = []
        for i in range(p.point_layers):
            layers += [
                nn.Linear(c_in if i == 0 else c, c, bias=False),
                nn.LayerNorm(c),
                nn.ReLU(inplace=True),
            ]
        self.mlp = nn.Sequential(*layers)
        # The export's scatter (`scatter_max_nonnegative`) needs features >= 0: true after a final ReLU.
        self.nonnegative_features = bool(layers) and isinstance(layers[-1], nn.ReLU)

    @staticmethod
    def _pillar_sums(flat: Tensor, cell: Tensor, num_cells: int) -> tuple[Tensor, Tensor]:
        """Per pillar the sums of x, y, z and the point count, scatter-added into an extra trash row.

        flat [B*P, 4], cell [B*P] (-1 = dropped) -> row [B*P] (the point's pillar, dropped -> num_cells),
        sums [num_cells + 1, 4] = (sum x, sum y, sum z, count).
        """
        kept = cell >= 0  # [B*P]
        row = torch.where(kept, cell, num_cells)  # [B*P], dropped -> trash row num_cells
        xyz1 = torch.cat([flat[:, :3], torch.ones_like(flat[:, :1])], dim=1)  # [B*P, 4]
        sums = xyz1.new_zeros(num_cells + 1, 4).scatter_add(0, row[:, None].expand(-1, 4), xyz1)
        return row, sums

    def _decorate_channels_first(
        self, flat: Tensor, cell: Tensor, num_cells: int, extra: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """`PillarEncoder.forward`'s decorated points, channels first ([9 + E, B*P]), and the scatter rows
        (`ExportPillarEncoder`).

        flat [B*P, 4], cell [B*P], extra [B, P, E] or None. Every channel is the same float32 arithmetic
        as in `forward`, one coordinate row at a time: ONNX Runtime's CPU broadcasting of [B*P, 2 or 3]
        against [2 or 3] constants pays per row of 2-3 elements (~0.17 ms per op at 20k points), column
        slices of [B*P, 4] are strided copies, and the [B*P, E] painting features arrive channels first
        (grid_sample's layout), so the [B*P, 9 + E] row-major concat and its transpose go away.
        """
        x0, y0, z0, x1, y1, z1 = self.pc_range
        x, y, z, intensity = flat.t()  # [B*P] each, contiguous rows of the [4, B*P] transpose
        cell_x = (x - x0) / self.cell  # [B*P] continuous cell coordinates
        cell_y = (y - y0) / self.cell
        row, sums = self._pillar_sums(flat, cell, num_cells)  # [B*P], [cells+1, 4]
        # The point's own pillar sums, then the division: per element what `forward` computes on every
        # cell of the grid ([cells+1, 3], ~2x the rows) before gathering.
        sx, sy, sz, count = sums[row].t()  # [B*P] each
        count = count.clamp(min=1.0)
        rows = [
            (x - x0) / (x1 - x0) * 2.0 - 1.0,  # xyz normalized to [-1, 1]
            (y - y0) / (y1 - y0) * 2.0 - 1.0,
            (z - z0) / (z1 - z0) * 2.0 - 1.0,
            intensity,
            cell_x - torch.floor(cell_x) - 0.5,  # offset to the pillar centre, cells
            cell_y - torch.floor(cell_y) - 0.5,
            (x - sx / count) / self.cell,  # offset to the pillar's point mean, cells
            (y - sy / count) / self.cell,
            (z - sz / count) / self.cell,
        ]
        decorated_t = torch.stack(rows)  # [9, B*P]
        if extra is not None:
            e = extra.shape[-1]
            decorated_t = torch.cat([decorated_t, extra.permute(2, 0, 1).reshape(e, -1)])  # [9 + E, B*P]
        return decorated_t, row

    def _canvas_cells(self, cell: Tensor) -> Tensor:
        """cell [N] (`b*H*W + row*W + col`, -1 dropped) -> the canvas row each point scatters into.

        With the space-to-depth stem the canvas rows are ordered `((b*H/2 + row//2)*W/2 + col//2)*4 +
        (row%2)*2 + col%2`, so the [B*H*W, C] canvas *is* [B, H/2, W/2, 4*C] in memory: every 2x2 block of
        pillars is one 0.8 m cell with 4*C channels, and no space-to-depth copy is ever made.
        """
        if not self.space_to_depth:
            return cell
        h, w = self.grid
        c = cell.clamp(min=0)  # [N]
        col = c % w
        row = (c // w) % h
        b = c // (h * w)
        blocked = ((b * (h // 2) + row // 2) * (w // 2) + col // 2) * 4 + (row % 2) * 2 + col % 2  # [N]
        return torch.where(cell >= 0, blocked, -1)

    def painted_weight(self) -> Tensor:
        """[C, E - 1]: the first MLP layer's columns for the painted image features (E = image channels
        + the seen flag), what `paint_points_projected` applies before sampling."""
        return self.mlp[0].weight[:, 9:-1]

    def _cells(self, points: Tensor, num_points: Tensor) -> tuple[Tensor, Tensor, int]:
        """points [B, P, 4], num_points [B] -> (flat [B*P, 4], cell [B*P] canvas row or -1, num_cells)."""
        b, p, _ = points.shape
        h, w = self.grid
        flat = points.reshape(b * p, -1)  # [B*P, 4]
        arange_p = torch.arange(p, device=points.device)  # [P]
        batch = torch.arange(b, device=points.device)[:, None].expand(b, p)  # [B, P]
        # Padding rows get batch index -1, which points_to_cells drops (cell -1): no data-dependent
        # control flow, so the same graph serves every num_points (export, compile).
        batch = torch.where(arange_p[None, :] < num_points[:, None], batch, -1).reshape(b * p)  # [B*P]
        cell = kernels.points_to_cells(flat, batch, self.pc_range, (self.cell, self.cell), (h, w))  # [B*P]
        # An int in eager; a symbolic int under ONNX export with a dynamic batch (no int(): it would pin
        # the batch to the example's).
        return flat, self._canvas_cells(cell), b * h * w  # the canvas row: a permutation of the pillars

    def forward(
        self, points: Tensor, num_points: Tensor, painted: Tensor | tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor]:
        """points [B, P, 4], num_points [B], painted -> (point features [B*P, C] >= 0 after the final
        ReLU, canvas cell [B*P] int64, -1 dropped).

        `painted`: None (no camera), `paint_points`' [B, P, E] (concatenated behind the decoration), or
        `paint_points_projected`'s (rows [B, P, C], flag [B, P]): the image features already multiplied by
        the first layer's columns for them; the first layer then multiplies the 9 decoration channels and
        the flag (its last column) in one float32 GEMM and adds the rows, the same function to rounding.
        """
        b, p, _ = points.shape
        x0, y0, z0, x1, y1, z1 = self.pc_range
        flat, cell, num_cells = self._cells(points, num_points)
        # Offsets to the pillar centre, in cells ([-0.5, 0.5) inside the pillar).
        xy = flat[:, :2]  # [B*P, 2]
        origin = xy.new_tensor([x0, y0])  # [2]
        cell_xy = (xy - origin) / self.cell  # [B*P, 2] continuous cell coordinates
        to_centre = cell_xy - torch.floor(cell_xy) - 0.5  # [B*P, 2]

        # Offsets to the pillar's point mean: scatter-add sums and counts into an extra trash row.
        row, sums = self._pillar_sums(flat, cell, num_cells)  # [B*P], [cells+1, 4]
        mean = sums[:, :3] / sums[:, 3:].clamp(min=1.0)  # [cells+1, 3]
        to_mean = (flat[:, :3] - mean[row]) / self.cell  # [B*P, 3] in cells

        span = xy.new_tensor([x1 - x0, y1 - y0, z1 - z0])  # [3]
        lo = xy.new_tensor([x0, y0, z0])  # [3]
        xyz_n = (flat[:, :3] - lo) / span * 2.0 - 1.0  # [B*P, 3] in [-1, 1] inside the range
        feats = [xyz_n, flat[:, 3:4], to_centre, to_mean]  # 3 + 1 + 2 + 3 = 9 channels
        # Dropped points carry garbage offsets (trash-row mean); they never reach the canvas.
        if isinstance(painted, tuple):  # projected painting: rows [B, P, C], flag [B, P]
            rows, flag = painted
            weight = self.mlp[0].weight  # [C, 9 + E]
            with torch.autocast(points.device.type, enabled=False):
                decorated = torch.cat([*feats, flag.reshape(b * p, 1)], dim=1).float()  # [B*P, 10]
                w_geo = torch.cat([weight[:, :9], weight[:, -1:]], dim=1).float()  # [C, 10]
                # linear + add_, not addmm: MKL's beta=1 path for this K=10 GEMM is ~2x slower (CPU).
                first = linear_long_k(decorated, w_geo).add_(rows.reshape(b * p, -1))  # [B*P, C] float32
            return self.mlp[1:](first), cell
        if painted is not None:
            feats.append(painted.reshape(b * p, -1))  # [B*P, E]
        return self.mlp(torch.cat(feats, dim=1)), cell  # [B*P, 9 + E] -> [B*P, C]


class ExportPillarEncoder(PillarEncoder):
    """`PillarEncoder` as the ONNX export's graph: the decoration channels first (`_decorate_channels_first`)
    and a transposed Gemm input (ORT folds the Transpose into Gemm's transA: no [B*P, 9 + E] copy).
    -> (point features [B*P, C], row [B*P]: the canvas row, dropped points in the trash row B*H*W)."""

    def forward(self, points: Tensor, num_points: Tensor, painted: Tensor | None) -> tuple[Tensor, Tensor]:
        if isinstance(painted, tuple):
            raise ValueError("ExportPillarEncoder: projected painting is not exported (use ExportPainter)")
        flat, cell, num_cells = self._cells(points, num_points)
        decorated_t, row = self._decorate_channels_first(flat, cell, num_cells, painted)  # [9 + E, B*P]
        return self.mlp(decorated_t.t()), row  # [B*P, C], [B*P]


class CanvasStem(nn.Sequential):
    """The BEV backbone's first block fed by the pillars: (point features [N, C] >= 0, cell [N], B) ->
    canvas [B, C, H, W] (`kernels.pillar_scatter_max`; [B, 4*C, H/2, W/2] with the space-to-depth stem),
    zero-padded at the bottom/right by `pad` = (rows, cols), -> conv -> GroupNorm + ReLU.

    Holds the block's own conv and norm as children "0" and "1" (the state-dict keys of the
    `conv_norm_act` Sequential it replaces). The canvas is a channels-last view, which the convs prefer.
    """

    def __init__(
        self, block: nn.Sequential, grid: tuple[int, int], space_to_depth: bool, pad: tuple[int, int]
    ):
        super().__init__(*block)
        self.grid, self.space_to_depth, self.pad = grid, space_to_depth, pad

    def _as_image(self, canvas: Tensor, b: int) -> Tensor:
        """canvas [B*H*W, C] -> [B, C, H, W], or [B, 4*C, H/2, W/2] with the space-to-depth stem (a view)."""
        h, w = self.grid
        if self.space_to_depth:
            return canvas.reshape(b, h // 2, w // 2, -1).permute(0, 3, 1, 2)
        return canvas.reshape(b, h, w, -1).permute(0, 3, 1, 2)

    def canvas(self, point_feats: Tensor, cell: Tensor, b: int) -> Tensor:
        """-> [B, C, H, W] (channels-last view). Under autocast the canvas is written in the autocast dtype:
        the first convolution would cast it there anyway (the same values), so no full-precision canvas,
        cast, or gradient cast is made."""
        h, w = self.grid
        dev = point_feats.device.type
        canvas_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        canvas = kernels.pillar_scatter_max(
            point_feats, cell, b * h * w, check_indices=False, canvas_dtype=canvas_dtype
        )  # [B*H*W, C]
        return self._as_image(canvas, b)

    def forward(self, point_feats: Tensor, cell: Tensor, b: int) -> Tensor:  # type: ignore[override]
        x = self.canvas(point_feats, cell, b)  # [B, C0, H, W]
        ph, pw = self.pad
        x = F.pad(x, (0, pw, 0, ph)) if ph or pw else x  # [B, C0, Hp, Wp]
        return self[1](self[0](x))


class ExportCanvasStem(CanvasStem):
    """`CanvasStem` as the ONNX export's graph: for non-negative features (a final ReLU) one 1-D
    ScatterElements(max) (`scatter_max_nonnegative`), else the reference's; `cell` is the export
    encoder's row (dropped: the trash row B*H*W)."""

    def __init__(self, stem: CanvasStem, nonnegative: bool) -> None:
        super().__init__(nn.Sequential(*stem), stem.grid, stem.space_to_depth, stem.pad)
        self.nonnegative = nonnegative

    def canvas(self, point_feats: Tensor, cell: Tensor, b: int) -> Tensor:
        h, w = self.grid
        if self.nonnegative:
            return self._as_image(scatter_max_nonnegative(point_feats, cell, b * h * w), b)
        # what `kernels.pillar_scatter_max` exports; it also takes a symbolic num_cells
        return self._as_image(kernels.pillar_scatter_max_reference(point_feats, cell, b * h * w), b)


class SparseCanvasStem(CanvasStem):
    """`CanvasStem` for the 3x3 stride-2 conv stem, from the occupied pillars only: the canvas'
    scatter-max and the conv are one op (`kernels.pillar_stem`; the C kernels on CPU), then the norm.
    The same function to float rounding; the stem's cost times the occupancy (docs/MODEL.md, "Speed").
    Under bf16 autocast the canvas maxima and the weight are rounded to bf16 values, as the dense bf16
    conv's inputs are, and the output is bf16."""

    def __init__(self, stem: CanvasStem) -> None:
        if not self.applies(stem):
            raise ValueError(
                "SparseCanvasStem: the stem must be a 3x3, stride-2, padding-1 conv without bias"
            )
        super().__init__(nn.Sequential(*stem), stem.grid, stem.space_to_depth, stem.pad)

    @staticmethod
    def applies(stem: CanvasStem) -> bool:
        """Whether `stem` is a dense stem this one can replace."""
        conv = stem[0]
        return (
            not stem.space_to_depth
            and type(conv) is nn.Conv2d
            and conv.kernel_size == (3, 3)
            and conv.stride == (2, 2)
            and conv.padding == (1, 1)
            and conv.bias is None
            and conv.groups == 1
        )

    def forward(self, point_feats: Tensor, cell: Tensor, b: int) -> Tensor:  # type: ignore[override]
        h, w = self.grid
        ph, pw = self.pad
        out_hw = ((h + ph - 1) // 2 + 1, (w + pw - 1) // 2 + 1)  # the dense conv's (k3, s2, p1) output
        dev = point_feats.device.type
        bf16 = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.bfloat16
        out_dtype = torch.bfloat16 if bf16 else torch.float32
        x = kernels.pillar_stem(point_feats.float(), cell, self[0].weight, b, (h, w), out_hw, bf16, out_dtype)
        return self[1](x)  # [B, C1, Ho, Wo]
