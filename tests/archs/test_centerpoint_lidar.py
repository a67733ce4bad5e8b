"""The `centerpoint_lidar` architecture through the detector contract: build by name, loss, decode, the
heading code, the ONNX export, and its params section (a 16 m x 16 m grid of 0.4 m pillars: fast)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from pfactory.archs.centerpoint_lidar.params import CenterPointLidarParams, Geometry
from pfactory.archs.centerpoint_lidar.targets import build_targets, decode_heading, encode_heading
from pfactory.detectors import registry
from pfactory.detectors.contract import DataSpec, Detections, LossContext, batch_inputs, check_detector
from tests.archs.painted_pillars.helpers import random_batch

CLASSES = ("Car", "Pedestrian", "Cyclist")
SPEC = DataSpec(CLASSES, (0.0, -8.0, -3.0, 16.0, 8.0, 1.0))
ARCH = "centerpoint_lidar"


def tiny(**over) -> CenterPointLidarParams:
    base = dict(
        point_channels=16, bev_channels=[16, 16, 32], up_channels=16, head_channels=16, max_detections=20
    )
    base.update(over)
    return CenterPointLidarParams(**base)


def build(p: CenterPointLidarParams | None = None, seed: int = 0):
    torch.manual_seed(seed)
    return registry.build(ARCH, p or tiny(), SPEC)


def batch(seed: int = 0, b: int = 2) -> dict:
    return random_batch(
        types.SimpleNamespace(pc_range=list(SPEC.pc_range), classes=list(CLASSES)), batch=b, seed=seed
    )


def test_builds_by_name_and_satisfies_the_contract() -> None:
    model = build()
    check_detector(model)
    assert model.inputs == model.deploy_inputs == ("points", "num_points")
    assert model.spec == SPEC and model.max_detections == 20
    assert isinstance(model.params, CenterPointLidarParams)
    # model_config.json stores the params: they rebuild the same architecture
    again = registry.build(ARCH, model.params.model_dump(mode="json"), SPEC)
    assert again.state_dict().keys() == model.state_dict().keys()
    out = model(*batch_inputs(model, batch()))
    h, w = model.geo.head_grid
    assert out["heatmap"].shape == (2, 3, h, w)
    assert out["reg"].shape == (2, 3, len(model.params.reg_channels), h, w)


def test_class_groups_share_a_head_and_must_cover_the_classes() -> None:
    model = build(tiny(class_groups=[["Cyclist", "Pedestrian"], ["Car"]]))
    assert len(model.heads) == 2 and model.geo.order == (2, 1, 0)
    det = model.decode(model(*batch_inputs(model, batch())))
    assert set(det.labels.unique().tolist()) <= {0, 1, 2}
    with pytest.raises(ValueError, match="class_groups"):
        build(tiny(class_groups=[["Car"], ["Pedestrian"]]))


def test_loss_decreases_over_a_few_steps() -> None:
    model = build()
    b = batch()
    ctx = LossContext(lambda t: t)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        terms = model.loss(model(*batch_inputs(model, b)), b, ctx)
        assert {"loss", "heatmap", "box", "dir_cls", "dir_res", "box/log_l"} <= terms.keys()
        assert all(torch.isfinite(v) for v in terms.values())
        opt.zero_grad()
        terms["loss"].backward()
        opt.step()
        losses.append(float(terms["loss"].detach()))
    assert losses[-1] < 0.7 * losses[0], losses


def test_decode_follows_the_contract() -> None:
    """Scores in [0, 1] descending; with more entries than peaks, the rest is padding with score 0."""
    p = tiny(max_detections=10_000)  # more than K * Ho * Wo = 3 * 20 * 20: capped there
    model = build(p).eval()
    with torch.no_grad():
        for head in model.heads:
            torch.nn.init.normal_(head.heatmap.weight, std=0.3)
        det = model.decode(model(*batch_inputs(model, batch())))
    assert isinstance(det, Detections)
    d = 3 * 20 * 20
    assert det.boxes.shape == (2, d, 7) and det.scores.shape == det.labels.shape == (2, d)
    assert det.labels.dtype == torch.int64 and torch.isfinite(det.boxes).all()
    s = det.scores
    assert ((s >= 0) & (s <= 1)).all() and (s[:, :-1] >= s[:, 1:]).all()
    assert (s[:, -1] == 0).all() and (s[:, 0] > 0).all()  # non-peaks are padding, after every peak
    yaw = det.boxes[..., 6]
    assert ((yaw > -math.pi) & (yaw <= math.pi)).all()


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_heading_bins_round_trip_exactly(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    yaw = (torch.rand(1000, generator=g, dtype=torch.float64) * 2 - 1) * math.pi  # (-pi, pi)
    yaw = torch.cat([yaw, torch.tensor([math.pi, -math.pi + 1e-9, 0.0, math.pi / n, -math.pi / n])]).double()
    k, res = encode_heading(yaw, n)
    assert ((k >= 0) & (k < n)).all()
    r = torch.atan2(res[:, 0], res[:, 1])
    assert (r.abs() <= math.pi / n + 1e-9).all()  # the nearest centre
    logits = torch.nn.functional.one_hot(k, n).double().T[None]  # [1, n, D]
    residuals = torch.randn(1, n, 2, yaw.shape[0], generator=g, dtype=torch.float64)  # other bins: noise
    residuals[0, k, :, torch.arange(yaw.shape[0])] = res
    back = decode_heading(logits, residuals)[0]
    diff = torch.remainder(back - yaw + math.pi, 2 * math.pi) - math.pi
    assert diff.abs().max() < 1e-12
    assert ((back > -math.pi) & (back <= math.pi)).all()


def test_targets_decode_back_to_the_boxes() -> None:
    """Head outputs made from the targets decode to the ground-truth boxes (offsets, z, sizes, yaw): the first
    stage alone (the refiner's turns are tested in test_refine.py)."""
    p = tiny(max_detections=4, refine=False)
    geo = Geometry.of(p, CLASSES, SPEC.pc_range)
    boxes = torch.tensor([[[3.1, -4.3, -0.7, 4.2, 1.8, 1.5, 2.9], [12.7, 5.2, -1.1, 0.7, 0.6, 1.8, -1.2],
                           [8.3, 0.9, -0.9, 1.8, 0.6, 1.7, -3.1], [13.0, -6.1, -0.8, 3.9, 1.7, 1.4, 0.4]]])  # fmt: skip
    labels = torch.tensor([[0, 1, 2, 0]])
    t = build_targets(boxes, labels, p, geo)
    assert t.mask.all() and t.num_peaks == 4
    h, w = geo.head_grid
    n = p.heading_bins
    logits = torch.logit(t.heatmap.clamp(1e-4, 1 - 1e-4))  # [1, K, H, W]
    reg = torch.zeros(1, len(geo.groups), 6 + 3 * n, h * w)
    for m in range(4):
        g, cell = int(t.group[0, m]), int(t.index[0, m])
        reg[0, g, :6, cell] = t.box[0, m]
        reg[0, g, 6 + int(t.bin[0, m]), cell] = 10.0
        reg[0, g, 6 + n + 2 * int(t.bin[0, m]) : 6 + n + 2 * int(t.bin[0, m]) + 2, cell] = t.res[0, m]
    model = build(p)
    det = model.decode({"heatmap": logits, "reg": reg.reshape(1, len(geo.groups), -1, h, w)})
    found = sorted(zip(det.labels[0].tolist(), det.boxes[0].tolist()), key=lambda e: e[1][0])
    want = sorted(zip(labels[0].tolist(), boxes[0].tolist()), key=lambda e: e[1][0])
    for (lf, bf), (lw, bw) in zip(found, want):
        assert lf == lw
        np.testing.assert_allclose(bf, bw, atol=1e-5)


def test_export_runs_in_onnx_runtime_and_matches_forward_export(tmp_path) -> None:
    import onnxruntime as ort

    from pfactory.optimize.export import example_inputs, export_onnx

    model = build().eval()
    with torch.no_grad():  # look trained: distinct peaks, O(1) regressions (no float-noise ties)
        for head in model.heads:
            torch.nn.init.normal_(head.heatmap.weight, std=0.3)
            torch.nn.init.normal_(head.reg.weight, std=0.3)
    result = export_onnx(model, tmp_path / "model.onnx", cameras=1, opset=18, export_points=512)
    assert [i.name for i in result.inputs] == ["points", "num_points"]
    assert [o.name for o in result.outputs] == ["boxes", "scores", "labels"]
    assert result.outputs[0].shape[1:] == [20, 7]
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    for batch_size, points, seed in ((1, 300, 1), (2, 900, 2)):
        if batch_size > 1 and not result.dynamic_batch:
            continue
        pts, num = example_inputs(model, batch_size, points, 0, seed)[:2]
        with torch.no_grad():
            ref = [t.numpy() for t in model.forward_export(pts, num)]
        got = session.run(None, {"points": pts.numpy(), "num_points": num.numpy()})
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-4, atol=1e-6)  # scores
        np.testing.assert_array_equal(got[2], ref[2])  # labels
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-4)  # boxes


def test_unknown_key_in_its_section_is_refused_naming_it() -> None:
    from flows.params import load_params
    from pfactory.config.params_file import ParamsError

    with pytest.raises(ParamsError, match="bogus"):
        load_params(None, ["model.arch=centerpoint_lidar", "model.centerpoint_lidar.bogus=1"])
    params = load_params(None, ["model.arch=centerpoint_lidar", "model.centerpoint_lidar.heading_bins=2"])
    assert params.model.selected.heading_bins == 2
