"""Training across processes and nodes through `factory train` (`tasks/train.py`, `pfactory/train/runtime.py`):
the launch options' validation (one line, exit 2), and two "nodes" on 127.0.0.1 (`--nnodes 2 --node-rank 0/1
--rdzv-endpoint 127.0.0.1:PORT`, c10d rendezvous, gloo) training the curve of one node with
`--nproc-per-node 2`, step for step, into node 0's `--out` only.

Real processes throughout: `factory train` subprocesses (the console script), each starting PyTorch's
elastic agent, which spawns the workers; the data is the real synth -> prepare chain (as
tests/tasks/test_train.py), read by the PyTorch shard loader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.local_services import free_port

FACTORY = str(Path(sys.executable).with_name("factory"))
TINY = [
    "model.painted_pillars.image_channels=8", "model.painted_pillars.point_channels=16",
    "model.painted_pillars.bev_channels=[16,16,32]", "model.painted_pillars.up_channels=16",
    "model.painted_pillars.head_channels=16", "train.torch_threads=1", "train.loader_workers=1",
    "train.loader=torch", "train.batch_size=2", "train.epochs=1", "train.max_steps=6",
    "train.checkpoint_every_steps=3",
]  # fmt: skip
# What a step's record holds that is the training's maths (curves.json also has wall-time figures).
MATHS = ("loss", "heatmap", "reg", "lr", "grad_norm")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK", "RANK")}
    return {**env, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _factory_train(cwd: Path, data: Path, *args: str, overrides: list[str] = TINY) -> subprocess.Popen:
    """`factory train` in `cwd` (its project: the embedded defaults, `--params` absent), --out `model`."""
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [FACTORY, "train", "--data", str(data), "--out", "model", "--no-track", "--params",
           str(cwd / "none.yaml"), *args, *[a for o in overrides for a in ("-S", o)]]  # fmt: skip
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr); every one is killed if it outlives `timeout`."""
    results = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    return results


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real prepared directory: 15 synthetic frames (KITTI layout, 13 train) through the prepare stage."""
    import tasks.prepare
    from flows.params import Params
    from pfactory.synth.dataset import generate_dataset

    root = tmp_path_factory.mktemp("synth")
    generate_dataset(root / "raw", frames=15, seed=3, workers=1)
    tasks.prepare.run(Params(), root / "raw", root / "prepared", track=False)
    return root / "prepared"


# --------------------------------------------------------------------------------------------------
# The launch options: validated before anything starts, one line, exit 2
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank 2: expected 0..1"),
        (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank -1"),
        (["--nnodes", "2", "--node-rank", "1"], "--rdzv-endpoint HOST:PORT is required with --nnodes 2"),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"], "--node-rank is required with --nnodes 2"),
        (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1"], "--rdzv-endpoint '127.0.0.1'"),
        (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "host:70000"], "port in 1..65535"),
        (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "a b:1"], "--rdzv-endpoint 'a b:1'"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--nnodes", "0"], "--nnodes 0"),
        (["--nproc-per-node", "2", "--rdzv-timeout", "0"], "--rdzv-timeout 0"),
        (["--nproc-per-node", "2", "--rdzv-id", "a/b"], "--rdzv-id 'a/b'"),
        (["--nproc-per-node", "3"], "train.batch_size=2 must be divisible by the 3 processes"),
    ],
)
def test_bad_launch_options_exit_2_with_one_line(args: list[str], says: str, tmp_path: Path, capsys) -> None:
    """`python -m tasks.train` (what `factory train` runs too): refused before training, naming the option."""
    import tasks.train

    argv = ["--data", str(tmp_path / "none"), "--out", str(tmp_path / "model"), "--params", str(tmp_path / "none.yaml"),
            "--no-track", *args, *[a for o in TINY for a in ("-S", o)]]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        tasks.train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train: ") and says in err[0], err
    assert not (tmp_path / "model").exists()


def test_factory_train_refuses_a_second_node_without_endpoint(tmp_path: Path) -> None:
    """The same through the `factory` console script (Typer parses the declared options)."""
    res = subprocess.run([FACTORY, "train", "--nnodes", "2", "--node-rank", "1", "--params", str(tmp_path / "x.yaml")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines == ["train: --rdzv-endpoint HOST:PORT is required with --nnodes 2 (node 0's address)"], lines


def test_launch_spec_defaults_and_world_checks() -> None:
    from pfactory.train.runtime import DEFAULT_RDZV_TIMEOUT_S, launch_spec, parse_endpoint, world_problem

    spec = launch_spec(None, None, None, None, None, None, "artifacts/model")
    assert (spec.world_size, spec.node_rank, spec.endpoint, spec.timeout_s) == (1, 0, None, DEFAULT_RDZV_TIMEOUT_S)
    # Both nodes derive the same rendezvous id from the name of their own --out.
    assert launch_spec(1, 2, 1, "h:1", None, 5, "/a/model").rdzv_id == spec.rdzv_id == "train-model"
    assert parse_endpoint("[::1]:29400") == ("[::1]", 29400) and parse_endpoint(" node-0.lan:1 ") == ("node-0.lan", 1)

    def w(node: int, local: int, nproc: int = 1, nnodes: int = 2, digest: str = "d") -> dict:
        return {"node_rank": node, "local_rank": local, "nproc": nproc, "nnodes": nnodes, "digest": digest, "host": "h"}

    assert world_problem([w(0, 0), w(1, 0)], 2) is None
    assert "--node-rank 0 was given to more than one node" in world_problem([w(0, 0), w(0, 0)], 2)
    assert "--nproc-per-node differs" in world_problem([w(0, 0, 2), w(0, 1, 2), w(1, 0, 1)], 3)
    assert "--nnodes differs" in world_problem([w(0, 0, nnodes=2), w(1, 0, nnodes=3)], 2)
    assert "params of --node-rank 1 differ" in world_problem([w(1, 0, digest="x"), w(0, 0)], 2)


# --------------------------------------------------------------------------------------------------
# Two nodes == one node with two processes
# --------------------------------------------------------------------------------------------------
def _curve(out: Path) -> list[dict[str, float]]:
    return [{k: r[k] for k in ("step", *MATHS)} for r in json.loads((out / "curves.json").read_text())]


def test_two_nodes_train_the_curve_of_one_node_with_two_processes(prepared: Path, tmp_path: Path) -> None:
    import torch

    t0 = time.monotonic()
    (code, out, err), = _wait([_factory_train(tmp_path / "one", prepared, "--nproc-per-node", "2")])
    assert code == 0, err[-3000:]
    assert json.loads(out)["world_size"] == 2
    one_s = time.monotonic() - t0

    port = free_port()
    nodes = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "120"]
    t0 = time.monotonic()
    # Node 1 first: it waits for node 0's store to listen (read_timeout), then for the rendezvous.
    node1 = _factory_train(tmp_path / "node1", prepared, *nodes, "--node-rank", "1")
    time.sleep(1.0)
    node0 = _factory_train(tmp_path / "node0", prepared, *nodes, "--node-rank", "0")
    (c1, out1, err1), (c0, out0, err0) = _wait([node1, node0])
    two_s = time.monotonic() - t0
    print(f"one node x 2 processes: {one_s:.1f} s; two nodes x 1 process: {two_s:.1f} s")
    assert (c0, c1) == (0, 0), f"node 0: {err0[-3000:]}\nnode 1: {err1[-3000:]}"

    # Only global rank 0 (local rank 0 of --node-rank 0) writes; node 1's --out is not even created.
    assert not (tmp_path / "node1" / "model").exists(), list((tmp_path / "node1" / "model").iterdir())
    assert json.loads(out0)["world_size"] == 2 and out1.strip() == ""
    assert "--node-rank 0 wrote the outputs" in err1

    a, b = _curve(tmp_path / "one" / "model"), _curve(tmp_path / "node0" / "model")
    assert [r["step"] for r in a] == list(range(1, 7))
    # Exact: the same 2 ranks take the same halves of the same batches (rank = node_rank x nproc +
    # local_rank), and gloo's sum of 2 operands is the same float whichever order it adds them in.
    assert a == b, next((x, y) for x, y in zip(a, b) if x != y)
    wa = torch.load(tmp_path / "one" / "model" / "model.pt", weights_only=True)
    wb = torch.load(tmp_path / "node0" / "model" / "model.pt", weights_only=True)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    # Again in the same folders: node 0 would resume its finished checkpoint, node 1 (nothing in its --out)
    # would train from step 0 -- DDP would hang; every worker stops instead, exit 2 on both nodes.
    port = free_port()
    nodes = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "120"]
    node0 = _factory_train(tmp_path / "node0", prepared, *nodes, "--node-rank", "0")
    node1 = _factory_train(tmp_path / "node1", prepared, *nodes, "--node-rank", "1")
    (c0, _, err0), (c1, _, err1) = _wait([node0, node1])
    assert (c0, c1) == (2, 2), f"node 0: {err0[-3000:]}\nnode 1: {err1[-3000:]}"
    assert "resume from different checkpoints (rank 0: step 6, rank 1: step 0)" in err1.strip().splitlines()[-1]


def test_nodes_with_different_params_stop_with_exit_2(prepared: Path, tmp_path: Path) -> None:
    """A node started with other -S overrides is refused by every worker before training (exit 2, both nodes)."""
    port = free_port()
    nodes = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "120"]
    node0 = _factory_train(tmp_path / "node0", prepared, *nodes, "--node-rank", "0")
    node1 = _factory_train(tmp_path / "node1", prepared, *nodes, "--node-rank", "1", overrides=[*TINY, "train.lr=0.01"])
    (c0, _, err0), (c1, _, err1) = _wait([node0, node1])
    assert (c0, c1) == (2, 2), f"node 0: {err0[-3000:]}\nnode 1: {err1[-3000:]}"
    for err in (err0, err1):
        assert "params of --node-rank 1 differ from --node-rank 0's" in err.strip().splitlines()[-1], err[-2000:]
    assert not (tmp_path / "node0" / "model" / "model.pt").exists()


def test_a_node_whose_node_0_never_comes_exits_75(tmp_path: Path) -> None:
    """--node-rank 1 with nobody listening at the endpoint: a one-line transient failure after --rdzv-timeout."""
    port = free_port()
    t0 = time.monotonic()
    (code, _, err), = _wait([_factory_train(tmp_path / "node1", tmp_path / "none", "--nnodes", "2", "--node-rank", "1",
                                            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "3")])  # fmt: skip
    assert code == 75, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"train: rendezvous at --rdzv-endpoint 127.0.0.1:{port}: node 0 did not listen there within "
        "--rdzv-timeout 3 s"
    ), err[-3000:]
    assert time.monotonic() - t0 < 60
