"""The `train:` section of params.yaml: the training loop (`pfactory.train`). The defaults are sized so
that `factory run` trains in minutes on a 2-core CPU (docs/MODEL.md has the measurements)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pfactory.config.section import NonNegFloat, PositiveFloat, PositiveInt, Section
from pfactory.prepare.augment import AugmentParams


class TrainParams(Section):
    """The training loop (`factory train`, `pfactory/train/`)."""

    epochs: PositiveInt = 15
    """Passes over the train split (default: ~765 steps on ~200 frames, ~3 min on 2 CPU cores)."""
    batch_size: PositiveInt = 4
    """Global batch size (split across DDP processes, so the loss does not depend on their number)."""
    lr: PositiveFloat = 3e-3
    """Peak learning rate of AdamW."""
    weight_decay: NonNegFloat = 0.01
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    schedule: Literal["cosine", "onecycle", "constant"] = "onecycle"
    """Learning-rate shape after warm-up: cosine to `min_lr_ratio`, one-cycle (cosine up then down), constant."""
    warmup_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.1
    """Share of the total steps spent warming up linearly from `lr * min_lr_ratio`."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.01
    """Final (and initial) learning rate as a fraction of `lr`."""
    grad_clip: NonNegFloat = 10.0
    """Max global gradient L2 norm (0 disables clipping)."""
    seed: int = 0
    """Seeds weights, data order and augmentation: same seed -> same loss curve on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto = cuda when available."""
    bf16: bool = True
    """bf16 autocast where this machine runs bf16 natively: a CUDA device of compute capability >= 8.0 whose
    bf16 step has verified itself against fp32 (`factory doctor`), or a CPU with AVX512-BF16 or AMX
    (`pfactory.train.runtime.native_bf16`); fp32 elsewhere, where bf16 would be emulated and slower. The loss,
    GroupNorm statistics and the camera projection stay fp32; the CPU path is as deterministic as fp32 (same
    seed, same loss curve). 2 cores with AVX512-BF16: 1.29x the fp32 training step (docs/MODEL.md, "Speed").
    metrics.json's `precision` says which one a run used. false: fp32 everywhere."""
    compile: bool = False
    """`torch.compile` the model (first step pays ~20-60 s of compilation)."""
    loader: Literal["auto", "dali", "torch"] = "auto"
    """Batch loader (`pfactory.prepare.loader`), same batches either way: auto = the DALI pipeline on CUDA, its
    PyTorch reference on CPU, where DALI's reader processes compete with training for the cores (2 cores:
    DALI 16.1 samples/s, 11% data wait; PyTorch 18.0 samples/s, 6.5%)."""
    num_threads: PositiveInt = 2
    """DALI pipeline threads."""
    loader_workers: PositiveInt = 2
    """DALI reader processes (parallel `external_source`)."""
    torch_threads: Annotated[int, Field(ge=0)] = 0
    """Intra-op threads for torch on CPU (0 = leave torch's default)."""
    checkpoint_every_steps: PositiveInt = 50
    """Write the resume checkpoint every this many optimizer steps (also every `checkpoint_every_minutes`, on
    SIGTERM and at the end). Cost on the default run: docs/MODEL.md, "Checkpoints and resume"."""
    checkpoint_every_minutes: PositiveFloat = 5.0
    """... and at least every this many minutes of training (long steps: a preemption loses at most this)."""
    log_every_steps: PositiveInt = 5
    """Log step metrics to MLflow every this many steps."""
    val_every_epochs: Annotated[int, Field(ge=0)] = 3
    """Validate (KPIs on the val split) every this many epochs, and always after the last; 0 = only then.
    ~1.2 s per validation of ~50 frames on 2 cores: every epoch cost 18 s of a 178 s default train; every
    3rd epoch (5 points on the val curve) costs ~6 s."""
    max_steps: PositiveInt | None = None
    """Train for min(this, epochs x batches per epoch) optimizer steps; None = `epochs` passes."""
    augment: AugmentParams | None = Field(default_factory=AugmentParams)
    """Global flip/rotation/scaling applied consistently to points, boxes and camera projections
    (`pfactory.prepare.augment`); null disables it. Never applied at validation."""
