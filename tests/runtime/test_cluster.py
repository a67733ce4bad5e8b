"""Dask the conventional way (`pfactory.runtime.cluster.resolve_scheduler` / `dask_client`): the stages take the
scheduler from Dask's own configuration (`scheduler-address`, which Dask fills from `DASK_SCHEDULER_ADDRESS`
and its YAML files) when their params name none.

- precedence: params > Dask config > a local cluster, with `dask.config.set` and with the environment
  variable (read by a real `dask.config.refresh()`); `local:N` in params starts a LocalCluster even when
  Dask's config names a scheduler;
- a Dask-config address where no scheduler answers: one line naming DASK_SCHEDULER_ADDRESS /
  scheduler-address, not the params key;
- prepare on a cluster started with `dask scheduler` / `dask worker` (each in its own folder, data on S3 -- a
  moto server), named by DASK_SCHEDULER_ADDRESS only: the published objects are byte-identical to a
  one-process prepare of the same frames, the source is said once on stderr and recorded (MLflow tag).
- evaluate on that cluster the same way: the files of a LocalCluster run (~27 s: it builds and optimizes
  the tiny model first, `tests/evaluate/helpers.py`).
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prepare.conftest import small_params
from tests.prepare.test_storage import (  # noqa: F401 - s3, raw_local: module fixtures (moto server, dataset)
    BUCKET,
    _local_published,
    _remote_tree,
    _upload,
    raw_local,
    s3,
)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo's `tasks`, not tests/'s namespace packages
    sys.path.insert(0, str(ROOT))

ENV = "DASK_SCHEDULER_ADDRESS"


def _dead_address() -> str:
    """A 127.0.0.1 port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def dask_env(monkeypatch) -> Iterator[pytest.MonkeyPatch]:
    """Set/unset `DASK_SCHEDULER_ADDRESS` with `monkeypatch`, then `dask.config.refresh()` (what a fresh process
    reads at `import dask`); the configuration is refreshed again without it afterwards."""
    import dask
    import distributed  # noqa: F401  (its defaults are registered before any refresh)

    monkeypatch.delenv(ENV, raising=False)
    dask.config.refresh()
    yield monkeypatch
    monkeypatch.delenv(ENV, raising=False)
    dask.config.refresh()


@pytest.fixture(autouse=True)
def _dask_scratch(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_TEMPORARY_DIRECTORY", str(tmp_path / "dask"))


def test_params_win_over_dask_config_which_wins_over_a_local_cluster(dask_env) -> None:
    import dask

    from pfactory.runtime.cluster import resolve_scheduler

    key = "prepare.dask_address"
    assert resolve_scheduler(None, key) == (None, "local cluster (prepare.workers)")
    assert resolve_scheduler(None, "evaluate.dask_address") == (None, "local cluster (evaluate.workers)")
    with dask.config.set({"scheduler-address": "tcp://10.1.2.3:8786"}):  # Dask's YAML or config.set
        assert resolve_scheduler(None, key) == ("tcp://10.1.2.3:8786", "Dask config scheduler-address")
        assert resolve_scheduler("tcp://h:1", key) == ("tcp://h:1", "params prepare.dask_address")
        assert resolve_scheduler("local:2", key) == ("local:2", "params prepare.dask_address")

    dask_env.setenv(ENV, "tcp://10.9.8.7:8786")
    dask.config.refresh()
    got = ("tcp://10.9.8.7:8786", "Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)")
    assert resolve_scheduler(None, key) == got
    assert resolve_scheduler(None, "evaluate.dask_address") == got
    assert resolve_scheduler("tcp://h:1", "evaluate.dask_address") == ("tcp://h:1", "params evaluate.dask_address")
    dask_env.delenv(ENV)
    dask.config.refresh()
    assert resolve_scheduler(None, key) == (None, "local cluster (prepare.workers)")


def test_a_dead_dask_config_address_is_one_line_naming_it(dask_env, capfd) -> None:
    import dask

    from pfactory.runtime.cluster import dask_client

    dead = _dead_address()
    dask_env.setenv(ENV, dead)
    dask.config.refresh()
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "2s"}),
        pytest.raises(ConnectionError) as e,
        dask_client(None, 1, 1, "prepare.dask_address"),
    ):
        pass
    msg = str(e.value)
    assert "\n" not in msg and dead in msg, msg
    assert msg.startswith("Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)"), msg
    assert "no Dask scheduler answered" in msg and "prepare.dask_address" not in msg, msg
    # Said once on stderr before the attempt: where the scheduler came from.
    err = [x for x in capfd.readouterr().err.splitlines() if "Dask cluster" in x]
    assert err == [f"prepare: Dask cluster {dead} from Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)"]

    # From Dask's YAML / config.set (no variable): named as scheduler-address. (A refresh drops what
    # config.set contexts hold: none is open across one.)
    dask_env.delenv(ENV)
    dask.config.refresh()
    with dask.config.set({"scheduler-address": dead, "distributed.comm.timeouts.connect": "2s"}):
        with (
            pytest.raises(ConnectionError, match=r"^Dask config scheduler-address 'tcp://") as e2,
            dask_client(None, 1, 1, "evaluate.dask_address"),
        ):
            pass
        assert "\n" not in str(e2.value) and "evaluate.dask_address" not in str(e2.value), e2.value
        assert "DASK_SCHEDULER_ADDRESS" in str(e2.value), e2.value

        # A dead address in params (over the same Dask config): the params key is named, as before.
        with (
            pytest.raises(ConnectionError, match=r"^evaluate\.dask_address 'tcp://"),
            dask_client(_dead_address(), 1, 1, "evaluate.dask_address"),
        ):
            pass


def test_prepare_of_local_paths_goes_to_the_dask_config_scheduler(dask_env, raw_local, tmp_path) -> None:  # noqa: F811
    """prepare.dask_address null and prepare.workers 1 no longer mean "this process" when Dask's config names
    a scheduler: the stage goes there (here a dead one: the one-line error, nothing published)."""
    import dask

    from pfactory.prepare.scaleout import prepare_data

    dask_env.setenv(ENV, _dead_address())
    dask.config.refresh()
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "2s"}),
        pytest.raises(ConnectionError, match=r"^Dask config scheduler-address \(DASK_SCHEDULER_ADDRESS\) 'tcp://"),
    ):
        prepare_data(raw_local[0], tmp_path / "out", small_params())
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_local_n_in_params_starts_a_local_cluster_despite_dask_config(dask_env, capfd) -> None:
    import dask

    from pfactory.runtime.cluster import cluster_slots, dask_client

    dask_env.setenv(ENV, _dead_address())  # would fail if it were used
    dask.config.refresh()
    with dask_client("local:1", 2, 1, "prepare.dask_address") as (client, where):
        assert where == "local:1 from params prepare.dask_address"
        assert cluster_slots(client) == 1 and client.scheduler.address.startswith("tcp://127.0.0.1:")
    assert capfd.readouterr().err.count("Dask cluster") == 1


@pytest.fixture(scope="module")
def dask_cli(s3, tmp_path_factory) -> Iterator[str]:  # noqa: F811 - s3 first: the worker gets its AWS variables
    """`dask scheduler` + `dask worker` (1 process, 1 thread), each with its cwd in its own folder."""
    from tests.cluster_helpers import dask_cli_cluster

    with dask_cli_cluster(tmp_path_factory.mktemp("dask-cli"), workers=1) as address:
        yield address


def test_prepare_on_a_cli_cluster_named_by_dask_config_writes_the_bytes_of_one_process(
    s3, raw_local, dask_cli, dask_env, tmp_path, capfd  # noqa: F811
) -> None:
    import dask
    import mlflow

    import tasks.prepare
    from flows.params import Params
    from pfactory.prepare.stage import prepare_dataset

    raw, bad = raw_local
    raw_url, out = f"s3://{BUCKET}/conventional/raw", f"s3://{BUCKET}/conventional/prepared"
    _upload(raw, raw_url)
    prepare_dataset(raw, tmp_path / "local", small_params())  # the same frames, one process, local files

    driver = tmp_path / "driver"  # the driver's project: MLflow under it; the cluster's folders are elsewhere
    driver.mkdir()
    dask_env.chdir(driver)
    dask_env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    dask_env.setenv(ENV, dask_cli)
    dask.config.refresh()
    capfd.readouterr()
    params = Params(prepare=small_params(unit_frames=4))
    assert params.prepare.dask_address is None and params.prepare.workers == 1  # nothing in params
    metrics = tasks.prepare.run(params, raw_url, out, track=True)

    assert _remote_tree(out) == _local_published(tmp_path / "local")  # every shard, rejected.jsonl, manifest
    assert metrics["frames_rejected"] == len(bad) and metrics["units"] == 6 and metrics["workers_used"] == 1
    source = f"{dask_cli} from Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)"
    said = [x for x in capfd.readouterr().err.splitlines() if "Dask cluster" in x]
    assert said == [f"prepare: Dask cluster {source}"], said
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.tags["prepare.cluster"] == source
    # The units ran on the `dask worker`, in its own folder: not the driver's, not the checkout.
    from distributed import Client

    def seen(dask_worker) -> tuple[str, int]:
        import os

        return os.getcwd(), dask_worker.state.executed_count

    with Client(dask_cli, timeout=30) as client:
        ((cwd, executed),) = client.run(seen).values()
    assert Path(cwd).name == "worker" and not Path(cwd).is_relative_to(ROOT) and not Path(cwd).is_relative_to(driver)
    assert executed >= metrics["units"] + metrics["shard_tasks"], executed


def test_evaluate_on_a_cli_cluster_named_by_dask_config_gives_the_files_of_a_local_cluster(
    dask_cli, dask_env, tmp_path, capfd
) -> None:
    """evaluate.dask_address null, DASK_SCHEDULER_ADDRESS names the `dask scheduler`: the same kpis.json,
    predictions and KITTI files as a LocalCluster run; the source in the metrics and timings.json. (Evaluate
    reads the prepared data and the model from paths: its workers see this machine's files.)"""
    import dask

    import tasks.evaluate
    from tests.evaluate.helpers import build_eval_setup
    from tests.tasks.test_evaluate import _params, _tree

    setup = build_eval_setup(tmp_path / "setup")
    dask_env.chdir(tmp_path)
    params = _params(reference=False)
    assert params.evaluate.dask_address is None
    args = (setup["optimized"], setup["model"], setup["prepared"])
    tasks.evaluate.run(params, *args, tmp_path / "local", "local:1", track=False, raw=setup["raw"])

    dask_env.setenv(ENV, dask_cli)
    dask.config.refresh()
    capfd.readouterr()
    metrics = tasks.evaluate.run(params, *args, tmp_path / "remote", track=False, raw=setup["raw"])
    assert _tree(tmp_path / "remote") == _tree(tmp_path / "local")
    source = f"{dask_cli} from Dask config scheduler-address (DASK_SCHEDULER_ADDRESS)"
    assert metrics["cluster"] == source
    timings = json.loads((tmp_path / "remote" / "report" / "timings.json").read_text())
    assert timings["cluster"] == source
    assert {u["worker"] for u in timings["units"]} == {next(iter(_workers(dask_cli)))}
    said = [x for x in capfd.readouterr().err.splitlines() if "Dask cluster" in x]
    assert said == [f"evaluate: Dask cluster {source}"], said


def _workers(address: str) -> list[str]:
    from distributed import Client

    with Client(address, timeout=30) as client:
        return sorted(client.scheduler_info()["workers"])
