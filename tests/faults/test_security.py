"""Security probes: nothing from a data, model or artifact directory is ever unpickled or executed, dataset
paths stay inside their root, no shell is built from user strings, secrets never leave the environment.

1. A static scan (AST) of everything the factory runs (pfactory/, tasks/, flows/, kernels/): no pickle /
   marshal / shelve / joblib / dill loads, `torch.load` only with `weights_only=True`, no `np.load(...,
   allow_pickle=True)`, no unsafe YAML loader, no eval/exec, no `shell=True` / `os.system` / `os.popen`,
   no loading of pickled MLflow model flavors.
2. A malicious pickle (whose unpickling would create a marker file) planted under every file name the CLI
   loads from a prepared, model or optimized directory, and the command that reads it run: the marker
   never appears, and the command either refuses in one line or does not read the file.
3. YAML tags that construct Python objects in params.yaml are refused.
4. Canary secrets in the environment (tracking token, S3 keys, a password in the tracking URI) appear in no
   output, log, MLflow record or file a run writes.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from tests.faults.conftest import REPO, factory, one_line_error
from tests.faults.test_errors import PREPARE, TRAIN, malicious_pickle

SCANNED = ("pfactory", "tasks", "flows", "kernels")


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(func: ast.expr) -> str:
    """`a.b.c` of a call's function; "" when the chain starts at an expression (`model.to(d).eval()` is a
    method of a value, not the builtin `eval`)."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return ""
    parts.append(func.id)
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


FORBIDDEN_CALLS = {
    "pickle.load": "unpickles", "pickle.loads": "unpickles", "pickle.Unpickler": "unpickles",
    "cPickle.load": "unpickles", "cloudpickle.load": "unpickles", "cloudpickle.loads": "unpickles",
    "dill.load": "unpickles", "dill.loads": "unpickles", "joblib.load": "unpickles",
    "marshal.load": "unmarshals code", "marshal.loads": "unmarshals code", "shelve.open": "unpickles",
    "pandas.read_pickle": "unpickles", "pd.read_pickle": "unpickles",
    "yaml.unsafe_load": "constructs arbitrary objects", "yaml.full_load": "constructs Python objects",
    "os.system": "runs a shell", "os.popen": "runs a shell",
    "mlflow.pytorch.load_model": "unpickles a whole model", "mlflow.sklearn.load_model": "unpickles",
    "torch.jit.load": "loads code", "eval": "evaluates a string", "exec": "executes a string",
}  # fmt: skip


def scan(root: Path = REPO) -> list[str]:
    """`path:line: what` for every unsafe call in the factory's code (module docstring, point 1)."""
    found = []
    for d in SCANNED:
        for path in sorted((root / d).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for call in _calls(tree):
                name = _name(call.func)
                where = f"{path.relative_to(root)}:{call.lineno}"
                if name in FORBIDDEN_CALLS:
                    found.append(f"{where}: {name} ({FORBIDDEN_CALLS[name]})")
                elif name.endswith("torch.load"):
                    if not _is_true(_kw(call, "weights_only")):
                        found.append(f"{where}: torch.load without weights_only=True")
                elif name in ("np.load", "numpy.load") and _is_true(_kw(call, "allow_pickle")):
                    found.append(f"{where}: np.load(allow_pickle=True)")
                elif name in ("yaml.load", "yaml.load_all"):
                    loader = _kw(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
                    if not (loader is not None and _name(loader).endswith(("SafeLoader", "CSafeLoader"))):
                        found.append(f"{where}: {name} without a SafeLoader")
                elif name.startswith("subprocess.") and _is_true(_kw(call, "shell")):
                    found.append(f"{where}: {name}(shell=True)")
    return found


def test_static_scan_finds_no_unsafe_load_exec_or_shell(ledger) -> None:
    found = scan()
    ledger.record("security", "static scan: no pickle/marshal/unsafe YAML/eval/exec/shell, torch.load weights_only",
                  not found, lost=len(found), detail="; ".join(found) or f"{len(SCANNED)} packages clean")  # fmt: skip
    assert not found, "\n".join(found)


def test_the_scan_catches_what_it_looks_for(tmp_path: Path) -> None:
    """The scan is not vacuous: each forbidden pattern planted in a copy is found."""
    (tmp_path / "pfactory").mkdir()
    for d in SCANNED[1:]:
        (tmp_path / d).mkdir()
    (tmp_path / "pfactory" / "bad.py").write_text(
        "import pickle, torch, yaml, subprocess, numpy as np, os\n"
        "pickle.loads(b'')\ntorch.load('x')\ntorch.load('x', weights_only=False)\nyaml.load('a')\n"
        "np.load('x', allow_pickle=True)\nsubprocess.run('ls', shell=True)\nos.system('ls')\neval('1')\n"
        "yaml.load('a', Loader=yaml.SafeLoader)\ntorch.load('x', weights_only=True)\n"
    )
    found = scan(tmp_path)
    assert len(found) == 8, found


# ---------------------------------------------------------------------------------------------------------
# Planted pickles


@pytest.fixture(scope="module")
def artifacts(clean_kitti: Path, tmp_path_factory) -> dict[str, Path]:
    """A real prepared dir, trained model dir (a few steps) and optimized dir (ONNX Runtime FP32)."""
    root = tmp_path_factory.mktemp("security")
    prepared, model, optimized = root / "prepared", root / "model", root / "optimized"
    r = factory(
        "prepare",
        "--raw",
        str(clean_kitti),
        "--out",
        str(prepared),
        *PREPARE,
        "-S",
        "prepare.val_fraction=0.5",
    )
    assert r.code == 0, r.text
    assert json.loads((prepared / "manifest.json").read_text())["counts"]["val"] > 0
    r = factory("train", "--data", str(prepared), "--out", str(model), *TRAIN, "-S", "train.max_steps=2")
    assert r.code == 0, r.text
    r = factory("optimize", "--model", str(model), "--data", str(prepared), "--out", str(optimized),
                "--backend", "onnxruntime", "--precision", "fp32", *OPT)  # fmt: skip
    assert r.code == 0, r.text
    return {"prepared": prepared, "model": model, "optimized": optimized}


OPT = ["-S", "optimize.parity.frames=2", "-S", "optimize.latency.iterations=2", "-S", "optimize.latency.warmup=1",
       "-S", "optimize.latency.batch_sizes=[1]", "-S", "optimize.parity.split=val"]  # fmt: skip


def _commands(kind: str, d: dict[str, Path], out: Path) -> list[list[str]]:
    """The CLI commands that read a directory of `kind`."""
    train = [
        "train",
        "--data",
        str(d["prepared"]),
        "--out",
        str(out / "model"),
        *TRAIN,
        "-S",
        "train.max_steps=1",
    ]
    optimize = ["optimize", "--model", str(d["model"]), "--data", str(d["prepared"]), "--out", str(out / "opt"),
                "--backend", "onnxruntime", "--precision", "fp32", *OPT]  # fmt: skip
    evaluate = ["evaluate", "--model", str(d["optimized"]), "--data", str(d["prepared"]), "--reference",
                str(d["model"]), "--out", str(out / "eval"), "--no-track", "--dask", "local:1"]  # fmt: skip
    return {"prepared": [train, evaluate], "model": [optimize, evaluate], "optimized": [evaluate]}[kind]


def _targets(d: dict[str, Path]) -> list[tuple[str, str]]:
    """(kind, relative file) for every file of the three directories (the CLI may read any of them)."""
    out = []
    for kind in ("prepared", "model", "optimized"):
        for p in sorted(d[kind].rglob("*")):
            if p.is_file():
                out.append((kind, p.relative_to(d[kind]).as_posix()))
    out.append(("model", "checkpoint.pt"))  # train resumes from its --out: planted there below
    return list(dict.fromkeys(out))


def test_planted_pickles_never_run(artifacts: dict[str, Path], tmp_path: Path, full: bool, ledger) -> None:
    targets = _targets(artifacts)
    if not full:  # CI: the files a loader opens directly (the full run plants every file)
        keep = ("manifest.json", "model.pt", "model_config.json", "checkpoint.pt", "backend.json", "model.onnx",
                "shard-00000.parquet")  # fmt: skip
        targets = [t for t in targets if Path(t[1]).name in keep]
    failures = []
    for kind, rel in targets:
        work = tmp_path / f"{kind}-{rel.replace('/', '_')}"
        marker = work / "PWNED"
        if rel == "checkpoint.pt":  # train resumes from its --out (work/model): planted there
            (work / "model").mkdir(parents=True)
            (work / "model" / "checkpoint.pt").write_bytes(malicious_pickle(marker))
            commands = [_commands("prepared", artifacts, work)[0]]
        else:
            d = {k: (work / k if k == kind else v) for k, v in artifacts.items()}
            shutil.copytree(artifacts[kind], d[kind])
            (d[kind] / rel).write_bytes(malicious_pickle(marker))
            commands = _commands(kind, d, work)
        for cmd in commands:
            r = factory(*cmd)
            ran = marker.exists()
            clean = r.code == 0 or one_line_error(r)
            ok = not ran and clean and "weights_only=False" not in r.text
            ledger.record("security", f"pickle planted as {kind}/{rel}, read by `factory {cmd[0]}`", ok,
                          lost=int(ran), detail="executed!" if ran else (r.err.strip().splitlines() or ["ok"])[-1][:150])  # fmt: skip
            if not ok:
                failures.append(f"{kind}/{rel} via {cmd[0]}: ran={ran} exit={r.code}: {r.text[-600:]}")
    assert not failures, "\n\n".join(failures)


def test_yaml_object_tags_are_refused(tmp_path: Path, ledger) -> None:
    marker = tmp_path / "PWNED"
    for tag in (f'!!python/object/apply:os.system ["touch {marker}"]', "!!python/name:os.system"):
        path = tmp_path / "params.yaml"
        path.write_text(f"train:\n  lr: {tag}\n")
        r = factory("params", "--params", str(path))
        ok = r.code == 2 and one_line_error(r) and not marker.exists()
        ledger.record("security", f"params.yaml tag {tag.split()[0]}", ok, detail=r.err.strip()[:150])
        assert ok, r.text


# ---------------------------------------------------------------------------------------------------------
# Secrets

CANARIES = {
    "MLFLOW_TRACKING_TOKEN": "canary-token-7f3a91",
    "AWS_ACCESS_KEY_ID": "AKIACANARY7F3A91",
    "AWS_SECRET_ACCESS_KEY": "canary-secret-key-7f3a91",
    "MLFLOW_TRACKING_PASSWORD": "canary-password-7f3a91",
}


def _leaks(texts: list[str], roots: list[Path], secrets: list[str]) -> list[str]:
    found = [f"output: {s}" for s in secrets for t in texts if s in t]
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                found += [f"{p}: {s}" for s in secrets if s.encode() in data]
    return found


def test_secrets_from_the_environment_are_never_written(clean_kitti: Path, tmp_path: Path, ledger) -> None:
    """Canary credentials in the environment; a tracked prepare + train with a sqlite store: not one
    byte of them in the output, the stage outputs, the MLflow store or its artifacts."""
    from tests.faults.conftest import clean_env, factory_subprocess

    store = tmp_path / "mlflow"
    env = clean_env(**CANARIES, MLFLOW_TRACKING_URI=f"sqlite:///{store / 'mlflow.db'}")
    store.mkdir()
    texts = []
    for args in (["prepare", "--raw", str(clean_kitti), "--out", str(tmp_path / "prepared"), *PREPARE],
                 ["train", "--data", str(tmp_path / "prepared"), "--out", str(tmp_path / "model"), *TRAIN,
                  "-S", "train.max_steps=1"]):  # fmt: skip
        proc, _, _ = factory_subprocess(*args, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        texts += [proc.stdout, proc.stderr]
    leaks = _leaks(texts, [tmp_path], list(CANARIES.values()))
    ledger.record("security", "secrets in the environment (token, S3 keys, password) never written", not leaks,
                  lost=len(leaks), detail="; ".join(leaks[:3]) or "stdout, stderr, outputs, MLflow store clean")  # fmt: skip
    assert not leaks, leaks


def test_password_in_the_tracking_uri_is_never_printed_or_stored(
    clean_kitti: Path, tmp_path: Path, ledger
) -> None:
    from tests.faults.conftest import clean_env, factory_subprocess
    from tests.faults.servers import mlflow_server

    secret = "canary-uri-password-7f3a91"
    with mlflow_server(tmp_path / "server") as server:
        uri = server.url.replace("http://", f"http://someone:{secret}@")
        env = clean_env(MLFLOW_TRACKING_URI=uri)
        proc, _, _ = factory_subprocess(
            "prepare",
            "--raw",
            str(clean_kitti),
            "--out",
            str(tmp_path / "prepared"),
            *PREPARE,
            env=env,
            cwd=tmp_path,
        )
        ok_run = proc.returncode == 0
        # And when the server is gone: the error names the server, without the password.
        server.stop()
        down, _, _ = factory_subprocess(
            "prepare",
            "--raw",
            str(clean_kitti),
            "--out",
            str(tmp_path / "p2"),
            *PREPARE,
            env=env,
            cwd=tmp_path,
        )
    leaks = _leaks([proc.stdout, proc.stderr, down.stdout, down.stderr], [tmp_path], [secret])
    ok = ok_run and not leaks and down.returncode != 0 and "someone:***@" in down.stderr
    ledger.record("security", "password in MLFLOW_TRACKING_URI never printed or stored", ok, lost=len(leaks),
                  detail=(down.stderr.strip().splitlines() or [""])[-1][:160])  # fmt: skip
    assert ok, (proc.stderr[-1500:], down.stderr[-1500:], leaks)
