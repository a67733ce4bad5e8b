"""The run report (`factory report`, also written by the evaluate stage): one self-contained HTML page with
the headline KPIs and their deltas against the champion, per-class x per-range tables, the error breakdown,
PR curves, the worst frames drawn (camera + BEV, error labels), score calibration, parity and latency.

`inputs` finds what a report is made of (an evaluation directory, an MLflow run, a registered model);
`build` computes and lays it out; `svg` draws the charts, `frames` the worst frames. docs/REPORT.md.
`compare`: `factory compare`, MLflow runs side by side (KPIs, latency, stage times, params), regressions flagged.
"""
