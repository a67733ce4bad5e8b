"""Model registry and gated promotion (DESIGN.md §9): candidate -> gates -> `champion` alias, audited.

Modules (each imports MLflow itself, so `import pfactory.promote` stays cheap):
- `params`    `PromoteParams` (the `promote:` section of params.yaml; not imported here: a module that
              only reads evidence does not depend on the promotion gates' defaults)
- `evidence`  a candidate's evidence (kpis.json, parity.json, latency.json, backend.json) -> `Evidence`,
              and the version tags it becomes
- `gates`     `apply_gates(params, candidate, champion_kpis)` -> `Gate`s (min mAP, regressions, latency, parity)
- `registry`  MLflow registry operations: register, alias, the registry lock, the audit trail, downloads
- `release`   the release folder: model files, `MODEL_CARD.md`, `release.json`, `audit.jsonl`
- `promotion` the whole promotion (`promote`), `rollback` and `lineage`
Stage: tasks/promote.py. CLI: `factory promote|rollback|lineage`. Docs: docs/PROMOTE.md.
"""

from pfactory.promote.errors import EvidenceError, LockTimeout, RegistryError

__all__ = ["EvidenceError", "LockTimeout", "RegistryError"]
