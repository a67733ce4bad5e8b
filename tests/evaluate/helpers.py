"""A tiny end-to-end setup for the evaluate tests: synthetic KITTI frames -> prepared shards -> the tiny
detector (tests/optimize/helpers.py) saved as a trained model -> the real optimize stage (ORT FP32).

~15-25 s on 2 quiet cores, built once per test module. Row groups of 2 frames, shards of 4: the val
split is cut into several work units, so two workers really share the work.
"""

from __future__ import annotations

from pathlib import Path

from tests.optimize import helpers


def build_eval_setup(root: Path, frames: int = 16, cameras: int = 1) -> dict[str, Path]:
    """`{"raw", "prepared", "model", "optimized"}` under `root` (module docstring); `cameras > 1`: the
    synthetic nuScenes layout (96x54 px images, an ROI around the car) and a model with those cameras."""
    import tasks.optimize
    from pfactory.optimize.params import OptimizeParams
    from pfactory.prepare.params import PrepareParams
    from pfactory.prepare.stage import prepare_dataset
    from pfactory.synth.dataset import generate_dataset
    from tests.archs.painted_pillars.helpers import save_trained

    nus = cameras > 1
    generate_dataset(
        root / "raw", frames=frames, seed=5, cameras=cameras, image_size=(96, 54) if nus else (208, 64)
    )
    pc_range = [-8.0, -8.0, -3.0, 8.0, 8.0, 1.0] if nus else [0.0, -8.0, -3.0, 16.0, 8.0, 1.0]
    result = prepare_dataset(
        root / "raw",
        root / "prepared",
        PrepareParams(
            image_size=list(helpers.IMAGE_SIZE), batch_size=2, shard_max_frames=4, val_fraction=0.5,
            max_reject_fraction=0.5, pc_range=pc_range,
        ),
    )  # fmt: skip
    save_trained(root / "model", helpers.make_model(), result.manifest["cameras"])
    opt = OptimizeParams.model_validate(
        {
            "precision": "fp32",
            "dynamic_batch": True,
            "intra_op_threads": 1,
            "export_points": 512,
            "parity": {"frames": 2},
            "latency": {"batch_sizes": [1], "warmup": 1, "iterations": 2, "eager": True},
        }
    )
    tasks.optimize.run(
        opt, root / "model", root / "prepared", root / "optimized", "onnxruntime", "fp32", track=False
    )
    return {
        "raw": root / "raw",
        "prepared": root / "prepared",
        "model": root / "model",
        "optimized": root / "optimized",
    }
