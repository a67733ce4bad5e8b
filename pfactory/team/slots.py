"""Fair training slots: training takes a slot of one Prefect global concurrency limit, held as a lease.

In:  a Prefect server (`PREFECT_API_URL`: the team's; without it there are no slots and nothing waits),
     `PFACTORY_TRAIN_SLOT_LIMIT` (the limit's name, default `pfactory-train`), `PFACTORY_TRAIN_SLOTS` (its size
     when it has to be created or changed; default 1 slot per machine), `PFACTORY_SLOT_LEASE_S` (default 60,
     the shortest lease Prefect's API accepts).
Out: `training_slot(run, user)` holds one slot around a block (`prefect.concurrency.sync.concurrency` with a
     lease: Prefect renews it from a background thread at 75 % of its duration while the holder lives, the
     server's repossessor revokes it once a SIGKILLed holder stops renewing, and a holder that finishes or
     fails releases it at once). While it waits it prints, and keeps printing when the holders change,
     `waiting for a training slot: 1 of 1 held by alice, run nightly, since 12:03`.
     Who holds and who waits is published beside the limit as Prefect variables
     `pfactory-slot-<key>` (`{"state": "waiting"|"holding", "user", "run", "host", "pid", "since",
     "heartbeat"}`; the Prefect UI lists them under Variables), refreshed every `HEARTBEAT_S` by a daemon
     thread and deleted on release; a record whose heartbeat is older than the lease is stale (its process
     died) and is ignored and removed by whoever reads it. `status()` reads the limit and those records:
     `factory team status`.
`record_on_run(run_id, slot)`: tags `pfactory.slot.acquired_at` / `pfactory.slot.released_at` (Unix seconds)
     and the metric `slot/wait_s` on the train stage's MLflow run.

Why a side record: a Prefect lease holder is only `{"type": "flow_run"|"task_run"|"deployment", "id": UUID}`
and the API lists no leases, so the names a waiting person needs are kept next to it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

LIMIT_ENV = "PFACTORY_TRAIN_SLOT_LIMIT"
SLOTS_ENV = "PFACTORY_TRAIN_SLOTS"
NO_SERVER_ENV = "PFACTORY_NO_SLOT_SERVER"  # "1": the flow that runs this stage found no Prefect server
LEASE_ENV = "PFACTORY_SLOT_LEASE_S"
DEFAULT_LIMIT = "pfactory-train"
LEASE_S = 60.0  # Prefect's API refuses shorter leases (ge=60, FEASIBILITY.md 2026-12-03)
POLL_S = 20.0  # one acquisition attempt waits this long before the waiting line is refreshed
FIRST_POLL_S = 1.0  # the first attempt: a run that has to wait says so within about a second
HEARTBEAT_S = 15.0
RECORD_PREFIX = "pfactory-slot-"


def enabled() -> bool:
    """Slots are taken only with a Prefect server configured (the team's services).

    A stage of `factory run` whose flow found none (`NO_SERVER_ENV`, set by the flow: the local ephemeral
    API) knows without importing Prefect (~2 s of a stage's start on 2 cores)."""
    if os.environ.get(NO_SERVER_ENV) == "1" and not os.environ.get("PREFECT_API_URL"):
        return False
    from prefect.settings import PREFECT_API_URL

    _follow_environment()
    return bool(PREFECT_API_URL.value())


def _follow_environment() -> None:
    """Make Prefect's client use the `PREFECT_API_URL`, `PREFECT_API_AUTH_STRING` and
    `PREFECT_API_SSL_CERT_FILE` of the environment as they are now.

    Prefect reads its settings once, when it is first imported; a process that imported it before the team's
    variables were exported (a test worker, a notebook, a `factory` command that ran a local flow first) would
    otherwise take slots on another server -- or on an ephemeral one, where nothing ever waits -- or send no
    (or a stale) auth string and get 401."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    url = os.environ.get("PREFECT_API_URL")
    if not url:
        return
    api = get_current_settings().api
    auth = api.auth_string.get_secret_value() if api.auth_string is not None else None
    if (url, os.environ.get("PREFECT_API_AUTH_STRING"), os.environ.get("PREFECT_API_SSL_CERT_FILE")) != (
        api.url,
        auth,
        api.ssl_cert_file,
    ):
        refresh_global_settings_context()


def limit_name() -> str:
    return os.environ.get(LIMIT_ENV) or DEFAULT_LIMIT


def _client() -> Any:
    from prefect.client.orchestration import get_client

    _follow_environment()
    return get_client(sync_client=True)


def ensure_limit(name: str, slots: int | None) -> Any:
    """The global concurrency limit `name`, created with `slots` (default 1) if missing, resized when `slots`
    is given and differs; returns Prefect's `GlobalConcurrencyLimitResponse`."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    with _client() as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots or 1))
            return client.read_global_concurrency_limit_by_name(name)
        if slots is not None and limit.limit != slots:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
            limit = client.read_global_concurrency_limit_by_name(name)
        return limit


@contextlib.contextmanager
def hold_limit(name: str, size: int, timeout_s: float, lease_s: float = LEASE_S) -> Iterator[None]:
    """Hold one slot of the global concurrency limit `name` (created, or resized, to `size` slots) for the
    block, as a lease of `lease_s` seconds (at least 60) that Prefect renews from a background thread while
    this process lives and the server repossesses once it stops (a SIGKILLed holder frees it within a
    lease + the repossessor's loop); released at once when the block ends. `TimeoutError` when no slot was
    free for `timeout_s` seconds (raised before the block runs). `size` 1: a lock held by the server (the
    promotion lock, `pfactory.promote.registry.registry_lock`)."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency

    ensure_limit(name, size)
    holder = ConcurrencyLeaseHolder(
        type="flow_run", id=os.environ.get("PREFECT__FLOW_RUN_ID") or uuid.uuid4()
    )
    with concurrency(name, occupy=1, timeout_seconds=timeout_s, lease_duration=max(lease_s, LEASE_S),
                     strict=True, holder=holder, raise_on_lease_renewal_failure=False):  # fmt: skip
        yield


@dataclass
class Slot:
    """One run's claim on a training slot."""

    limit: str | None
    """None: no slots configured (nothing was waited for)."""
    user: str = ""
    run: str = ""
    key: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    requested_at: float = field(default_factory=time.time)
    acquired_at: float | None = None
    released_at: float | None = None
    lease_s: float = LEASE_S

    @property
    def wait_s(self) -> float | None:
        return None if self.acquired_at is None else self.acquired_at - self.requested_at

    def record(self, state: str) -> dict[str, Any]:
        since = self.acquired_at if state == "holding" else self.requested_at
        return {"state": state, "user": self.user, "run": self.run, "host": socket.gethostname(),
                "pid": os.getpid(), "since": since, "heartbeat": time.time(), "limit": self.limit,
                "lease_s": self.lease_s}  # fmt: skip


def _publish(slot: Slot, state: str) -> None:
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    name = RECORD_PREFIX + slot.key
    value = slot.record(state)
    with _client() as client:
        if client.read_variable_by_name(name) is None:
            client.create_variable(VariableCreate(name=name, value=value, tags=["pfactory-slot"]))
        else:
            client.update_variable(VariableUpdate(name=name, value=value))


def _withdraw(slot: Slot) -> None:
    from prefect.exceptions import ObjectNotFound

    with _client() as client, contextlib.suppress(ObjectNotFound):
        client.delete_variable_by_name(RECORD_PREFIX + slot.key)


def records(limit: str | None = None) -> list[dict[str, Any]]:
    """The fresh holder/waiter records (of `limit`, default all), oldest first; stale ones are deleted."""
    from prefect.exceptions import ObjectNotFound

    now = time.time()
    out = []
    with _client() as client:
        for var in client.read_variables():
            if not var.name.startswith(RECORD_PREFIX) or not isinstance(var.value, dict):
                continue
            rec = {**var.value, "key": var.name.removeprefix(RECORD_PREFIX)}
            silent_s = now - float(rec.get("heartbeat", 0))
            rec["answering"] = silent_s <= 2 * HEARTBEAT_S  # a killed holder, its lease not yet repossessed
            if silent_s > float(rec.get("lease_s", LEASE_S)) + HEARTBEAT_S:
                with contextlib.suppress(ObjectNotFound):
                    client.delete_variable_by_name(var.name)  # its process stopped beating: gone
                continue
            if limit is None or rec.get("limit") == limit:
                out.append(rec)
    return sorted(out, key=lambda r: float(r.get("since", 0)))


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M")


def waiting_line(limit: Any, recs: list[dict[str, Any]], full: bool = False) -> str:
    """`waiting for a training slot: 1 of 1 held by alice, run nightly, since 12:03`. `full`: an acquisition
    attempt timed out, so all `limit.limit` slots are held (the server's count may lag a fresh lease)."""
    holders = [r for r in recs if r.get("state") == "holding"]
    who = "; ".join(
        f"{r['user']}, run {r['run']}, since {_clock(float(r['since']))}"
        + ("" if r.get("answering", True) else " (not answering: its lease runs out)")
        for r in holders
    )
    if not who:
        who = "a holder that no longer answers (its lease runs out within a minute)"
    active = limit.limit if full else limit.active_slots
    return f"waiting for a training slot: {active} of {limit.limit} held by {who}"


class _Heartbeat(threading.Thread):
    """Refreshes the slot's record every HEARTBEAT_S (a daemon: it dies with the process, as it must)."""

    def __init__(self, slot: Slot) -> None:
        super().__init__(name="pfactory-slot-heartbeat", daemon=True)
        self.slot, self.state, self.stop = slot, "waiting", threading.Event()

    def run(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is harmless; the lease is what counts
                _publish(self.slot, self.state)


def _say(line: str) -> None:
    """The stage's log (stderr) and the run's terminal (a progress event `factory run` shows on the train line)."""
    from pfactory.runtime.progress import emit

    print(line, file=sys.stderr, flush=True)
    emit("train", phase=line, force=True)


@contextlib.contextmanager
def training_slot(run: str, user: str, say: Callable[[str], None] | None = None) -> Iterator[Slot]:
    """Hold one training slot for the block (module docstring); a no-op without a Prefect server.

    `say(line)`: where the waiting lines go (default: the stage log and the `factory run` terminal, `_say`)."""
    if not enabled() or int(os.environ.get("RANK", "0")) != 0:  # DDP: rank 0 holds the slot for all ranks
        yield Slot(None)
        return
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency

    say = say or _say
    name = limit_name()
    lease_s = max(float(os.environ.get(LEASE_ENV) or LEASE_S), LEASE_S)
    size = os.environ.get(SLOTS_ENV)
    limit = ensure_limit(name, int(size) if size else None)
    slot = Slot(name, user, run, lease_s=lease_s)
    beat = _Heartbeat(slot)
    _publish(slot, "waiting")
    beat.start()
    holder = ConcurrencyLeaseHolder(
        type="flow_run", id=os.environ.get("PREFECT__FLOW_RUN_ID") or uuid.uuid4()
    )
    held: contextlib.ExitStack | None = None
    last = ""
    full = False  # an attempt timed out: every slot is taken, whatever the limit's (lagging) count says
    try:
        while held is None:
            limit = ensure_limit(name, None)
            if full or limit.active_slots >= limit.limit:
                recs = records(name)
                if not any(r.get("state") == "holding" for r in recs):
                    time.sleep(2.0)  # a run that took the slot a moment ago publishes its record right after
                    recs = records(name)
                line = waiting_line(limit, recs, full=full)
                if line != last:
                    say(line)
                    last = line
            stack = contextlib.ExitStack()
            try:
                # A short first attempt: a wait is said within a second even when the server's count of
                # active slots lags behind a lease taken a moment ago (seen under a loaded CI run).
                stack.enter_context(
                    concurrency(name, occupy=1, timeout_seconds=POLL_S if full else FIRST_POLL_S,
                                lease_duration=lease_s, strict=True, holder=holder,
                                raise_on_lease_renewal_failure=False)
                )  # fmt: skip
                held = stack
            except TimeoutError:
                full = True
                continue
        slot.acquired_at = time.time()
        beat.state = "holding"
        _publish(slot, "holding")
        if last:
            say(f"got a training slot after {slot.wait_s:.0f} s")
        with held:  # releases the lease at once when the block ends, however it ends
            yield slot
        slot.released_at = time.time()
    finally:
        beat.stop.set()
        with contextlib.suppress(Exception):
            _withdraw(slot)


def run_label() -> str:
    """The pipeline run's name (the MLflow parent run of `PFACTORY_PARENT_RUN_ID`), else the folder's name."""
    from pathlib import Path

    parent = os.environ.get("PFACTORY_PARENT_RUN_ID")
    if parent:
        with contextlib.suppress(Exception):  # a label only: never fail training over it
            from mlflow import MlflowClient

            return str(MlflowClient().get_run(parent).info.run_name)
    return Path.cwd().name


def user() -> str:
    from pfactory.tracking.identity import user_name

    return user_name()


def record_on_run(run_id: str | None, slot: Slot) -> None:
    """Tags `pfactory.slot.acquired_at` / `released_at` (Unix seconds) and metric `slot/wait_s` on run
    `run_id` (the train stage's MLflow run); nothing without a slot or a run."""
    if run_id is None or slot.limit is None or slot.acquired_at is None:
        return
    from mlflow import MlflowClient

    c = MlflowClient()
    c.set_tag(run_id, "pfactory.slot.limit", slot.limit)
    c.set_tag(run_id, "pfactory.slot.acquired_at", f"{slot.acquired_at:.3f}")
    if slot.released_at is not None:
        c.set_tag(run_id, "pfactory.slot.released_at", f"{slot.released_at:.3f}")
    c.log_metric(run_id, "slot/wait_s", float(slot.wait_s or 0.0))


def status(name: str | None = None) -> dict[str, Any]:
    """`{"limit", "slots", "active", "holding": [records], "waiting": [records]}` of the training limit."""
    from prefect.exceptions import ObjectNotFound

    name = name or limit_name()
    with _client() as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return {"limit": name, "slots": None, "active": 0, "holding": [], "waiting": []}
    recs = records(name)
    return {
        "limit": name,
        "slots": limit.limit,
        "active": limit.active_slots,
        "holding": [r for r in recs if r.get("state") == "holding"],
        "waiting": [r for r in recs if r.get("state") == "waiting"],
    }
