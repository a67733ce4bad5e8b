"""Writes tests/metrics/kitti_golden.json: the Python reference evaluator's numbers on `kitti_scenes`.

Not a test, and not run by CI: it needs the reference (kitti_object_eval_python as in OpenPCDet, which this
repository does not ship) in a separate environment, with its numba.cuda rotated IoU replaced by a
numba.njit copy of the same device functions (float32, error_model="numpy"; the CUDA simulator is too slow
and racy). Procedure and caveats: docs/KPIS.md ("KITTI metric: how the reference was established").

Run (from the repository root): KITTI_REF=/path/with/kitti_ref_package REF_PYTHON=/path/to/venv/bin/python \
    python tests/metrics/make_kitti_golden.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from kitti_scenes import make_scenes, write_scenes  # noqa: E402

# (seed, frames, max ground-truth boxes per frame, alphas in the results, ground-truth types dropped)
SCENES = [
    {"seed": 1, "frames": 60, "max_gt": 9, "alpha": True, "drop": []},
    {"seed": 5, "frames": 400, "max_gt": 12, "alpha": True, "drop": []},
    {"seed": 6, "frames": 250, "max_gt": 25, "alpha": True, "drop": []},
    {"seed": 7, "frames": 120, "max_gt": 3, "alpha": True, "drop": []},
    {"seed": 8, "frames": 80, "max_gt": 6, "alpha": False, "drop": ["Cyclist"]},
]

DRIVER = r"""
import json, sys
import numpy as np
from kitti_ref import kitti_common as kitti
from kitti_ref.eval import do_eval
label_dir, result_dir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ids = list(range(n))
gt, dt = kitti.get_label_annos(label_dir, ids), kitti.get_label_annos(result_dir, ids)
strict = np.array([[0.7, 0.5, 0.5], [0.7, 0.5, 0.5], [0.7, 0.5, 0.5]])
loose = np.array([[0.7, 0.5, 0.5], [0.5, 0.25, 0.25], [0.5, 0.25, 0.25]])
aos = False
for a in dt:  # get_official_eval_result's rule
    if a["alpha"].shape[0] != 0:
        aos = bool(a["alpha"][0] != -10)
        break
r = do_eval(gt, dt, [0, 1, 2], np.stack([strict, loose], 0), aos)
out = {}
for rec, arrs in (("R11", r[0:4]), ("R40", r[4:8])):
    for k, ov in enumerate(("strict", "loose")):
        t = out.setdefault(rec, {}).setdefault(ov, {})
        for j, c in enumerate(("Car", "Pedestrian", "Cyclist")):
            t[c] = {m: {d: (None if a is None or not np.isfinite(a[j, i, k]) else float(a[j, i, k]))
                        for i, d in enumerate(("easy", "moderate", "hard"))}
                    for m, a in zip(("bbox", "bev", "3d", "aos"), arrs)}
print(json.dumps({"compute_aos": aos, "percent": out}))
"""


def main() -> None:
    ref, py = os.environ["KITTI_REF"], os.environ["REF_PYTHON"]
    golden = {
        "reference": "kitti_object_eval_python (OpenPCDet copy), get_official_eval_result's do_eval, "
        "AP in percent; rotated IoU: numba.njit copy of its CUDA device functions",
        "scenes": [],
    }
    for cfg in SCENES:
        gt, dt = make_scenes(cfg["seed"], cfg["frames"], cfg["max_gt"], cfg["alpha"], tuple(cfg["drop"]))
        with tempfile.TemporaryDirectory() as tmp:
            labels, results = write_scenes(Path(tmp), gt, dt)
            res = subprocess.run(
                [py, "-c", DRIVER, str(labels), str(results), str(cfg["frames"])],
                cwd=ref,
                capture_output=True,
                text=True,
                check=True,
            )
        golden["scenes"].append({**cfg, **json.loads(res.stdout.splitlines()[-1])})
        print(cfg, "done", file=sys.stderr)
    (HERE / "kitti_golden.json").write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
