"""Camera path of prepare: encoded PNG/JPEG -> normalized float16 `[3, H, W]` on NVIDIA DALI.

In: encoded image bytes of (frame, camera) pairs, batched across frames, and each image's
resized size. Out: `[n, 3, H, W]` float16 (H, W = `prepare.image_size` reversed), plus the
decoded `(h, w)` of every image (checked against its header by the caller).

Per image: decode (CPU: libjpeg-turbo / libpng; GPU: nvJPEG "mixed"), resize with the aspect
kept so it fits `(W, H)` (linear, antialiased when shrinking), pad right/bottom to `(W, H)`,
normalize `(x - 255 mean) / (255 std)`, HWC -> CHW. The padding value is 0 *after*
normalization, i.e. the mean colour.

Geometry (what keeps projection exact): the resized size is `round(w s), round(h s)` with
`s = min(W / w, H / h)`, computed here and passed to DALI per sample, so the per-axis scales
`sx = w' / w`, `sy = h' / h` are known exactly (they differ from s by < 0.5 px / size). DALI maps
pixel *edges* to edges (`u' + 0.5 = sx (u + 0.5)` with pixel centres at integers, measured on a
ramp image: < 0.01 px), so the intrinsics of the resized image are `K' = S K` with
`S = [[sx, 0, (sx - 1) / 2], [0, sy, (sy - 1) / 2], [0, 0, 1]]`; padding at the right/bottom
does not move the origin. `tests/data/test_camera.py` checks this on a rendered blob.

`pil_reference` is the PIL + NumPy path doing the same work; DALI agrees with it within
1 grey level inside the image (both decoders are bit-identical; the resize filters differ at
the image border only -- numbers in docs/DATA.md).
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass

import numpy as np

# An upper bound on a batch of (frame, camera) pairs (memory: one batch is in flight). DALI's
# CPU resize runs one thread-pool task per sample (its `minibatch_size` applies to the GPU
# only), so every operator of this pipeline spreads a batch over `num_threads` threads.
_MAX_BATCH_PAIRS = 256


@dataclass(frozen=True)
class ResizeGeometry:
    """How one image is resized: its resized size (w', h') and per-axis scales sx, sy."""

    out_w: int
    out_h: int
    sx: float
    sy: float

    def intrinsics(self, K: np.ndarray) -> np.ndarray:
        """Intrinsics `K' [3, 3]` of the resized (and right/bottom padded) image."""
        S = np.array(
            [[self.sx, 0.0, (self.sx - 1.0) / 2], [0.0, self.sy, (self.sy - 1.0) / 2], [0.0, 0.0, 1.0]]
        )
        return S @ np.asarray(K, dtype=np.float64)


def resize_geometry(orig_size: tuple[int, int], target_size: tuple[int, int]) -> ResizeGeometry:
    """Fit `orig_size` (w, h) into `target_size` (W, H) keeping the aspect ratio."""
    w, h = orig_size
    W, H = target_size
    if w <= 0 or h <= 0:
        raise ValueError(f"image size must be positive, got {orig_size}")
    s = min(W / w, H / h)
    # Round half up (not Python's half-to-even), clamp to the target: the size DALI is told.
    out_w = min(W, max(1, math.floor(w * s + 0.5)))
    out_h = min(H, max(1, math.floor(h * s + 0.5)))
    return ResizeGeometry(out_w, out_h, out_w / w, out_h / h)


def cuda_device_count() -> int:
    """CUDA devices DALI can use (0 on a machine without a driver)."""
    try:
        from nvidia.dali import backend

        return int(backend.GetCUDADeviceCount())
    except Exception:  # no driver / library: a CPU-only machine
        return 0


def resolve_device(device: str) -> str:
    """`"auto"` -> `"gpu"` when CUDA is present, else `"cpu"`; `"gpu"` without CUDA is an error."""
    if device == "auto":
        return "gpu" if cuda_device_count() > 0 else "cpu"
    if device == "gpu" and cuda_device_count() == 0:
        raise RuntimeError("prepare.device = gpu, but DALI finds no CUDA device (use auto or cpu)")
    return device


class CameraBatchError(RuntimeError):
    """DALI failed on a batch (a sample it could not decode); the pipeline must be rebuilt."""


@dataclass
class CameraOutput:
    """One batch out of the camera pipeline."""

    # [n, 3, H, W] float16; resize_only: uint8 [n, h', w', 3] (a list of [h', w', 3] when the
    # sizes differ); decode_only: None (the decoded images stay inside DALI, see below)
    images: np.ndarray | list[np.ndarray] | None
    decoded_hw: np.ndarray  # [n, 2] int64: (height, width) of each decoded image


class CameraPipeline:
    """DALI decode -> resize -> pad -> normalize -> CHW float16, over batches of images.

    `submit` feeds one batch and starts it asynchronously (DALI's own `num_threads` threads, or
    the GPU); `collect` waits for it. Between the two the caller's Python thread is free (prepare
    runs the lidar path there), so the two paths overlap. One batch is in flight at a time.
    `decode_only=True` builds the decode-only pipeline (the benchmark's ceiling): it returns
    the decoded shapes only, so the ceiling is not charged for copying full-size images out
    (4.3 MB per nuScenes image) that the PIL decode-only baseline does not copy either;
    `resize_only=True` stops after the resize (the benchmark's time split by operator).
    """

    def __init__(
        self,
        image_size: tuple[int, int],
        mean: list[float],
        std: list[float],
        batch_size: int,
        num_threads: int,
        device: str = "cpu",
        decode_only: bool = False,
        resize_only: bool = False,
    ):
        self.image_size = (int(image_size[0]), int(image_size[1]))  # (W, H)
        self.mean = [255.0 * m for m in mean]
        self.std = [255.0 * s for s in std]
        self.batch_size = min(int(batch_size), _MAX_BATCH_PAIRS)
        self.num_threads = int(num_threads)
        self.device = resolve_device(device)
        self.decode_only = decode_only
        self.resize_only = resize_only and not decode_only
        self._pipe = None
        self._inflight = 0

    def _build(self):
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        W, H = self.image_size
        gpu = self.device == "gpu"
        # exec_pipelined + exec_async: `schedule_run` returns at once; depth 1 is enough since
        # one batch is in flight (deeper queues need that many batches fed before the first run).
        pipe = Pipeline(
            batch_size=self.batch_size,
            num_threads=self.num_threads,
            device_id=0 if gpu else None,
            exec_async=True,
            exec_pipelined=True,
            prefetch_queue_depth=1,
        )
        with pipe:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            size = fn.external_source(name="size", dtype=types.FLOAT, ndim=1)  # [h', w'] per sample
            img = fn.decoders.image(encoded, device="mixed" if gpu else "cpu", output_type=types.RGB)
            shape = img.shape()  # [h, w, 3]
            if self.decode_only:
                out = img
            else:
                # subpixel_scale=False: the scale is exactly size / input size per axis (see
                # the module docstring); antialias: a triangle filter when shrinking, as PIL's
                # BILINEAR does, so the PIL baseline does the same work.
                resized = fn.resize(
                    img,
                    size=size,
                    interp_type=types.INTERP_LINEAR,
                    antialias=True,
                    subpixel_scale=False,
                )
                out = (
                    resized
                    if self.resize_only
                    else fn.crop_mirror_normalize(
                        resized,
                        crop=(H, W),
                        crop_pos_x=0.0,
                        crop_pos_y=0.0,
                        out_of_bounds_policy="pad",
                        fill_values=[0.0],
                        mean=self.mean,
                        std=self.std,
                        output_layout="CHW",
                        dtype=types.FLOAT16,
                    )
                )
            if self.decode_only:
                pipe.set_outputs(shape)  # the decoder still runs: the shape depends on it
            else:
                pipe.set_outputs(out.cpu() if gpu else out, shape)
        pipe.build()
        return pipe

    @property
    def pipe(self):
        if self._pipe is None:
            self._pipe = self._build()
        return self._pipe

    def submit(self, encoded: list[bytes | np.ndarray], resized_hw: list[tuple[int, int]]) -> None:
        """Start one batch (<= batch_size images) with their resized `(h', w')` sizes."""
        if self._inflight:
            raise RuntimeError("CameraPipeline: collect() the batch in flight before submitting another")
        if not 0 < len(encoded) <= self.batch_size or len(encoded) != len(resized_hw):
            raise ValueError(f"1..{self.batch_size} images with one size each, got {len(encoded)}")
        data = [np.frombuffer(e, dtype=np.uint8) if isinstance(e, bytes | bytearray) else e for e in encoded]
        sizes = [np.array(hw, dtype=np.float32) for hw in resized_hw]
        pipe = self.pipe
        try:
            pipe.feed_input("encoded", data)
            if not self.decode_only:  # DALI prunes the unused size input of a decode-only pipe
                pipe.feed_input("size", sizes)
            pipe.schedule_run()
        except Exception as e:
            self._pipe = None
            raise CameraBatchError(str(e)) from e
        self._inflight = len(data)

    def collect(self) -> CameraOutput:
        """Wait for the batch in flight; CameraBatchError (pipeline dropped) if DALI failed."""
        if not self._inflight:
            raise RuntimeError("CameraPipeline: nothing in flight")
        self._inflight = 0
        try:
            outs = self.pipe.outputs()
            shape = outs[-1]
            images: np.ndarray | list[np.ndarray] | None = None
            if not self.decode_only:
                out = outs[0]
                if out.is_dense_tensor():
                    images = np.array(out.as_tensor())
                else:  # resize_only with mixed sizes: keep a list
                    images = [np.array(out[i]) for i in range(len(out))]
            hw = np.array(shape.as_tensor())[:, :2].astype(np.int64)  # [n, 2]
        except Exception as e:
            # DALI invalidates the pipeline after an operator error: rebuild on next use.
            self._pipe = None
            raise CameraBatchError(str(e)) from e
        return CameraOutput(images, hw)

    def run(self, encoded: list[bytes | np.ndarray], resized_hw: list[tuple[int, int]]) -> CameraOutput:
        self.submit(encoded, resized_hw)
        return self.collect()

    def run_each(
        self, encoded: list[bytes | np.ndarray], resized_hw: list[tuple[int, int]]
    ) -> list[CameraOutput | str]:
        """Run images one at a time: each result, or the DALI error message for that image.

        The slow path after a failed batch: it finds which images DALI cannot decode.
        """
        results: list[CameraOutput | str] = []
        for e, hw in zip(encoded, resized_hw):
            try:
                results.append(self.run([e], [hw]))
            except CameraBatchError as err:
                results.append(_dali_message(str(err)))
        return results


def _dali_message(text: str) -> str:
    """The informative part of a DALI error: the operator and what it "encountered"."""
    op = re.search(r"Error in \w+ operator `([^`]+)`", text)
    enc = text.split("encountered:", 1)[1].strip().splitlines()[0] if "encountered:" in text else ""
    msg = f"DALI {op.group(1) if op else 'pipeline'} failed" + (f": {enc}" if enc else "")
    return msg[:300]


def pil_reference(
    data: bytes,
    geometry: ResizeGeometry,
    image_size: tuple[int, int],
    mean: list[float],
    std: list[float],
) -> np.ndarray:
    """The PIL + NumPy path: decode, resize (BILINEAR, antialiased), pad, normalize -> `[3, H, W]` float32.

    Same work as `CameraPipeline`; the benchmark's baseline and the tests' reference.
    """
    from PIL import Image

    W, H = image_size
    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB").resize((geometry.out_w, geometry.out_h), Image.BILINEAR)
    a = np.asarray(rgb, dtype=np.float32)  # [h', w', 3]
    m = np.asarray(mean, dtype=np.float32) * 255.0
    inv = 1.0 / (np.asarray(std, dtype=np.float32) * 255.0)
    out = np.zeros((3, H, W), dtype=np.float32)
    out[:, : geometry.out_h, : geometry.out_w] = ((a - m) * inv).transpose(2, 0, 1)  # HWC -> CHW
    return out
