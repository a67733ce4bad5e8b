"""The model's variants hold together: the built (training) model, its export conversion
(`for_export`, what the ONNX file is traced from) and its compiled conversion (`for_compile` under
torch.compile, fullgraph) give the same outputs on one batch, and the compiled training step the same
gradients; the conversions keep the parameters (the same tensors) and the state-dict keys. The exported
graph run by ONNX Runtime: tests/archs/painted_pillars/test_detector.py::test_forward_export_runs_in_onnx_runtime and
tests/optimize/test_export.py."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from kernels import native
from pfactory.archs.painted_pillars.detector import build_model
from pfactory.archs.painted_pillars.variants import for_compile, for_export, use_sparse_stem

from .helpers import IMAGE_SIZE, random_batch, tiny_params


def _loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["heatmap"].square().mean() + out["reg"].square().mean()


@pytest.mark.parametrize("sampler", ["gather", pytest.param("grid_sample", marks=pytest.mark.full)])
def test_trained_exported_and_compiled_models_agree(sampler: str) -> None:
    torch.manual_seed(0)
    p = tiny_params(paint_sampler=sampler)
    model = build_model(p, IMAGE_SIZE)
    keys = list(model.state_dict())
    bt = random_batch(p, batch=2, cams=2, points=400)
    args = (bt["points"], bt["num_points"], bt["images"], bt["proj"], bt["cam_valid"])

    exported = for_export(model)  # a copy: the trained model is unchanged
    assert list(exported.state_dict()) == keys
    assert type(model.backbone.stages[0][0]).__name__ == (
        "SparseCanvasStem" if native.available() else "CanvasStem"
    )
    compiled_model = for_compile(build_model(p, IMAGE_SIZE))
    compiled_model.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)  # fake kernels + autograd

    out = model(*args)
    _loss(out).backward()
    cout = compiled(*args)
    _loss(cout).backward()
    with torch.no_grad():
        eout = exported(*args)
    for k in out:
        torch.testing.assert_close(eout[k], out[k].detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cout[k].detach(), out[k].detach(), atol=1e-5, rtol=1e-4)
    for (name, a), b in zip(model.named_parameters(), compiled_model.parameters()):
        assert a.grad is not None and b.grad is not None, name
        rel = float((a.grad - b.grad).norm() / a.grad.norm().clamp(min=1e-12))
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"


def test_conversions_keep_the_parameters_and_can_be_undone() -> None:
    """`for_compile` and `use_sparse_stem` swap modules in place around the same parameter tensors (an
    optimizer built before still steps them); `use_sparse_stem(False)` gives the dense canvas back."""
    torch.manual_seed(0)
    p = tiny_params()
    model = build_model(p, IMAGE_SIZE, sparse_stem=True)
    params = [id(q) for q in model.parameters()]
    for_compile(use_sparse_stem(model, False))
    assert type(model.backbone.stages[0][0]).__name__ == "CanvasStem"
    assert type(model.painter).__name__ == "ProjectedPainter" and model.painter.dense
    assert [id(q) for q in model.parameters()] == params
