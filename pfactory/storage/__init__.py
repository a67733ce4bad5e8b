"""Where the bytes live: artifact names, atomic writes, object storage, the DVC cache and DAG, retention.

- `artifacts`  the file names and readers of every stage's outputs (`kpis.json`, `model.pt`, ...)
- `fsutil`     atomic writes (temp + rename), owned output folders, JSON readers with one-line errors
- `objects`    local paths and `s3://` URLs behind one interface (reads, atomic writes, listings)
- `dvccache`   the project's DVC cache settings (shared caches, permissions)
- `dag`        dvc.yaml's stages and the YAML reader of dvc.lock
- `retention`  what `factory gc` may delete and what a registered model needs
"""
