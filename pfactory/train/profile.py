"""`factory profile train`: a few training steps under torch.profiler -> a Chrome/Perfetto trace and
the top ops."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pfactory.detectors import registry
from pfactory.detectors.contract import for_compile
from pfactory.train.data import LoaderFactory, data_info, epoch_batches, make_loader_factory, to_device
from pfactory.train.rng import seed_everything
from pfactory.train.runtime import Timer, setup_runtime, use_bf16
from pfactory.train.schedule import make_optimizer
from pfactory.train.trainer import train_step


def profile_train(params: Any, data: Path, steps: int, out: Path, *, loader_factory: LoaderFactory | None = None,
                  row_limit: int = 25) -> Path:  # fmt: skip
    """Run `steps` training steps under torch.profiler; write a Chrome/Perfetto trace, print the top ops.

    The first 2 steps warm up (allocator, oneDNN primitive caches, compile) and are not recorded.
    Returns the trace path (`out/train_trace.json`; open in https://ui.perfetto.dev or chrome://tracing).
    """
    from torch.profiler import ProfilerActivity, profile

    mp, tp = params.model, params.train
    data, out = Path(data), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rt = setup_runtime(tp.device)
    info = data_info(data)
    seed_everything(tp.seed)
    factory = loader_factory or make_loader_factory(tp)
    loader = factory(data, "train", tp.batch_size, True, getattr(tp, "augment", None), tp.seed, rt.device,
                     tp.num_threads)  # fmt: skip
    model = registry.build(mp.arch, mp.selected, info.spec()).to(rt.device)
    optimizer = make_optimizer(model, tp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    forward = torch.compile(for_compile(model)) if tp.compile else model
    bf16 = use_bf16(tp.bf16, rt.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    warmup = 2
    timer = Timer()

    def batches() -> Iterator[dict[str, Any]]:
        epoch = 0
        while True:
            yield from epoch_batches(loader, epoch, 0)
            epoch += 1

    def step() -> None:
        with timer("data"):
            batch = to_device(next(it), rt.device)
        train_step(forward, model, batch, optimizer, scheduler, tp, rt, timer, bf16)

    it = batches()
    for _ in range(warmup):
        step()
    timer.totals.clear()
    with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("step"):
                step()
    trace = out / "train_trace.json"
    prof.export_chrome_trace(str(trace))
    sort = "self_device_time_total" if rt.device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=row_limit))
    print(
        json.dumps(
            {"trace": str(trace), "phase_seconds": {k: round(v, 3) for k, v in timer.totals.items()}},
            indent=2,
        )
    )
    return trace
