"""Where a training process runs: device, DDP rank and world size (torchrun), and the small
per-process utilities the loop needs (phase timer with NVTX ranges, peak memory, all-reduce).

CPU: gloo; CUDA: nccl. The process group is joined when torchrun sets WORLD_SIZE > 1.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels import selfcheck


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
    if not use_cuda:
        tune_malloc()
    return Runtime(dev, rank, world, local)


# glibc mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
_TRIM_THRESHOLD = 2**30  # mallopt takes a C int: 1 GiB


def tune_malloc() -> bool:
    """Keep a CPU training step's tensors in glibc's heap instead of fresh mmap pages (Linux, glibc).

    By default glibc serves a block above its dynamic mmap threshold with mmap and unmaps it on free, and
    trims the heap top back to the OS; a training step allocates and frees the same few-MB activations
    every step, so each step pays the kernel's page faults and zero-fill again. A fixed 32 MiB mmap
    threshold and a 1 GiB trim threshold (what the environment variables MALLOC_MMAP_THRESHOLD_ and
    MALLOC_TRIM_THRESHOLD_ would set) make the memory stay and be reused: the default bf16 step is ~4%
    faster on the dev box (docs/MODEL.md, "Speed"); peak RSS is unchanged, the process just keeps its
    peak. Returns whether it applied (False off glibc, or when the user set either variable).
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    applied = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    return mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and applied


BF16_STEP = "cuda.bf16_train_step"  # the self-check of a CUDA bf16 training step (kernels/selfcheck.py)


def cuda_bf16_native(capability: tuple[int, int]) -> bool:
    """Whether a CUDA device of compute capability (major, minor) has bf16 tensor cores: Ampere (8.0) and
    later. Before it (Volta 7.0, Turing 7.5) bf16 matmuls and convolutions are emulated, slower than fp32."""
    return tuple(capability) >= (8, 0)


def native_bf16(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """True where bf16 convolutions and matmuls run natively: a CUDA device of compute capability >= 8.0
    (`capability`, default the device's own), or a CPU with AVX512-BF16 or AMX (oneDNN's bf16 kernels);
    elsewhere bf16 is emulated and slower than fp32."""
    if device.type == "cuda":
        return cuda_bf16_native(capability or torch.cuda.get_device_capability(device))
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())  # fmt: skip


def use_bf16(enabled: bool, device: torch.device) -> bool:
    """`train.bf16` resolved for this device: bf16 autocast when asked for and native here; on CUDA also
    once a bf16 training step has verified itself against fp32 on this device (`check_bf16_step`)."""
    if not (enabled and native_bf16(device)):
        return False
    return device.type != "cuda" or selfcheck.trusted(BF16_STEP, device)


def check_bf16_step(device: torch.device) -> selfcheck.Figures:
    """One training step of a small conv + GroupNorm + linear network under bf16 autocast vs fp32 on
    `device`: the loss and every gradient within bf16 rounding (normwise relative 2**-5)."""
    if not torch.cuda.is_available():
        raise selfcheck.Skip("no CUDA device")
    if not native_bf16(device):
        raise selfcheck.Skip(
            f"compute capability {torch.cuda.get_device_capability(device)} < 8.0: fp32 runs"
        )
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(4, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 3),
    ).to(device)  # fmt: skip
    x = torch.randn(4, 4, 8, 8, generator=g).to(device)
    y = torch.randn(4, 3, generator=g).to(device)
    results = []
    for bf16 in (False, True):
        net.zero_grad()
        with torch.enable_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        results.append((loss.detach(), [p.grad.detach().clone() for p in net.parameters()]))
    (loss32, grads32), (loss16, grads16) = results
    figures: selfcheck.Figures = {}
    selfcheck.compare(figures, "bf16 loss", loss16, loss32, 2**-5, rel=True)
    for i, (a, e) in enumerate(zip(grads16, grads32)):
        selfcheck.compare(figures, f"bf16 grad {i}", a, e, 2**-5, rel=True)
    return figures


selfcheck.register(
    selfcheck.Check(
        BF16_STEP,
        check_bf16_step,
        lambda: selfcheck.sources_hash([__file__]),
        ("cuda",),
        "a conv+GroupNorm+linear step, bf16 autocast vs fp32",
    )
)


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


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def all_reduce_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
