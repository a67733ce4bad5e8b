"""The traced export graphs kept between exports (pfactory/optimize/export_cache.py): a template traced with
other weights writes the bytes of a fresh export; the key follows what shapes the trace and not the
weights; a template that disagrees with the model is traced anew; the folder keeps the newest entries."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from pfactory.optimize import export_cache
from pfactory.optimize.export import ExportWrapper, export_onnx

ARGS = {"cameras": 1, "opset": 18, "dynamic_batch": True, "export_points": 512}  # the `exported` fixture's


def _other_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return other


@pytest.fixture(scope="module")
def traced(tiny_model, tmp_path_factory) -> dict:
    """A cache holding the template of the tiny detector traced with *other* weights (a miss)."""
    root = tmp_path_factory.mktemp("export-cache")
    cache = root / "cache"
    result = export_onnx(_other_weights(tiny_model, 0), root / "other.onnx", cache=cache, **ARGS)
    return {"root": root, "cache": cache, "result": result}


def test_a_template_traced_with_other_weights_writes_the_bytes_of_a_fresh_export(
    tiny_model, exported, traced, tmp_path: Path
) -> None:
    assert traced["result"].cache == "miss"
    hit = export_onnx(tiny_model, tmp_path / "model.onnx", cache=traced["cache"], **ARGS)
    assert hit.cache == "hit"
    assert hit.dynamic_batch == exported.dynamic_batch and hit.fallback_reason == exported.fallback_reason
    # `exported`: the same model and arguments, traced afresh without a cache
    assert (tmp_path / "model.onnx").read_bytes() == exported.path.read_bytes()
    assert hit.checks == exported.checks


def test_the_key_follows_what_shapes_the_trace_not_the_weights(tiny_model) -> None:
    def key(model=tiny_model, **over) -> str:
        return export_cache.template_key(ExportWrapper(model), model, **{**ARGS, **over})

    base = key()
    assert key(model=_other_weights(tiny_model, 1)) == base
    assert len({base, key(opset=17), key(cameras=2), key(dynamic_batch=False), key(export_points=1024)}) == 5
    other_params = copy.deepcopy(tiny_model)
    other_params.params = other_params.params.model_copy(update={"max_detections": 7})
    assert key(model=other_params) != base


def test_a_template_that_disagrees_with_the_model_is_traced_anew(
    tiny_model, exported, traced, tmp_path
) -> None:
    """A constant of the graph that is not a weight (what a trace could derive from the weights) changed in
    the cached template: the hit fails FP32 parity with the model, the graph is traced anew, the entry
    replaced."""
    import onnx
    from onnx import numpy_helper

    cache = tmp_path / "cache"
    cache.mkdir()
    key = export_cache.template_key(ExportWrapper(tiny_model), tiny_model, **ARGS)
    for suffix in (".onnx", ".json"):
        src = next(traced["cache"].glob(f"*{suffix}"))
        (cache / f"{key}{suffix}").write_bytes(src.read_bytes())
    graph = onnx.load(str(cache / f"{key}.onnx"))
    weights = set(ExportWrapper(tiny_model).state_dict())
    # the box regression head's bias: in the graph under a name no state-dict key has once renamed
    bias = next(i for i in graph.graph.initializer if i.name.endswith("head.reg.bias"))
    assert bias.name in weights
    bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + 5.0, "planted_constant"))
    for node in graph.graph.node:
        node.input[:] = ["planted_constant" if n.endswith("head.reg.bias") else n for n in node.input]
    onnx.save(graph, str(cache / f"{key}.onnx"))

    result = export_onnx(tiny_model, tmp_path / "model.onnx", cache=cache, **ARGS)
    assert result.cache == "stale"
    assert (tmp_path / "model.onnx").read_bytes() == exported.path.read_bytes()
    replaced = onnx.load(str(cache / f"{key}.onnx"))
    assert "planted_constant" not in {i.name for i in replaced.graph.initializer}


def test_the_folder_keeps_the_newest_entries(tmp_path: Path, monkeypatch) -> None:
    template = tmp_path / "t.onnx"
    template.write_bytes(b"graph")
    cache = tmp_path / "cache"
    for i in range(export_cache.KEEP + 2):
        export_cache.store(cache, f"k{i}", template, {"dynamic_batch": True, "fallback_reason": None})
        os.utime(cache / f"k{i}.onnx", (1000 + i, 1000 + i))
    export_cache.prune(cache)
    assert sorted(p.stem for p in cache.glob("*.onnx")) == sorted(
        f"k{i}" for i in range(2, export_cache.KEEP + 2)
    )
    assert sorted(p.stem for p in cache.glob("*.json")) == sorted(p.stem for p in cache.glob("*.onnx"))
    assert export_cache.lookup(cache, "k0") is None
    assert export_cache.lookup(cache, "k5") == (
        cache / "k5.onnx",
        {"dynamic_batch": True, "fallback_reason": None},
    )

    monkeypatch.setenv(export_cache.CACHE_ENV, "off")
    assert export_cache.cache_dir() is None
    monkeypatch.delenv(export_cache.CACHE_ENV)
    assert export_cache.cache_dir() is None
    monkeypatch.setenv(export_cache.CACHE_ENV, str(cache))
    assert export_cache.cache_dir() == cache
