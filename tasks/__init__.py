"""Pipeline stages, one module per stage: `run(params, inputs, outputs) -> metrics`.

Each is what `dvc.yaml` runs as `python -m tasks.<stage>` and what `factory <stage>` calls;
the domain work lives in `pfactory`, a stage only wires files, params and tracking.
"""
