"""Native CPU kernels: C code (kernels/_native.c) compiled on first use and called through ctypes.

    available() -> bool                       whether the library is built and loaded (builds it once)
    status() -> str                           "native" or why not (no compiler, disabled, build error)
    group_norm_relu_forward(x, weight, bias, groups, eps, out_dtype) -> (out, mean, rstd)
    group_norm_relu_backward(grad, x, mean, rstd, weight, bias, groups) -> (dx, dweight, dbias)
    scatter_max_forward(features, cell_index, num_cells, with_winner, canvas_dtype)
        -> (canvas, winner_cell, winner_point, winner_rows)   (`pfk::pillar_scatter_max` off CUDA)
    scatter_max_backward(grad_canvas, winner_cell, winner_point, winner_rows, grad_dtype) -> grad_features
    pillar_stem_forward(features, cell_index, batch, grid, weight, out_hw, round_bf16, out_dtype)
        -> (out, saved)        the scatter-max canvas and a 3x3 stride-2 conv of it, from the occupied pillars
    pillar_stem_backward(grad, saved) -> (grad_features, grad_weight)

Why: on CPU the detector's GroupNorm + ReLU layers are memory-bound passes that eager PyTorch runs as
~10 separate ops each way (casts, statistics, the affine, ReLU, the backward's two sums and two
`addcmul`s); one C loop per pass reads bf16 directly and writes bf16 once (docs/KERNELS.md, "Native
CPU kernels"; docs/MODEL.md, "Speed").

Build: `cc -O3 -march=native -fopenmp -shared` (about a second, no PyTorch headers), into
`$PFK_NATIVE_CACHE_DIR` (the factory sets `artifacts/.state/native`), else `kernels/.native` when
writable, else the temp directory; the file name is a hash of the source, the flags, the compiler's
version and this CPU's model and flags, so a cache shared between machines never loads code built for
another CPU. Written to a temp name and renamed (atomic). `PFK_NATIVE=0` turns the kernels off; no C
compiler (or a failed build) falls back to the PyTorch ops, and `status()` says why.
OpenMP: linked against `libgomp.so.1`, which resolves to the copy PyTorch already loaded, so the
kernels share PyTorch's thread pool; they use `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

_SOURCE = Path(__file__).with_name("_native.c")
# -ffp-contract=off: `x * a + d` rounds the same way in every loop (the backward recomputes the forward's
# ReLU mask from it), whatever the vectorizer fuses
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_CHANNELS = 1024  # MAX_C in the C source
_status = "not loaded"


def _cpu_signature() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    env = os.environ.get("PFK_NATIVE_CACHE_DIR")
    if env:
        return Path(env)
    here = Path(__file__).with_name(".native")
    try:
        here.mkdir(exist_ok=True)
        if os.access(here, os.W_OK):
            return here
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pfk-native-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _build() -> Path:
    """The compiled library's path (built now if this source/compiler/CPU has no cached build)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"pfk_native_{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run(
            [cc, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if res.returncode:
            raise RuntimeError(f"{cc} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: a concurrent builder's identical file may win, either is fine
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    global _status
    if os.environ.get("PFK_NATIVE", "1") == "0":
        _status = "off (PFK_NATIVE=0)"
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _status = f"unavailable ({e}); using the PyTorch ops"
        return None
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.pfk_group_norm_relu_fwd.argtypes = [p, i32, i64, i64, p, i32, p, p, p, p, i64, i64, i64, i64,
                                            ctypes.c_float, i32]  # fmt: skip
    lib.pfk_group_norm_relu_bwd.argtypes = [p, i32, i64, i64, p, i32, p, p, p, p, p, i32, p, p, i64, i64,
                                            i64, i64, i32]  # fmt: skip
    lib.pfk_group_norm_relu_fwd.restype = lib.pfk_group_norm_relu_bwd.restype = i32
    lib.pfk_scatter_max_fwd.argtypes = [p, p, i64, i64, i64, p, i32, i32, p, p, p, p, i32]
    lib.pfk_scatter_max_fwd.restype = i64
    lib.pfk_scatter_max_bwd.argtypes = [p, i32, i64, p, p, i64, i64, i64, p, i32]
    lib.pfk_scatter_max_bwd.restype = i32
    lib.pfk_pillar_stem_fwd.argtypes = [p, p, i64, i64, i64, i64, i64, p, i64, i64, i64, i32, p, p, p, p, p,
                                        p, i32]  # fmt: skip
    lib.pfk_pillar_stem_fwd.restype = i64
    lib.pfk_pillar_stem_bwd.argtypes = [p, i32, i64, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, p, i64,
                                        i64, i64, i64, i64, i32, p, p, i32]  # fmt: skip
    lib.pfk_pillar_stem_bwd.restype = i32
    _status = "native"
    return lib


def available() -> bool:
    """True when the native library is built and loaded (the first call builds it: ~1 s)."""
    return _library() is not None


def status() -> str:
    """ "native", or why the PyTorch ops are used instead."""
    _library()
    return _status


def supports(x: Tensor, groups: int) -> bool:
    """Whether `group_norm_relu_*` take x [B, C, H, W]: CPU, float32/bfloat16, channels-last."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 4
        and x.shape[1] <= _MAX_CHANNELS
        and x.shape[1] % groups == 0
        and x.numel() > 0
        and x.is_contiguous(memory_format=torch.channels_last)
        and available()
    )


def _rows(t: Tensor) -> tuple[Tensor, int, int]:
    """t [B, C, H, W] whose channels are contiguous and pixels evenly strided (channels-last, or a channel
    slice of a wider channels-last tensor) -> (t, sample stride, pixel stride) in elements; anything else
    is first copied to channels-last."""
    c, w = t.shape[1], t.shape[3]
    sb, sc, sh, sw = t.stride()
    if not (sc == 1 and sh == w * sw and sw >= c):
        t = t.contiguous(memory_format=torch.channels_last)
        sb, sc, sh, sw = t.stride()
    return t, sb, sw


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"kernels.native.{what}: the C kernel refused its arguments (code {code})")


def group_norm_relu_forward(
    x: Tensor, weight: Tensor, bias: Tensor, groups: int, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """relu(group_norm(x.float(), groups, weight, bias, eps)) rounded once to `out_dtype`.

    x [B, C, H, W] channels-last float32/bfloat16; weight, bias [C] float32 -> (out [B, C, H, W]
    channels-last `out_dtype`, mean [B, G] float32, rstd [B, G] float32).
    """
    b, c, h, w = x.shape
    x, sb, sp = _rows(x)
    weight, bias = weight.detach().float().contiguous(), bias.detach().float().contiguous()
    out = torch.empty((b, c, h, w), dtype=out_dtype, memory_format=torch.channels_last)
    mean = torch.empty(b, groups, dtype=torch.float32)
    rstd = torch.empty(b, groups, dtype=torch.float32)
    code = _library().pfk_group_norm_relu_fwd(
        x.data_ptr(), _DTYPES[x.dtype], sb, sp, out.data_ptr(), _DTYPES[out_dtype], weight.data_ptr(),
        bias.data_ptr(), mean.data_ptr(), rstd.data_ptr(), b, h * w, c, groups, float(eps),
        torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "group_norm_relu_forward")
    return out, mean, rstd


def group_norm_relu_backward(
    grad: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor, groups: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of `group_norm_relu_forward`: grad [B, C, H, W] (any float32/bfloat16 layout whose
    channels are contiguous), x, weight and bias as the forward took them, its mean and rstd [B, G] ->
    (dx [B, C, H, W] channels-last in x's dtype, dweight [C] float32, dbias [C] float32). The ReLU's mask
    is recomputed from x (the forward's own arithmetic: the same signs), so the output is not needed."""
    b, c, h, w = x.shape
    if grad.dtype not in _DTYPES:
        grad = grad.float()
    grad, sb, sp = _rows(grad)
    x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = weight.detach().float().contiguous(), bias.detach().float().contiguous()
    dx = torch.empty((b, c, h, w), dtype=x.dtype, memory_format=torch.channels_last)
    dweight = torch.empty(c, dtype=torch.float32)
    dbias = torch.empty(c, dtype=torch.float32)
    code = _library().pfk_group_norm_relu_bwd(
        grad.data_ptr(), _DTYPES[grad.dtype], sb, sp, x.data_ptr(), _DTYPES[x.dtype], mean.data_ptr(),
        rstd.data_ptr(), weight.data_ptr(), bias.data_ptr(), dx.data_ptr(), _DTYPES[x.dtype],
        dweight.data_ptr(), dbias.data_ptr(), b, h * w, c, groups, torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "group_norm_relu_backward")
    return dx, dweight, dbias


def scatter_max_supported(features: Tensor, cell_index: Tensor) -> bool:
    """Whether `scatter_max_forward` takes these: CPU float32 features [N, C], int64 cells, N < 2**31."""
    return (
        features.device.type == "cpu"
        and features.dtype == torch.float32
        and features.dim() == 2
        and 0 < features.shape[1] <= _MAX_CHANNELS
        and features.shape[0] < 2**31
        and cell_index.dtype == torch.int64
        and available()
    )


def scatter_max_backward_supported(
    grad_canvas: Tensor, winner_point: Tensor, grad_dtype: torch.dtype
) -> bool:
    """Whether `scatter_max_backward` takes these: CPU, float32/bfloat16 in and out, C > 0."""
    return (
        grad_canvas.device.type == "cpu"
        and grad_canvas.dtype in _DTYPES
        and grad_dtype in _DTYPES
        and 0 < winner_point.shape[1] <= _MAX_CHANNELS
        and available()
    )


def scatter_max_forward(
    features: Tensor, cell_index: Tensor, num_cells: int, with_winner: bool, canvas_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`pfk::pillar_scatter_max` in one C pass (kernels/pillar_scatter.py has the contract and the spec).

    features [N, C] float32, cell_index [N] int64 (outside [0, num_cells): dropped) -> (canvas
    [num_cells, C] canvas_dtype, winner_cell [N] int64, winner_point [N, C] int32, winner_rows [1] int64):
    the same values, bit for bit, as `_pillar_scatter_max_compact`.
    """
    n, c = features.shape
    features = features.detach().contiguous()
    cell_index = cell_index.contiguous()
    canvas = torch.empty(num_cells, c, dtype=canvas_dtype)
    rows = n if with_winner else 0
    winner_cell = torch.empty(rows, dtype=torch.int64)
    winner_point = torch.empty(rows, c, dtype=torch.int32)
    rank = torch.empty(num_cells, dtype=torch.int32)
    seg = torch.empty(min(n, num_cells), c, dtype=torch.float32)  # [M <= min(N, cells), C] scratch
    m = _library().pfk_scatter_max_fwd(
        features.data_ptr(), cell_index.data_ptr(), n, c, num_cells, canvas.data_ptr(), _DTYPES[canvas_dtype],
        int(with_winner), winner_cell.data_ptr(), winner_point.data_ptr(), rank.data_ptr(), seg.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if m < 0:
        raise RuntimeError("kernels.native.scatter_max_forward: the C kernel refused its arguments")
    return canvas, winner_cell, winner_point, torch.full((1,), m if with_winner else 0, dtype=torch.int64)


def scatter_max_backward(
    grad_canvas: Tensor,
    winner_cell: Tensor,
    winner_point: Tensor,
    winner_rows: Tensor,
    grad_dtype: torch.dtype,
) -> Tensor:
    """grad_features [N, C] grad_dtype: row m < M of the winner table sends grad_canvas[winner_cell[m], c]
    to point winner_point[m, c], every other element is 0 (`_pillar_scatter_max_backward_compact`)."""
    n, c = winner_point.shape
    if grad_canvas.stride(1) != 1:
        grad_canvas = grad_canvas.contiguous()
    grad = torch.empty(n, c, dtype=grad_dtype)
    code = _library().pfk_scatter_max_bwd(
        grad_canvas.data_ptr(), _DTYPES[grad_canvas.dtype], grad_canvas.stride(0), winner_cell.data_ptr(),
        winner_point.data_ptr(), int(winner_rows[0]), n, c, grad.data_ptr(), _DTYPES[grad_dtype],
    )  # fmt: skip
    _check(code, "scatter_max_backward")
    return grad


def pillar_stem_forward(
    features: Tensor,
    cell_index: Tensor,
    batch: int,
    grid: tuple[int, int],
    weight: Tensor,
    out_hw: tuple[int, int],
    round_bf16: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, dict]:
    """conv2d(scatter_max canvas, weight, stride 2, padding 1) computed from the occupied pillars only.

    features [N, C] float32 (the pillar MLP's output), cell_index [N] int64 (`b*H*W + row*W + col`;
    outside [0, B*H*W): dropped), grid (H, W), weight [Cout, C, 3, 3] (the stem conv's, no bias), out_hw
    (Ho, Wo): the dense conv's output size (of the canvas padded at the bottom/right, if it is). With
    `round_bf16` the canvas maxima and the weight are rounded to bfloat16 values first (what the dense
    conv under bf16 autocast multiplies); the sums are float32 and the output is rounded once to
    `out_dtype`. -> (out [B, Cout, Ho, Wo] channels-last, saved: what `pillar_stem_backward` needs).
    """
    n, c = features.shape
    cout = weight.shape[0]
    cp, cq = -(-cout // 16) * 16, -(-c // 16) * 16  # padded to whole 16-float register blocks
    h, w = grid
    ho, wo = out_hw
    features = features.detach().contiguous()
    cell_index = cell_index.contiguous()
    wq = weight.detach().to(torch.bfloat16).float() if round_bf16 else weight.detach().float()
    wt = F.pad(wq.permute(2, 3, 1, 0), (0, cp - cout)).contiguous()  # [3, 3, C, Cp]
    wtt = F.pad(wq.permute(2, 3, 0, 1), (0, cq - c)).contiguous()  # [3, 3, Cout, Cq]
    rows = min(n, batch * h * w)
    seg = torch.empty(rows, c, dtype=torch.float32)
    occupied = torch.empty(rows, dtype=torch.int64)
    win = torch.empty(rows, c, dtype=torch.int32)
    rank = torch.empty(batch * h * w, dtype=torch.int32)
    first = torch.empty(batch + 1, dtype=torch.int64)
    acc = torch.zeros(batch, ho, wo, cp, dtype=torch.float32)
    m = _library().pfk_pillar_stem_fwd(
        features.data_ptr(), cell_index.data_ptr(), n, c, batch, h, w, wt.data_ptr(), cp, ho, wo,
        int(round_bf16), acc.data_ptr(), seg.data_ptr(), occupied.data_ptr(), win.data_ptr(), rank.data_ptr(),
        first.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if m < 0:
        raise RuntimeError("kernels.native.pillar_stem_forward: the C kernel refused its arguments")
    out = acc[..., :cout].to(out_dtype).contiguous().permute(0, 3, 1, 2)  # [B, Cout, Ho, Wo], channels-last
    saved = {"seg": seg, "occupied": occupied, "win": win, "first": first, "m": int(m), "n": n, "batch": batch,
             "grid": (h, w), "wtt": wtt, "cp": cp, "out_hw": (ho, wo), "round_bf16": round_bf16}  # fmt: skip
    return out, saved


def pillar_stem_backward(grad: Tensor, saved: dict) -> tuple[Tensor, Tensor]:
    """The gradients of `pillar_stem_forward`: grad [B, Cout, Ho, Wo] (float32/bfloat16, channels
    contiguous) -> (grad_features [N, C] float32: the canvas gradient at each pillar's winners, rounded
    to bfloat16 values with `round_bf16` as a bf16 canvas' gradient is; grad_weight [Cout, C, 3, 3])."""
    if grad.dtype not in _DTYPES:
        grad = grad.float()
    grad, sb, sp = _rows(grad)
    seg, wtt, cp = saved["seg"], saved["wtt"], saved["cp"]
    n, c = saved["n"], seg.shape[1]
    h, w = saved["grid"]
    ho, wo = saved["out_hw"]
    cout, cq = wtt.shape[2], wtt.shape[3]
    batch = saved["batch"]
    grad_features = torch.empty(n, c, dtype=torch.float32)
    dwt = torch.zeros(batch, 3, 3, c, cp, dtype=torch.float32)  # per-sample partials
    code = _library().pfk_pillar_stem_bwd(
        grad.data_ptr(), _DTYPES[grad.dtype], sb, sp, seg.data_ptr(), saved["occupied"].data_ptr(),
        saved["win"].data_ptr(), saved["first"].data_ptr(), saved["m"], n, c, batch, h, w,
        wtt.data_ptr(), cout, cp, cq, ho, wo, int(saved["round_bf16"]), grad_features.data_ptr(), dwt.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    _check(code, "pillar_stem_backward")
    dw = functools.reduce(torch.add, dwt.unbind(0))  # in sample order: deterministic
    return grad_features, dw[..., :cout].permute(3, 2, 0, 1).contiguous()
