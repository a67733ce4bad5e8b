"""Benchmark the kernels: reference vs torch.compile(reference) vs Triton, with achieved bandwidth.

    python benchmarks/bench_kernels.py [--device cpu|cuda] [--quick] [--no-compile] [--threads T]
                                       [--reps R] [--json FILE]

In: nothing (synthetic inputs at realistic sizes, seeded). Out: a table on stdout and, with --json,
{"meta": {...}, "rows": [{kernel, impl, ms, gbps, bytes, speedup, max_abs_err, ...}], "targets": [...]}.

Sizes (full; --quick divides the batch by 4 and runs fewer repeats):
- pillar_scatter_max: 300k points x 64 channels into 4 x 496 x 432 cells (~7 points per occupied cell).
- render_heatmap: 100 objects per sample, radius 2..10, into 4 x 3 x 200 x 176.
- focal_loss: logits and target [4, 3, 200, 176], forward + backward.

Byte models (bytes each implementation must at least move; GB/s = bytes / median time, 1 GB = 1e9 B):
- scatter fwd: features N*C*s + cell index N*8 + canvas num_cells*C*s (+ winner mask N*C when the
  training forward produces it).
- scatter bwd: winner N*C + cell index N*8 + gathered grad rows N*C*s + grad_features N*C*s.
- heatmap: heatmap B*K*H*W*4 + object tables M*(2*4 + 3*8).
- focal fwd+bwd: forward reads logits + target, backward reads them again and writes the gradient:
  n*(3*s_logits + 2*s_target).
- copy: tensor.clone() of a 1 GiB buffer on CUDA (copy_ into a preallocated 256 MiB buffer on CPU,
  where a fresh clone measures page faults), counted as read + write (2 * bytes).

Timing: CUDA events around each call (median of --reps) after warm-up on GPU; time.perf_counter
after warm-up on CPU. Triton rows call the `pfk::*` ops directly, so the public functions' one-sync
index checks are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import kernels
from kernels import focal_loss_reference, pillar_scatter_max_reference, render_heatmap_reference
from kernels._dispatch import triton_available
from kernels.pillar_scatter import (
    _pillar_scatter_max_backward_reference,
    _winner_from_argmax,
    pillar_scatter_argmax_reference,
)


@dataclass
class Row:
    kernel: str
    impl: str
    ms: float
    bytes: int
    gbps: float
    speedup: float | None = None  # reference time / this time
    max_abs_err: float | None = None  # vs the reference output (and gradient, where there is one)
    note: str = ""


@dataclass
class Sizes:
    batch: int
    points: int
    channels: int = 64
    grid: tuple[int, int] = (496, 432)
    objects_per_sample: int = 100
    classes: int = 3
    heat_hw: tuple[int, int] = (200, 176)
    extra: dict = field(default_factory=dict)


def _timer(device: str, warmup: int, reps: int) -> Callable[[Callable[[], object]], float]:
    """Return time_ms(fn): median milliseconds of `reps` calls after `warmup` calls."""

    def time_ms(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        samples = []
        if device == "cuda":
            torch.cuda.synchronize()
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return time_ms


def _row(kernel: str, impl: str, ms: float, nbytes: int, **kw: object) -> Row:
    gbps = nbytes / (ms * 1e-3) / 1e9
    return Row(kernel, impl, round(ms, 4), nbytes, round(gbps, 1), **kw)  # type: ignore[arg-type]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.detach().float() - b.detach().float()).abs()
    return float(diff.nan_to_num(0.0).max()) if diff.numel() else 0.0


def _compile(fn: Callable, enabled: bool) -> Callable | None:
    return torch.compile(fn, fullgraph=True) if enabled else None


# --------------------------------------------------------------------------------------------------
def bench_pillar_scatter(
    sz: Sizes, device: str, time_ms: Callable, compile_ref: bool, with_triton: bool
) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(0)
    n, c = sz.points, sz.channels
    num_cells = sz.batch * sz.grid[0] * sz.grid[1]
    features = torch.randn(n, c, device=device, generator=g)  # [N, C]
    # Lidar-like occupancy: points fall into ~n/7 occupied pillars; 5% are outside the range.
    occupied = torch.randint(0, num_cells, (n // 7,), device=device, generator=g)
    cell = occupied[torch.randint(0, n // 7, (n,), device=device, generator=g)]  # [N]
    cell[torch.rand(n, device=device, generator=g) < 0.05] = -1
    s = features.element_size()
    fwd_bytes = n * c * s + n * 8 + num_cells * c * s
    bwd_bytes = n * c + n * 8 + 2 * n * c * s
    kernel = f"pillar_scatter_max fwd [{n}x{c} -> {num_cells}x{c}]"
    kernel_bwd = f"pillar_scatter_max bwd [{n}x{c}]"

    rows = []
    ref_ms = time_ms(lambda: pillar_scatter_max_reference(features, cell, num_cells))
    rows.append(_row(kernel, "reference", ref_ms, fwd_bytes, speedup=1.0))
    compiled = _compile(pillar_scatter_max_reference, compile_ref)
    if compiled is not None:
        ms = time_ms(lambda: compiled(features, cell, num_cells))
        rows.append(_row(kernel, "torch.compile(reference)", ms, fwd_bytes, speedup=round(ref_ms / ms, 2)))
    # The plain library baseline: one scatter_reduce into a zero canvas (+1 trash row for dropped).
    row_index = torch.where(cell >= 0, cell, num_cells)[:, None].expand(n, c)  # [N, C]
    base_ms = time_ms(
        lambda: torch.zeros(num_cells + 1, c, device=device).scatter_reduce_(
            0, row_index, features, "amax", include_self=False
        )
    )
    rows.append(
        _row(kernel, "torch scatter_reduce(amax)", base_ms, fwd_bytes, speedup=round(ref_ms / base_ms, 2))
    )

    canvas_ref = pillar_scatter_max_reference(features, cell, num_cells)
    argmax_ref = pillar_scatter_argmax_reference(features, cell, num_cells, canvas_ref)  # [cells, C]
    winner_ref = _winner_from_argmax(argmax_ref, cell, num_cells)  # [N, C], for the backward rows
    grad = torch.randn(num_cells, c, device=device, generator=g)
    grad_ref = _pillar_scatter_max_backward_reference(grad, cell, winner_ref, num_cells)
    bwd_ref_ms = time_ms(lambda: _pillar_scatter_max_backward_reference(grad, cell, winner_ref, num_cells))
    rows.append(_row(kernel_bwd, "reference", bwd_ref_ms, bwd_bytes, speedup=1.0))

    if with_triton:
        op, op_bwd = torch.ops.pfk.pillar_scatter_max, torch.ops.pfk.pillar_scatter_max_backward
        canvas_tri, winner_tri = op(features, cell, num_cells, True)
        err = max(_max_err(canvas_tri, canvas_ref), float((winner_tri != winner_ref).sum()))
        ms = time_ms(lambda: op(features, cell, num_cells, False))
        rows.append(
            _row(kernel, "triton (inference)", ms, fwd_bytes, speedup=round(ref_ms / ms, 2), max_abs_err=err)
        )
        ms = time_ms(lambda: op(features, cell, num_cells, True))
        rows.append(
            _row(
                kernel,
                "triton (train, +winner)",
                ms,
                fwd_bytes + n * c,
                speedup=round(ref_ms / ms, 2),
                note=f"{base_ms / ms:.1f}x scatter_reduce",
            )
        )
        grad_tri = op_bwd(grad, cell, winner_tri, num_cells)
        ms = time_ms(lambda: op_bwd(grad, cell, winner_tri, num_cells))
        rows.append(
            _row(
                kernel_bwd,
                "triton",
                ms,
                bwd_bytes,
                speedup=round(bwd_ref_ms / ms, 2),
                max_abs_err=_max_err(grad_tri, grad_ref),
            )
        )
    return rows


def bench_heatmap(
    sz: Sizes, device: str, time_ms: Callable, compile_ref: bool, with_triton: bool
) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(1)
    b, k, (h, w) = sz.batch, sz.classes, sz.heat_hw
    m = b * sz.objects_per_sample
    centers = torch.rand(m, 2, device=device, generator=g) * torch.tensor([w, h], device=device)  # [M, 2]
    radii = torch.randint(2, 11, (m,), device=device, generator=g)
    labels = torch.randint(0, k, (m,), device=device, generator=g)
    batch = torch.arange(b, device=device).repeat_interleave(sz.objects_per_sample)  # [M]
    args = (centers, radii, labels, batch, b, k, h, w)
    nbytes = b * k * h * w * 4 + m * (2 * 4 + 3 * 8)
    kernel = f"render_heatmap [{m} obj -> {b}x{k}x{h}x{w}]"

    rows = []
    ref_ms = time_ms(lambda: render_heatmap_reference(*args))
    rows.append(_row(kernel, "reference", ref_ms, nbytes, speedup=1.0))
    compiled = _compile(render_heatmap_reference, compile_ref)
    if compiled is not None:
        ms = time_ms(lambda: compiled(*args))
        rows.append(_row(kernel, "torch.compile(reference)", ms, nbytes, speedup=round(ref_ms / ms, 2)))
    if with_triton:
        err = _max_err(torch.ops.pfk.render_heatmap(*args), render_heatmap_reference(*args))
        ms = time_ms(lambda: torch.ops.pfk.render_heatmap(*args))
        rows.append(
            _row(kernel, "triton (tile-culled)", ms, nbytes, speedup=round(ref_ms / ms, 2), max_abs_err=err)
        )
    return rows


def bench_focal_loss(
    sz: Sizes, device: str, time_ms: Callable, compile_ref: bool, with_triton: bool
) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(2)
    shape = (sz.batch, sz.classes, *sz.heat_hw)
    logits = (torch.randn(shape, device=device, generator=g) * 3).requires_grad_(True)
    target = torch.rand(shape, device=device, generator=g) ** 8  # mostly ~0, like a heatmap
    target.view(-1)[torch.randperm(target.numel(), device=device, generator=g)[: sz.batch * 100]] = 1.0
    n = logits.numel()
    nbytes = n * (3 * logits.element_size() + 2 * target.element_size())
    kernel = f"focal_loss fwd+bwd [{'x'.join(map(str, shape))}]"

    def fwd_bwd(fn: Callable) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            loss = fn(logits, target)
            (grad,) = torch.autograd.grad(loss, logits)
            return loss, grad

        return run

    rows = []
    ref_loss, ref_grad = fwd_bwd(focal_loss_reference)()
    ref_ms = time_ms(fwd_bwd(focal_loss_reference))
    rows.append(_row(kernel, "reference (autograd)", ref_ms, nbytes, speedup=1.0))
    compiled = _compile(focal_loss_reference, compile_ref)
    if compiled is not None:
        ms = time_ms(fwd_bwd(compiled))
        rows.append(_row(kernel, "torch.compile(reference)", ms, nbytes, speedup=round(ref_ms / ms, 2)))
    if with_triton:
        loss, grad = fwd_bwd(kernels.focal_loss)()
        err = max(
            _max_err(loss, ref_loss) / max(1.0, float(ref_loss.detach().abs())), _max_err(grad, ref_grad)
        )
        ms = time_ms(fwd_bwd(kernels.focal_loss))
        rows.append(
            _row(
                kernel,
                "triton (fused)",
                ms,
                nbytes,
                speedup=round(ref_ms / ms, 2),
                max_abs_err=err,
                note="err: loss relative, grad absolute",
            )
        )
    return rows


def bench_copy(device: str, time_ms: Callable, quick: bool) -> list[Row]:
    numel = (2**28 if device == "cuda" else 2**26) // (4 if quick else 1)  # 1 GiB / 256 MiB of fp32
    buf = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    if device == "cuda":
        ms = time_ms(lambda: buf.clone())  # the caching allocator reuses the block: a pure copy
        what = "clone"
    else:
        # On CPU a fresh 256 MiB clone is dominated by first-touch page faults (2.3 GB/s measured
        # here), so copy into a buffer allocated once.
        dst = torch.empty_like(buf).fill_(0.0)
        ms = time_ms(lambda: dst.copy_(buf))
        what = "copy_"
    name = f"copy ({what} {numel * 4 / 2**20:.0f} MiB)"
    return [_row(name, "torch", ms, 2 * numel * 4, note="read + write")]


# --------------------------------------------------------------------------------------------------
def check_targets(rows: list[Row]) -> list[dict]:
    """The H200 targets of the kernels issue, evaluated where the rows exist (CUDA only)."""

    def find(kernel_prefix: str, impl: str) -> Row | None:
        return next((r for r in rows if r.kernel.startswith(kernel_prefix) and r.impl == impl), None)

    copy = next((r for r in rows if r.kernel.startswith("copy")), None)
    scatter = find("pillar_scatter_max fwd", "triton (train, +winner)")
    base = find("pillar_scatter_max fwd", "torch scatter_reduce(amax)")
    heat = find("render_heatmap", "triton (tile-culled)")
    focal = find("focal_loss", "triton (fused)")
    targets = []
    if scatter and base:
        targets.append(
            {"target": "scatter-max >= 5x scatter_reduce", "value": round(base.ms / scatter.ms, 2), "need": 5}
        )
    if scatter and copy:
        targets.append(
            {
                "target": "scatter-max >= 50% copy GB/s",
                "value": round(scatter.gbps / copy.gbps, 2),
                "need": 0.5,
            }
        )
    if heat:
        targets.append({"target": "heatmap >= 10x reference", "value": heat.speedup, "need": 10})
    if focal:
        targets.append({"target": "focal fwd+bwd >= 3x reference", "value": focal.speedup, "need": 3})
    for t in targets:
        t["pass"] = t["value"] is not None and t["value"] >= t["need"]
    return targets


def print_table(rows: list[Row], targets: list[dict]) -> None:
    header = f"{'kernel':<48} {'impl':<28} {'ms':>10} {'GB/s':>8} {'speedup':>8} {'max|err|':>9}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        speed = f"{r.speedup:.2f}x" if r.speedup is not None else ""
        err = f"{r.max_abs_err:.1e}" if r.max_abs_err is not None else ""
        print(f"{r.kernel:<48} {r.impl:<28} {r.ms:>10.3f} {r.gbps:>8.1f} {speed:>8} {err:>9}  {r.note}")
    for t in targets:
        print(
            f"target {t['target']:<36} {t['value']:>8} (need >= {t['need']}): "
            + ("PASS" if t["pass"] else "FAIL")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--quick", action="store_true", help="batch / 4 and fewer repeats")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(reference) rows")
    parser.add_argument("--json", type=Path, help="also write the rows and targets to this JSON file")
    parser.add_argument(
        "--reps", type=int, default=None, help="timed repeats per row (default 20 cuda, 5 cpu)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a shared machine)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")

    batch = 1 if args.quick else 4
    sz = Sizes(batch=batch, points=75_000 * batch)
    reps = args.reps or ((10 if args.quick else 20) if args.device == "cuda" else (3 if args.quick else 5))
    warmup = 3 if args.device == "cuda" else 1
    time_ms = _timer(args.device, warmup=warmup, reps=reps)
    compile_ref = not args.no_compile
    with_triton = args.device == "cuda" and triton_available()  # Triton rows on GPU only

    rows: list[Row] = []
    rows += bench_copy(args.device, time_ms, args.quick)
    for bench in (bench_pillar_scatter, bench_heatmap, bench_focal_loss):
        rows += bench(sz, args.device, time_ms, compile_ref, with_triton)
    targets = check_targets(rows)
    print_table(rows, targets)

    if args.json:
        meta = {
            "device": torch.cuda.get_device_name()
            if args.device == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": _triton_version(),
            "cpu_threads": torch.get_num_threads(),
            "load_average_1min": os.getloadavg()[0],  # CPU timings are only comparable on a quiet machine
            "quick": args.quick,
            "reps": reps,
            "sizes": asdict(sz),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows], "targets": targets}, indent=2)
        )
        print(f"wrote {args.json}")
    return 0


def _triton_version() -> str | None:
    if not triton_available():
        return None
    import triton

    return triton.__version__


if __name__ == "__main__":
    raise SystemExit(main())
