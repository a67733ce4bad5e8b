"""The newcomer's first `factory run`, from scratch, N times: per-stage wall times, total, orchestration share.

Each run: a fresh `git clone` of this repository into a new temp dir (no `artifacts/`, no Prefect home, no
MLflow DB, no DVC cache, a HOME of its own: `tests/newcomer.py`), then either the README's first command
exactly (`--install`: `python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/factory run`,
install timed apart) or this environment reused (`python -m factory.cli run` from the clone's root: the
clone's code comes first on sys.path), then the clone is deleted (`--keep DIR` keeps them). Nothing is
shared between runs, so every run pays the first-start costs a newcomer pays.

Variants (`--variant LABEL=k=v[,k=v...]`, repeatable) run `--runs` times each, interleaved (A B A B ...:
a drift in the machine's load falls on every variant alike), so one command produces the whole acceptance
table, e.g. the default, one training thread and two other seeds:

    factory bench newcomer --runs 3 --variant default= --variant torch1=train.torch_threads=1 \\
        --variant seed1=synth.seed=1 --variant seed2=synth.seed=2 --json newcomer.json

`LABEL@REF=...` runs the code of git revision REF instead of the working tree (a clone checked out at REF, no
uncommitted files): the change against main in one sitting, paired run by run:

    factory bench newcomer --runs 3 --variant main@origin/main= --variant mine= --json ab.json

`--cpus 0.7` runs each clone inside a CPU quota (cgroup) of 0.7 CPUs: a slower machine, emulated.
Quote figures measured on a quiet machine only; the load average before and after each run is printed.
Output: one Markdown table row per run (paste-ready), then the median per variant; `--json` keeps all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from pfactory.promote import EvidenceError  # noqa: E402
from pfactory.promote.evidence import agreement_summary  # noqa: E402
from pfactory.storage.fsutil import atomic_write_json  # noqa: E402
from tests.newcomer import cpu_quota, fresh_clone, newcomer_env  # noqa: E402

STAGES = ("synth", "prepare", "train", "optimize", "evaluate", "promote")
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -q -e ."  # the README's install, quiet


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.system()}"


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parse_variant(text: str) -> tuple[str, list[str]]:
    label, sep, overrides = text.partition("=")
    if not sep or not label or label.startswith("@") or label.endswith("@"):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected LABEL[@REF]=k=v[,k=v...] (or LABEL= for none)"
        )
    parts, depth, cur = [], 0, ""
    for ch in overrides:  # split on commas outside brackets: `prepare.image_size=[104,32]` stays whole
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return label, [o for o in [*parts, cur] if o]


def split_ref(label: str) -> tuple[str, str | None]:
    """`"main@origin/main"` -> `("main", "origin/main")`; a label without `@` runs the working tree (None)."""
    name, sep, ref = label.partition("@")
    return (name, ref) if sep else (label, None)


def _clone_at(dst: Path, ref: str | None) -> Any:
    """A fresh clone of this repository: its working tree (uncommitted files copied over), or revision `ref`."""
    if ref is None:
        return fresh_clone(dst)
    clone = fresh_clone(dst, working_tree=False)
    try:
        subprocess.run(["git", "-C", str(dst), "checkout", "--quiet", "--detach", ref], check=True,
                       capture_output=True, text=True)  # fmt: skip
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--variant ...@{ref}: git checkout {ref} failed: {e.stderr.strip()[:200]}") from None
    commit = subprocess.run(["git", "-C", str(dst), "rev-parse", "HEAD"], capture_output=True, text=True)
    return type(clone)(clone.path, commit.stdout.strip(), [])


def one_run(
    label: str,
    overrides: list[str],
    install: bool,
    cpus: float | None,
    keep: Path | None,
    timeout_s: float,
    shared: Path | None = None,
    ref: str | None = None,
) -> dict[str, Any]:
    """Clone, (install,) run; returns the record of the run (figures, exit, where, how). `shared`: run in
    this directory's clone, made by the first run and kept (later runs reuse its state). `ref`: the clone is
    checked out at this git revision (else the working tree)."""
    work = shared or Path(tempfile.mkdtemp(prefix="pfactory-newcomer-", dir=keep))
    rec: dict[str, Any] = {"variant": label, "ref": ref, "overrides": overrides, "load_before": os.getloadavg()}
    try:
        fresh = not (work / "clone").exists()
        clone = _clone_at(work / "clone", ref) if fresh else None
        rec["from_scratch"] = fresh
        if clone is not None:
            rec.update(commit=clone.commit, dirty=clone.dirty)
        rec["clone"] = str(work / "clone")
        clone_path = work / "clone"
        venv = clone_path / ".venv"
        env = newcomer_env(work / "home", python=sys.executable)
        sets = [a for o in overrides for a in ("-S", o)]
        with cpu_quota(cpus) as quota:
            rec["quota"] = quota.how
            cpu0 = _children_cpu_s()
            rec["install_s"] = None  # None: no install in this run (this environment, or a shared clone's)
            if install and not venv.exists():
                # The system python3, as a newcomer has, and this user's (warm) pip cache: a cold one measures
                # the network, not the project.
                env_i = {**env, "PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", str(work))}
                env_i.pop("XDG_CACHE_HOME", None)
                t0 = time.perf_counter()
                p = subprocess.run(INSTALL, shell=True, cwd=clone_path, env=env_i, capture_output=True,
                                   text=True, preexec_fn=quota.preexec)  # fmt: skip
                rec["install_s"] = round(time.perf_counter() - t0, 1)
                if p.returncode != 0:
                    rec.update(exit=p.returncode, failure=f"install failed: {p.stderr.strip()[-300:]}")
                    return rec
            if venv.exists():  # the README's command: the clone's own `factory`
                cmd = [str(venv / "bin" / "factory"), "run", *sets, "--json"]
                env["PATH"] = str(venv / "bin") + os.pathsep + os.environ.get("PATH", "")
            else:  # this environment; `-m` from the clone's root puts the clone's code first on sys.path
                cmd = [sys.executable, "-m", "factory.cli", "run", *sets, "--json"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=clone_path, env=env, capture_output=True, text=True,
                               timeout=timeout_s, preexec_fn=quota.preexec)  # fmt: skip
            rec["command_s"] = round(time.perf_counter() - t0, 1)
            rec["cpu_s"] = round(_children_cpu_s() - cpu0, 1)
        rec["exit"] = p.returncode
        rec["load_after"] = os.getloadavg()
        rec["stderr_head"] = p.stderr.splitlines()[:6]  # the first-start lines, as the newcomer saw them
        (work / f"stderr-{label}-{time.strftime('%H%M%S')}.txt").write_text(p.stderr)
        if p.returncode != 0:
            lines = [ln for ln in p.stderr.splitlines() if ln.startswith("✗")]
            rec["failure"] = lines[0] if lines else p.stderr.strip()[-300:]
            rec["stderr_tail"] = p.stderr.splitlines()[-15:]
            return rec
        result = json.loads(p.stdout[p.stdout.index("{") :])
        rec.update(figures(result, rec["command_s"]))
        rec.update(accuracy(clone_path / "artifacts" / "runs"))
        return rec
    finally:
        if shared is not None or keep is not None:
            rec["kept"] = str(work)
        else:
            shutil.rmtree(work, ignore_errors=True)


def figures(result: dict[str, Any], command_s: float) -> dict[str, Any]:
    """The table's figures from `factory run --json`."""
    orch = result.get("orchestration") or {}
    work = orch.get("stage_work_s") or {}
    startup = orch.get("stage_startup_s") or 0.0
    outside = command_s - sum(work.values()) - startup
    kpis = result.get("kpis") or {}
    return {
        "stages_s": {s: result.get("timings_s", {}).get(s) for s in STAGES},
        "work_s": work,
        "flow_s": orch.get("total_s"),
        "orch_flow": orch.get("orchestration_fraction"),
        "orch_command": outside / command_s if command_s else None,
        "prefect_start_s": (result.get("startup") or {}).get("prefect_start_s"),
        "mAP": kpis.get("mAP"),
        "int8_delta_mAP": kpis.get("delta_mAP_vs_pytorch"),
        "parity": result.get("parity_passed"),
        "promotion": (result.get("promotion") or {}).get("decision"),
        "not_run": [s for s, r in (result.get("stages") or {}).items() if r.get("how") != "ran"],
    }


def accuracy(runs: Path) -> dict[str, Any]:
    """The run's accuracy evidence, read from its own files before the clone goes: per class AP (mean over
    the distance thresholds), AOE and the optimized artifact's AP@2m delta vs PyTorch (eval/kpis.json), and
    the primary artifact's confident-detection agreement (optimized/parity.json + backend.json)."""
    dirs = sorted(d for d in runs.glob("*") if (d / "artifacts" / "eval" / "kpis.json").is_file())
    if not dirs:
        return {"accuracy": None}
    art = dirs[-1] / "artifacts"
    kpis = json.loads((art / "eval" / "kpis.json").read_text())
    delta = (kpis.get("delta") or {}).get("classes") or {}
    out: dict[str, Any] = {
        "classes": {
            c: {
                "ap": v.get("mean_ap"),
                "aoe": v.get("aoe"),
                "num_gt": v.get("num_gt"),
                "delta_ap_2m": ((delta.get(c) or {}).get("ap") or {}).get("2.0"),
            }
            for c, v in (kpis.get("classes") or {}).items()
        }
    }
    try:
        p = json.loads((art / "optimized" / "backend.json").read_text())["primary"]
        primary = f"{p['backend']}/{p['precision']}"  # the key of parity.json "artifacts"
        parity_file = art / "optimized" / "parity.json"
        agreement = agreement_summary(json.loads(parity_file.read_text()), primary, str(parity_file))
        out["agreement"] = agreement or {"error": f"{parity_file}: no agreement for {primary}"}
    except (OSError, KeyError, TypeError, ValueError, EvidenceError) as e:
        out["agreement"] = {"error": f"{type(e).__name__}: {e}"}
    return {"accuracy": out}


def accuracy_line(i: int, r: dict[str, Any]) -> str:
    a = r.get("accuracy")
    if not a:
        return f"{r['variant']} {i}: -"
    cls = "; ".join(
        f"{c} AP {_f(v['ap'], '{:.3f}')} AOE {_f(v['aoe'], '{:.3f}')} ΔAP@2m {_f(v['delta_ap_2m'], '{:+.4f}')}"
        f" (N {v['num_gt']})"
        for c, v in a["classes"].items()
    )
    ag = a.get("agreement") or {}
    agree = (
        f"{ag['artifact']} match {ag['match_rate']:.3f} (score>=0.3, {ag['matched']} matched), p99 "
        f"{_f(ag['scores_p99'], '{:.3f}')}"
        if "match_rate" in ag
        else ag.get("error", "-")
    )
    return f"{r['variant']} {i}: {cls}; {agree}"


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


HEADER = (
    "| variant | run | exit | install s | Prefect start s | "
    + " | ".join(f"{s} s" for s in STAGES)
    + " | command s | orch. flow | orch. command | CPU s | mAP | INT8 Δ mAP | parity | promotion | restored"
    " | load before→after |"
)


def row(i: int, r: dict[str, Any]) -> str:
    st = r.get("stages_s") or {}
    load = f"{r['load_before'][0]:.2f}→{r['load_after'][0]:.2f}" if "load_after" in r else "-"
    cells = [
        r["variant"], str(i), str(r.get("exit")), _f(r.get("install_s")), _f(r.get("prefect_start_s")),
        *(_f(st.get(s)) for s in STAGES), _f(r.get("command_s")),
        _f(r.get("orch_flow"), "{:.1%}"), _f(r.get("orch_command"), "{:.1%}"), _f(r.get("cpu_s")),
        _f(r.get("mAP"), "{:.3f}"), _f(r.get("int8_delta_mAP"), "{:+.4f}"),
        {True: "passed", False: "FAILED"}.get(r.get("parity"), "-"), r.get("promotion") or "-",
        ",".join(r.get("not_run") or []) or "-", load,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def medians(runs: list[dict[str, Any]]) -> str:
    ok = [r for r in runs if r.get("exit") == 0]
    if not ok:
        return "no successful run"
    med = {
        s: statistics.median(r["stages_s"][s] for r in ok if r["stages_s"].get(s) is not None) for s in STAGES
    }
    cmd = statistics.median(r["command_s"] for r in ok)
    orch_f = statistics.median(r["orch_flow"] for r in ok)
    orch_c = statistics.median(r["orch_command"] for r in ok)
    stages = ", ".join(f"{s} {med[s]:.1f}" for s in STAGES)
    return (
        f"{len(ok)}/{len(runs)} exit 0; median s: {stages}; command {cmd:.1f} "
        f"(min {min(r['command_s'] for r in ok):.1f}, max {max(r['command_s'] for r in ok):.1f}); "
        f"orchestration {orch_f:.1%} of the flow, {orch_c:.1%} of the command"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="factory bench newcomer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="runs per variant, each from scratch (default 1)")
    ap.add_argument("--variant", action="append", type=parse_variant, default=[],
                    help="LABEL=k=v[,k=v...]: a parameter set (repeatable; default: one, 'default', with -S)")  # fmt: skip
    ap.add_argument("-S", "--set-param", action="append", default=[], help="override for every variant")
    ap.add_argument("--install", action="store_true",
                    help="run the README's install in each clone (timed) instead of reusing this environment")  # fmt: skip
    ap.add_argument(
        "--cpus", type=float, default=None, help="CPU quota per run (cgroup): emulate a slower machine"
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's clone under this directory")
    ap.add_argument("--shared-clone", type=Path, default=None, metavar="DIR",
                    help="one clone in DIR for every run: the first from scratch, the others reuse its state "
                    "(DVC run-cache, databases): a parameter matrix, not a newcomer figure")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per `factory run`")
    ap.add_argument("--json", type=Path, default=None, help="write every run's record here")
    args = ap.parse_args(argv)
    variants = args.variant or [("default", [])]
    for d in (args.keep, args.shared_clone):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
    env_note = (
        "the README's install in each clone"
        if args.install
        else f"this environment reused ({sys.executable})"
    )
    print(f"machine: {machine()}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(f"install: {env_note}; CPU quota: {args.cpus or 'none'}", flush=True)
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1), flush=True)
    records: list[dict[str, Any]] = []
    for i in range(1, args.runs + 1):
        for tagged, overrides in variants:
            label, ref = split_ref(tagged)
            rec = one_run(
                label, [*args.set_param, *overrides], args.install, args.cpus, args.keep, args.timeout,
                shared=args.shared_clone, ref=ref,
            )  # fmt: skip
            rec["run"] = i
            records.append(rec)
            print(row(i, rec), flush=True)
            if rec.get("exit") != 0:
                print(f"  {label} run {i}: {rec.get('failure')}", flush=True)
            if args.json:  # after every run: a long matrix stopped halfway keeps what it measured
                atomic_write_json(args.json, {"machine": machine(), "install": env_note, "runs": records})
    print()
    for tagged, _ in variants:
        label = split_ref(tagged)[0]
        print(f"{tagged}: {medians([r for r in records if r['variant'] == label])}")
    print("\naccuracy (per run):")
    for r in records:
        print("  " + accuracy_line(r["run"], r))
    if records and records[0].get("quota"):
        print(f"quota: {records[0]['quota']}")
    if records and records[0].get("dirty"):
        print(f"note: {len(records[0]['dirty'])} uncommitted working-tree files were copied into each clone")
    return 0 if all(r.get("exit") == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
