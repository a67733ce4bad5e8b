"""Latency measurement: JSON structure, percentiles, speedups, interleaving."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from pfactory.optimize.latency import EAGER, measure_latency, summarize, time_interleaved


class _Sleeper:
    """A fake runner that takes `ms` per frame and records the order it was called in."""

    def __init__(self, name: str, ms: float, log: list[str]) -> None:
        self.name, self.ms, self.log = name, ms, log

    def __call__(self, points, num_points, images, proj):
        self.log.append(self.name)
        time.sleep(self.ms * points.shape[0] / 1000.0)
        return {}


def _feeds(batch: int, n: int = 2) -> list[dict[str, np.ndarray]]:
    return [
        {
            "points": np.zeros((batch, 10 + i, 4), np.float32),
            "num_points": np.full(batch, 10 + i, np.int64),
            "images": np.zeros((batch, 1, 3, 4, 4), np.float32),
            "proj": np.zeros((batch, 1, 3, 4), np.float32),
        }
        for i in range(n)
    ]


def test_latency_json_structure_and_ratios() -> None:
    log: list[str] = []
    runners = {EAGER: _Sleeper(EAGER, 8.0, log), "onnxruntime/fp32": _Sleeper("ort", 2.0, log)}
    report = measure_latency(
        runners, {1: _feeds(1), 2: _feeds(2)}, warmup=1, iterations=6, config={"threads": 2}
    )
    assert {"batch_1", "batch_2", "speedup_vs_eager", "config"} <= set(report)
    for batch in ("batch_1", "batch_2"):
        for name in runners:
            s = report[batch][name]
            assert set(s) == {
                "p50_ms",
                "p95_ms",
                "p99_ms",
                "mean_ms",
                "min_ms",
                "throughput_fps",
                "iterations",
            }
            assert s["min_ms"] <= s["p50_ms"] <= s["p95_ms"] <= s["p99_ms"] and s["iterations"] == 6
    # sleep() only oversleeps, so the 4x ratio shows as >= ~2.5x even on a busy machine.
    assert report["speedup_vs_eager"]["batch_1"]["onnxruntime/fp32"] > 2.5
    assert EAGER not in report["speedup_vs_eager"]["batch_1"]
    b1, b2 = report["batch_1"]["onnxruntime/fp32"], report["batch_2"]["onnxruntime/fp32"]
    assert b2["throughput_fps"] == pytest.approx(2000.0 / b2["p50_ms"], rel=1e-3)
    assert b1["throughput_fps"] == pytest.approx(1000.0 / b1["p50_ms"], rel=1e-3)
    cfg = report["config"]
    assert cfg["threads"] == 2 and cfg["warmup"] == 1 and cfg["interleaved"] is True
    assert cfg["points_per_frame_median"] in (10, 11)
    json.dumps(report)  # serializable as is


def test_runners_alternate_and_rotate() -> None:
    log: list[str] = []
    runners = {"a": _Sleeper("a", 0, log), "b": _Sleeper("b", 0, log), "c": _Sleeper("c", 0, log)}
    times = time_interleaved(runners, _feeds(1), warmup=0, iterations=3)
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(t) == 3 for t in times.values())


def test_summarize_percentiles() -> None:
    s = summarize([i / 1000 for i in range(1, 101)], batch_size=4)  # 1..100 ms
    assert s["p50_ms"] == pytest.approx(50.5) and s["p99_ms"] == pytest.approx(99.01)
    assert s["throughput_fps"] == pytest.approx(4000 / 50.5, rel=1e-4)


def test_no_feeds_is_an_error() -> None:
    with pytest.raises(ValueError, match="no feeds"):
        time_interleaved({"a": _Sleeper("a", 0, [])}, [], 0, 1)
