"""Where a training process runs: device, DDP rank and world size (torchrun), and the small
per-process utilities the loop needs (phase timer with NVTX ranges, peak memory, all-reduce).

CPU: gloo; CUDA: nccl. The process group is joined when torchrun sets WORLD_SIZE > 1.

Launching (the end of this module): `factory train --nproc-per-node N [--nnodes M --node-rank R
--rdzv-endpoint HOST:PORT]` starts PyTorch's elastic agent (what `torchrun` runs) in-process.
In:  the launch options (`launch_spec` validates them: a `UsageError`, exit 2, names the option), a picklable
     module-level function and its arguments (what each worker process runs).
Out: `launch(spec, fn, args)` -> `fn`'s return value on global rank 0 when that rank runs on this node, else
     None; a failed worker raises `LaunchFailed` carrying that worker's exit code (the command's exit code).

Why `torch.distributed.launcher.api.elastic_launch` with a function, not `python -m torch.distributed.run`
as a subprocess: torchrun's process exits 1 whatever its workers exited with, where the agent's
`ChildFailedError` keeps each worker's exit code, so a bad parameter on a worker still exits 2 and a transient
failure 75 (the stage contract, `tasks._stage`); and a function receives the validated params and options
as they are, so no argv has to be rebuilt from what `factory train` parsed. The agent is torchrun's own:
c10d rendezvous at `--rdzv-endpoint` (node 0 hosts its store), `max_restarts=0`, spawn start method.

Ranks: the c10d rendezvous numbers nodes in the order it sorts them (host name, pid), not by `--node-rank`
(torchrun reads `--node_rank` only for its static rendezvous). Each worker therefore takes the global rank
`node_rank * nproc_per_node + local_rank` before it joins the process group (`adopt_node_rank`), after
checking through the agent's store that every node agrees: the node ranks are distinct and in range, every
node runs the same number of processes, and the train/model params are the same (a digest). So global
rank 0, the one process that writes the outputs (`pfactory.train.trainer`: checkpoint, model, curves,
MLflow), is always local rank 0 of `--node-rank 0`; the other nodes' `--out` is left untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kernels import selfcheck
from pfactory.runtime import failures as fl


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


# ----------------------------------------------------------------------------------------------------------
# Launching (module docstring)

DEFAULT_RDZV_TIMEOUT_S = 600  # torchrun's default join timeout: nodes started by hand have 10 min to meet
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_STORE_PREFIX = "pfactory-train"


class LaunchFailed(fl.UserError):
    """A worker of the launch failed: exit with its code (`exit_code` per instance)."""

    def __init__(self, message: str, exit_code: int = fl.EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class LaunchSpec:
    """Where and how many: `nproc_per_node` workers on each of `nnodes` nodes, this node's `node_rank`, the
    c10d rendezvous `endpoint` (HOST:PORT; node 0 hosts it) under the id `rdzv_id`, and `timeout_s` for the
    nodes to join (and for a node to reach the endpoint)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    rdzv_id: str = ""
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is already a worker of torchrun / an elastic agent (WORLD_SIZE or LOCAL_RANK set)."""
    env = os.environ if env is None else env
    return "WORLD_SIZE" in env or "LOCAL_RANK" in env


def parse_endpoint(text: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6addr]:PORT` too) -> (host, port); a `UsageError` naming `--rdzv-endpoint` otherwise."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):([0-9]{1,5})", text.strip())
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise fl.UsageError(f"--rdzv-endpoint {text!r}: expected HOST:PORT with a port in 1..65535 (node 0's address)")
    return m.group(1), int(m.group(2))


def default_rdzv_id(out: str | Path) -> str:
    """The rendezvous id when `--rdzv-id` is not given: from the name of the output folder (each node passes
    its own `--out`; the same name, e.g. `artifacts/model`, on every node gives the same id)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(out).name).strip("-.") or "model"
    return f"train-{name}"[:128]


def launch_spec(
    nproc_per_node: int | None,
    nnodes: int | None,
    node_rank: int | None,
    endpoint: str | None,
    rdzv_id: str | None,
    timeout_s: int | None,
    out: str | Path,
    batch_size: int = 0,
) -> LaunchSpec:
    """The validated launch options (None: the default); a `UsageError` (exit 2) names the option at fault.
    `out`: the output folder (the default rendezvous id, `default_rdzv_id`); `batch_size`: the global batch
    (`train.batch_size`), which the processes share out evenly (0: not checked)."""
    nproc = 1 if nproc_per_node is None else nproc_per_node
    nodes = 1 if nnodes is None else nnodes
    timeout = DEFAULT_RDZV_TIMEOUT_S if timeout_s is None else timeout_s
    if nproc < 1:
        raise fl.UsageError(f"--nproc-per-node {nproc}: expected a process count >= 1")
    if nodes < 1:
        raise fl.UsageError(f"--nnodes {nodes}: expected a node count >= 1")
    if timeout < 1:
        raise fl.UsageError(f"--rdzv-timeout {timeout}: expected seconds >= 1")
    if nodes > 1 and node_rank is None:
        raise fl.UsageError(f"--node-rank is required with --nnodes {nodes}: 0 on the node at --rdzv-endpoint, "
                         f"1..{nodes - 1} on the others")  # fmt: skip
    rank = 0 if node_rank is None else node_rank
    if not 0 <= rank < nodes:
        raise fl.UsageError(f"--node-rank {rank}: expected 0..{nodes - 1} (--nnodes {nodes})")
    if nodes > 1 and not endpoint:
        raise fl.UsageError(f"--rdzv-endpoint HOST:PORT is required with --nnodes {nodes} (node 0's address)")
    if endpoint:
        host, port = parse_endpoint(endpoint)
        endpoint = f"{host}:{port}"
    if rdzv_id is not None and not _ID.fullmatch(rdzv_id):
        raise fl.UsageError(f"--rdzv-id {rdzv_id!r}: expected 1-128 of A-Z a-z 0-9 . _ - (not starting with . _ -)")
    if batch_size % (nproc * nodes):
        raise fl.UsageError(f"train.batch_size={batch_size} must be divisible by the {nproc * nodes} processes "
                            "(--nproc-per-node x --nnodes)")  # fmt: skip
    return LaunchSpec(nproc, nodes, rank, endpoint, rdzv_id or default_rdzv_id(out), timeout)


def launch(spec: LaunchSpec, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Run `fn(*args)` in `spec.nproc_per_node` spawned workers of this node, which meet the other nodes' at
    `spec.endpoint` (c10d; a single node without an endpoint: a free local port). `fn` returns None except on
    global rank 0; returns rank 0's value when it runs here, else None. `fn` and `args` must pickle (spawn).

    A worker that fails raises `LaunchFailed` with the exit code of the first worker that failed (a signal
    N: 128 + N); a signal to this process (SIGTERM) is passed to the workers, then 128 + N."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        raise fl.UsageError("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: factory train's launch needs the agent's shared "
                         "store; unset it")  # fmt: skip
    single = spec.nnodes == 1 and spec.endpoint is None
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.rdzv_id,
        role="train",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0" if single else str(spec.endpoint),
        # node 0 hosts the store at the endpoint (not guessed from the host name: two "nodes" on one host);
        # the others wait for it to listen as long as they wait for the rendezvous.
        rdzv_configs={
            "join_timeout": spec.timeout_s,
            "read_timeout": spec.timeout_s,
            "is_host": spec.node_rank == 0,
        },
        max_restarts=0,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, fn)(*args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()  # the first of this node's workers to fail: the root cause
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        why = _reason(failure)
        detail = f": {why}" if why else ""
        where = f"node {spec.node_rank} local rank {failure.local_rank}"
        raise LaunchFailed(f"training process ({where}) exited {code}{detail}", code or 1) from None
    except RendezvousConnectionError:
        where = config.rdzv_endpoint
        why = ("could not listen there: port in use (another node with --node-rank 0?)" if spec.node_rank == 0
               else f"node 0 did not listen there within --rdzv-timeout {spec.timeout_s} s")  # fmt: skip
        raise LaunchFailed(f"rendezvous at --rdzv-endpoint {where}: {why}", fl.EXIT_TRANSIENT) from None
    except RendezvousError as e:  # a timeout: not every node joined
        raise LaunchFailed(
            f"rendezvous {spec.rdzv_id!r} at {config.rdzv_endpoint}: {type(e).__name__} {e}".strip()
            + f"; the {spec.nnodes} nodes did not all join within --rdzv-timeout {spec.timeout_s} s (the same "
            "--nnodes, --rdzv-endpoint and --rdzv-id on every node?)",
            fl.EXIT_TRANSIENT,
        ) from None
    except SignalException as e:
        raise LaunchFailed(f"stopped by {signal.Signals(e.sigval).name}", 128 + int(e.sigval)) from None
    # keyed by the rank the rendezvous gave (not the one `adopt_node_rank` took): `fn` returns None but on rank 0
    return next((r for r in (results or {}).values() if r is not None), None)


def _reason(failure: Any) -> str:
    """The first line of a failed worker's error file (`record_exception`: "Type: message"), else ""."""
    message = failure.message if os.path.isfile(str(failure.error_file)) else ""
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = str(message or "").strip().splitlines()
    return lines[0] if lines else ""


def params_digest(doc: Mapping[str, Any]) -> str:
    """A short digest of a params document (JSON-able): what every node must agree on."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def adopt_node_rank(node_rank: int, nnodes: int, digest: str, timeout_s: float) -> int:
    """In a worker of `launch`: check with every other worker, through the agent's store, that the nodes agree
    (distinct `--node-rank`s in range, the same `--nproc-per-node` and `--nnodes`, the same params `digest`),
    then set RANK to `node_rank * nproc_per_node + local_rank` (module docstring) and return it. Every
    worker reaches the same verdict: on a disagreement all raise the same `UsageError` (exit 2)."""
    env = os.environ
    agent_rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local, nproc = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    store = dist.PrefixStore(
        f"{_STORE_PREFIX}/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
        dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
        ),
    )
    me = {"node_rank": node_rank, "nnodes": nnodes, "local_rank": local, "nproc": nproc, "digest": digest,
          "host": os.uname().nodename}  # fmt: skip
    store.set(f"worker/{agent_rank}", json.dumps(me))
    keys = [f"worker/{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=timeout_s))
    workers = [json.loads(store.get(k)) for k in keys]
    problem = world_problem(workers, world)
    if problem:
        raise fl.UsageError(problem)
    rank = node_rank * nproc + local
    env["RANK"] = env["ROLE_RANK"] = str(rank)
    env["GROUP_RANK"] = str(node_rank)
    return rank


def world_problem(workers: list[dict[str, Any]], world: int) -> str | None:
    """What is wrong with the nodes' launch options as the workers report them (`adopt_node_rank`), else None."""
    counts = {w["nproc"] for w in workers}
    if len(counts) > 1:
        return f"--nproc-per-node differs between nodes ({sorted(counts)}): give every node the same"
    nodes = {w["nnodes"] for w in workers}
    if len(nodes) > 1 or next(iter(nodes)) * next(iter(counts)) != world:
        return f"--nnodes differs between nodes ({sorted(nodes)}) or from the {world} workers that met"
    pairs = [(w["node_rank"], w["local_rank"]) for w in workers]
    if len(set(pairs)) != len(pairs):
        dup = sorted({n for n, _ in pairs if pairs.count((n, 0)) > 1})
        return f"--node-rank {dup[0] if dup else '?'} was given to more than one node: each node needs its own"
    digests = {}
    for w in sorted(workers, key=lambda w: (w["node_rank"], w["local_rank"])):
        digests.setdefault(w["digest"], w["node_rank"])
    if len(digests) > 1:
        other = sorted(digests.values())[1]
        return (f"the train/model params of --node-rank {other} differ from --node-rank 0's: start every node "
                "with the same params.yaml and -S overrides")  # fmt: skip
    return None


def check_same_start(step: int, finished: bool) -> None:
    """In a DDP worker (no-op outside one): every rank resumes from the same step (a `UsageError` on all ranks,
    exit 2, else). A node that resumes a checkpoint the others do not see would make DDP hang."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    positions: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(positions, (step, finished))
    if len(set(positions)) > 1:
        steps = ", ".join(f"rank {r}: step {s}" for r, (s, _) in enumerate(positions))
        raise fl.UsageError(f"the workers would resume from different checkpoints ({steps}): give every node the "
                            "same --out (a shared folder) or remove the checkpoint.pt to start fresh")  # fmt: skip


def exit_worker(stage: str, exc: Exception) -> None:
    """In a worker of `launch`: an error a user can act on (`pfactory.runtime.failures.stage_outcome`) is written to
    the worker's error file, which the launching process reports (`LaunchFailed`), and the worker exits with
    its code; a bug returns (the caller re-raises it: its traceback, exit 1)."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    outcome = fl.stage_outcome(stage, exc)
    if outcome.code == fl.EXIT_FAILED and fl.explain(exc) is None:
        return
    get_error_handler().record_exception(exc)
    sys.exit(outcome.code)
