"""Params: the `Section` base every stage's params derive from, the params file (one home per value, the
shared values copied from their home), and the plugin loader (architectures and dataset layouts by name).

- `section`     `Section` (strict pydantic model) and the shared field types
- `paths`       `PathsParams`, the `paths:` section (one directory per stage)
- `params_file` reading params.yaml: one section or a few for a stage, `--set` overrides, `ParamsError`
- `plugins`     entry-point groups `pfactory.models` / `pfactory.datasets`: load by name, one-line errors
The whole file's schema (every section) is the flow's: `flows/params.py`.
"""
