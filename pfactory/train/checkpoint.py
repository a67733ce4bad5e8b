"""Training checkpoints: one atomic `checkpoint.pt` (a plain dict; `torch.load(weights_only=True)`)
holding everything to resume (model, optimizer, scheduler, RNG states, data position, curves,
MLflow run id), and the rule for when a checkpoint may be resumed (same format, same prepared
data, same trajectory params)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pfactory.detectors.io import CheckpointError, load_state, save_bytes
from pfactory.storage import artifacts as af
from pfactory.storage.fsutil import atomic_write_bytes
from pfactory.train.data import DataInfo
from pfactory.train.params import TrainParams

CHECKPOINT = af.CHECKPOINT
CHECKPOINT_FORMAT = 1
EXIT_PREEMPTED = 143  # 128 + SIGTERM: what Kubernetes and Slurm expect of a preempted process
# Train params that do not change the trajectory: a checkpoint written with other values resumes.
_RESUME_IGNORED = {
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
    "log_every_steps",
    "num_threads",
    "loader",
    "loader_workers",
    "torch_threads",
    "val_every_epochs",
    "compile",
}


def trajectory_config(arch: str, model_p: Any, train_p: TrainParams) -> dict[str, Any]:
    """The params that determine the training trajectory (a resume must match them): the architecture's
    name and its built params, and the train params that shape the trajectory."""
    t = {k: v for k, v in train_p.model_dump(mode="json").items() if k not in _RESUME_IGNORED}
    return {"model": {"arch": arch, **model_p.model_dump(mode="json")}, "train": t}


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at `path` (None when there is none); CheckpointError when it is not a loadable one."""
    if not path.exists():
        return None
    try:
        state = load_state(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; delete it to train from scratch") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a checkpoint dict, got {type(state).__name__}; delete it to "
                              "train from scratch")  # fmt: skip
    return state


def save_checkpoint(path: Path, state: dict[str, Any], *also: Path) -> None:
    """Write `state` to `path` (and the same bytes to each of `also`). Atomic: a temporary sibling, fsync,
    rename; a SIGKILL leaves the previous checkpoint intact."""
    data = save_bytes(state)
    for p in (path, *also):
        atomic_write_bytes(p, data, clean_stale=True)


def resume_mismatch(state: dict[str, Any], config: dict[str, Any], info: DataInfo) -> str | None:
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
