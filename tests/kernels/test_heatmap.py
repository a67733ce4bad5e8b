"""render_heatmap: hand-computed Gaussians, border clipping, max-combination, Triton (culled) == reference.

Triton runs under TRITON_INTERPRET=1 on CPU (set below, before any Triton kernel is imported) and
for real on CUDA (`pytest -m gpu`). Tolerance: the interpreter evaluates exp with numpy, worst
|triton - reference| measured 1.2e-7 (1 ulp at 1.0), so atol = 1e-6 with rtol = 1e-5; on a GPU
tl.exp and the fp32 division are approximate to a few ulp, inside the same bounds (the benchmark's
JSON records the measured worst error on the GPU).
"""

from __future__ import annotations

import math

from kernels._testing import enable_triton_interpreter, triton_device_params

enable_triton_interpreter()  # before anything imports the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import render_heatmap, render_heatmap_reference  # noqa: E402
from kernels._dispatch import force_triton  # noqa: E402
from kernels.heatmap import _render_heatmap_windowed  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5


def _render(
    objects: list[tuple[float, float, int, int, int]], b: int, k: int, h: int, w: int
) -> torch.Tensor:
    """objects: (x, y, radius, label, batch) -> reference heatmap [B, K, H, W]."""
    centers = torch.tensor([[o[0], o[1]] for o in objects], dtype=torch.float32).reshape(-1, 2)
    radii, labels, batch = (torch.tensor([o[i] for o in objects], dtype=torch.int64) for i in (2, 3, 4))
    return render_heatmap(centers, radii, labels, batch, b, k, h, w)


def _gauss(d2: float, radius: int) -> float:
    sigma = (2 * radius + 1) / 6
    return math.exp(-d2 / (2 * sigma * sigma))


def test_hand_computed_cells() -> None:
    heat = _render([(5.7, 3.2, 2, 0, 0)], 1, 1, 8, 12)[0, 0]  # peak cell: row 3, col 5
    assert heat[3, 5].item() == 1.0
    expected = {
        (3, 6): _gauss(1, 2),  # exp(-0.72) = 0.48675
        (4, 6): _gauss(2, 2),  # exp(-1.44) = 0.23693
        (3, 7): _gauss(4, 2),  # exp(-2.88) = 0.05613
        (5, 7): _gauss(8, 2),  # window corner, exp(-5.76) = 0.00315
        (1, 3): _gauss(8, 2),
        (3, 8): 0.0,  # |dx| = 3 > radius
        (0, 5): 0.0,  # |dy| = 3 > radius
    }
    for (r, c), v in expected.items():
        assert heat[r, c].item() == pytest.approx(v, rel=1e-6, abs=1e-7), (r, c)
    assert int((heat > 0).sum()) == 25  # the full 5 x 5 window, nothing else
    assert _gauss(1, 2) == pytest.approx(0.486752, rel=1e-5)  # the formula itself, by hand


def test_radius_zero_is_a_single_peak() -> None:
    heat = _render([(2.99, 1.0, 0, 0, 0)], 1, 1, 4, 4)[0, 0]
    assert heat.nonzero().tolist() == [[1, 2]] and heat[1, 2].item() == 1.0


def test_border_clipping_equals_crop_of_unclipped() -> None:
    # An object near the top-left corner equals the crop of the same object drawn 3 cells further in
    # on a grid 3 cells larger: clipping removes cells, it never moves or renormalises them.
    clipped = _render([(0.2, 0.9, 3, 0, 0)], 1, 1, 9, 10)
    padded = _render([(3.2, 3.9, 3, 0, 0)], 1, 1, 12, 13)
    torch.testing.assert_close(clipped, padded[:, :, 3:, 3:], rtol=0, atol=0)
    assert clipped[0, 0, 0, 0] == 1.0 and clipped[0, 0, 2, 3].item() == pytest.approx(_gauss(13, 3), rel=1e-6)
    # Bottom-right corner, centre outside the grid: only the in-grid part of the window is drawn.
    outside = _render([(10.5, 9.5, 2, 0, 0)], 1, 1, 9, 10)[0, 0]  # peak (row 9, col 10) is off-grid
    assert outside.nonzero().tolist() == [[7, 8], [7, 9], [8, 8], [8, 9]]
    assert outside[8, 9].item() == pytest.approx(_gauss(2, 2), rel=1e-6)


def test_overlapping_objects_combine_by_max_and_planes_separate() -> None:
    a, b = (4.5, 4.5, 3, 1, 0), (6.2, 5.1, 2, 1, 0)
    both = _render([a, b], 2, 2, 10, 12)
    alone_a, alone_b = _render([a], 2, 2, 10, 12), _render([b], 2, 2, 10, 12)
    torch.testing.assert_close(both, torch.maximum(alone_a, alone_b), rtol=0, atol=0)
    assert (alone_a > 0).logical_and(alone_b > 0).any(), "the two windows must overlap for this test"
    assert both[:, 0].abs().sum() == 0 and both[1].abs().sum() == 0  # label 1, batch 0 only
    other = _render([(4.5, 4.5, 3, 0, 1)], 2, 2, 10, 12)
    assert other[1, 0, 4, 4] == 1.0 and other[0].abs().sum() == 0 and other[1, 1].abs().sum() == 0


def test_no_objects_and_non_finite_centres_draw_nothing() -> None:
    assert _render([], 2, 3, 5, 7).abs().sum() == 0
    assert _render([(math.nan, 2.0, 2, 0, 0), (math.inf, 1.0, 1, 0, 0)], 1, 1, 5, 7).abs().sum() == 0


def test_validation_errors() -> None:
    c, r = torch.zeros(2, 2), torch.ones(2, dtype=torch.int64)
    z = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="labels values must lie in \\[0, 3\\)"):
        render_heatmap(c, r, torch.tensor([0, 3]), z, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="batch_index values must lie in \\[0, 1\\)"):
        render_heatmap(c, r, z, torch.tensor([0, 1]), 1, 3, 4, 4)
    with pytest.raises(ValueError, match="radii values must lie"):
        render_heatmap(c, -r, z, z, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="centers must be \\[M, 2\\]"):
        render_heatmap(torch.zeros(2, 3), r, z, z, 1, 3, 4, 4)
    with pytest.raises(ValueError, match="height must be an int >= 1"):
        render_heatmap(c, r, z, z, 1, 3, 0, 4)


def test_opcheck() -> None:
    g = torch.Generator().manual_seed(0)
    args = (
        torch.rand(6, 2, generator=g) * 10,
        torch.randint(0, 3, (6,), generator=g),
        torch.randint(0, 2, (6,), generator=g),
        torch.randint(0, 2, (6,), generator=g),
        2,
        2,
        9,
        11,
    )
    torch.library.opcheck(torch.ops.pfk.render_heatmap.default, args)


# --------------------------------------------------------------------------------------------------
# the op's CPU path (windows only) == reference, bitwise
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("m", "b", "k", "h", "w", "max_radius"),
    [(0, 1, 1, 5, 7, 2), (1, 1, 1, 1, 1, 0), (30, 2, 3, 37, 70, 12), (84, 4, 3, 100, 88, 4), (5, 1, 2, 9, 9, 7)],
    ids=["M0", "1x1_grid", "odd_grid_30_objects", "default_head_grid", "window_larger_than_grid"],
)
def test_windowed_matches_reference_bitwise(m: int, b: int, k: int, h: int, w: int, max_radius: int) -> None:
    centers, radii, labels, batch = _random_objects(m, b, k, h, w, max_radius, seed=m + 1, device="cpu")
    if m >= 4:  # what the targets feed it: masked objects with label -1, non-finite centres
        labels[0] = -1
        centers[1, 0] = math.nan
        centers[2, 1] = math.inf
        batch[3] = b  # out of range: drawn nowhere
    expected = render_heatmap_reference(centers, radii, labels, batch, b, k, h, w)
    actual = _render_heatmap_windowed(centers, radii, labels, batch, b, k, h, w)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# Triton (tile-by-tile, culled) == reference
# --------------------------------------------------------------------------------------------------
def _random_objects(m: int, b: int, k: int, h: int, w: int, max_radius: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    centers = torch.rand(m, 2, generator=g) * torch.tensor([w + 8.0, h + 8.0]) - 4  # some off-grid
    radii = torch.randint(0, max_radius + 1, (m,), generator=g)
    labels = torch.randint(0, k, (m,), generator=g)
    batch = torch.randint(0, b, (m,), generator=g)
    return tuple(t.to(device) for t in (centers, radii, labels, batch))


def _compare(objects: tuple, b: int, k: int, h: int, w: int) -> None:
    expected = render_heatmap_reference(*objects, b, k, h, w)
    with force_triton():
        actual = render_heatmap(*objects, b, k, h, w)
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    # Culling must never drop a cell: compare supports exactly, not just values within tolerance.
    assert torch.equal(actual > 0, expected > 0), "a culled object left cells undrawn (or drew extra)"


@pytest.mark.parametrize("device", triton_device_params())
@pytest.mark.parametrize(
    ("m", "b", "k", "h", "w", "max_radius"),
    [(0, 1, 1, 5, 7, 2), (1, 1, 1, 1, 1, 0), (30, 2, 3, 37, 70, 12), (12, 1, 2, 17, 33, 40)],
    ids=["M0", "1x1_grid", "odd_grid_30_objects", "radius_larger_than_tiles"],
)
def test_triton_matches_reference(
    device: str, m: int, b: int, k: int, h: int, w: int, max_radius: int
) -> None:
    _compare(_random_objects(m, b, k, h, w, max_radius, seed=m, device=device), b, k, h, w)


@pytest.mark.parametrize("device", triton_device_params())
def test_triton_culling_at_tile_edges(device: str) -> None:
    # Tiles are 16 rows x 32 cols, so a 32 x 64 grid is 2 x 2 tiles meeting at (row 16, col 32).
    # Sweep peaks and radii across that corner so windows end exactly on, one before and one after
    # every tile edge. Each object gets its own class plane: a max over overlapping objects could
    # hide a culled one, separate planes cannot.
    objs = [
        (col + 0.5, row + 0.5, r)
        for col in (28, 29, 31, 32, 34, 35)
        for row in (12, 15, 16, 19)
        for r in (1, 3)
    ]
    centers = torch.tensor([[x, y] for x, y, _ in objs])  # [48, 2]
    radii = torch.tensor([r for *_, r in objs])  # [48]
    labels = torch.arange(len(objs))  # object i -> plane i
    batch = torch.zeros(len(objs), dtype=torch.int64)
    _compare(tuple(t.to(device) for t in (centers, radii, labels, batch)), 1, len(objs), 32, 64)


@pytest.mark.parametrize("device", triton_device_params())
def test_triton_many_object_blocks(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels._heatmap_triton as heatmap_triton

    monkeypatch.setattr(heatmap_triton, "_BLOCK_M", 8)  # 45 objects -> 6 culling blocks, last one partial
    objects = _random_objects(45, 2, 2, 20, 40, 6, seed=7, device=device)
    objects[0][3] = torch.nan  # a NaN centre among the others draws nothing
    _compare(objects, 2, 2, 20, 40)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_realistic_size() -> None:
    # 100 objects per sample into 4 x 3 x 200 x 176, CenterPoint-like radii 2..10.
    centers, radii, labels, batch = _random_objects(400, 4, 3, 200, 176, 10, seed=1, device="cuda")
    radii = radii.clamp(min=2)
    _compare((centers, radii, labels, batch), 4, 3, 200, 176)
