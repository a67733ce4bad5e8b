"""Training: the loop and what it stands on, one module per job.

- `runtime`: device, DDP rank/world (torchrun), the multi-node launcher of `factory train --nnodes`
  (c10d rendezvous), phase timer with NVTX ranges, peak memory;
- `rng`: seeding and checkpointable RNG state;
- `data`: the prepared data as the loop sees it (manifest summary, loader, resume position);
- `schedule`: AdamW and the learning-rate schedule;
- `checkpoint`: `checkpoint.pt` and when it may be resumed;
- `remote_checkpoint`: a pipeline run's checkpoints on the DVC remote, so another machine can resume it;
- `tracker`: MLflow logging and the progress bar;
- `trainer`: `Trainer(params, data, out).train()`, the loop; `train_step`, `validate`, `finish`;
- `profile`: `factory profile train` (torch.profiler trace).

The stage around it is `tasks/train.py`; docs/MODEL.md has the design and measurements.
"""
