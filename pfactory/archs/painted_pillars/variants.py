"""Model variants as conversions of a built detector, applied from outside (torchtitan's ModelConverter
pattern): the detector's `forward` is the math once; what differs between eager training, torch.compile
and the ONNX export is which modules it is made of.

    use_sparse_stem(model, enabled=None) -> model   (in place) the canvas + 3x3 stem as one sparse op
    for_compile(model) -> model                      (in place) static-shape painting for torch.compile
    for_export(model) -> a converted copy            the ONNX export's formulation, the same function

Each swap keeps the parameters (the same tensors, the same state-dict keys), so a variant computes the
same function as the model it came from, to float rounding; tests/archs/painted_pillars/test_variants.py holds them
together (trained model vs compiled module vs exported graph on one batch).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

from kernels import native
from pfactory.archs.painted_pillars.layers import Conv1x1, GroupNormReLU, GroupNormReLUExport
from pfactory.archs.painted_pillars.painting import ExportPainter, Painter, ProjectedPainter
from pfactory.archs.painted_pillars.pillars import (
    CanvasStem,
    ExportCanvasStem,
    ExportPillarEncoder,
    PillarEncoder,
    SparseCanvasStem,
)


def swap_modules(model: nn.Module, convert: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """Replace every submodule m of `model` for which `convert(m)` returns a module (in place, children
    before parents are not revisited: a replacement is not converted again). Returns `model`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = convert(child)
            if new is not None:
                setattr(parent, name, new)
    return model


def _retype(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """`module` as an instance of `cls`, a class with exactly its state (a subclass adding no attribute,
    or its base): only `forward` changes, the parameters stay the same tensors. For converted copies."""
    module.__class__ = cls
    return module


def use_sparse_stem(model: nn.Module, enabled: bool | None = None) -> nn.Module:
    """The dense `CanvasStem`s that qualify (a 3x3 stride-2 stem) become `SparseCanvasStem`s, or back with
    `enabled=False`. Default: sparse where the C kernels are built (`kernels.native.available()`), the
    dense canvas otherwise (the op's PyTorch fallback makes the dense canvas anyway). In place."""
    enabled = native.available() if enabled is None else enabled

    def convert(m: nn.Module) -> nn.Module | None:
        if enabled and type(m) is CanvasStem and SparseCanvasStem.applies(m):
            return SparseCanvasStem(m)
        if not enabled and type(m) is SparseCanvasStem:
            return CanvasStem(nn.Sequential(*m), m.grid, m.space_to_depth, m.pad)
        return None

    return swap_modules(model, convert)


def for_compile(model: nn.Module) -> nn.Module:
    """What torch.compile traces: painting with static shapes (every sample gathered, zero weights where
    unseen, instead of the seen samples' `nonzero`), and the gather sampler for `grid_sample` (Inductor,
    torch 2.13 CPU, compiles grid_sample's backward with the first batch's point count baked into a saved
    tensor's stride: the next point count fails `assert_size_stride`; the gather gives the same values).
    The C kernels stay: they are custom ops. In place (parameterless modules only)."""

    def convert(m: nn.Module) -> nn.Module | None:
        if type(m) is ProjectedPainter:
            return ProjectedPainter(m.image_size, dense=True)
        if type(m) is Painter:
            return Painter(m.image_size, sampler="gather")
        return None

    return swap_modules(model, convert)


def for_export(model: nn.Module) -> nn.Module:
    """A copy of `model` in the ONNX export's formulation (plain ops ONNX Runtime runs fast, no custom
    op): the 1x1 convs and GroupNorm + ReLU as ONNX Conv / GroupNormalization + Relu, per-coordinate
    grid_sample painting (`paint_points_export`), channels-first point decoration (`ExportPillarEncoder`)
    and the non-negative 1-D scatter-max canvas (`ExportCanvasStem`). `model` itself is not changed."""
    model = copy.deepcopy(model)
    encoders = [m for m in model.modules() if isinstance(m, PillarEncoder)]
    nonnegative = all(e.nonnegative_features for e in encoders) and bool(encoders)

    def convert(m: nn.Module) -> nn.Module | None:
        if type(m) is Conv1x1:
            return _retype(m, nn.Conv2d)
        if type(m) is GroupNormReLU:
            return _retype(m, GroupNormReLUExport)
        if type(m) in (Painter, ProjectedPainter):
            return ExportPainter(m.image_size)
        if type(m) is PillarEncoder:
            return _retype(m, ExportPillarEncoder)
        if type(m) in (CanvasStem, SparseCanvasStem):
            return ExportCanvasStem(m, nonnegative)
        return None

    return swap_modules(model, convert)
