"""Issue 34's acceptance against one real team (`factory team up` in a temporary folder), printed as figures.

1. Three users (alice and carol: engineers, bob: maintainer) start `factory run` at the same moment, training
   slots = 1, tiny sizes, each its own train.seed (so DVC's run-cache restores no one's training): every exit
   code, every train interval from MLflow (`pfactory.slot.acquired_at` / `released_at`), whether they overlap,
   the other stages' intervals, the waiting lines, every registered version's and audit line's user.
2. SIGKILL of a run's process group while its training holds the slot: when the next waiting run got it, the
   lease settings that bound it, and the RUNNING runs left after the reaper.

Run (several minutes; heavy: under the lock): PYTHONPATH=$PWD flock /tmp/pf-bench.lock python scripts/team_acceptance.py
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.flows.pipeline_project import clean_env, make_project, tiny_args  # noqa: E402
from tests.team.conftest import free_port  # noqa: E402

USERS = {"alice": "engineer", "bob": "maintainer", "carol": "engineer"}
PW = {u: f"{u}-pw-0123456789" for u in USERS}


def clock(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-4]


def start_run(project: Path, team_env: dict[str, str], user: str, seed: int, logs: Path,
              *extra: str) -> subprocess.Popen:  # fmt: skip
    env = {**clean_env(project), **team_env, "MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": PW[user]}
    out = open(logs / f"{user}-{seed}.out", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", *tiny_args(), "-S", f"train.seed={seed}", "--name",
         f"{user}-s{seed}", "--no-checkout", *extra],
        cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def main() -> None:
    from mlflow import MlflowClient

    from pfactory.team.services import admin_env, client_env, down, up
    from pfactory.team.users import add_user

    root = Path(tempfile.mkdtemp(prefix="pf-team-acceptance-"))
    project = make_project(root / "project")
    logs = root / "logs"
    logs.mkdir()
    t0 = time.time()
    state = up(root / "team", "127.0.0.1", free_port(), free_port(), train_slots=1, say=print)
    print(f"team up in {time.time() - t0:.1f} s; uptime: {os.popen('uptime').read().strip()}")
    try:
        os.environ.update(admin_env(state))
        os.environ["PREFECT_API_URL"] = state.prefect_url
        for u, role in USERS.items():
            add_user(state.mlflow_url, u, role, PW[u])
        team_env = {**client_env(state), "PFACTORY_TRAIN_SLOT_LIMIT": state.slot_limit}  # URLs + Prefect auth

        part = sys.argv[sys.argv.index("--part") + 1] if "--part" in sys.argv else "all"
        if part == "2":
            return sigkill(project, team_env, logs, state, exp_of(state))
        print("\n== 1. three users' factory run at the same moment, 1 training slot")
        procs = {u: start_run(project, team_env, u, i + 1, logs) for i, u in enumerate(USERS)}
        codes = {u: p.wait(timeout=3600) for u, p in procs.items()}
        print(f"exit codes: {codes}; uptime: {os.popen('uptime').read().strip()}")
        c = MlflowClient(state.mlflow_url)
        exp = exp_of(state)  # the shared experiment and each user's own
        runs = c.search_runs(exp, max_results=500)
        parents = {r.info.run_id: r for r in runs if r.data.tags.get("pipeline") == "true"}
        trains = []
        for r in runs:
            if r.data.tags.get("stage") == "train":
                t = r.data.tags
                parent = parents.get(t.get("mlflow.parentRunId"))
                trains.append((float(t.get("pfactory.slot.acquired_at", "nan")),
                               float(t.get("pfactory.slot.released_at", "nan")), t.get("pfactory.user"),
                               parent.info.run_name if parent else "?", r.data.metrics.get("slot/wait_s")))  # fmt: skip
        trains.sort()
        print("train intervals (slot acquired -> released, MLflow tags):")
        for a, b, u, name, wait in trains:
            print(f"  {u:6s} {name:10s} {clock(a)} -> {clock(b)}  ({b - a:.1f} s; waited {wait:.1f} s)")
        overlap = any(trains[i + 1][0] < trains[i][1] for i in range(len(trains) - 1))
        print(f"train intervals overlap: {overlap}")
        print("other stages (MLflow run start -> end):")
        for r in sorted(runs, key=lambda r: r.info.start_time):
            st = r.data.tags.get("stage")
            if st and st != "train":
                print(f"  {r.data.tags.get('pfactory.user'):6s} {st:9s} {clock(r.info.start_time / 1e3)} -> "
                      f"{clock((r.info.end_time or 0) / 1e3)}")  # fmt: skip
        for f in sorted(logs.glob("*.out")):
            said = [ln.strip() for ln in f.read_text(errors="replace").splitlines() if "training slot" in ln]
            print(f"  {f.name}: {said[:2]}")
        for ws_log in sorted((project / "artifacts" / "runs").glob("*/logs/train.log")):
            said = [ln.strip() for ln in ws_log.read_text(errors="replace").splitlines() if "training slot" in ln]
            print(f"  {ws_log.parent.parent.name}/logs/train.log: {said[:2]}")
        print("registered versions:")
        for m in ("pfactory-detector-candidates", "pfactory-detector"):
            for mv in c.search_model_versions(f"name = '{m}'"):
                print(f"  {m}/{mv.version}: user {mv.tags.get('pfactory.user')}, decision "
                      f"{mv.tags.get('promotion.decision')}, by {mv.tags.get('promotion.by')}")  # fmt: skip
        from pfactory.promote.registry import audit_trail

        for m in ("pfactory-detector-candidates", "pfactory-detector"):
            for rec in audit_trail(c, m):
                print(f"  audit {m}: {rec['action']} {rec['from']} -> {rec['to']} by {rec['by']}")

        sigkill(project, team_env, logs, state, exp)
    finally:
        print(down(root / "team"))
        print(f"everything under {root}")


def exp_of(state) -> list[str]:
    """The ids of the team's experiments: the shared one and each user's (where their runs go)."""
    from mlflow import MlflowClient

    from pfactory.tracking.runs import experiment_ids

    return experiment_ids(MlflowClient(state.mlflow_url))


def sigkill(project: Path, team_env: dict[str, str], logs: Path, state, exp: list[str]) -> None:
    """Part 2: the victim trains long (40 epochs) so that it surely holds the slot when it is killed."""
    from mlflow import MlflowClient

    from pfactory.team import slots
    from pfactory.team.services import REPOSSESSOR_LOOP_S, SLOT_WAIT_S
    from pfactory.tracking.runs import reap_orphan_runs

    c = MlflowClient(state.mlflow_url)
    print("\n== 2. SIGKILL of a run holding the training slot")
    victim = start_run(project, team_env, "alice", 11, logs, "-S", "train.epochs=40")
    while not any(r["user"] == "alice" for r in slots.status(state.slot_limit)["holding"]):
        if victim.poll() is not None:
            raise SystemExit(f"the victim run ended ({victim.returncode}) before holding the slot")
        time.sleep(0.5)
    waiter = start_run(project, team_env, "carol", 12, logs)
    while not any(r["user"] == "carol" for r in slots.status(state.slot_limit)["waiting"]):
        time.sleep(0.5)
    killed = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()  # not a zombie of this script (a zombie's pid still "lives" for the reaper)
    print(f"killed alice's run (process group {victim.pid}) at {clock(killed)} while it held the slot")
    while not any(r["user"] == "carol" for r in slots.status(state.slot_limit)["holding"]):
        time.sleep(0.5)
    got = time.time()
    print(f"carol's run got the slot at {clock(got)}: {got - killed:.1f} s after the kill (lease "
          f"{slots.LEASE_S:g} s, repossessor loop {REPOSSESSOR_LOOP_S} s, retry cap {SLOT_WAIT_S} s, "
          f"poll of this script 0.5 s); uptime: {os.popen('uptime').read().strip()}")  # fmt: skip
    print(f"carol's run exit: {waiter.wait(timeout=3600)}")
    reaped = [r for e in exp for r in reap_orphan_runs(e)]
    running = c.search_runs(exp, "attributes.status = 'RUNNING'")
    print(f"reaped {len(reaped)} runs of the killed process (here; carol's stages reap at their start); "
          f"RUNNING left: {[(r.info.run_name, r.data.tags.get('pfactory.pid')) for r in running]}")  # fmt: skip
    killed_runs = c.search_runs(exp, "attributes.status = 'KILLED'")
    print(f"KILLED runs: {[(r.info.run_name, r.data.tags.get('pfactory.user'), r.data.tags.get('pfactory.ended_by')) for r in killed_runs]}")
    held = [r for r in slots.status(state.slot_limit)["holding"]]
    print(f"slot holders now: {held}")


if __name__ == "__main__":
    main()
