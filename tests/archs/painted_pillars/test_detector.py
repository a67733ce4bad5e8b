"""The detector: output shapes, painting geometry, padding/batch independence, differentiable fusion,
and that the export path compiles as one graph."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from kernels import native
from pfactory.archs.painted_pillars.detector import build_model
from pfactory.archs.painted_pillars.layers import Conv1x1, GroupNormReLU, linear_long_k
from pfactory.archs.painted_pillars.painting import paint_points, paint_points_projected, sample_bilinear
from pfactory.archs.painted_pillars.params import ModelParams
from pfactory.archs.painted_pillars.variants import for_export

from .helpers import IMAGE_SIZE, camera_proj, random_batch, tiny_params


@pytest.mark.parametrize("camera", [True, False])
@pytest.mark.parametrize("cams", [1, 3])
@pytest.mark.parametrize(
    ("stem", "head_kernel", "heading", "neck"),
    [
        ("space_to_depth", 1, "axis_sign", "concat"),
        ("conv3x3", 3, "sincos", "concat"),
        ("conv3x3", 3, "sincos", "sum"),
    ],
    ids=["s2d_head1_axis_sign", "format1_network", "sum_neck"],
)
def test_output_shapes(camera: bool, cams: int, stem: str, head_kernel: int, heading: str, neck: str) -> None:
    p = tiny_params(camera=camera, bev_stem=stem, head_kernel=head_kernel, heading=heading, neck=neck)
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE)
    b = random_batch(p, batch=2, cams=cams)
    out = model(b["points"], b["num_points"], b["images"], b["proj"], b["cam_valid"])
    h, w = p.head_grid
    assert out["heatmap"].shape == (2, 3, h, w)
    assert out["reg"].shape == (2, len(p.reg_channels), h, w)
    boxes, scores, labels = model.forward_export(b["points"], b["num_points"], b["images"], b["proj"])
    assert boxes.shape == (2, p.max_detections, 7) and scores.shape == labels.shape == (2, p.max_detections)
    assert torch.isfinite(boxes).all() and (scores[:, :-1] >= scores[:, 1:]).all()


def test_sample_bilinear_matches_grid_sample_forward_and_backward() -> None:
    torch.manual_seed(0)
    b, n, c, h, w, p = 2, 3, 5, 7, 9, 400
    feats = torch.randn(b * n, h, w, c).permute(0, 3, 1, 2).reshape(b, n, c, h, w)  # channels-last memory
    feats.requires_grad_(True)
    gx = torch.rand(b, n, p) * 2.4 - 1.2  # some points off the map: zero padding
    gy = torch.rand(b, n, p) * 2.4 - 1.2
    mask = torch.rand(b, n, p) > 0.2
    mine = sample_bilinear(feats, gx, gy, mask)  # [B, N, P, C]
    ref = torch.nn.functional.grid_sample(
        feats.reshape(b * n, c, h, w), torch.stack([gx, gy], -1).reshape(b * n, 1, p, 2),
        mode="bilinear", align_corners=False, padding_mode="zeros",
    ).reshape(b, n, c, p).transpose(2, 3) * mask[..., None]  # fmt: skip
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    (grad_mine,) = torch.autograd.grad(mine, feats, g)
    (grad_ref,) = torch.autograd.grad(ref, feats, g)
    torch.testing.assert_close(grad_mine, grad_ref, atol=1e-5, rtol=1e-5)


def test_sample_bilinear_of_a_batch_is_its_samples_alone_forward_and_backward() -> None:
    """Batch 2 vs the same samples at batch 1 each (a DDP split): bitwise the same values and gradient into
    the features (no index or buffer depends on the batch), and grid_sample's to float rounding at both."""
    torch.manual_seed(0)
    b, n, c, h, w, p = 2, 2, 6, 8, 16, 500
    feats = torch.randn(b * n, h, w, c).permute(0, 3, 1, 2).reshape(b, n, c, h, w)  # channels-last memory
    gx = torch.rand(b, n, p) * 2.2 - 1.1  # some taps off the map: zero padding
    gy = torch.rand(b, n, p) * 2.2 - 1.1
    mask = torch.rand(b, n, p) > 0.3
    g = torch.randn(b, n, p, c)

    def sample(lo: int, hi: int, ref: bool) -> tuple[torch.Tensor, torch.Tensor]:
        f = feats[lo:hi].detach().clone().requires_grad_(True)
        m = f.shape[0] * n
        if ref:
            grid = torch.stack([gx[lo:hi], gy[lo:hi]], -1).reshape(m, 1, p, 2)
            out = torch.nn.functional.grid_sample(f.reshape(m, c, h, w), grid, align_corners=False)
            out = out.reshape(-1, n, c, p).transpose(2, 3) * mask[lo:hi, ..., None]  # [b, N, P, C]
        else:
            out = sample_bilinear(f, gx[lo:hi], gy[lo:hi], mask[lo:hi])  # [b, N, P, C]
        (grad,) = torch.autograd.grad(out, f, g[lo:hi])
        return out.detach(), grad

    out, grad = sample(0, 2, ref=False)
    split = [sample(i, i + 1, ref=False) for i in range(b)]
    assert torch.equal(out, torch.cat([o for o, _ in split]))
    assert torch.equal(grad, torch.cat([gr for _, gr in split]))
    for lo, hi in ((0, 2), (0, 1), (1, 2)):
        for mine, ref in zip(sample(lo, hi, ref=False), sample(lo, hi, ref=True)):
            torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sampler", ["gather", "grid_sample"])
def test_painting_of_a_batch_is_its_samples_painted_alone(sampler: str) -> None:
    """paint_points (projection + sampling) at batch 2 vs batch 1 each, values and feature gradient, with
    either `model.paint_sampler`; the two samplers agree. To float rounding: the projection's einsum
    blocks differently at another batch size."""
    torch.manual_seed(0)
    b, n, c, h, w, p = 2, 2, 6, 8, 16, 500  # h, w: the 64 x 32 test image at stride 4
    feats = torch.randn(b * n, h, w, c).permute(0, 3, 1, 2).reshape(b, n, c, h, w)
    points = torch.cat([torch.rand(b, p, 1) * 30, torch.rand(b, p, 2) * 20 - 10, torch.rand(b, p, 1)], -1)
    proj = camera_proj(b, n)  # [B, N, 3, 4]
    cam_valid = torch.tensor([[True, True], [True, False]])
    g = torch.randn(b, p, c + 1)

    def paint(lo: int, hi: int, how: str) -> tuple[torch.Tensor, torch.Tensor]:
        f = feats[lo:hi].detach().clone().requires_grad_(True)
        out = paint_points(points[lo:hi], f, proj[lo:hi], cam_valid[lo:hi], IMAGE_SIZE, sampler=how)
        (grad,) = torch.autograd.grad(out, f, g[lo:hi])
        return out.detach(), grad

    out, grad = paint(0, 2, sampler)
    assert 0.2 < out[..., -1].mean() < 0.9  # some points seen by a camera, some not
    split = [paint(i, i + 1, sampler) for i in range(b)]
    torch.testing.assert_close(out, torch.cat([o for o, _ in split]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, torch.cat([gr for _, gr in split]), atol=1e-5, rtol=1e-5)
    other = paint(0, 2, "grid_sample" if sampler == "gather" else "gather")
    torch.testing.assert_close(out, other[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, other[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_conv1x1_equals_conv2d_forward_and_backward(memory_format: torch.memory_format) -> None:
    torch.manual_seed(0)
    conv = Conv1x1(12, 7)
    ref = torch.nn.Conv2d(12, 7, 1)
    ref.load_state_dict(conv.state_dict())
    x = torch.randn(2, 12, 5, 6).contiguous(memory_format=memory_format).requires_grad_(True)
    y, y_ref = conv(x), ref(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, conv.weight, conv.bias], g)
    grads_ref = torch.autograd.grad(y_ref, [x, ref.weight, ref.bias], g)
    for a, e in zip(grads, grads_ref):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("hw", [(6, 5), (60, 55)])  # below / above the own-backward pixel count
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch-ops"])
def test_group_norm_relu_is_relu_of_fp32_group_norm_forward_and_backward(
    memory_format: torch.memory_format,
    hw: tuple[int, int],
    out_fp32: bool,
    use_native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """relu(nn.GroupNorm(x.float())) in values and in the gradients of x, weight and bias, for fp32 and
    bf16 inputs (a conv output under autocast), channels-last (`pfk::group_norm_relu`: the C kernels of
    kernels/native.py, or the PyTorch ops with both of their backward paths) and NCHW (the PyTorch ops);
    the output is channels-last and keeps the input's dtype unless `out_fp32`."""
    if use_native and not native.available():
        pytest.skip(f"native CPU kernels: {native.status()}")
    if not use_native:
        monkeypatch.setattr(native, "supports", lambda x, groups: False)
    torch.manual_seed(0)
    gn, ref = GroupNormReLU(4, 16, out_fp32=out_fp32), torch.nn.GroupNorm(4, 16)
    with torch.no_grad():
        gn.weight.uniform_(0.5, 1.5), gn.bias.uniform_(-0.5, 0.5)
    ref.load_state_dict(gn.state_dict())
    x32 = (torch.randn(2, 16, *hw) * 2 + 0.5).contiguous(memory_format=memory_format)
    for x in (x32, x32.to(torch.bfloat16)):
        xa = x.detach().requires_grad_(True)
        fused = memory_format == torch.channels_last
        # The C kernels' statistics are float64 sums: compared with the float64 reference, which they meet
        # closer than ATen's float32 kernel does (5e-7 vs 3e-6 here); the PyTorch ops with ATen's fp32.
        ref_dtype = torch.float64 if use_native and fused else torch.float32
        ref = ref.to(ref_dtype)
        xr = x.detach().to(ref_dtype).requires_grad_(True)
        y, y_ref = gn(xa), torch.relu(ref(xr))
        assert y.dtype == (torch.float32 if out_fp32 else x.dtype)
        assert y.is_contiguous(memory_format=torch.channels_last)
        if y.dtype == torch.bfloat16:  # rounded once: within one bf16 ulp of the reference
            torch.testing.assert_close(y.float(), y_ref.float(), atol=1e-6, rtol=2**-8)
        else:
            torch.testing.assert_close(y, y_ref.to(y.dtype), atol=2e-6, rtol=1e-6)
        g = torch.randn(y.shape).to(y.dtype)
        grads = torch.autograd.grad(y, [xa, gn.weight, gn.bias], g)
        grads_ref = [
            t.float() for t in torch.autograd.grad(y_ref, [xr, ref.weight, ref.bias], g.to(ref_dtype))
        ]
        if x.dtype == torch.bfloat16:  # dx rounded to bf16 once: within one bf16 rounding of the fp32 value
            torch.testing.assert_close(grads[0].float(), grads_ref[0], atol=1e-4, rtol=8e-3)
        else:
            torch.testing.assert_close(grads[0], grads_ref[0], atol=1e-5, rtol=1e-5)
        assert grads[0].dtype == x.dtype
        for a, e in zip(grads[1:], grads_ref[1:]):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-5)


def test_linear_long_k_is_linear_forward_and_backward() -> None:
    """The pillar MLP's first layer: F.linear's values and gradients (x and weight), and plain F.linear
    (no autograd node of its own) without grad."""
    torch.manual_seed(0)
    x = torch.randn(5000, 10, requires_grad=True)
    w = torch.randn(32, 10, requires_grad=True)
    g = torch.randn(5000, 32)
    y, y_ref = linear_long_k(x, w), F.linear(x, w)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    grads = torch.autograd.grad(y, [x, w], g)
    grads_ref = torch.autograd.grad(y_ref, [x, w], g)
    for a, e in zip(grads, grads_ref):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        assert linear_long_k(x, w).grad_fn is None


def test_painting_projects_in_fp32_under_bf16_autocast() -> None:
    """Under CPU bf16 autocast the projection einsum stays fp32: painting samples the same pixels."""
    p = tiny_params()
    b = random_batch(p, batch=2, cams=2)
    feats = torch.randn(2, 2, 5, IMAGE_SIZE[1] // 4, IMAGE_SIZE[0] // 4)
    ref = paint_points(b["points"], feats, b["proj"], b["cam_valid"], IMAGE_SIZE)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = paint_points(b["points"], feats, b["proj"], b["cam_valid"], IMAGE_SIZE)
    torch.testing.assert_close(got.float(), ref, atol=1e-5, rtol=1e-5)


def test_default_params_grid() -> None:
    p = ModelParams()
    assert p.grid == (200, 176)  # 80 m / 0.4 m rows (y), 70.4 m / 0.4 m columns (x)
    assert p.head_grid == (100, 88) and p.head_cell_m == pytest.approx(0.8)


def test_painting_picks_the_projected_pixel_feature() -> None:
    wi, hi = IMAGE_SIZE
    proj = camera_proj(1, 2)  # [1, 2, 3, 4] two identical cameras
    feats = torch.zeros(1, 2, 2, hi, wi)  # [B, N, C, h, w] feature map at stride 1
    feats[0, 0, 0, 10, 20] = 5.0  # camera 0, channel 0, pixel (u=20, v=10)
    feats[0, 1, 0, 10, 20] = 1.0  # camera 1 sees 1 there: the mean over both cameras is 3
    feats[0, :, 1] = 7.0  # channel 1 constant
    f = 30.0
    depth = 8.0
    # Invert the pinhole: u = f * (-y / x) + cx, v = f * (-z / x) + cy with cx = wi/2 - 0.5.
    u, v = 20.0, 10.0
    y = -(u - (wi / 2 - 0.5)) * depth / f
    z = -(v - (hi / 2 - 0.5)) * depth / f
    pts = torch.tensor([[[depth, y, z, 0.5], [-depth, y, z, 0.5], [depth, 100.0, 0.0, 0.5]]])  # [1, 3, 4]
    valid = torch.tensor([[True, True]])
    out = paint_points(pts, feats, proj, valid, IMAGE_SIZE)  # [1, 3, 3]
    torch.testing.assert_close(out[0, 0], torch.tensor([3.0, 7.0, 1.0]))  # mean of 5 and 1; flag 1
    torch.testing.assert_close(out[0, 1], torch.zeros(3))  # behind the cameras
    torch.testing.assert_close(out[0, 2], torch.zeros(3))  # outside the images
    # An invalid camera contributes nothing: camera 0 alone gives 5.
    out = paint_points(pts, feats, proj, torch.tensor([[True, False]]), IMAGE_SIZE)
    torch.testing.assert_close(out[0, 0], torch.tensor([5.0, 7.0, 1.0]))


def test_painting_is_differentiable_into_the_image_branch() -> None:
    p = tiny_params()
    model = build_model(p, IMAGE_SIZE)
    b = random_batch(p, batch=1, points=2000)
    # Points in front of the camera, inside its field of view.
    b["points"][..., 1] = b["points"][..., 1] * 0.2
    b["points"][..., 2] = 0.0
    out = model(b["points"], b["num_points"], b["images"], b["proj"], b["cam_valid"])
    out["heatmap"].sum().backward()
    grad = model.image_branch.net[0][0].weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_padding_rows_and_batch_neighbours_do_not_change_a_sample() -> None:
    # GroupNorm and masked padding: a frame's output is the same alone, padded, or next to another.
    p = tiny_params()
    torch.manual_seed(1)
    model = build_model(p, IMAGE_SIZE).eval()
    b = random_batch(p, batch=2, points=400)
    n0 = int(b["num_points"][0])
    with torch.no_grad():
        both = model(b["points"], b["num_points"], b["images"], b["proj"], b["cam_valid"])
        padded = b["points"][:1].clone()
        padded[:, n0 - 50 :] = 1e3 * torch.randn_like(padded[:, n0 - 50 :])  # garbage beyond num_points
        alone = model(
            torch.cat([b["points"][:1, : n0 - 50], padded[:, n0 - 50 :]], 1),
            torch.tensor([n0 - 50]),
            b["images"][:1],
            b["proj"][:1],
            b["cam_valid"][:1],
        )
        trimmed = model(
            b["points"][:1, : n0 - 50],
            torch.tensor([n0 - 50]),
            b["images"][:1],
            b["proj"][:1],
            b["cam_valid"][:1],
        )
    torch.testing.assert_close(alone["heatmap"], trimmed["heatmap"])
    assert not torch.allclose(both["heatmap"][:1], trimmed["heatmap"])  # it did drop 50 real points
    full = model(b["points"][:1], b["num_points"][:1], b["images"][:1], b["proj"][:1], b["cam_valid"][:1])
    torch.testing.assert_close(both["heatmap"][:1], full["heatmap"].detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",  # Dynamo's whole graph + AOTAutograd over the fake impls: what a graph break or a bad fake breaks
        # Inductor's codegen (~50 s): used only by opt-in paths (train.compile, optimize.backend=aoti; both
        # full tier too: tests/train/test_compile.py, tests/optimize/test_aoti.py)
        pytest.param("inductor", marks=pytest.mark.full),
    ],
)
def test_forward_export_compiles_fullgraph(backend: str) -> None:
    # DESIGN.md §6: the model compiles without graph breaks (kernels are custom ops with fake impls).
    p = tiny_params()
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE).eval()
    b = random_batch(p, batch=2)
    args = (b["points"], b["num_points"], b["images"], b["proj"])
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.forward_export(*args)
        compiled = torch.compile(model.forward_export, fullgraph=True, backend=backend)(*args)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


def test_forward_export_runs_in_onnx_runtime(tmp_path) -> None:
    # The optimize stage exports `forward_export`; the whole pipeline (pillars via ScatterElements,
    # painting via GridSample, decode via TopK/GatherElements) must run in ONNX Runtime as is.
    ort = pytest.importorskip("onnxruntime")
    p = tiny_params()
    torch.manual_seed(0)
    model = build_model(p, IMAGE_SIZE).eval()
    b = random_batch(p, batch=1, points=800)
    args = (b["points"], b["num_points"], b["images"], b["proj"])
    names = ["points", "num_points", "images", "proj"]

    class Export(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = for_export(model)  # what pfactory.optimize.export's wrapper exports

        def forward(self, *inputs):
            return self.model.forward_export(*inputs)

    path = tmp_path / "detector.onnx"
    torch.onnx.export(Export(), args, str(path), dynamo=False, opset_version=18, input_names=names)
    got = ort.InferenceSession(str(path)).run(None, {n: a.numpy() for n, a in zip(names, args)})
    with torch.no_grad():
        ref = model.forward_export(*args)
    torch.testing.assert_close(torch.from_numpy(got[1]), ref[1], rtol=1e-5, atol=1e-5)  # scores
    torch.testing.assert_close(torch.from_numpy(got[0]), ref[0], rtol=1e-4, atol=1e-4)  # boxes
    assert torch.equal(torch.from_numpy(got[2]), ref[2])  # labels


def test_sample_bilinear_bf16_table_and_grad_coordinates() -> None:
    """A bf16 feature map (autocast's conv output) is gathered in float32 and gets a bf16 gradient; the
    coordinates carry no gradient, so coordinates that require one are refused, not silently cut."""
    torch.manual_seed(0)
    b, n, c, h, w, p = 1, 2, 4, 5, 6, 50
    feats = torch.randn(b * n, h, w, c).permute(0, 3, 1, 2).reshape(b, n, c, h, w).bfloat16().requires_grad_()
    gx, gy = torch.rand(b, n, p) * 2 - 1, torch.rand(b, n, p) * 2 - 1
    mask = torch.ones(b, n, p, dtype=torch.bool)
    out = sample_bilinear(feats, gx, gy, mask)
    assert out.dtype == torch.float32
    ref = sample_bilinear(feats.detach().float(), gx, gy, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.sum().backward()
    assert feats.grad is not None and feats.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="gx and gy must not require grad"):
        sample_bilinear(feats, gx.requires_grad_(), gy, mask)


@pytest.mark.parametrize("cams", [1, 2])
def test_projected_painting_is_painting_times_the_weight_forward_and_backward(cams: int) -> None:
    """paint_points_projected = paint_points' features @ weight.T and its flag, with the gradients of the
    features and of the weight, to float rounding: projecting before sampling is the same function.
    Some points behind, outside or in an invalid camera (batch 2 has only camera 0 valid)."""
    torch.manual_seed(0)
    b, c, h, w, p, d = 2, 6, 8, 16, 500, 5
    feats = torch.randn(b * cams, h, w, c).permute(0, 3, 1, 2).reshape(b, cams, c, h, w)
    points = torch.cat(
        [torch.rand(b, p, 1) * 40 - 10, torch.rand(b, p, 2) * 20 - 10, torch.rand(b, p, 1)], -1
    )
    proj = camera_proj(b, cams)
    cam_valid = torch.tensor([[True, True], [True, False]])[:, :cams]
    weight = torch.randn(d, c)
    g = torch.randn(b, p, d)

    def run(projected: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        f, wt = feats.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if projected:
            rows, flag = paint_points_projected(points, f, proj, cam_valid, IMAGE_SIZE, wt)
        else:
            painted = paint_points(points, f, proj, cam_valid, IMAGE_SIZE)  # [B, P, C + 1]
            rows, flag = painted[..., :c] @ wt.t(), painted[..., c]
        gf, gw = torch.autograd.grad(rows, [f, wt], g)
        return rows.detach(), flag, gf, gw

    got, ref = run(True), run(False)
    assert 0.2 < ref[1].mean() < 0.9  # some points seen by a camera, some not
    assert torch.equal(got[1], ref[1])
    for a, e in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cams", [1, 2])
def test_gather_and_grid_sample_models_agree_forward_and_backward(cams: int) -> None:
    """The whole detector with `paint_sampler: gather` (projected painting, flag in the first GEMM) and
    with `grid_sample` (painting, concat, first layer), the same weights, fp32: the same outputs and
    parameter gradients to float rounding; and under bf16 autocast both run, to bf16 rounding."""
    torch.manual_seed(0)
    pg, pr = tiny_params(paint_sampler="gather"), tiny_params(paint_sampler="grid_sample")
    mg, mr = build_model(pg, IMAGE_SIZE), build_model(pr, IMAGE_SIZE)
    mr.load_state_dict(mg.state_dict())
    bt = random_batch(pg, batch=2, cams=cams)
    args = (bt["points"], bt["num_points"], bt["images"], bt["proj"], bt["cam_valid"])
    outs = [m(*args) for m in (mg, mr)]
    for k in outs[0]:
        torch.testing.assert_close(outs[0][k], outs[1][k], atol=1e-5, rtol=1e-4)
    for o in outs:
        (o["heatmap"].square().sum() + o["reg"].square().sum()).backward()
    for (name, a), b in zip(mg.named_parameters(), mr.parameters()):
        assert a.grad is not None and b.grad is not None, name
        rel = float((a.grad - b.grad).norm() / b.grad.norm().clamp(min=1e-12))
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf = [m(*args) for m in (mg, mr)]
    torch.testing.assert_close(bf[0]["heatmap"].float(), bf[1]["heatmap"].float(), atol=0.1, rtol=0.05)


@pytest.mark.skipif(not native.available(), reason=f"native CPU kernels: {native.status()}")
@pytest.mark.parametrize("camera", [True, False])
def test_sparse_stem_model_equals_the_dense_canvas_model(
    camera: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the C kernels are built, `build_model` runs the canvas' scatter-max and the stem conv as one
    sparse op (`SparseCanvasStem`); `sparse_stem=False` builds the dense canvas and conv. Same weights,
    fp32: the same outputs and parameter gradients to float rounding; the sparse kernel really runs."""
    torch.manual_seed(0)
    p = tiny_params(camera=camera)
    sparse, dense = build_model(p, IMAGE_SIZE), build_model(p, IMAGE_SIZE, sparse_stem=False)
    dense.load_state_dict(sparse.state_dict())
    assert type(sparse.backbone.stages[0][0]).__name__ == "SparseCanvasStem"
    assert type(dense.backbone.stages[0][0]).__name__ == "CanvasStem"
    bt = random_batch(p, batch=2, cams=1)
    args = (bt["points"], bt["num_points"], bt["images"], bt["proj"], bt["cam_valid"])
    calls = []
    real = native.pillar_stem_forward
    monkeypatch.setattr(native, "pillar_stem_forward", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(model: torch.nn.Module) -> tuple[dict, list]:
        out = model(*args)
        (out["heatmap"].square().sum() + out["reg"].square().sum()).backward()
        return {k: v.detach() for k, v in out.items()}, [q.grad for q in model.parameters()]

    (sparse_out, sparse_grads), (dense_out, dense_grads) = run(sparse), run(dense)
    assert len(calls) == 1, "the sparse stem did not run (or ran in the dense model)"
    for k in dense_out:
        torch.testing.assert_close(sparse_out[k], dense_out[k], atol=1e-5, rtol=1e-4)
    for (name, _), a, b in zip(sparse.named_parameters(), sparse_grads, dense_grads):
        rel = float((a - b).norm() / b.norm().clamp(min=1e-12))
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"
