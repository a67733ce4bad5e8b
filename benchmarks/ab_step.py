"""One source tree's training step, timed on in-memory batches: the child of `bench_train.py ab`.

Run with the tree to measure as the working directory and first on PYTHONPATH, so every import below
resolves to *that* tree's code and its embedded default params (this file imports nothing of its own
tree). Prints one line `AB {json}`: samples/s of the median step, step ms (median, min, max), CPU ms per
step, the bf16 flag the tree's defaults resolve to on this machine, the point counts of the batches.

    python ab_step.py DATA STEPS WARMUP '["section.key=value", ...]'
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _cuda_only_bf16(enabled: bool, device: torch.device) -> bool:
    return enabled and device.type == "cuda"


def _api() -> dict[str, Any]:
    """The training-step functions of the tree on sys.path (both layouts this project has had)."""
    try:
        from pfactory.train import data, rng, runtime, schedule, trainer
    except ImportError:  # c0686b9's layout: the whole stage in tasks/train.py
        import tasks.train as t

        return {
            "data_info": t.data_info, "epoch_batches": t.epoch_batches, "make_loader_factory": t.make_loader_factory,
            "to_device": t.to_device, "seed_everything": t.seed_everything, "Timer": t.Timer,
            "setup_runtime": t.setup_runtime, "make_optimizer": t.make_optimizer, "train_step": t.train_step,
            "build": lambda mp, info: _old_build(mp, info.image_size), "use_bf16": _cuda_only_bf16,
        }  # fmt: skip
    return {
        "data_info": data.data_info, "epoch_batches": data.epoch_batches,
        "make_loader_factory": data.make_loader_factory, "to_device": data.to_device,
        "seed_everything": rng.seed_everything, "Timer": runtime.Timer, "setup_runtime": runtime.setup_runtime,
        "make_optimizer": schedule.make_optimizer, "train_step": trainer.train_step,
        "build": _build_for(trainer), "use_bf16": getattr(runtime, "use_bf16", _cuda_only_bf16),
    }  # fmt: skip


def _old_build(mp, image_size):
    from pfactory.archs.painted_pillars.detector import build_model

    return build_model(mp, image_size)


def _build_for(trainer):
    """The detector as this checkout's trainer builds it: through the registry (architectures by name), or
    (older commits) `build_model(model_for_data(...))`."""
    if hasattr(trainer, "model_for_data"):
        return lambda mp, info: _old_build(trainer.model_for_data(mp, info), info.image_size)
    from pfactory.detectors import registry

    return lambda mp, info: registry.build(mp.arch, mp.selected, info.spec())


def main() -> None:
    from flows.params import load_params

    data, steps, warmup, overrides = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        json.loads(sys.argv[4]),
    )
    api = _api()
    params = load_params(None, overrides)
    mp, tp = params.model, params.train
    rt = api["setup_runtime"]("cpu" if not torch.cuda.is_available() else tp.device)
    info = api["data_info"](data)
    api["seed_everything"](tp.seed)
    loader = api["make_loader_factory"](tp)(data, "train", tp.batch_size, True, tp.augment, tp.seed, rt.device,
                                            tp.num_threads)  # fmt: skip
    batches = [api["to_device"](b, rt.device) for _, b in zip(range(8), api["epoch_batches"](loader, 0, 0))]
    model = api["build"](mp, info).to(rt.device)
    optimizer = api["make_optimizer"](model, tp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    bf16 = api["use_bf16"](tp.bf16, rt.device)
    timer = api["Timer"]()
    wall, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        api["train_step"](model, model, batches[i % len(batches)], optimizer, scheduler, tp, rt, timer, bf16)
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    med = statistics.median(wall)
    points = sorted(int(b["points"].shape[1]) for b in batches)
    print("AB " + json.dumps({
        "samples/s": tp.batch_size / med, "step ms": 1000 * med, "min ms": 1000 * min(wall),
        "max ms": 1000 * max(wall), "CPU ms": 1000 * statistics.median(cpu), "bf16": bf16,
        "threads": torch.get_num_threads(), "points": f"{points[0]}..{points[-1]}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
