"""perception-factory kernels: the hot ops of the pillar detector, each a `torch.library` custom op.

    points_to_cells(points [N, >=3], batch_index [N], pc_range, cell_size, grid) -> cell_index [N] int64
    pillar_scatter_max(features [N, C], cell_index [N], num_cells) -> canvas [num_cells, C]
    pillar_stem(features [N, C], cell_index [N], weight [Co, C, 3, 3], B, grid, out_hw) -> [B, Co, Ho, Wo]
    group_norm_relu(x [B, C, H, W], weight [C], bias [C], groups) -> [B, C, H, W]
    render_heatmap(centers [M, 2], radii [M], labels [M], batch_index [M], B, K, H, W) -> [B, K, H, W]
    bilinear_rows(table [R, C], index [S, 4], weight [S, 4], dest=None, total=0) -> [S or total, C]
    focal_loss(logits [...], target [...], alpha=2.0, beta=4.0) -> scalar

Each op has a readable PyTorch reference (`<op>_reference`, the spec) beside it; the scatter-max,
heatmap and focal loss have a Triton implementation used on CUDA (`import kernels` never imports
Triton: kernels/_dispatch.py). On CPU, `kernels.native` (C built on first use, called through a typed
binding) implements the scatter-max, GroupNorm + ReLU and the sparse BEV stem, forward and backward,
with PyTorch ops as their fallback; the ops are opaque to torch.compile, which keeps them. Conventions, algorithms,
byte models and tolerances: docs/KERNELS.md. Tests: `pytest tests/kernels`; benchmark:
`python benchmarks/bench_kernels.py --device cuda`.
"""

from kernels.bilinear_rows import bilinear_rows, bilinear_rows_reference
from kernels.focal_loss import focal_loss, focal_loss_reference
from kernels.group_norm_relu import group_norm_relu, group_norm_relu_reference
from kernels.heatmap import render_heatmap, render_heatmap_reference
from kernels.pillar_scatter import (
    pillar_scatter_argmax_reference,
    pillar_scatter_max,
    pillar_scatter_max_reference,
    points_to_cells,
)
from kernels.pillar_stem import pillar_stem, pillar_stem_reference

__all__ = [
    "bilinear_rows",
    "bilinear_rows_reference",
    "focal_loss",
    "focal_loss_reference",
    "group_norm_relu",
    "group_norm_relu_reference",
    "pillar_scatter_argmax_reference",
    "pillar_scatter_max",
    "pillar_scatter_max_reference",
    "pillar_stem",
    "pillar_stem_reference",
    "points_to_cells",
    "render_heatmap",
    "render_heatmap_reference",
]
