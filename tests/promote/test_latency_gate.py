"""The promotion's latency gate against the champion, on real artifacts: a candidate whose artifact really
computes twice as much (the detector's graph run twice, the second copy's outputs added times 0) is timed
side by side with the champion, interleaved, and refused with both figures; an equal one passes. With no
champion only the absolute ceiling applies, and the gate record says so."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pfactory.promote.evidence import read_evidence
from pfactory.promote.gates import apply_gates, failed

from . import helpers as H

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def slow_down(optimized: Path) -> None:
    """Rewrite the primary artifact of `optimized` in place so it computes the detector twice: a second copy
    of the graph on inputs scaled by (1 + 1e-7) -- not the same tensors, so ONNX Runtime cannot merge the
    copies -- whose outputs are added to the first copy's times 0 (the outputs are unchanged). Re-records the
    file's sha256 in backend.json as the optimize stage would."""
    import numpy as np
    import onnx
    from onnx import compose, helper, numpy_helper

    from pfactory.optimize.manifest import MANIFEST, file_hashes

    manifest = json.loads((optimized / MANIFEST).read_text())
    primary = manifest["primary"]
    art = next(a for a in manifest["artifacts"] if a["backend"] == primary["backend"]
               and a["precision"] == primary["precision"])  # fmt: skip
    path = optimized / art["file"]
    model = onnx.load(str(path))
    g = model.graph
    dup = compose.add_prefix_graph(g, "slow_")
    nodes = []
    for i in g.input:  # the copy reads its own (scaled) inputs
        floating = i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        if floating:
            one = numpy_helper.from_array(np.array(1.0 + 1e-7, dtype=np.float32), f"slow_one_{i.name}")
            g.initializer.append(one)
            nodes.append(helper.make_node("Mul", [i.name, one.name], [f"slow_{i.name}"]))
        else:
            nodes.append(helper.make_node("Identity", [i.name], [f"slow_{i.name}"]))
    nodes += list(dup.node)
    g.initializer.extend(dup.initializer)
    for o in g.output:  # o = first copy's o + 0 * second copy's o
        for n in g.node:
            n.output[:] = [f"orig_{o.name}" if x == o.name else x for x in n.output]
            n.input[:] = [f"orig_{x}" if x == o.name else x for x in n.input]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type)
        zero = numpy_helper.from_array(np.array(0, dtype=dtype), f"slow_zero_{o.name}")
        g.initializer.append(zero)
        nodes.append(helper.make_node("Mul", [f"slow_{o.name}", zero.name], [f"slow_zeroed_{o.name}"]))
        nodes.append(helper.make_node("Add", [f"orig_{o.name}", f"slow_zeroed_{o.name}"], [o.name]))
    g.node.extend(nodes)
    onnx.save(model, str(path))
    hashes = file_hashes(optimized)
    art["sha256"], art["bytes"] = hashes[art["file"]], path.stat().st_size
    manifest["files"] = hashes
    (optimized / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _measure(candidate: Path, champion: Path, prepared: Path) -> dict:
    from pfactory.optimize.calibration import load_feeds
    from pfactory.optimize.latency import compare_directories

    feeds = load_feeds(prepared, "val", 1, 4).feeds
    return {"champion_version": 1, "rounds": [compare_directories(candidate, champion, feeds, 3, 30)]}


@pytest.fixture
def champion_and_candidates(bench, tmp_path):
    champion = tmp_path / "champion"
    shutil.copytree(bench["optimized"], champion)
    slow = H.candidate(tmp_path, bench, "slow", 0.3)
    slow_down(slow["optimized"])
    same = H.candidate(tmp_path, bench, "same", 0.3)
    return champion, slow, same


def test_a_twice_slower_artifact_is_refused_and_an_equal_one_passes(bench, champion_and_candidates) -> None:
    champion, slow, same = champion_and_candidates
    params = H.promote_params()
    from pfactory.optimize.calibration import load_feeds
    from pfactory.optimize.runtime import load_runner

    feed = load_feeds(bench["prepared_a"], "val", 1, 1).feeds[0]
    a, b = load_runner(slow["optimized"]).run(feed), load_runner(champion).run(feed)
    assert all((a[k] == b[k]).all() for k in a)  # the same outputs: only the compute doubled

    for cand, slower in ((slow, True), (same, False)):
        ev = read_evidence(cand["optimized"], cand["eval"] / "kpis.json")
        timing = _measure(cand["optimized"], champion, bench["prepared_a"])
        gates = {g.name: g for g in apply_gates(params, ev, ev.kpis, timing)}
        p50, p99 = gates["latency_p50_vs_champion"], gates["latency_p99_vs_champion"]
        r = timing["rounds"][0]
        if slower:
            assert r["ratio_p50"] > 1.6, r  # really about twice the work
            assert not p50.passed and p50.value == r["ratio_p50"] and p50.threshold == 1.3
            c, ch = r["candidate"]["p50_ms"], r["champion"]["p50_ms"]
            assert (
                f"candidate onnxruntime/fp32 {c:.3g} ms / champion v1 onnxruntime/fp32 {ch:.3g} ms"
                in p50.detail
            )
            assert "FAILED by" in p50.detail
            # the p99 gate fails too (at its tightest tolerance 1.0: a p99 estimate over 30 calls is noisy)
            tight = H.promote_params(max_p99_latency_ratio=1.0)
            p99 = next(
                g for g in apply_gates(tight, ev, ev.kpis, timing) if g.name == "latency_p99_vs_champion"
            )
            assert not p99.passed and p99.value == r["ratio_p99"], p99.detail
        else:
            assert p50.passed and p99.passed, (p50.detail, p99.detail)
            assert {g.name for g in failed(gates.values())} == set()


def test_without_a_champion_only_the_ceiling_applies_and_says_so(bench, champion_and_candidates) -> None:
    _, slow, _ = champion_and_candidates
    ev = read_evidence(slow["optimized"], slow["eval"] / "kpis.json")
    gates = {g.name: g for g in apply_gates(H.promote_params(), ev, None)}
    assert not any(n.startswith("latency_") for n in gates)
    assert "no champion: this absolute ceiling is the only latency gate" in gates["p99_latency_ms"].detail
    # with a champion but no side-by-side timing the latency gates cannot pass
    bad = {g.name for g in failed(apply_gates(H.promote_params(), ev, ev.kpis, None))}
    assert bad == {"latency_p50_vs_champion", "latency_p99_vs_champion"}


def test_promotion_refuses_the_slower_candidate_and_promotes_the_equal_one(
    bench, champion_and_candidates, tmp_path, registry
) -> None:
    """Through `tasks.promote.run`: the champion's files come back from the registry and are timed here."""
    import tasks.promote

    _, slow, same = champion_and_candidates
    first = H.candidate(tmp_path, bench, "first", 0.3)

    def promote(c):
        return tasks.promote.run(
            H.promote_params(), c["optimized"], c["eval"], bench["prepared_a"], tmp_path / "release"
        )

    r1 = promote(first)
    assert r1["decision"] == "promoted", r1["reason"]
    r2 = promote(slow)
    bad = {g["name"]: g for g in r2["gates"] if not g["passed"]}
    assert r2["decision"] == "refused" and "latency_p50_vs_champion" in bad, r2["reason"]
    assert set(bad) <= {"latency_p50_vs_champion", "latency_p99_vs_champion"}, r2["reason"]
    assert "latency_p50_vs_champion: p50 candidate onnxruntime/fp32" in r2["reason"]
    assert "(side by side, interleaved, 30 calls each, batch 1, 2 measurement(s))" in r2["reason"]
    r3 = promote(same)
    assert r3["decision"] == "promoted", r3["reason"]
    assert r3["champion_before"] == 1 and {"latency_p50_vs_champion", "latency_p99_vs_champion"} <= {
        g["name"] for g in r3["gates"]
    }
