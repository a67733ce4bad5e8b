"""The training loop: prepared shards -> a trained detector, resumable, tracked in MLflow.

Files in:  `data` = a prepared directory (`paths.prepared`: manifest.json + Parquet shards).
Files out (`out` = `paths.model`):
    checkpoint.pt      everything needed to resume (`pfactory.train.checkpoint`), written atomically at the
                       end (and, without a `resume_dir`, also while training: below)
    model.pt           final weights (state dict) + model_config.json: what optimize/evaluate load
                       (`pfactory.detectors.io.load_model`)
    curves.json        one record per step: loss terms, lr, samples/s, data-wait fraction (DVC plots)
    val_curves.json    one record per validation: epoch, step, mAP, NDS, AP per class at each threshold
    metrics.json       final summary: time, throughput, last validation mAP / NDS (DVC metrics)
    compile_cache.bin  with `train.compile`: PyTorch's portable compile artifacts
                       (`torch.compiler.save_cache_artifacts`), loaded by the next run into this `out`
                       (or copied next to a model elsewhere), so it starts from warm Inductor/AOT caches

`Trainer(params, data, out).train()` builds everything (runtime, loader, model, optimizer,
schedule, checkpoint, tracker) and runs the loop; `tasks/train.py` is the stage around it.
DDP: under `torchrun --nproc_per_node N` (gloo on CPU, nccl on CUDA) the global batch
`train.batch_size` is split across processes, so the loss does not depend on N.

Resume: while training, the checkpoint is written atomically every `train.checkpoint_every_steps` steps,
every `train.checkpoint_every_minutes` minutes and on SIGTERM (then the process exits 143, `Preempted`: what
Kubernetes and Slurm preemption expect), into `resume_dir` (the pipeline's workspace keeps it outside DVC's
outputs, which DVC deletes before it reruns a stage: `flows.workspace`) or else `out`. When a checkpoint
there (or in `out`) was written by the same model/train params on the same prepared data, training
continues from it: a killed run (SIGTERM or SIGKILL) resumed this way has the same loss at every step and
ends with the same weights as an uninterrupted one on CPU (tests/train/test_trainer.py). Otherwise it
starts fresh.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels import native
from pfactory.detectors import registry
from pfactory.detectors.contract import LossContext, batch_inputs, for_compile
from pfactory.detectors.inference import evaluate_kpis, predict
from pfactory.detectors.io import save_model
from pfactory.detectors.params import ModelSection
from pfactory.runtime.failures import EXIT_FAILED, UserError
from pfactory.runtime.progress import emit as emit_progress
from pfactory.storage import artifacts as af
from pfactory.storage.artifacts import kpi_scalars
from pfactory.storage.fsutil import atomic_write_json
from pfactory.train.checkpoint import (
    CHECKPOINT,
    CHECKPOINT_FORMAT,
    EXIT_PREEMPTED,
    load_checkpoint,
    resume_mismatch,
    save_checkpoint,
    trajectory_config,
)
from pfactory.train.data import (
    DataInfo,
    LoaderFactory,
    data_info,
    epoch_batches,
    make_loader_factory,
    rank_slice,
    to_device,
)
from pfactory.train.params import TrainParams
from pfactory.train.remote_checkpoint import uploader_from_env
from pfactory.train.rng import rng_state, seed_everything, set_rng_state
from pfactory.train.runtime import Runtime, Timer, all_reduce_sum, peak_memory_mb, setup_runtime, use_bf16
from pfactory.train.schedule import lr_factor, make_optimizer
from pfactory.train.tracker import Tracker, progress_bar


class TrainingDiverged(UserError, RuntimeError):
    """The loss became NaN/Inf: stop before writing weights that are garbage (the message says the step)."""

    exit_code = EXIT_FAILED


class Preempted(UserError, RuntimeError):
    """SIGTERM (preemption, `kill`, `factory run` stopping): the checkpoint was written; exit 143 (128 + 15)."""

    exit_code = EXIT_PREEMPTED
    hint = "run the same command again to resume from the checkpoint (a pipeline run: factory run --resume)"


COMPILE_CACHE = "compile_cache.bin"  # torch.compile's portable cache artifacts, in `out`


class Trainer:
    """One training run of the architecture `params.model.arch` (its section `params.model.<arch>`, resolved:
    `pfactory.detectors.params`) with `params.train` on `data`, writing into `out`; the validation KPIs count
    detections scoring >= `params.evaluate.score_threshold`. The loop knows the
    detector only through the contract (`pfactory.detectors.contract`): forward, loss, decode.

    `max_steps` overrides `train.max_steps`. `loader_factory` replaces the shard loader (tests).
    `progress`: show the rich bar (default: when stderr is a terminal). `track=False`: no MLflow.
    `resume_dir`: where the checkpoint written while training lives (default: `out`); the final one is
    written to both.
    """

    def __init__(
        self,
        params: Any,
        data: Path,
        out: Path,
        track: bool = True,
        max_steps: int | None = None,
        *,
        loader_factory: LoaderFactory | None = None,
        progress: bool | None = None,
        resume_dir: Path | None = None,
    ) -> None:
        section: ModelSection = params.model
        tp: TrainParams = params.train
        if max_steps is not None:
            tp = tp.model_copy(update={"max_steps": max_steps})
        self.tp = tp
        self.score_threshold = params.evaluate.score_threshold  # the validation KPIs' cut: evaluate's (a view)
        self.arch, self.plugin = section.arch, section.plugin
        self.data, self.out = data, out = Path(data), Path(out)
        t_start = time.perf_counter()
        self.rt = rt = setup_runtime(tp.device)
        if tp.torch_threads:
            torch.set_num_threads(tp.torch_threads)
        self.info = info = data_info(data)
        self.factory = factory = loader_factory or make_loader_factory(tp)
        if tp.batch_size % rt.world_size:
            raise ValueError(
                f"train.batch_size={tp.batch_size} must be divisible by the {rt.world_size} DDP processes"
            )
        augment = getattr(tp, "augment", None)
        self.train_loader = factory(
            data, "train", tp.batch_size, True, augment, tp.seed, rt.device, tp.num_threads
        )
        self.steps_per_epoch = len(self.train_loader)
        total = tp.epochs * self.steps_per_epoch
        self.total = total if tp.max_steps is None else min(total, tp.max_steps)

        # Model, optimizer, schedule (seeded after the loader is built: the same draws as ever);
        # then the checkpoint, if it belongs to this configuration.
        # The detector's classes and range are the prepared data's (prepare.classes / pc_range, carried
        # by the manifest): labels always mean the classes the head predicts.
        seed_everything(tp.seed)
        self.model = model = registry.build(self.arch, section.selected, info.spec()).to(rt.device)
        if tp.compile:
            for_compile(model)  # the architecture's torch.compile formulation (its hook); the same weights
        self.optimizer = make_optimizer(model, tp)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total, tp)
        )
        self.config = trajectory_config(self.arch, model.params, tp)
        self.final_ckpt = out / CHECKPOINT
        self.ckpt_path = Path(resume_dir) / CHECKPOINT if resume_dir is not None else self.final_ckpt
        self.step, self.epoch, self.in_epoch, self.elapsed_before = 0, 0, 0, 0.0
        self.curves: list[dict[str, float]] = []
        self.val_curves: list[dict[str, Any]] = []
        self.resumed = self.finished = False
        self.stop_signal: int | None = None  # set by the SIGTERM handler: checkpoint and stop after this step
        self.checkpoints = 0  # written by this process
        self._last_ckpt = time.monotonic()
        self.resumed_at = 0  # the step a resumed run continued from
        # `$PFACTORY_CHECKPOINT_REMOTE`: each checkpoint also goes to the DVC remote (a background thread)
        self.uploader = uploader_from_env() if rt.is_main else None
        state = load_checkpoint(self.ckpt_path)
        if state is None and self.ckpt_path != self.final_ckpt:
            state = load_checkpoint(self.final_ckpt)
        run_id = self._resume(state)

        net: nn.Module = model
        if rt.distributed:
            net = nn.parallel.DistributedDataParallel(
                model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None
            )
        self.forward = torch.compile(net) if tp.compile else net  # for_compile: at build, above
        self.compile_cache = out / COMPILE_CACHE
        if tp.compile and self.compile_cache.exists():
            # a previous run's portable artifacts: the first compile reads them instead of compiling cold
            torch.compiler.load_cache_artifacts(self.compile_cache.read_bytes())
        self.use_bf16 = use_bf16(tp.bf16, rt.device)

        self.tracker = Tracker(track and rt.is_main)
        # The resolved config: the whole params when given a `flows.params.Params`, else its two sections.
        resolved = params.model_dump(mode="json") if hasattr(params, "model_dump") else {}
        resolved.update({"model": {"arch": self.arch, "plugin": self.plugin, self.arch: model.params.model_dump(mode="json")},
                         "train": tp.model_dump(mode="json")})  # fmt: skip
        resolved["dataset"] = {"path": str(data), "fingerprint": info.fingerprint, "train_frames": info.train_frames,
                               "val_frames": info.val_frames, "world_size": rt.world_size}  # fmt: skip
        self.tracker.start(resolved, run_id)
        self.timer = Timer()
        self.timer.totals["init"] = time.perf_counter() - t_start
        self.show = rt.is_main and (sys.stderr.isatty() if progress is None else progress)
        self._t_loop = time.perf_counter()
        self._last_log = self._t_loop

    def _resume(self, state: dict[str, Any] | None) -> str | None:
        """Load a matching checkpoint into model, optimizer, schedule, RNGs and position; its MLflow run id."""
        if state is None:
            return None
        reason = resume_mismatch(state, self.config, self.info)
        if reason is not None:
            if self.rt.is_main:
                print(f"train: {self.ckpt_path} not resumed ({reason}); starting fresh", file=sys.stderr)
            return None
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step, self.epoch, self.in_epoch = (
            int(state["step"]),
            int(state["epoch"]),
            int(state["batch_in_epoch"]),
        )
        self.curves, self.val_curves = list(state["curves"]), list(state["val_curves"])
        self.elapsed_before = float(state["elapsed_s"])
        self.resumed, self.finished, self.resumed_at = True, bool(state["done"]), self.step
        if self.rt.is_main:
            print(f"train: resumed from {self.ckpt_path} at step {self.step} of {self.total}", file=sys.stderr)
        return state.get("mlflow_run_id")

    def train_time(self) -> float:
        """Seconds of this process's loop (a resumed run adds `elapsed_before`)."""
        return time.perf_counter() - self._t_loop

    def train(self) -> dict[str, Any]:
        """Run to `total` steps (validating every `val_every_epochs`), write the outputs; the summary."""
        tp, rt = self.tp, self.rt
        summary: dict[str, Any] = {}
        self._t_loop = time.perf_counter()
        self._last_ckpt = time.monotonic()
        previous = self._catch_sigterm()
        try:
            with progress_bar(self.show, self.total, self.step) as bar:
                self._last_log = time.perf_counter()
                while self.step < self.total:
                    if not self.train_epoch(bar):
                        break  # step == total inside the epoch
                    # The epoch's batches are exhausted.
                    self.epoch, self.in_epoch = self.epoch + 1, 0
                    if (
                        tp.val_every_epochs
                        and self.epoch % tp.val_every_epochs == 0
                        and self.step < self.total
                    ):
                        self.val_curves.append(self.validate())
                        self.stop_if_asked()
                if self.in_epoch >= self.steps_per_epoch:  # stopped exactly at an epoch end
                    self.epoch, self.in_epoch = self.epoch + 1, 0
            train_s = self.elapsed_before + self.train_time()
            bad = [
                n
                for n, t in self.model.state_dict().items()
                if t.is_floating_point() and not torch.isfinite(t).all()
            ]
            if bad:
                raise TrainingDiverged(
                    f"{len(bad)} weight tensors hold NaN/Inf after step {self.step} (e.g. {bad[0]}): the run "
                    f"diverged; lower train.lr (now {self.tp.lr:g}). No model was written"
                )
            # A finished checkpoint already holds the final validation: then only re-emit the outputs.
            if not self.finished:
                self.val_curves.append(self.validate())
                self.checkpoint(done=True)
            if rt.is_main and tp.compile:
                self.save_compile_cache()
            if self.uploader is not None:
                self.uploader.close()  # a queued resume copy is moot now
            if rt.is_main:
                summary = finish(self.out, self.model, (self.arch, self.plugin), self.info, tp, rt, self.curves,
                                 self.val_curves, self.timer, train_s, self.tracker, self.resumed,
                                 checkpoints=self.checkpoints, resumed_at=self.resumed_at,
                                 remote=self.uploader.stats() if self.uploader is not None else None)  # fmt: skip
        except BaseException as e:
            self.tracker.close(e)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if self.uploader is not None:
                self.uploader.close()
        self.tracker.close()
        if rt.distributed:
            dist.barrier()  # nobody tears the process group down before the main process has written
        return summary

    def train_epoch(self, bar: Any) -> bool:
        """Steps through the rest of this epoch; True when its batches ran out, False at `total`."""
        tp, rt, timer = self.tp, self.rt, self.timer
        batches = epoch_batches(self.train_loader, self.epoch, self.in_epoch)
        while self.step < self.total:
            t_step = time.perf_counter()
            with timer("data"):
                batch = next(batches, None)
            if batch is None:
                return True
            t_data = time.perf_counter() - t_step
            batch = to_device(rank_slice(batch, rt), rt.device)
            terms = train_step(self.forward, self.model, batch, self.optimizer, self.scheduler, tp, rt, timer,
                               self.use_bf16)  # fmt: skip
            self.step += 1
            self.in_epoch += 1
            if not math.isfinite(terms["loss"]):
                raise TrainingDiverged(
                    f"the training loss is {terms['loss']} at step {self.step} (epoch {self.epoch}): the run "
                    f"diverged; lower train.lr (now {tp.lr:g}) or check the prepared data {self.data}. "
                    "No model was written"
                )
            dt = time.perf_counter() - t_step
            record = {"step": self.step, "epoch": self.epoch, "lr": self.optimizer.param_groups[0]["lr"],
                      "samples_per_s": tp.batch_size / dt, "data_wait_fraction": t_data / dt, **terms}  # fmt: skip
            self.curves.append(record)
            self.log_step(record, bar)
            self.stop_if_asked()
            due = self.step % tp.checkpoint_every_steps == 0 or (
                time.monotonic() - self._last_ckpt >= tp.checkpoint_every_minutes * 60
            )
            if due and self.step < self.total:
                self.checkpoint(done=False)
        return False

    def _catch_sigterm(self) -> Any:
        """Install the SIGTERM handler (main thread only): it only records the signal; the loop checkpoints and
        stops after the step in progress (`stop_if_asked`). Returns the previous handler (None: not installed)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def asked(signum: int, _frame: Any) -> None:
            self.stop_signal = signum

        return signal.signal(signal.SIGTERM, asked)

    def stop_if_asked(self) -> None:
        """After a step or a validation: when SIGTERM came (on any DDP process), write the checkpoint and raise
        `Preempted` (exit 143). All processes agree on the step: the flag is summed across them."""
        asked = self.stop_signal is not None
        if self.rt.distributed:
            flag = torch.tensor([1.0 if asked else 0.0], device=self.rt.device)
            asked = bool(all_reduce_sum(flag, self.rt).item() > 0)
        if not asked:
            return
        self.checkpoint(done=False)
        if self.uploader is not None:
            self.uploader.flush()  # the copy on the DVC remote is what another machine resumes from
        raise Preempted(
            f"stopped by SIGTERM at step {self.step} of {self.total}: checkpoint {self.ckpt_path} written; "
            "the same command resumes from it"
        )

    def log_step(self, record: dict[str, Any], bar: Any) -> None:
        """MLflow every `log_every_steps`; the progress bar, or a plain line every ~30 s without a terminal."""
        step = self.step
        if step % self.tp.log_every_steps == 0 or step == self.total:
            logged = {f"train/{k}": v for k, v in record.items() if k != "step"}
            logged["train/peak_memory_mb"] = peak_memory_mb(self.rt.device)
            self.tracker.metrics(logged, step)
        if self.rt.is_main:  # to `factory run`'s terminal (pfactory.runtime.progress)
            emit_progress("train", step=step, total=self.total, loss=record["loss"], samples_per_s=record["samples_per_s"])  # fmt: skip
        if bar is not None:
            bar.update(bar.task_ids[0], completed=step, loss=record["loss"], sps=record["samples_per_s"],
                       lr=record["lr"])  # fmt: skip
        elif self.rt.is_main and time.perf_counter() - self._last_log > 30:
            # No terminal (DVC, CI): a plain line every ~30 s keeps the log alive.
            print(f"train: step {step}/{self.total} loss {record['loss']:.4f} "
                  f"{record['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)  # fmt: skip
            self._last_log = time.perf_counter()

    def save_compile_cache(self) -> None:
        """Write `compile_cache.bin` (atomically) from what this process compiled, if anything."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            tmp = self.compile_cache.with_suffix(".tmp")
            tmp.write_bytes(saved[0])
            tmp.replace(self.compile_cache)

    def validate(self) -> dict[str, Any]:
        return validate(self.model, self.data, self.info, self.factory, self.tp, self.rt, self.timer, self.tracker,
                        self.step, self.epoch, self.score_threshold)  # fmt: skip

    def checkpoint(self, done: bool) -> None:
        """Write `checkpoint.pt` (main process only) to `resume_dir`, and the final one (`done`) to `out` too."""
        self._last_ckpt = time.monotonic()
        if not self.rt.is_main:
            return
        also = [self.final_ckpt] if done and self.final_ckpt != self.ckpt_path else []
        with self.timer("checkpoint"):
            save_checkpoint(self.ckpt_path, {
                "format": CHECKPOINT_FORMAT, "config": self.config, "data_fingerprint": self.info.fingerprint,
                "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.in_epoch, "total_steps": self.total,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": rng_state(), "curves": self.curves,
                "val_curves": self.val_curves, "elapsed_s": self.elapsed_before + self.train_time(),
                "mlflow_run_id": self.tracker.run_id, "done": done,
            }, *also)  # fmt: skip
            if self.uploader is not None and not done:
                self.uploader.submit(self.ckpt_path, self.step)
        self.checkpoints += 1
        self._last_ckpt = time.monotonic()


def train_step(
    forward: nn.Module,
    model: nn.Module,
    batch: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tp: TrainParams,
    rt: Runtime,
    timer: Timer,
    use_bf16: bool,
) -> dict[str, float]:
    """One optimizer step on this process's slice; returns the global-batch loss terms (floats).
    `forward`: the detector as run (DDP-wrapped and/or compiled); `model`: the detector itself (its loss)."""
    ctx = LossContext(lambda t: all_reduce_sum(t, rt), rt.world_size, use_bf16)
    with timer("forward", rt.device), torch.autocast(rt.device.type, dtype=torch.bfloat16, enabled=use_bf16):
        out = forward(*batch_inputs(model, batch))
        terms = model.loss(out, batch, ctx)
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
    values = all_reduce_sum(values, rt) / rt.world_size  # mean of rescaled slices = global-batch loss
    result = dict(zip(names, values.tolist()))
    result["grad_norm"] = float(grad_norm)
    return result


def validate(
    model: nn.Module,
    data: Path,
    info: DataInfo,
    factory: LoaderFactory,
    tp: TrainParams,
    rt: Runtime,
    timer: Timer,
    tracker: Tracker,
    step: int,
    epoch: int,
    score_threshold: float,
) -> dict[str, Any]:
    """KPIs on the val split (main process; the others wait), over detections scoring >= `score_threshold`
    (`evaluate.score_threshold`); returns the val-curve record."""
    record: dict[str, Any] = {"epoch": epoch, "step": step}
    if rt.is_main and info.val_frames > 0:
        with timer("validate"):
            loader = factory(data, "val", tp.batch_size, False, None, tp.seed, rt.device, tp.num_threads)
            loader.set_epoch(0)
            val_bf16 = tp.bf16 and rt.device.type == "cuda"
            gts, preds = predict(model, loader, info.classes, score_threshold, rt.device,
                                 torch.bfloat16 if val_bf16 else None)  # fmt: skip
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
    model: nn.Module,
    arch: tuple[str, dict[str, Any] | None],
    info: DataInfo,
    tp: TrainParams,
    rt: Runtime,
    curves: list[dict[str, float]],
    val_curves: list[dict[str, Any]],
    timer: Timer,
    train_s: float,
    tracker: Tracker,
    resumed: bool,
    checkpoints: int = 0,
    resumed_at: int = 0,
    remote: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write model.pt, model_config.json, curves, metrics; log them; return the summary. `checkpoints`: how
    many this process wrote (their cost: `checkpoint` = written, seconds, share of this process' loop);
    `resumed_at`: the step a resumed run continued from; `remote`: the uploads to the DVC remote
    (`pfactory.train.remote_checkpoint.CheckpointUploader.stats`)."""
    paths = save_model(out, model, *arch)
    atomic_write_json(out / af.CURVES, curves)
    atomic_write_json(out / af.VAL_CURVES, [{k: v for k, v in r.items() if k != "kpis"} for r in val_curves])
    final = val_curves[-1] if val_curves else {}
    steps = len(curves)
    step_time = sum(timer.totals.get(k, 0.0) for k in ("data", "forward", "backward", "optimizer"))
    ckpt_s = timer.totals.get("checkpoint", 0.0)
    loop_s = step_time + timer.totals.get("validate", 0.0) + ckpt_s
    ckpt = {
        "written": checkpoints,
        "seconds": round(ckpt_s, 3),
        "fraction": round(ckpt_s / loop_s, 5) if loop_s else 0.0,
    }
    if remote is not None:
        ckpt["remote"] = remote
    summary = {
        "steps": steps,
        "epochs": max((r["epoch"] for r in curves), default=-1) + 1,
        "train_seconds": round(train_s, 2),
        "samples_per_s": round(steps * tp.batch_size / step_time, 2) if step_time else 0.0,
        "data_wait_fraction": round(timer.totals.get("data", 0.0) / step_time, 4) if step_time else 0.0,
        "peak_memory_mb": round(peak_memory_mb(rt.device), 1),
        "final_loss": curves[-1]["loss"] if curves else None,
        "resumed": resumed,
        "resumed_at_step": resumed_at,
        "checkpoint": ckpt,
        "world_size": rt.world_size,
        "device": str(rt.device),
        "precision": "bf16 autocast" if use_bf16(tp.bf16, rt.device) else "fp32",
        # the C kernels (GroupNorm + ReLU, scatter-max) or why the slower PyTorch ops ran (kernels/native.py)
        "cpu_kernels": native.status() if rt.device.type == "cpu" else None,
        "timings_s": {k: round(v, 3) for k, v in timer.totals.items()},
        "val": final.get("kpis"),
        "mlflow_run_id": tracker.run_id,
        "arch": arch[0],
    }
    # DVC's metrics file: the last validation's mAP and NDS only (evaluate's metrics.json has the headline KPIs;
    # every validation's detail is in the MLflow run, `val/...`; the returned summary keeps the full KPIs).
    val = summary["val"]
    val_head = {k: val.get(k) for k in ("mAP", "NDS")} if val else None
    atomic_write_json(out / af.TRAIN_METRICS, {**summary, "val": val_head})
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
    for p in (out / CHECKPOINT, paths["weights"], paths["config"], out / af.CURVES, out / af.TRAIN_METRICS):
        tracker.artifact(p, "model")
    return summary
