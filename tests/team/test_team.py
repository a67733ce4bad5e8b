"""A team's factory against real servers on 127.0.0.1 (tests/team/conftest.py): identities, permissions the
server enforces, the promotion of a candidate by copy, refusals (one line, exit 77, audited), training slots."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.promote.helpers import build_bench, candidate, honest_candidate, promote_params, real_evaluate

from .conftest import ROOT

MODEL = "pfactory-detector"
CANDIDATES = "pfactory-detector-candidates"


def _cli(team, user: str | None, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`factory ...` through the real console entry (`factory.cli.main`: errors -> one line + exit code)."""
    return subprocess.run(
        [sys.executable, "-c", "from factory.cli import main; main()", *args],
        cwd=cwd, env=team.subprocess_env(user), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _last_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and "Warning" not in ln and "import" not in ln]
    return lines[-1] if lines else ""


def test_secrets_are_0600_and_never_in_the_export_lines(team) -> None:
    from pfactory.team.services import env_lines

    d = Path(team.state.dir)
    for f in (d / "secrets" / "admin_password", d / "secrets" / "flask_secret", d / "mlflow" / "auth.ini"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE((d / "secrets").stat().st_mode) == 0o700
    text = "\n".join(env_lines(team.state))
    assert (d / "secrets" / "admin_password").read_text().strip() not in text
    assert "team.json" not in text and (d / "secrets" / "admin_password").read_text() not in (d / "team.json").read_text()
    assert f"export MLFLOW_TRACKING_URI={team.state.mlflow_url}" in text


def test_identity_permissions_and_unauthenticated(team, monkeypatch) -> None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pfactory.runtime.failures import explain
    from pfactory.tracking import identity
    from pfactory.tracking.identity import NotAuthenticated

    team.become(monkeypatch, "alice")
    me = identity.current()
    assert (me.username, me.is_admin) == ("alice", False)
    assert identity.permission(me, MODEL) == "READ" and identity.permission(me, CANDIDATES) == "EDIT"
    team.become(monkeypatch, "bob")
    assert identity.permission(identity.current(), MODEL) == "MANAGE"

    team.become(monkeypatch, None)  # no credentials: the server's 401, one clear line
    with pytest.raises(NotAuthenticated, match="401 not authenticated"):
        identity.current()
    with pytest.raises(MlflowException) as raw:
        MlflowClient().get_registered_model(MODEL)
    known = explain(raw.value)
    assert known is not None, (type(raw.value), getattr(raw.value, "error_code", None), str(raw.value)[:300])
    line, code = known.reason, known.code
    assert code == 77 and "401" in line and "\n" not in line and "MLFLOW_TRACKING_USERNAME" in line


def test_engineer_registers_maintainer_promotes_by_copy(team, tmp_path_factory, tmp_path, monkeypatch) -> None:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    import tasks.promote
    from pfactory.promote import registry as reg
    from pfactory.promote.candidates import promote_ref
    from pfactory.promote.promotion import lineage, rollback
    from pfactory.tracking.identity import PermissionRefused

    bench = build_bench(tmp_path_factory.getbasetemp() / "promote-bench")
    prm = promote_params(model_name=MODEL, min_map=0.0)  # the bench's tiny model: verification, not quality
    monkeypatch.chdir(tmp_path)

    # alice (engineer) runs the promote stage: a gated candidate in the candidates model, not promoted, exit 0.
    team.become(monkeypatch, "alice")
    forged = candidate(tmp_path, bench, "c0", 0.0)  # kpis.json: ground truth scored as its own detections
    out = tasks.promote.run(prm, forged["optimized"], forged["eval"], bench["prepared_a"], tmp_path / "release")
    assert out["decision"] == "awaiting-maintainer", out["reason"]
    forged_version = out["version"]
    c = honest_candidate(tmp_path, bench, "c1")
    out = tasks.promote.run(prm, c["optimized"], c["eval"], bench["prepared_a"], tmp_path / "release")
    assert out["decision"] == "awaiting-maintainer", out["reason"]
    assert out["model"] == CANDIDATES and "bob" in out["who_may_promote"]
    v = out["version"]
    client = MlflowClient()
    mv = client.get_model_version(CANDIDATES, str(v))
    assert mv.tags["pfactory.user"] == "alice" and mv.tags["promotion.decision"] == "awaiting-maintainer"
    run = client.get_run(out["mlflow_run_id"])
    assert run.data.tags["pfactory.user"] == "alice" and run.data.tags["mlflow.user"] == "alice"
    # her run is in her own experiment: the maintainer below reads it (READ) and cannot edit it (403)
    assert run.info.experiment_id == client.get_experiment_by_name("perception-factory/alice").experiment_id
    assert reg.champion(client, MODEL, "champion") is None

    # alice calls MLflow directly: the server refuses the alias move (403), not only the factory.
    with pytest.raises(MlflowException) as denied:
        client.set_registered_model_alias(MODEL, "champion", "1")
    assert denied.value.get_http_status_code() == 403

    # alice's `factory promote`: one line, exit 77, nothing changed, the refusal audited.
    res = _cli(team, "alice", "promote", f"{CANDIDATES}/{v}", "--data", str(bench["prepared_a"]),
               "--release", str(tmp_path / "release"))  # fmt: skip
    assert res.returncode == 77, res.stderr[-2000:]
    line = _last_line(res.stderr)
    assert line.startswith("promote: promote refused: user 'alice' has READ on registered model 'pfactory-detector'"), line
    assert "needs EDIT" in line and "bob" in line
    assert reg.champion(client, MODEL, "champion") is None
    refusals = [r for r in reg.audit_trail(client, CANDIDATES) if r["action"] == "refused-promote"]
    assert refusals and refusals[-1]["by"].startswith("alice@") and refusals[-1]["to"] == v

    # bob (maintainer) promotes the forged one: promotion recomputes its KPIs from its artifact (a team's
    # default, promote.verify_candidate "team") and refuses it with both figures; nothing moves.
    team.become(monkeypatch, "bob")
    res = promote_ref(prm, f"{CANDIDATES}/{forged_version}", bench["prepared_a"], tmp_path / "release-bob",
                      evaluate_fn=real_evaluate)  # fmt: skip
    assert res["decision"] == "refused" and res["gates"][0]["name"] == "candidate_verified", res["reason"]
    assert f"recorded mAP {round(forged['kpis']['mAP'], 4):g}, recomputed " in res["reason"]
    assert reg.champion(MlflowClient(), MODEL, "champion") is None
    assert reg.audit_trail(MlflowClient(), CANDIDATES)[-1]["action"] == "refused-verify"

    # bob promotes the honest one: copied into the production model, champion there, who did what recorded.
    res = promote_ref(prm, f"{CANDIDATES}/{v}", bench["prepared_a"], tmp_path / "release-bob",
                      evaluate_fn=real_evaluate)  # fmt: skip
    assert res["decision"] == "promoted", res["reason"]
    pv = res["production_version"]
    client = MlflowClient()
    assert reg.champion(client, MODEL, "champion") == pv
    prod = client.get_model_version(MODEL, str(pv))
    assert prod.tags["pfactory.user"] == "alice" and prod.tags["promotion.by"].startswith("bob@")
    assert (prod.tags["candidate.model"], prod.tags["candidate.version"]) == (CANDIDATES, str(v))
    assert reg.audit_trail(client, MODEL)[-1]["by"].startswith("bob@")
    info = lineage(f"{MODEL}@champion", MODEL)
    assert info["candidate"] == {"model": CANDIDATES, "version": v} and info["run"]["id"] == mv.run_id
    assert info["run"]["experiment_id"] == run.info.experiment_id  # lineage follows it into her experiment
    with pytest.raises(MlflowException) as denied:
        client.set_tag(mv.run_id, "pfactory.user", "bob")
    assert denied.value.get_http_status_code() == 403
    assert (Path(mlflow.artifacts.download_artifacts(f"models:/{MODEL}@champion", dst_path=str(tmp_path / "dl")))
            / "optimized").is_dir()  # fmt: skip

    # alice's rollback: refused before anything moves.
    team.become(monkeypatch, "alice")
    with pytest.raises(PermissionRefused, match="rollback refused: user 'alice' has READ"):
        rollback(prm, tmp_path / "release")
    assert reg.champion(MlflowClient(), MODEL, "champion") == pv

    # No credentials at all: MLflow's 401 becomes one line and exit 77.
    res = _cli(team, None, "lineage", f"{MODEL}@champion")
    assert res.returncode == 77 and "401 not authenticated" in _last_line(res.stderr), res.stderr[-2000:]


LOCK_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pfactory.promote import registry as reg
    try:
        with reg.registry_lock(os.environ["MLFLOW_TRACKING_URI"], float(sys.argv[2]), model=sys.argv[1]) as held:
            print("held", held, time.time(), flush=True)
            time.sleep(float(sys.argv[3]))
            print("released", time.time(), flush=True)
    except reg.LockTimeout as e:
        print("timeout", e, flush=True)
        sys.exit(1)
    """
)


def _lock_holder(team, clone: Path, timeout_s: float, hold_s: float) -> subprocess.Popen:
    """A promotion's lock taken in another clone (its own working directory, so its own file lock)."""
    clone.mkdir(exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, MODEL, str(timeout_s), str(hold_s)], stdout=subprocess.PIPE,
        text=True, env=team.subprocess_env("bob"), cwd=clone,
    )  # fmt: skip


def test_the_promotion_lock_is_held_by_the_server_not_by_a_clone(team, tmp_path) -> None:
    """Three clones (three working directories, so three different file locks) take the promotion lock of
    the same model: it is the team's Prefect limit `promote-<model>`, so while the first holds it the second
    times out with one line naming the limit, and the third waits and gets it only after the first released
    it. (Each in its own process, as promotions run.)"""
    from pfactory.promote import registry as reg

    first = _lock_holder(team, tmp_path / "clone-a", 60.0, 15.0)
    line = first.stdout.readline()
    assert line.startswith(f"held promote-{MODEL} "), line
    gives_up = _lock_holder(team, tmp_path / "clone-b", 2.0, 0.0)
    waits = _lock_holder(team, tmp_path / "clone-c", 120.0, 0.0)
    out, _ = gives_up.communicate(timeout=120)
    assert gives_up.returncode == 1, out
    assert out.startswith("timeout ") and f"the promotion lock 'promote-{MODEL}'" in out, out
    assert "held by another promotion" in out and len(out.strip().splitlines()) == 1, out
    out, _ = waits.communicate(timeout=180)
    assert waits.returncode == 0, out
    acquired = float(out.splitlines()[0].split()[-1])
    assert first.wait(60) == 0
    released = float(first.stdout.read().split()[-1])
    assert acquired >= released, "two promotions held the lock at once"
    # A local registry (no team server) takes the file lock.
    assert reg.server_lock_name("sqlite:///mlflow.db", MODEL) is None


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pfactory.team import slots
    with slots.training_slot(sys.argv[1], sys.argv[2]) as s:
        print("acquired", s.acquired_at, flush=True)
        end = time.time() + float(sys.argv[3])
        while time.time() < end:
            if sys.argv[4] == "busy":  # CPU-bound Python in the main thread, as a training step loop
                sum(i * i for i in range(20000))
            else:
                time.sleep(0.1)
    print("released", s.released_at, flush=True)
    """
)


def _holder(team, user: str, run: str, hold_s: float, work: str = "sleep") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, run, user, str(hold_s), work], stdout=subprocess.PIPE,
                         text=True, env=team.subprocess_env(user), cwd=ROOT)  # fmt: skip
    line = p.stdout.readline()
    assert line.startswith("acquired"), line
    return p


def test_slots_use_the_team_server_even_when_prefect_was_imported_before(team, monkeypatch) -> None:
    """Prefect reads PREFECT_API_URL once, at import. A process that imported it earlier (an xdist worker that
    ran a local flow; a notebook) must still take its slot on the team's server, not on the URL it saw first:
    that mismatch let a waiting run take a slot on another server and say nothing (two CI runs)."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import PREFECT_API_URL

    from pfactory.team import slots

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # discard port: nothing answers
    refresh_global_settings_context()
    assert PREFECT_API_URL.value() == "http://127.0.0.1:9/api"
    team.become(monkeypatch, "bob")  # exports the team's variables after Prefect read its settings
    status = slots.status()
    assert status["limit"] == team.state.slot_limit and status["slots"] == 1
    assert PREFECT_API_URL.value() == team.state.prefect_url


WAITER = textwrap.dedent(
    """
    import dataclasses, json, sys
    from pfactory.team import slots
    said = []
    with slots.training_slot(sys.argv[1], sys.argv[2], say=said.append) as slot:
        status = slots.status()
    after = slots.status()
    print(json.dumps({"said": said, "slot": dataclasses.asdict(slot), "during": status["holding"],
                      "active": status["active"], "after": [after["active"], after["holding"]]}), flush=True)
    """
)


@pytest.mark.timeout(300)  # normally < 60 s
def test_training_slot_waits_says_who_and_records_on_the_run(team, monkeypatch) -> None:
    """The waiting run is its own process, as a train stage is (a long-lived process that had swapped
    PREFECT_API_URL between tests was seen to stay waiting inside Prefect's slot-acquisition client while the
    server had the slot free)."""
    import json

    import mlflow
    from mlflow import MlflowClient

    from pfactory.team import slots

    team.become(monkeypatch, "bob")
    holder = _holder(team, "alice", "run-of-alice", 20.0)  # long enough that bob waits on a loaded machine
    t0 = time.time()
    waiter = subprocess.run([sys.executable, "-c", WAITER, "run-of-bob", "bob"], capture_output=True, text=True,
                            env=team.subprocess_env("bob"), cwd=ROOT, timeout=240)  # fmt: skip
    assert waiter.returncode == 0, waiter.stderr[-3000:]
    got = json.loads(waiter.stdout.strip().splitlines()[-1])
    said, slot = got["said"], slots.Slot(**got["slot"])
    assert [r["user"] for r in got["during"]] == ["bob"] and got["active"] == 1
    assert holder.wait(60) == 0
    released = float(holder.stdout.read().split()[-1])
    assert said and said[0].startswith("waiting for a training slot: 1 of 1 held by alice, run run-of-alice, since ")
    assert slot.acquired_at >= released and slot.wait_s > 0 and slot.released_at >= slot.acquired_at
    assert slot.acquired_at - released < 15, "a freed slot is taken within the server's retry cap (5 s) + jitter"
    assert time.time() - t0 < 90
    assert got["after"] == [0, []]

    from pfactory.tracking.runs import experiment_id

    mlflow.set_tracking_uri(team.state.mlflow_url)
    run_id = MlflowClient().create_run(experiment_id(ROOT), tags={"stage": "train"}).info.run_id  # bob's
    slots.record_on_run(run_id, slot)
    run = MlflowClient().get_run(run_id)
    assert float(run.data.tags["pfactory.slot.acquired_at"]) == pytest.approx(slot.acquired_at, abs=1e-3)
    assert float(run.data.tags["pfactory.slot.released_at"]) == pytest.approx(slot.released_at, abs=1e-3)
    assert run.data.metrics["slot/wait_s"] == pytest.approx(slot.wait_s)


@pytest.mark.full
def test_sigkilled_holder_slot_is_back_within_90_s(team, monkeypatch) -> None:
    """Lease 60 s (Prefect's minimum) + repossessor loop 5 s + retry cap 5 s (`factory team up`'s settings)."""
    from pfactory.team import slots

    team.become(monkeypatch, "bob")
    holder = _holder(team, "alice", "killed-run", 600.0)
    killed = time.time()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with slots.training_slot("after-kill", "bob", say=lambda _line: None) as slot:
        pass
    assert slot.acquired_at - killed < 90


@pytest.mark.full
def test_lease_is_renewed_while_both_cores_are_busy(team, monkeypatch) -> None:
    """A holder busy in Python for 1.6 leases while two more processes spin on both cores keeps its slot: the
    waiter gets it only after the holder released it (a starved renewal would free it after 60-70 s)."""
    from pfactory.team import slots

    team.become(monkeypatch, "bob")
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        holder = _holder(team, "alice", "busy-run", 1.6 * slots.LEASE_S, work="busy")
        with slots.training_slot("waiter", "bob", say=lambda _line: None) as slot:
            pass
        assert holder.wait(60) == 0
        released = float(holder.stdout.read().split()[-1])
        assert slot.acquired_at >= released, "the busy holder lost its lease: renewal was starved"
    finally:
        for p in spin:
            p.kill()
            p.wait()


PROMOTER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from pfactory.promote.candidates import promote_ref
    from tests.promote.helpers import promote_params, real_evaluate
    prm = promote_params(model_name=sys.argv[1], min_map=0.0)
    print("ready", flush=True)
    sys.stdin.readline()  # both start at the same moment
    r = promote_ref(prm, sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), evaluate_fn=real_evaluate)
    print(json.dumps({k: r.get(k) for k in ("decision", "champion_before", "champion_after", "reason")}), flush=True)
    """
)


@pytest.mark.full
def test_two_maintainers_promoting_at_once_from_two_clones(team, tmp_path_factory, tmp_path, monkeypatch) -> None:
    """Two promotions of two gated candidates started at the same moment in two clones (their own working
    directories): both exit 0 and are promoted, one after the other; the second was gated against the champion
    the first one set; the audit shows the two moves in that order."""
    from mlflow import MlflowClient

    import tasks.promote
    from pfactory.promote import registry as reg

    bench = build_bench(tmp_path_factory.getbasetemp() / "promote-bench")
    prm = promote_params(model_name=MODEL, min_map=0.0)
    monkeypatch.chdir(tmp_path)
    team.become(monkeypatch, "alice")
    versions = []
    for name in ("race-a", "race-b"):
        c = honest_candidate(tmp_path, bench, name)
        out = tasks.promote.run(prm, c["optimized"], c["eval"], bench["prepared_a"], tmp_path / "release")
        assert out["decision"] == "awaiting-maintainer", out["reason"]
        versions.append(out["version"])
    team.become(monkeypatch, "bob")
    before = reg.champion(MlflowClient(), MODEL, "champion")
    trail_before = len(reg.audit_trail(MlflowClient(), MODEL))
    procs = []
    for v, clone in zip(versions, ("clone-a", "clone-b")):
        (tmp_path / clone).mkdir()
        p = subprocess.Popen(
            [sys.executable, "-c", PROMOTER, MODEL, f"{CANDIDATES}/{v}", str(bench["prepared_a"]),
             str(tmp_path / clone / "release")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=team.subprocess_env("bob"), cwd=tmp_path / clone,
        )  # fmt: skip
        assert p.stdout.readline().startswith("ready")
        procs.append(p)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["decision"] for r in results] == ["promoted", "promoted"], [r["reason"] for r in results]
    first, second = sorted(results, key=lambda r: r["champion_before"] != before)
    assert first["champion_before"] == before and second["champion_before"] == first["champion_after"]
    assert f"vs champion v{first['champion_after']}" in second["reason"], second["reason"]
    client = MlflowClient()
    assert reg.champion(client, MODEL, "champion") == second["champion_after"]
    moves = [(a["action"], a["from"], a["to"]) for a in reg.audit_trail(client, MODEL)[trail_before:]]
    assert moves == [("promote", before, first["champion_after"]), ("promote", first["champion_after"],
                                                                     second["champion_after"])], moves
    print(f"\ntwo promotions at once: {[(r['champion_before'], r['champion_after']) for r in results]}, audit {moves}")
