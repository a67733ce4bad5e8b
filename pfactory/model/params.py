"""Parameters of the detector (`params.model`) and of its training loop (`params.train`).

In: the `model:` and `train:` sections of `params.yaml` (hooked into `pfactory.config.Params`).
Out: validated pydantic models; `ModelParams` is also written next to the weights as
`model_config.json`, so the optimize/evaluate stages rebuild the exact network from it.

Units: metres in the lidar frame (x forward, y left, z up); BEV cells are square.
The defaults are sized so that `factory run` trains in minutes on a 2-core CPU (docs/MODEL.md has
the measurements behind them and a larger preset for a GPU).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pfactory.data.augment import AugmentParams
from pfactory.section import Section, check_pc_range

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


class ModelParams(Section):
    """The camera-painted pillar detector with a center head (DESIGN.md §5, docs/MODEL.md)."""

    classes: list[str] = Field(default_factory=lambda: ["Car", "Pedestrian", "Cyclist"])
    """Detected classes in label-index order; must equal the prepared data's (`prepare.classes`)."""
    pc_range: list[float] = Field(default_factory=lambda: [0.0, -40.0, -3.0, 70.4, 40.0, 1.0])
    """BEV region (x_min, y_min, z_min, x_max, y_max, z_max), metres, lidar frame; points outside are dropped."""
    pillar_size_m: PositiveFloat = 0.4
    """Side of a square pillar (BEV cell of the pillar encoder), metres. (x, y) extents must be multiples."""
    camera: bool = True
    """Paint lidar points with image features (camera fusion). False gives the lidar-only ablation."""
    image_channels: PositiveInt = 32
    """Channels of the image-branch feature map that points are painted with."""
    image_stride: Literal[4, 8] = 4
    """Output stride of the image branch (image pixels per feature cell)."""
    point_channels: PositiveInt = 32
    """Channels of the per-point MLP output, i.e. of the scattered BEV pillar canvas."""
    point_layers: Annotated[int, Field(ge=1, le=3)] = 1
    """Linear + LayerNorm + ReLU layers of the per-point MLP (PointPillars: 1)."""
    bev_channels: list[PositiveInt] = Field(default_factory=lambda: [32, 64, 128])
    """Channels of the BEV backbone stages (stage i runs at stride prod(bev_strides[:i+1]) of the pillar grid)."""
    bev_strides: list[PositiveInt] = Field(default_factory=lambda: [2, 2, 2])
    """Stride of the first conv of each backbone stage (relative to the previous stage)."""
    bev_blocks: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [1, 2, 2])
    """Extra 3x3 convs after the strided conv of each stage."""
    up_channels: PositiveInt = 32
    """Channels each stage is projected to before the multi-scale concat at the head stride."""
    head_stride: PositiveInt = 2
    """Output stride of the head w.r.t. the pillar grid: head cell = pillar_size_m * head_stride."""
    head_channels: PositiveInt = 32
    """Channels of the shared 3x3 conv in front of the heatmap and regression convs."""
    norm_groups: PositiveInt = 8
    """GroupNorm groups. GroupNorm (not BatchNorm) keeps a sample's output independent of its batch,
    so DDP and single-process runs agree and export needs no running statistics."""
    gaussian_overlap: Annotated[float, Field(gt=0, lt=1)] = 0.1
    """CenterPoint `min_overlap` for the Gaussian radius of a target peak."""
    min_radius: Annotated[int, Field(ge=0)] = 2
    """Smallest Gaussian radius, head cells (CenterPoint: 2)."""
    max_detections: PositiveInt = 100
    """Top-K peaks kept per frame by the decoder (fixed K: the exported graph has static shapes)."""
    nms_kernel: Literal[1, 3, 5] = 3
    """Max-pool window of the peak extraction (1 disables it)."""

    @field_validator("pc_range")
    @classmethod
    def _range(cls, v: list[float]) -> list[float]:
        return check_pc_range(v)

    @model_validator(mode="after")
    def _check(self) -> ModelParams:
        if not self.classes or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"model.classes must be non-empty and unique, got {self.classes}")
        for i, name in ((0, "x"), (1, "y")):
            cells = (self.pc_range[i + 3] - self.pc_range[i]) / self.pillar_size_m
            if abs(cells - round(cells)) > 1e-4:
                raise ValueError(
                    f"model.pc_range {name} extent must be a multiple of pillar_size_m, got {cells:.4f} cells"
                )
        if not (len(self.bev_channels) == len(self.bev_strides) == len(self.bev_blocks)):
            raise ValueError("model.bev_channels, bev_strides and bev_blocks need one entry per stage")
        h, w = self.grid
        if h % self.head_stride or w % self.head_stride:
            raise ValueError(
                f"model: the pillar grid (H, W)=({h}, {w}) must be divisible by head_stride={self.head_stride}"
            )
        strides = [math.prod(self.bev_strides[: i + 1]) for i in range(len(self.bev_strides))]
        if self.head_stride not in strides and self.head_stride != 1:
            raise ValueError(
                f"model.head_stride must be 1 or one of the stage strides {strides}, got {self.head_stride}"
            )
        for c in (
            self.image_channels,
            self.point_channels,
            *self.bev_channels,
            self.up_channels,
            self.head_channels,
        ):
            if c % self.norm_groups:
                raise ValueError(
                    f"model: every channel count must be divisible by norm_groups={self.norm_groups}, got {c}"
                )
        return self

    @property
    def grid(self) -> tuple[int, int]:
        """Pillar grid (H rows along y, W columns along x)."""
        x0, y0, _, x1, y1, _ = self.pc_range
        return round((y1 - y0) / self.pillar_size_m), round((x1 - x0) / self.pillar_size_m)

    @property
    def head_grid(self) -> tuple[int, int]:
        """Head grid (H rows along y, W columns along x)."""
        h, w = self.grid
        return h // self.head_stride, w // self.head_stride

    @property
    def head_cell_m(self) -> float:
        """Side of a head cell, metres."""
        return self.pillar_size_m * self.head_stride


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
    heatmap_weight: NonNegFloat = 1.0
    """Weight of the focal heatmap loss."""
    reg_weight: NonNegFloat = 0.25
    """Weight of the L1 regression loss (CenterPoint: 0.25)."""
    reg_code_weights: list[NonNegFloat] = Field(
        default_factory=lambda: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    )
    """Per-channel weights of the L1 terms: offset x, y; z; log l, w, h; sin, cos of yaw."""
    seed: int = 0
    """Seeds weights, data order and augmentation: same seed -> same loss curve on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train; auto = cuda when available."""
    bf16: bool = True
    """bf16 autocast on CUDA (ignored on CPU, where fp32 is faster and deterministic)."""
    compile: bool = False
    """`torch.compile` the model (first step pays ~20-60 s of compilation)."""
    loader: Literal["auto", "dali", "torch"] = "auto"
    """Batch loader (`pfactory.data.loader`), same batches either way: auto = the DALI pipeline on CUDA, its
    PyTorch reference on CPU, where DALI's reader processes compete with training for the cores (2 cores:
    DALI 16.1 samples/s, 11% data wait; PyTorch 18.0 samples/s, 6.5%)."""
    num_threads: PositiveInt = 2
    """DALI pipeline threads."""
    loader_workers: PositiveInt = 2
    """DALI reader processes (parallel `external_source`)."""
    torch_threads: Annotated[int, Field(ge=0)] = 0
    """Intra-op threads for torch on CPU (0 = leave torch's default)."""
    checkpoint_every_steps: PositiveInt = 50
    """Write `checkpoint.pt` every this many optimizer steps (and at the end)."""
    log_every_steps: PositiveInt = 5
    """Log step metrics to MLflow every this many steps."""
    val_every_epochs: Annotated[int, Field(ge=0)] = 1
    """Validate (KPIs on the val split) every this many epochs, and always after the last; 0 = only then.
    ~0.7 s per validation of 48 frames on 2 cores: per-epoch KPIs cost ~10 s of the ~3 min default run."""
    score_threshold: Annotated[float, Field(ge=0, lt=1)] = 0.05
    """Detections scoring below this are dropped before the KPIs."""
    max_steps: PositiveInt | None = None
    """Train for min(this, epochs x batches per epoch) optimizer steps; None = `epochs` passes."""
    augment: AugmentParams | None = Field(default_factory=AugmentParams)
    """Global flip/rotation/scaling applied consistently to points, boxes and camera projections
    (`pfactory.data.augment`); null disables it. Never applied at validation."""
