"""The `train` stage: prepared shards -> a trained detector, resumable, tracked in MLflow.

Files in:  `data` = a prepared directory (`paths.prepared`: manifest.json + Parquet shards).
Files out (`out` = `paths.model`):
    checkpoint.pt      everything needed to resume (model, optimizer, scheduler, RNG states, data
                       position, curves, MLflow run id), written atomically every
                       `train.checkpoint_every_steps` steps and at the end; `torch.load(weights_only=True)`
    model.pt           final weights (state dict) + model_config.json: what optimize/evaluate load
                       (`pfactory.model.io.load_model`)
    curves.json        one record per step: loss terms, lr, samples/s, data-wait fraction (DVC plots)
    val_curves.json    one record per validation: epoch, step, mAP, NDS, AP per class at each threshold
    metrics.json       final summary: time, throughput, val KPIs (DVC metrics)
Metrics back: the summary dict.

Run: `python -m tasks.train [-S train.epochs=5 ...]` (DVC: paths from params.yaml), `factory train
--data DIR --out DIR`, or under `torchrun --nproc_per_node N -m tasks.train` for DDP (gloo on CPU, nccl on
CUDA; the global batch `train.batch_size` is split across processes, so the loss does not depend on N).
`factory profile train --steps N` -> `profile_train` (torch.profiler trace + top ops).

Resume: when `out/checkpoint.pt` exists and was written by the same model/train params on the same
prepared data, training continues from it; a killed run (even SIGKILL) resumed this way ends with the
same weights as an uninterrupted one on CPU (tests/tasks/test_train.py). Otherwise it starts fresh.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pfactory.fsutil import atomic_write_bytes, atomic_write_json, sha256_file
from pfactory.model.detector import PaintedPillarDetector, build_model
from pfactory.model.inference import evaluate_kpis, kpi_scalars, predict
from pfactory.model.io import save_bytes, save_model
from pfactory.model.loss import detection_loss
from pfactory.model.params import ModelParams, TrainParams
from pfactory.model.targets import build_targets

CHECKPOINT = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
# Train params that do not change the trajectory: a checkpoint written with other values resumes.
_RESUME_IGNORED = {
    "checkpoint_every_steps",
    "log_every_steps",
    "num_threads",
    "loader",
    "loader_workers",
    "torch_threads",
    "val_every_epochs",
    "compile",
    "score_threshold",
}
_BATCH_TENSORS = ("points", "num_points", "images", "proj", "cam_valid", "boxes", "labels", "num_boxes")


# --------------------------------------------------------------------------------------------------
# Environment: devices, processes, seeds
# --------------------------------------------------------------------------------------------------
@dataclass
class Runtime:
    """Where this process trains: device, DDP rank and world size."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_runtime(device: str) -> Runtime:
    """Pick the device; join the process group when launched by torchrun (env WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but CUDA is not available")
    dev = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Runtime(dev, rank, world, local)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every global RNG state as types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    random.setstate(_tuplify(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list | tuple) else x


@contextlib.contextmanager
def nvtx(name: str) -> Iterator[None]:
    """An NVTX range (Nsight) when CUDA is present, and a profiler label either way."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------
@dataclass
class DataInfo:
    """What the loop needs to know about the prepared data."""

    classes: list[str]
    cameras: list[str]
    image_size: tuple[int, int]  # (W, H) of the model-input images
    train_frames: int
    val_frames: int
    fingerprint: str  # sha256 of manifest.json: a resumed run must see the same data


LoaderFactory = Callable[..., Any]
"""`(data, split, batch_size, shuffle, augment, seed, device, num_threads) -> loader` with `len()`,
`set_epoch(e)`, `skip_batches(k)` and iteration yielding batches (`pfactory.data.loader.Batch` or dicts)."""


def data_info(data: Path) -> DataInfo:
    """Read the prepared manifest (refuses a newer schema with the prepare stage's message)."""
    from pfactory.data.shards import open_prepared

    ds = open_prepared(data)
    _, h, w = ds.image_shape
    return DataInfo(
        classes=ds.classes,
        cameras=ds.cameras,
        image_size=(w, h),
        train_frames=ds.num_frames("train"),
        val_frames=ds.num_frames("val") if "val" in ds.manifest["splits"] else 0,
        fingerprint=sha256_file(Path(data) / "manifest.json"),
    )


def make_loader_factory(tp: TrainParams) -> LoaderFactory:
    """The shard loader of `train.loader` (DALI or its PyTorch reference: the same batches)."""

    def factory(data: Path, split: str, batch_size: int, shuffle: bool, augment: Any, seed: int,
                device: torch.device, num_threads: int) -> Any:  # fmt: skip
        from pfactory.data.loader import make_loader

        backend = tp.loader if tp.loader != "auto" else ("dali" if device.type == "cuda" else "torch")
        return make_loader(
            data, split, batch_size=batch_size, shuffle=shuffle, augment=augment, seed=seed, device=device.type,
            num_threads=num_threads, workers=tp.loader_workers, backend=backend,
        )  # fmt: skip

    return factory


def epoch_batches(loader: Any, epoch: int, skip: int) -> Iterator[dict[str, Any]]:
    """Batches of `epoch` as dicts, the first `skip` left out without loading them (exact resume)."""
    loader.set_epoch(epoch)
    loader.skip_batches(skip)
    for batch in loader:
        yield batch if isinstance(batch, dict) else dict(vars(batch))  # pfactory.data.loader.Batch -> dict


def rank_slice(batch: dict[str, Any], rt: Runtime) -> dict[str, Any]:
    """This process's contiguous share of the global batch (every process loads the same batch)."""
    if not rt.distributed:
        return batch
    b = len(batch["frame_ids"])
    lo, hi = b * rt.rank // rt.world_size, b * (rt.rank + 1) // rt.world_size
    return {k: v[lo:hi] for k, v in batch.items()}


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


# --------------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, tp: TrainParams) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases (1-d parameters), as is standard."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": tp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tp.lr, betas=tuple(tp.betas), foreach=True)


def lr_factor(step: int, total: int, tp: TrainParams) -> float:
    """Learning-rate multiplier at optimizer step `step` (0-based) of `total`."""
    lo = tp.min_lr_ratio
    warm = round(tp.warmup_fraction * total)
    if step < warm:
        t = (step + 1) / warm
        if tp.schedule == "onecycle":  # cosine ramp up, as torch's OneCycleLR
            return lo + (1 - lo) * (1 - math.cos(math.pi * t)) / 2
        return lo + (1 - lo) * t
    if tp.schedule == "constant":
        return 1.0
    t = (step - warm) / max(1, total - warm)
    return lo + (1 - lo) * (1 + math.cos(math.pi * min(1.0, t))) / 2


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------
def trajectory_config(model_p: ModelParams, train_p: TrainParams) -> dict[str, Any]:
    """The params that determine the training trajectory (a resume must match them)."""
    t = {k: v for k, v in train_p.model_dump(mode="json").items() if k not in _RESUME_IGNORED}
    return {"model": model_p.model_dump(mode="json"), "train": t}


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic: a temporary sibling, fsync, rename; a SIGKILL leaves the previous checkpoint intact."""
    atomic_write_bytes(path, save_bytes(state))


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
@dataclass
class Timer:
    """Accumulated wall time per phase (data wait, forward, backward, optimizer, ...)."""

    totals: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, name: str, sync: torch.device | None = None) -> Iterator[None]:
        t0 = time.perf_counter()
        with nvtx(name):
            yield
        if sync is not None and sync.type == "cuda":
            torch.cuda.synchronize(sync)  # honest phase times on GPU (costs a little overlap)
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _all_reduce_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class _Tracker:
    """MLflow logging on the main process (a no-op elsewhere or with `track=False`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.mlflow: Any = None
        self.run_id: str | None = None
        self._stack = contextlib.ExitStack()

    def start(self, params: dict[str, Any], run_id: str | None) -> None:
        if not self.enabled:
            return
        import mlflow

        from pfactory.tracking import configure_environment, stage_run

        self.mlflow = mlflow
        if run_id is not None:  # resume the killed run's MLflow run: one run, one curve
            configure_environment()
            mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
            try:
                self._stack.enter_context(mlflow.start_run(run_id=run_id))
                self.run_id = run_id
                return
            except Exception as e:  # the run may live in another tracking store
                print(
                    f"train: could not reopen MLflow run {run_id} ({e}); starting a new one", file=sys.stderr
                )
        run = self._stack.enter_context(stage_run("train", params))
        self.run_id = run.info.run_id

    def metrics(self, values: dict[str, float], step: int) -> None:
        if self.enabled and values:
            self.mlflow.log_metrics({k: float(v) for k, v in values.items()}, step=step)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if self.enabled:
            self.mlflow.log_artifact(str(path), artifact_path=folder)

    def close(self, error: BaseException | None = None) -> None:
        """End the run: FINISHED, or FAILED when `error` is given (the error keeps propagating)."""
        if error is None:
            self._stack.close()
        else:
            with contextlib.suppress(BaseException):
                self._stack.__exit__(type(error), error, error.__traceback__)


def _progress(enabled: bool, total: int, start: int):
    """A rich progress bar (step, loss, samples/s, ETA) on stderr; a null context when disabled."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]:.4f}  {task.fields[sps]:.1f} samples/s  lr {task.fields[lr]:.2e}"
        ),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    progress.add_task("train", total=total, completed=start, loss=float("nan"), sps=0.0, lr=0.0)
    return progress


def run(
    params: Any,
    data: Path,
    out: Path,
    track: bool = True,
    max_steps: int | None = None,
    *,
    loader_factory: LoaderFactory | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Train `params.model` with `params.train` on `data`, writing into `out`; returns the summary.

    `max_steps` overrides `train.max_steps`. `loader_factory` replaces the shard loader (tests).
    `progress`: show the rich bar (default: when stderr is a terminal).
    """
    mp: ModelParams = params.model
    tp: TrainParams = params.train
    if max_steps is not None:
        tp = tp.model_copy(update={"max_steps": max_steps})
    data, out = Path(data), Path(out)
    t_start = time.perf_counter()
    rt = setup_runtime(tp.device)
    if tp.torch_threads:
        torch.set_num_threads(tp.torch_threads)
    info = data_info(data)
    if list(info.classes) != list(mp.classes):
        raise ValueError(
            f"model.classes {mp.classes} differ from the prepared data's classes {info.classes} "
            "(prepare.classes): labels would mean different classes"
        )
    factory = loader_factory or make_loader_factory(tp)
    if tp.batch_size % rt.world_size:
        raise ValueError(
            f"train.batch_size={tp.batch_size} must be divisible by the {rt.world_size} DDP processes"
        )
    augment = getattr(tp, "augment", None)
    train_loader = factory(data, "train", tp.batch_size, True, augment, tp.seed, rt.device, tp.num_threads)
    steps_per_epoch = len(train_loader)
    total = tp.epochs * steps_per_epoch
    if tp.max_steps is not None:
        total = min(total, tp.max_steps)

    # Model, optimizer, schedule; then the checkpoint, if it belongs to this configuration.
    seed_everything(tp.seed)
    model = build_model(mp, info.image_size).to(rt.device)
    optimizer = make_optimizer(model, tp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, tp))
    config = trajectory_config(mp, tp)
    ckpt_path = out / CHECKPOINT
    state = load_checkpoint(ckpt_path)
    step, epoch, in_epoch, elapsed_before = 0, 0, 0, 0.0
    curves: list[dict[str, float]] = []
    val_curves: list[dict[str, Any]] = []
    run_id = None
    resumed = finished = False
    if state is not None:
        reason = _resume_mismatch(state, config, info)
        if reason is None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            step, epoch, in_epoch = int(state["step"]), int(state["epoch"]), int(state["batch_in_epoch"])
            curves, val_curves = list(state["curves"]), list(state["val_curves"])
            elapsed_before = float(state["elapsed_s"])
            run_id = state.get("mlflow_run_id")
            resumed, finished = True, bool(state["done"])
        elif rt.is_main:
            print(f"train: {ckpt_path} not resumed ({reason}); starting fresh", file=sys.stderr)
    net: nn.Module = model
    if rt.distributed:
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None
        )
    forward = torch.compile(net) if tp.compile else net
    use_bf16 = tp.bf16 and rt.device.type == "cuda"

    tracker = _Tracker(track and rt.is_main)
    # The resolved config: the whole params when given a `pfactory.config.Params`, else its two sections.
    resolved = params.model_dump(mode="json") if hasattr(params, "model_dump") else {}
    resolved.update({"model": mp.model_dump(mode="json"), "train": tp.model_dump(mode="json")})
    resolved["dataset"] = {"path": str(data), "fingerprint": info.fingerprint, "train_frames": info.train_frames,
                           "val_frames": info.val_frames, "world_size": rt.world_size}  # fmt: skip
    tracker.start(resolved, run_id)
    timer = Timer()
    timer.totals["init"] = time.perf_counter() - t_start
    show = rt.is_main and (sys.stderr.isatty() if progress is None else progress)
    summary: dict[str, Any] = {}

    def checkpoint(done: bool) -> None:
        if not rt.is_main:
            return
        with timer("checkpoint"):
            save_checkpoint(ckpt_path, {
                "format": CHECKPOINT_FORMAT, "config": config, "data_fingerprint": info.fingerprint,
                "step": step, "epoch": epoch, "batch_in_epoch": in_epoch, "total_steps": total,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": rng_state(), "curves": curves,
                "val_curves": val_curves, "elapsed_s": elapsed_before + train_time(), "mlflow_run_id": tracker.run_id,
                "done": done,
            })  # fmt: skip

    t_loop = time.perf_counter()

    def train_time() -> float:
        return time.perf_counter() - t_loop

    try:
        with _progress(show, total, step) as bar:
            last_log = time.perf_counter()
            while step < total:
                loader_iter = epoch_batches(train_loader, epoch, in_epoch)
                while step < total:
                    t_step = time.perf_counter()
                    with timer("data"):
                        batch = next(loader_iter, None)
                    if batch is None:
                        break
                    t_data = time.perf_counter() - t_step
                    batch = to_device(rank_slice(batch, rt), rt.device)
                    terms = train_step(forward, model, batch, optimizer, scheduler, tp, rt, timer, use_bf16)
                    step += 1
                    in_epoch += 1
                    dt = time.perf_counter() - t_step
                    record = {"step": step, "epoch": epoch, "lr": optimizer.param_groups[0]["lr"],
                              "samples_per_s": tp.batch_size / dt, "data_wait_fraction": t_data / dt,
                              **terms}  # fmt: skip
                    curves.append(record)
                    if step % tp.log_every_steps == 0 or step == total:
                        logged = {f"train/{k}": v for k, v in record.items() if k != "step"}
                        logged["train/peak_memory_mb"] = _peak_memory_mb(rt.device)
                        tracker.metrics(logged, step)
                    if bar is not None:
                        bar.update(bar.task_ids[0], completed=step, loss=terms["loss"], sps=record["samples_per_s"],
                                   lr=record["lr"])  # fmt: skip
                    elif rt.is_main and time.perf_counter() - last_log > 30:
                        # No terminal (DVC, CI): a plain line every ~30 s keeps the log alive.
                        print(f"train: step {step}/{total} loss {terms['loss']:.4f} "
                              f"{record['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)  # fmt: skip
                        last_log = time.perf_counter()
                    if step % tp.checkpoint_every_steps == 0 and step < total:
                        checkpoint(done=False)
                else:
                    break  # step == total inside the epoch
                # The epoch's batches are exhausted.
                epoch += 1
                in_epoch = 0
                if tp.val_every_epochs and epoch % tp.val_every_epochs == 0 and step < total:
                    val_curves.append(
                        validate(model, data, info, factory, tp, rt, timer, tracker, step, epoch)
                    )
            if in_epoch >= steps_per_epoch:  # stopped exactly at an epoch end
                epoch, in_epoch = epoch + 1, 0
        train_s = elapsed_before + train_time()
        if not finished:  # a finished checkpoint already holds the final validation: just re-emit the outputs
            val_curves.append(validate(model, data, info, factory, tp, rt, timer, tracker, step, epoch))
            checkpoint(done=True)
        if rt.is_main:
            summary = finish(out, model, info, tp, rt, curves, val_curves, timer, train_s, tracker, resumed)
    except BaseException as e:
        tracker.close(e)
        raise
    tracker.close()
    if rt.distributed:
        dist.barrier()  # nobody tears the process group down before the main process has written
    return summary


def _resume_mismatch(state: dict[str, Any], config: dict[str, Any], info: DataInfo) -> str | None:
    """Why a checkpoint cannot be resumed here, or None."""
    if int(state.get("format", 0)) != CHECKPOINT_FORMAT:
        return f"checkpoint format {state.get('format')} != {CHECKPOINT_FORMAT}"
    if state.get("data_fingerprint") != info.fingerprint:
        return "it was trained on other prepared data"
    if state.get("config") != config:
        old, new = state.get("config", {}), config
        diff = sorted(
            f"{sec}.{k}" for sec in ("model", "train") for k in set(old.get(sec, {})) | set(new.get(sec, {}))
            if old.get(sec, {}).get(k) != new.get(sec, {}).get(k)
        )  # fmt: skip
        return "params changed: " + ", ".join(diff)
    return None


def train_step(
    forward: nn.Module,
    model: PaintedPillarDetector,
    batch: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tp: TrainParams,
    rt: Runtime,
    timer: Timer,
    use_bf16: bool,
) -> dict[str, float]:
    """One optimizer step on this process's slice; returns the global-batch loss terms (floats)."""
    mp = model.params
    with timer("targets"):
        targets = build_targets(batch["boxes"], batch["labels"], mp, batch.get("num_boxes"))
        counts = torch.stack([targets.num_peaks, targets.num_objects]).to(torch.float64)  # [2]
        counts = _all_reduce_sum(counts, rt)  # global normalizers: loss independent of the process count
    with timer("forward", rt.device), torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=use_bf16):
        out = forward(
            batch["points"],
            batch["num_points"],
            batch.get("images"),
            batch.get("proj"),
            batch.get("cam_valid"),
        )
        terms = detection_loss(
            out, targets, tp.heatmap_weight, tp.reg_weight, tp.reg_code_weights,
            num_peaks=counts[0], num_objects=counts[1], world_size=rt.world_size,
        )  # fmt: skip
    with timer("backward", rt.device):
        optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
    with timer("optimizer", rt.device):
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), tp.grad_clip if tp.grad_clip > 0 else math.inf
        )
        optimizer.step()
        scheduler.step()
    names = list(terms)
    values = torch.stack([terms[k].detach().float() for k in names])  # [T]
    values = _all_reduce_sum(values, rt) / rt.world_size  # mean of rescaled slices = global-batch loss
    result = dict(zip(names, values.tolist()))
    result["grad_norm"] = float(grad_norm)
    return result


def validate(
    model: PaintedPillarDetector,
    data: Path,
    info: DataInfo,
    factory: LoaderFactory,
    tp: TrainParams,
    rt: Runtime,
    timer: Timer,
    tracker: _Tracker,
    step: int,
    epoch: int,
) -> dict[str, Any]:
    """KPIs on the val split (main process; the others wait); returns the val-curve record."""
    record: dict[str, Any] = {"epoch": epoch, "step": step}
    if rt.is_main and info.val_frames > 0:
        with timer("validate"):
            loader = factory(data, "val", tp.batch_size, False, None, tp.seed, rt.device, tp.num_threads)
            loader.set_epoch(0)
            use_bf16 = tp.bf16 and rt.device.type == "cuda"
            gts, preds = predict(model, loader, info.classes, tp.score_threshold, rt.device,
                                 torch.bfloat16 if use_bf16 else None)  # fmt: skip
            kpis = evaluate_kpis(gts, preds, info.classes)
        scalars = kpi_scalars(kpis.metrics)
        tracker.metrics(scalars, step)
        per_class = "  ".join(f"{c} {v['ap']['2.0']:.3f}" for c, v in kpis.metrics["classes"].items())
        print(
            f"val: epoch {epoch} step {step}  mAP {kpis.metrics['mAP']:.4f}  AP@2m {per_class}",
            file=sys.stderr,
        )
        record.update({k.removeprefix("val/"): v for k, v in scalars.items()})
        record["kpis"] = kpis.metrics
    if rt.distributed:
        dist.barrier()
    return record


def finish(
    out: Path,
    model: PaintedPillarDetector,
    info: DataInfo,
    tp: TrainParams,
    rt: Runtime,
    curves: list[dict[str, float]],
    val_curves: list[dict[str, Any]],
    timer: Timer,
    train_s: float,
    tracker: _Tracker,
    resumed: bool,
) -> dict[str, Any]:
    """Write model.pt, model_config.json, curves, metrics; log them; return the summary."""
    paths = save_model(out, model, info.image_size, info.cameras)
    atomic_write_json(out / "curves.json", curves)
    atomic_write_json(
        out / "val_curves.json", [{k: v for k, v in r.items() if k != "kpis"} for r in val_curves]
    )
    final = val_curves[-1] if val_curves else {}
    steps = len(curves)
    step_time = sum(timer.totals.get(k, 0.0) for k in ("data", "targets", "forward", "backward", "optimizer"))
    summary = {
        "steps": steps,
        "epochs": max((r["epoch"] for r in curves), default=-1) + 1,
        "train_seconds": round(train_s, 2),
        "samples_per_s": round(steps * tp.batch_size / step_time, 2) if step_time else 0.0,
        "data_wait_fraction": round(timer.totals.get("data", 0.0) / step_time, 4) if step_time else 0.0,
        "peak_memory_mb": round(_peak_memory_mb(rt.device), 1),
        "final_loss": curves[-1]["loss"] if curves else None,
        "resumed": resumed,
        "world_size": rt.world_size,
        "device": str(rt.device),
        "timings_s": {k: round(v, 3) for k, v in timer.totals.items()},
        "val": final.get("kpis"),
        "mlflow_run_id": tracker.run_id,
    }
    atomic_write_json(out / "metrics.json", summary)
    tracker.metrics(
        {
            "train/seconds": summary["train_seconds"],
            "train/samples_per_s_mean": summary["samples_per_s"],
            "train/data_wait_fraction_mean": summary["data_wait_fraction"],
            "train/peak_memory_mb": summary["peak_memory_mb"],
            **{f"time/{k}_s": v for k, v in timer.totals.items()},
        },
        steps,
    )
    for p in (out / CHECKPOINT, paths["weights"], paths["config"], out / "curves.json", out / "metrics.json"):
        tracker.artifact(p, "model")
    return summary


# --------------------------------------------------------------------------------------------------
# Profiling
# --------------------------------------------------------------------------------------------------
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
    model = build_model(mp, info.image_size).to(rt.device)
    optimizer = make_optimizer(model, tp)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    forward = torch.compile(model) if tp.compile else model
    use_bf16 = tp.bf16 and rt.device.type == "cuda"
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
        train_step(forward, model, batch, optimizer, scheduler, tp, rt, timer, use_bf16)

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


# --------------------------------------------------------------------------------------------------
# DVC entry point
# --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """`python -m tasks.train [--data DIR] [--out DIR] [-S k=v ...] [--params FILE]` (defaults: paths.*)."""
    import argparse

    from pfactory.cli_stage import stage_main

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--data", type=Path, default=None, help="prepared directory (default: paths.prepared)"
        )
        parser.add_argument("--out", type=Path, default=None, help="output directory (default: paths.model)")
        parser.add_argument("--no-track", action="store_true", help="do not log to MLflow")

    def body(params: Any, args: argparse.Namespace) -> dict | None:
        data = args.data or Path(params.paths.prepared)
        out = args.out or Path(params.paths.model)
        summary = run(params, data, out, track=not args.no_track)
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        return {k: v for k, v in summary.items() if k != "val"}

    stage_main("train", argv, body, add_arguments)


if __name__ == "__main__":
    main(sys.argv[1:])
