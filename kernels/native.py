"""Native CPU kernels: C code (kernels/_native.c) compiled on first use, called through a typed binding.

    available() -> bool                       whether the library is built and loaded (builds it once)
    status() -> str                           "native" or why not (no compiler, disabled, build error)
    group_norm_relu_forward(x, weight, bias, groups, eps, out_dtype) -> (out, mean, rstd)
    group_norm_relu_backward(grad, x, mean, rstd, weight, bias, groups) -> (dx, dweight, dbias)
    scatter_max_forward(features, cell_index, num_cells, with_winner, canvas_dtype)
        -> (canvas, winner_cell, winner_point, winner_rows)   (`pfk::pillar_scatter_max` off CUDA)
    scatter_max_backward(grad_canvas, winner_cell, winner_point, winner_rows, grad_dtype) -> grad_features
    pillar_stem_forward(features, cell_index, weight, batch, grid, out_hw, round_bf16, out_dtype)
        -> (out, seg, occupied, win, first, rows)   the scatter-max canvas' 3x3 stride-2 conv, sparse
    pillar_stem_backward(grad, weight, seg, occupied, win, first, rows, grid, round_bf16)
        -> (grad_features, grad_weight)
    stem_operand(t, round_bf16) -> float32 t   rounded to bf16 values first with round_bf16 (both stem paths)

These are the C implementations behind the `pfk::*` custom ops (kernels/group_norm_relu.py,
kernels/pillar_scatter.py, kernels/pillar_stem.py), which own the contracts, the PyTorch references and
the autograd; call those, not these.

Why C: on CPU the detector's GroupNorm + ReLU layers are memory-bound passes that eager PyTorch runs as
~10 separate ops each way (casts, statistics, the affine, ReLU, the backward's two sums and two
`addcmul`s); one C loop per pass reads bf16 directly and writes bf16 once (docs/KERNELS.md, "Native
CPU kernels"; docs/MODEL.md, "Speed").

Binding: the `pfk_*` prototypes in kernels/_native.c are the one declaration of each kernel.
`NativeLibrary` parses them, sets ctypes' argtypes from them, checks that the built library exports each
one, and `call(name, **arguments)` takes every argument by its C parameter name and checks it against
its C type before the call: a pointer takes a CPU tensor of the pointee's dtype (`void *` buffers:
float32 or bfloat16, whose `NAME_dt` code the binding fills in), an integer an int in range, a float a
float; a missing, extra or mistyped argument is a `TypeError` naming it, never a wrong pointer. So a C
signature that gains, loses, renames or retypes a parameter without the Python call following fails
loudly (tests/kernels/test_native.py builds such a library). Why not a C++ extension
(`torch.utils.cpp_extension`): it compiles PyTorch's headers (~1 min per build on 2 cores, a C++
toolchain and Python headers), where this plain C file builds in ~1 s; the custom ops around it give
Dynamo, Inductor and autograd what a C++ extension's registration would.

Build: `cc -O3 -march=native -fopenmp -shared` (about a second, no PyTorch headers), into
`$PFK_NATIVE_CACHE_DIR` (the factory sets `artifacts/.state/native`) alone when it is set, else the
checkout's `artifacts/.state/native`, else the user's cache folder (`~/.cache/pfactory/native`), else
`<temp>/pfk-native-<uid>`; a folder is used only if this user owns it and no one else can write to it
(created 0700; `kernels.selfcheck.private_dir`): a predictable folder in /tmp that another account made
is refused, in one line, never loaded from. The file name is a hash of the source, the flags, the
compiler's version and this CPU's model and flags, so a cache shared between machines never loads code
built for another CPU; a library file that is not this user's, or that others can write, is refused too.
Written to a temp name and renamed (atomic). `PFK_NATIVE=0` turns the kernels off; no C compiler, no
private cache folder (or a failed build) falls back to the PyTorch ops, and `status()` says why. Each
kernel is trusted only once its self-check has verified it on this machine (kernels/selfcheck.py; the
checks live with the ops: "native.pillar_scatter_max", "native.group_norm_relu", "native.pillar_stem").
OpenMP: linked against `libgomp.so.1`, which resolves to the copy PyTorch already loaded, so the
kernels share PyTorch's thread pool; they use `torch.get_num_threads()` threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import selfcheck

_SOURCE = Path(__file__).with_name("_native.c")
# -ffp-contract=off: `x * a + d` rounds the same way in every loop (the backward recomputes the forward's
# ReLU mask from it), whatever the vectorizer fuses
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C side's dtype codes (`int NAME_dt`)
_MAX_CHANNELS = 1024  # MAX_C in the C source
_status = "not loaded"


# --------------------------------------------------------------------------------------------------
# the typed binding: the C prototypes are the declarations
# --------------------------------------------------------------------------------------------------
# An exported kernel's definition: `int|int64_t pfk_name(params) {` (params may span lines).
_PROTOTYPE = re.compile(r"^(int|int64_t)\s+(pfk_\w+)\s*\(([^)]*)\)\s*\{", re.MULTILINE)
_DEFINITION = re.compile(
    r"^\w[\w\s\*]*\b(pfk_\w+)\s*\(", re.MULTILINE
)  # every pfk_ definition, parsed or not
_PARAM = re.compile(r"^(const\s+)?(void|float|int|int32_t|int64_t)\s*(\*?)\s*(?:restrict\s+)?(\w+)$")
_SCALARS = {"int": (ctypes.c_int, 31), "int64_t": (ctypes.c_int64, 63)}  # ctype, bits of magnitude
_POINTEES = {
    "float": (torch.float32,),
    "int32_t": (torch.int32,),
    "int64_t": (torch.int64,),
    "void": tuple(_DTYPES),  # a float32 or bfloat16 buffer; its `NAME_dt` says which
}
_RESTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64}


@dataclass(frozen=True)
class CParam:
    """One C parameter: its name, its C spelling, and what the binding accepts for it."""

    name: str
    decl: str  # e.g. "const float *mean"
    kind: str  # "tensor", "int", "float", "dtype code" (filled from a tensor) or "threads" (filled)
    ctype: type
    dtypes: tuple[torch.dtype, ...] = ()  # a tensor's allowed dtypes
    bits: int = 0  # an integer's magnitude bits


@dataclass(frozen=True)
class CKernel:
    """One exported kernel: name, return ctype and parameters, in C order."""

    name: str
    restype: type
    params: tuple[CParam, ...]

    def prototype(self) -> str:
        return f"{self.name}({', '.join(p.decl for p in self.params)})"


def parse_prototypes(source: str) -> dict[str, CKernel]:
    """The `pfk_*` kernels defined in C `source` -> {name: CKernel}. Raises ValueError on a definition or
    a parameter type the binding cannot check (so an unparsed kernel can never be called unchecked)."""
    kernels: dict[str, CKernel] = {}
    for ret, name, params in _PROTOTYPE.findall(source):
        parsed: list[CParam] = []
        buffers: set[str] = set()
        for raw in params.split(","):
            decl = " ".join(raw.split())
            m = _PARAM.match(decl)
            if not m:
                raise ValueError(
                    f"kernels/_native.c: {name}: parameter {decl!r} has a type the binding can't check"
                )
            _const, base, star, pname = m.groups()
            if star:
                parsed.append(CParam(pname, decl, "tensor", ctypes.c_void_p, dtypes=_POINTEES[base]))
                if base == "void":
                    buffers.add(pname)
            elif base == "float":
                parsed.append(CParam(pname, decl, "float", ctypes.c_float))
            elif base in _SCALARS:
                kind = "int"
                if base == "int" and pname.endswith("_dt") and pname[:-3] in buffers:
                    kind = "dtype code"
                elif base == "int" and pname == "nthreads":
                    kind = "threads"
                ctype, bits = _SCALARS[base]
                parsed.append(CParam(pname, decl, kind, ctype, bits=bits))
            else:
                raise ValueError(
                    f"kernels/_native.c: {name}: parameter {decl!r} has a type the binding can't check"
                )
        missing = buffers - {p.name[:-3] for p in parsed if p.kind == "dtype code"}
        if missing:
            raise ValueError(
                f"kernels/_native.c: {name}: void* buffer(s) {sorted(missing)} have no `int NAME_dt`"
            )
        kernels[name] = CKernel(name, _RESTYPES[ret], tuple(parsed))
    defined = set(_DEFINITION.findall(source))
    if defined != set(kernels):
        raise ValueError(
            f"kernels/_native.c: definitions the binding could not parse: {sorted(defined - set(kernels))}"
        )
    return kernels


class NativeLibrary:
    """A built kernel library and its parsed declarations: `call(name, **arguments)` checks, then calls."""

    def __init__(self, path: Path, kernels: dict[str, CKernel]) -> None:
        self.path = path
        self.kernels = kernels
        cdll = ctypes.CDLL(str(path))
        self._functions = {}
        for name, k in kernels.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError as e:
                raise RuntimeError(f"{path}: declared in the source but not exported: {name}") from e
            fn.argtypes = [p.ctype for p in k.params]
            fn.restype = k.restype
            self._functions[name] = fn

    def call(self, name: str, **arguments: object) -> int:
        """Call kernel `name` with every parameter by its C name (but `NAME_dt` and `nthreads`, filled in).

        A tensor goes to a pointer parameter (CPU, the pointee's dtype; its `data_ptr()` is passed), an
        int to an integer one, a float to a float one. Returns the C return value. Raises TypeError (a
        missing, unexpected or mistyped argument) before anything reaches C."""
        k = self.kernels[name]
        values: list[object] = []
        codes: dict[str, int] = {}
        for p in k.params:
            if p.kind == "dtype code":
                values.append(codes[p.name[:-3]])
                if p.name in arguments:
                    raise TypeError(f"{name}: {p.name} is filled in from the tensor's dtype; don't pass it")
                continue
            if p.kind == "threads":
                values.append(torch.get_num_threads())
                continue
            if p.name not in arguments:
                raise TypeError(f"{name}: missing argument for `{p.decl}` (C prototype: {k.prototype()})")
            v = arguments[p.name]
            if p.kind == "tensor":
                if not isinstance(v, Tensor) or v.device.type != "cpu" or v.dtype not in p.dtypes:
                    got = f"{v.dtype} on {v.device}" if isinstance(v, Tensor) else type(v).__name__
                    want = "/".join(str(d).removeprefix("torch.") for d in p.dtypes)
                    raise TypeError(f"{name}: `{p.decl}` takes a CPU {want} tensor, got {got}")
                if p.dtypes is _POINTEES["void"]:
                    codes[p.name] = _DTYPES[v.dtype]
                values.append(v.data_ptr())
            elif p.kind == "int":
                if not isinstance(v, int) or not -(2**p.bits) <= v < 2**p.bits:
                    raise TypeError(f"{name}: `{p.decl}` takes an int in range, got {v!r}")
                values.append(int(v))
            else:  # float
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise TypeError(f"{name}: `{p.decl}` takes a float, got {v!r}")
                values.append(float(v))
        if len(arguments) != len(values) - len(codes) - sum(p.kind == "threads" for p in k.params):
            extra = sorted(set(arguments) - {p.name for p in k.params})
            raise TypeError(f"{name}: unexpected argument(s) {extra} (C prototype: {k.prototype()})")
        return self._functions[name](*values)


def _cpu_signature() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    """The build cache: the first private candidate folder (module docstring); RuntimeError if none."""
    candidates = selfcheck.cache_candidates("native", "PFK_NATIVE_CACHE_DIR")
    found = selfcheck.private_dir(candidates, "C kernel build cache")
    if found is None:
        raise RuntimeError(
            "no private build cache: none of "
            + ", ".join(str(c) for c in candidates)
            + " is a folder of yours that others cannot write (set PFK_NATIVE_CACHE_DIR to one)"
        )
    return found


def _check_library_file(lib: Path) -> None:
    """Refuse to load a built library that another user owns or that others can write (RuntimeError)."""
    st = os.stat(lib)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"refusing {lib}: owned by uid {st.st_uid} (you: {uid}), mode {stat.S_IMODE(st.st_mode):o}; "
            "a library others can replace is never loaded"
        )


def build(source: Path = _SOURCE, out_dir: Path | None = None) -> NativeLibrary:
    """Compile `source` (cached by source, flags, compiler and CPU) and bind its `pfk_*` kernels.

    `out_dir` (default: the private cache folder, `_cache_dir`) must be this user's and not writable by
    others. Raises RuntimeError (no compiler, a failed build, a declared kernel not exported, a cache folder
    or library file refused) or ValueError (a prototype the binding cannot check)."""
    text = source.read_text()
    kernels = parse_prototypes(text)  # first: a source the binding can't check is never built or loaded
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    fingerprint = "\0".join([text, " ".join(_FLAGS), version, _cpu_signature()])
    key = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    if out_dir is None:
        out_dir = _cache_dir()
    elif selfcheck.private_dir([out_dir], "C kernel build cache") is None:
        raise RuntimeError(
            f"refusing the build cache {out_dir}: {selfcheck.folder_problem(out_dir) or 'it cannot be created'}"
        )
    lib = out_dir / f"pfk_native_{key}.so"
    if not lib.exists():
        fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=out_dir)
        os.close(fd)
        try:
            res = subprocess.run(
                [cc, *_FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=300
            )
            if res.returncode:
                raise RuntimeError(f"{cc} failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
            os.chmod(tmp, 0o700)
            os.replace(tmp, lib)  # atomic: a concurrent builder's identical file may win, either is fine
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    _check_library_file(lib)
    return NativeLibrary(lib, kernels)


@functools.cache
def _library() -> NativeLibrary | None:
    global _status
    if os.environ.get("PFK_NATIVE", "1") == "0":
        _status = "off (PFK_NATIVE=0)"
        return None
    try:
        lib = build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _status = f"unavailable ({e}); using the PyTorch ops"
        return None
    _status = "native"
    return lib


def available() -> bool:
    """True when the native library is built and loaded (the first call builds it: ~1 s)."""
    return _library() is not None


def build_id() -> str:
    """The loaded library's file name (a hash of the source, flags, compiler and CPU: what a native path's
    self-check fingerprints), or "not built" and why."""
    lib = _library()
    return lib.path.name if lib is not None else f"not built: {_status}"


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
    """t [B, C, H, W] as a C kernel's `void *` rows -> (t, sample stride, pixel stride) in elements.

    t float32/bfloat16 (any other dtype is first cast to float32) whose channels are contiguous and pixels
    evenly strided (channels-last, or a channel slice of a wider channels-last tensor) is passed as it is;
    any other layout is first copied to channels-last."""
    if t.dtype not in _DTYPES:
        t = t.float()
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

    x [B, C, H, W] channels-last float32/bfloat16 (`supports`); weight, bias [C] float32 -> (out
    [B, C, H, W] channels-last `out_dtype`, mean [B, G] float32, rstd [B, G] float32).
    """
    b, c, h, w = x.shape
    x, sb, sp = _rows(x)
    out = torch.empty((b, c, h, w), dtype=out_dtype, memory_format=torch.channels_last)
    mean = torch.empty(b, groups, dtype=torch.float32)
    rstd = torch.empty(b, groups, dtype=torch.float32)
    code = _library().call(
        "pfk_group_norm_relu_fwd", x=x, xsb=sb, xsp=sp, out=out, weight=weight.detach().float().contiguous(),
        bias=bias.detach().float().contiguous(), mean=mean, rstd=rstd, B=b, HW=h * w, C=c, G=groups, eps=eps,
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
    grad, sb, sp = _rows(grad)
    x = x.contiguous(memory_format=torch.channels_last)
    dx = torch.empty((b, c, h, w), dtype=x.dtype, memory_format=torch.channels_last)
    dweight = torch.empty(c, dtype=torch.float32)
    dbias = torch.empty(c, dtype=torch.float32)
    code = _library().call(
        "pfk_group_norm_relu_bwd", grad=grad, gsb=sb, gsp=sp, x=x, mean=mean.contiguous(),
        rstd=rstd.contiguous(), weight=weight.detach().float().contiguous(),
        bias=bias.detach().float().contiguous(), dx=dx, dweight=dweight, dbias=dbias, B=b, HW=h * w, C=c, G=groups,
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
    canvas = torch.empty(num_cells, c, dtype=canvas_dtype)
    rows = n if with_winner else 0
    winner_cell = torch.empty(rows, dtype=torch.int64)
    winner_point = torch.empty(rows, c, dtype=torch.int32)
    m = _library().call(
        "pfk_scatter_max_fwd", feat=features.detach().contiguous(), cell=cell_index.contiguous(), N=n, C=c,
        num_cells=num_cells, canvas=canvas, with_winner=int(with_winner), winner_cell=winner_cell,
        winner_point=winner_point, rank=torch.empty(num_cells, dtype=torch.int32),
        seg=torch.empty(min(n, num_cells), c, dtype=torch.float32),  # [M <= min(N, cells), C] scratch
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
    code = _library().call(
        "pfk_scatter_max_bwd", grad_canvas=grad_canvas, row_stride=grad_canvas.stride(0),
        winner_cell=winner_cell.contiguous(), winner_point=winner_point.contiguous(), M=int(winner_rows[0]), N=n,
        C=c, grad_features=grad,
    )  # fmt: skip
    _check(code, "scatter_max_backward")
    return grad


def pillar_stem_supported(features: Tensor, cell_index: Tensor, weight: Tensor) -> bool:
    """Whether `pillar_stem_forward` takes these: CPU float32 features [N, C], int64 cells, a float
    [Cout, C, 3, 3] weight, C and Cout <= 1024, and the library loaded."""
    return (
        scatter_max_supported(features, cell_index)
        and weight.dim() == 4
        and tuple(weight.shape[1:]) == (features.shape[1], 3, 3)
        and weight.shape[0] <= _MAX_CHANNELS
        and weight.device.type == "cpu"
    )


def stem_operand(t: Tensor, round_bf16: bool) -> Tensor:
    """t (any float dtype and shape) -> float32, its values first rounded to bfloat16 with `round_bf16`:
    what the stem's dense conv under bf16 autocast multiplies. The one rounding rule of both stem paths (the
    C kernels' weight here, the PyTorch path's canvas and weight in kernels/pillar_stem.py)."""
    return t.to(torch.bfloat16).float() if round_bf16 else t.float()


def _stem_weights(weight: Tensor, round_bf16: bool) -> tuple[Tensor, Tensor, int, int]:
    """weight [Cout, C, 3, 3] -> (wt [3, 3, C, Cp], wtt [3, 3, Cout, Cq], Cp, Cq): the kernels' layouts,
    output / input channels padded to whole 16-float register blocks (rounded to bf16 values first with
    `round_bf16`: what the dense bf16 conv multiplies)."""
    cout, c = weight.shape[:2]
    cp, cq = -(-cout // 16) * 16, -(-c // 16) * 16
    wq = stem_operand(weight.detach(), round_bf16)
    wt = F.pad(wq.permute(2, 3, 1, 0), (0, cp - cout)).contiguous()  # [3, 3, C, Cp]
    wtt = F.pad(wq.permute(2, 3, 0, 1), (0, cq - c)).contiguous()  # [3, 3, Cout, Cq]
    return wt, wtt, cp, cq


def pillar_stem_forward(
    features: Tensor,
    cell_index: Tensor,
    weight: Tensor,
    batch: int,
    grid: tuple[int, int],
    out_hw: tuple[int, int],
    round_bf16: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """conv2d(scatter_max canvas, weight, stride 2, padding 1) computed from the occupied pillars only.

    features [N, C] float32 (the pillar MLP's output), cell_index [N] int64 (`b*H*W + row*W + col`;
    outside [0, B*H*W): dropped), weight [Cout, C, 3, 3] (the stem conv's, no bias), grid (H, W), out_hw
    (Ho, Wo): the dense conv's output size (of the canvas padded at the bottom/right, if it is). With
    `round_bf16` the canvas maxima and the weight are rounded to bfloat16 values first (what the dense
    conv under bf16 autocast multiplies); the sums are float32 and the output is rounded once to
    `out_dtype`. -> (out [B, Cout, Ho, Wo] channels-last, and what `pillar_stem_backward` needs: seg
    [N, C] float32 (rows 0..M-1: the occupied pillars' maxima; the rest unwritten), occupied [N] int64
    (their cells, then -1), win [N, C] int32 (the winner table, rows 0..M-1), first [B + 1] int64 (each
    sample's first row), rows [1] int64 = M).
    """
    n, c = features.shape
    cout = weight.shape[0]
    h, w = grid
    ho, wo = out_hw
    wt, _wtt, cp, _cq = _stem_weights(weight, round_bf16)
    seg = torch.empty(n, c, dtype=torch.float32)  # M <= N rows used
    occupied = torch.empty(n, dtype=torch.int64)
    win = torch.empty(n, c, dtype=torch.int32)
    first = torch.empty(batch + 1, dtype=torch.int64)
    acc = torch.zeros(batch, ho, wo, cp, dtype=torch.float32)
    m = _library().call(
        "pfk_pillar_stem_fwd", feat=features.detach().contiguous(), cell=cell_index.contiguous(), N=n, C=c,
        B=batch, H=h, W=w, wt=wt, Cp=cp, Ho=ho, Wo=wo, round_bf16=int(round_bf16), acc=acc, seg=seg,
        occupied=occupied, win=win, rank=torch.empty(batch * h * w, dtype=torch.int32), first=first,
    )  # fmt: skip
    if m < 0:
        raise RuntimeError("kernels.native.pillar_stem_forward: the C kernel refused its arguments")
    out = acc[..., :cout].to(out_dtype).contiguous().permute(0, 3, 1, 2)  # [B, Cout, Ho, Wo], channels-last
    return out, seg, occupied, win, first, torch.full((1,), m, dtype=torch.int64)


def pillar_stem_backward(
    grad: Tensor,
    weight: Tensor,
    seg: Tensor,
    occupied: Tensor,
    win: Tensor,
    first: Tensor,
    rows: Tensor,
    grid: tuple[int, int],
    round_bf16: bool,
) -> tuple[Tensor, Tensor]:
    """The gradients of `pillar_stem_forward`: grad [B, Cout, Ho, Wo] (float32/bfloat16, channels
    contiguous), the forward's weight and saved tensors -> (grad_features [N, C] float32: the canvas
    gradient at each pillar's winners, rounded to bfloat16 values with `round_bf16` as a bf16 canvas'
    gradient is; grad_weight [Cout, C, 3, 3] float32)."""
    batch, cout, ho, wo = grad.shape
    grad, sb, sp = _rows(grad)
    n, c = seg.shape
    h, w = grid
    _wt, wtt, cp, cq = _stem_weights(weight, round_bf16)
    grad_features = torch.empty(n, c, dtype=torch.float32)
    dwt = torch.zeros(batch, 3, 3, c, cp, dtype=torch.float32)  # per-sample partials
    code = _library().call(
        "pfk_pillar_stem_bwd", grad=grad, gsb=sb, gsp=sp, seg=seg, occupied=occupied, win=win, first=first,
        M=int(rows[0]), N=n, C=c, B=batch, H=h, W=w, wtt=wtt, Cout=cout, Cp=cp, Cq=cq, Ho=ho, Wo=wo,
        round_bf16=int(round_bf16), grad_feat=grad_features, dwt=dwt,
    )  # fmt: skip
    _check(code, "pillar_stem_backward")
    dw = functools.reduce(torch.add, dwt.unbind(0))  # in sample order: deterministic
    return grad_features, dw[..., :cout].permute(3, 2, 0, 1).contiguous()


def register_check(path: str, run: Any, source_file: str, what: str) -> None:
    """Register the self-check `path` of a C kernel (`kernels.selfcheck`): `run(device) -> figures`, keyed by
    `source_file`'s bytes and this library's build; CPU only."""

    def fingerprint() -> str:
        return selfcheck.sources_hash([source_file], build_id())

    selfcheck.register(selfcheck.Check(path, run, fingerprint, ("cpu",), what))
