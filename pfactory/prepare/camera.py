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
does not move the origin. `tests/prepare/test_camera.py` checks this on a rendered blob.

`pil_reference` is the PIL + NumPy path doing the same work; DALI agrees with it within
1 grey level inside the image (both decoders are bit-identical; the resize filters differ at
the image border only -- numbers in docs/DATA.md).

Decoders (`open_camera`, `decoder_name`): DALI on the GPU ("dali-gpu": `device` auto on a CUDA machine,
once DALI's GPU decode has verified itself against its CPU pipeline on this machine, `check_gpu_decode`),
DALI on the CPU ("dali-cpu"), and where DALI is not installed (macOS, Linux on ARM: pyproject.toml installs
it on Linux x86_64 only) `PillowCamera` ("pillow"): `pil_reference` in a thread pool, the same interface
and output format, within the tolerance above of DALI's pixels (tests/prepare/test_camera_decoders.py).
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


def dali_available() -> bool:
    """Whether NVIDIA DALI imports here (it is installed on Linux x86_64 only)."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def cuda_device_count() -> int:
    """CUDA devices DALI can use (0 on a machine without a driver, or without DALI)."""
    try:
        from nvidia.dali import backend

        return int(backend.GetCUDADeviceCount())
    except Exception:  # no driver / library: a CPU-only machine
        return 0


GPU_DECODE = "dali.gpu_decode"  # the self-check of DALI's GPU decode (kernels/selfcheck.py)


def resolve_device(device: str) -> str:
    """`"auto"` -> `"gpu"` when CUDA is present and DALI's GPU decode has verified itself here (a failed
    check: one warning line, then `"cpu"`), else `"cpu"`; `"gpu"` without CUDA is an error."""
    if device == "auto":
        return "gpu" if cuda_device_count() > 0 and _gpu_decode_trusted() else "cpu"
    if device == "gpu" and cuda_device_count() == 0:
        why = "DALI finds no CUDA device" if dali_available() else "NVIDIA DALI is not installed here"
        raise RuntimeError(f"prepare.device = gpu, but {why} (use auto or cpu)")
    return device


def decoder_name(device: str) -> str:
    """The camera decoder prepare uses for `prepare.device`: "dali-gpu", "dali-cpu" or "pillow"."""
    if not dali_available():
        resolve_device(device)  # "gpu" without DALI is refused
        return "pillow"
    return f"dali-{resolve_device(device)}"


def _gpu_decode_trusted() -> bool:
    from kernels import selfcheck  # imports torch: only on a machine with a CUDA device

    register_selfcheck()
    return selfcheck.trusted(GPU_DECODE, "cuda:0")


def register_selfcheck() -> None:
    """Register DALI's GPU decode with the self-checks (`factory doctor` calls it; so does the first use)."""
    from kernels import selfcheck

    if GPU_DECODE not in selfcheck.checks():
        selfcheck.register(
            selfcheck.Check(
                GPU_DECODE,
                check_gpu_decode,
                lambda: selfcheck.sources_hash([__file__], _dali_version()),
                ("cuda",),
                "DALI mixed (nvJPEG) decode + resize vs DALI's CPU pipeline, PNG and JPEG",
            )
        )


def _dali_version() -> str:
    import importlib.metadata

    for dist in ("nvidia-dali-cuda120", "nvidia-dali-cuda130", "nvidia-dali-cuda110"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def check_gpu_decode(device: object) -> dict[str, float]:
    """DALI's GPU pipeline vs its CPU pipeline on a 97 x 61 PNG and JPEG (a gradient with noise) resized to
    64 x 48: max |difference| in grey levels <= 4 (nvJPEG and libjpeg-turbo may round the IDCT
    differently; the PNG decode is exact, the resize filters agree within ~1 level)."""
    from kernels import selfcheck

    if not dali_available():
        raise selfcheck.Skip("NVIDIA DALI is not installed")
    if cuda_device_count() == 0:
        raise selfcheck.Skip("DALI finds no CUDA device")
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:61, 0:97]
    rgb = np.stack([xx * 2.5, yy * 4.0, (xx + yy) * 1.5], -1) + rng.normal(0, 12, (61, 97, 3))
    im = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))
    encoded = {}
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        im.save(buf, format=fmt, quality=90) if fmt == "JPEG" else im.save(buf, format=fmt)
        encoded[fmt] = buf.getvalue()
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    size = resize_geometry((97, 61), (64, 48))
    hw = [(size.out_h, size.out_w)] * 2
    out = {
        dev: CameraPipeline((64, 48), mean, std, 2, 1, dev).run(list(encoded.values()), hw).images
        for dev in ("cpu", "gpu")
    }
    scale = (255.0 * np.asarray(std, dtype=np.float32))[None, :, None, None]
    levels = np.abs(out["gpu"].astype(np.float32) - out["cpu"].astype(np.float32)) * scale  # [2, 3, H, W]
    figures: dict[str, float] = {}
    for i, fmt in enumerate(encoded):
        selfcheck.compare(figures, f"{fmt.lower()} grey levels", levels[i], np.zeros_like(levels[i]), 4.0)
    return figures


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
        self.decoder = f"dali-{self.device}"
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


class PillowCamera:
    """`CameraPipeline`'s interface and output on Pillow (`pil_reference` per image, `num_threads` threads:
    Pillow's decode and resize release the GIL), where DALI is not installed. `submit` runs the batch in
    the pool; `collect` waits for it. An image Pillow cannot decode fails its batch (CameraBatchError), so
    prepare's image-by-image retry (`run_each`) names it, as it does with DALI."""

    decoder = "pillow"

    def __init__(
        self,
        image_size: tuple[int, int],
        mean: list[float],
        std: list[float],
        batch_size: int,
        num_threads: int,
        device: str = "cpu",
    ):
        from concurrent.futures import ThreadPoolExecutor

        resolve_device(device)  # "gpu" without DALI: refused in one line
        self.image_size = (int(image_size[0]), int(image_size[1]))  # (W, H)
        self.mean, self.std = list(mean), list(std)
        self.batch_size = min(int(batch_size), _MAX_BATCH_PAIRS)
        self.device = "cpu"
        self._pool = ThreadPoolExecutor(max(1, int(num_threads)), thread_name_prefix="prepare-pillow")
        self._inflight: list | None = None

    def _one(self, data: bytes | np.ndarray, hw: tuple[int, int]) -> tuple[np.ndarray, tuple[int, int]]:
        from PIL import Image

        raw = bytes(data) if isinstance(data, np.ndarray) else data
        with Image.open(io.BytesIO(raw)) as im:
            decoded = (im.height, im.width)
        w, h = decoded[1], decoded[0]
        geometry = ResizeGeometry(int(hw[1]), int(hw[0]), int(hw[1]) / w, int(hw[0]) / h)
        out = pil_reference(raw, geometry, self.image_size, self.mean, self.std)
        return out.astype(np.float16), decoded

    def submit(self, encoded: list[bytes | np.ndarray], resized_hw: list[tuple[int, int]]) -> None:
        """Start one batch (<= batch_size images) with their resized `(h', w')` sizes."""
        if self._inflight is not None:
            raise RuntimeError("PillowCamera: collect() the batch in flight before submitting another")
        if not 0 < len(encoded) <= self.batch_size or len(encoded) != len(resized_hw):
            raise ValueError(f"1..{self.batch_size} images with one size each, got {len(encoded)}")
        self._inflight = [self._pool.submit(self._one, e, hw) for e, hw in zip(encoded, resized_hw)]

    def collect(self) -> CameraOutput:
        """Wait for the batch in flight; CameraBatchError if Pillow could not decode an image of it."""
        if self._inflight is None:
            raise RuntimeError("PillowCamera: nothing in flight")
        futures, self._inflight = self._inflight, None
        try:
            results = [f.result() for f in futures]
        except Exception as e:  # PIL.UnidentifiedImageError, OSError (truncated), ValueError, ...
            raise CameraBatchError(f"Pillow decode failed: {type(e).__name__}: {e}") from e
        images = np.stack([r[0] for r in results])
        return CameraOutput(images, np.array([r[1] for r in results], dtype=np.int64))

    def run(self, encoded: list[bytes | np.ndarray], resized_hw: list[tuple[int, int]]) -> CameraOutput:
        self.submit(encoded, resized_hw)
        return self.collect()

    def run_each(
        self, encoded: list[bytes | np.ndarray], resized_hw: list[tuple[int, int]]
    ) -> list[CameraOutput | str]:
        """Run images one at a time: each result, or the decoder's error message for that image."""
        results: list[CameraOutput | str] = []
        for e, hw in zip(encoded, resized_hw):
            try:
                results.append(self.run([e], [hw]))
            except CameraBatchError as err:
                results.append(str(err)[:300])
        return results


_ANNOUNCED: set[str] = set()


def open_camera(
    image_size: tuple[int, int],
    mean: list[float],
    std: list[float],
    batch_size: int,
    num_threads: int,
    device: str,
) -> CameraPipeline | PillowCamera:
    """prepare's camera pipeline: DALI's (`device` resolved: `resolve_device`), or Pillow's where DALI is not
    installed. The first one of a process says which decoder it is, in one line on stderr."""
    import sys

    if dali_available():
        camera: CameraPipeline | PillowCamera = CameraPipeline(
            image_size, mean, std, batch_size, num_threads, device
        )
        name = f"dali-{camera.device}"
        why = "NVIDIA DALI"
    else:
        camera = PillowCamera(image_size, mean, std, batch_size, num_threads, device)
        name, why = "pillow", "NVIDIA DALI is not installed here; its pixels vs DALI: docs/GPU.md"
    if not _ANNOUNCED:
        _ANNOUNCED.add(name)
        print(f"prepare: camera decoder {name} ({why})", file=sys.stderr, flush=True)
    return camera


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
