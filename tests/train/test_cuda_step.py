"""One training step on a CUDA GPU equals the same step on the CPU in fp32 (GPU machines:
`scripts/gpu_check.sh`; skipped here).

The trainer's own `train_step` on the tiny detector, from the same weights and batch: on CUDA in bf16
where `use_bf16` allows it (compute capability >= 8.0 and the `cuda.bf16_train_step` self-check
verified), else fp32 (TF32 convolutions, PyTorch's default). The loss must be finite and equal to the
CPU fp32 loss within the precision's tolerance, the gradient norm too, and the step must move the
weights by finite amounts.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pfactory.train.params import TrainParams
from pfactory.train.runtime import Runtime, Timer, cuda_bf16_native, use_bf16
from pfactory.train.schedule import make_optimizer
from pfactory.train.trainer import train_step
from tests.archs.painted_pillars.helpers import IMAGE_SIZE, random_batch, tiny_params

# relative to the CPU fp32 step. The same step in bf16 on a CPU with AVX512-BF16 was off by 8.8e-4 (loss) and
# 1.0e-2 (gradient norm); TF32 convolutions (10-bit mantissa) by less.
TOLERANCE = {"bf16": {"loss": 2e-2, "grad_norm": 0.1}, "fp32": {"loss": 1e-2, "grad_norm": 2e-2}}


def _step(model: torch.nn.Module, batch: dict, device: torch.device, bf16: bool) -> dict[str, float]:
    tp = TrainParams()
    model = model.to(device).train()
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    opt = make_optimizer(model, tp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return train_step(model, model, batch, opt, sched, tp, Runtime(device), Timer(), bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_cuda_training_step_equals_the_cpu_fp32_step() -> None:
    from pfactory.archs.painted_pillars.detector import build_model

    torch.manual_seed(0)
    p = tiny_params()
    model = build_model(p, IMAGE_SIZE)
    batch = random_batch(p, batch=2, points=500, cams=1)
    cpu_model, cuda_model = copy.deepcopy(model), copy.deepcopy(model)
    device = torch.device("cuda", 0)
    bf16 = use_bf16(True, device)
    if not cuda_bf16_native(torch.cuda.get_device_capability(device)):
        assert not bf16  # before Ampere bf16 is emulated: fp32
    want = _step(cpu_model, batch, torch.device("cpu"), False)
    got = _step(cuda_model, batch, device, bf16)
    precision = "bf16" if bf16 else "fp32"
    assert all(math.isfinite(v) for v in got.values()), got
    for name, tol in TOLERANCE[precision].items():
        err = abs(got[name] - want[name]) / max(abs(want[name]), 1e-12)
        assert err <= tol, (
            f"{precision} {name}: CUDA {got[name]:.6g} vs CPU fp32 {want[name]:.6g} (rel {err:.3g})"
        )
    moved = [
        (a.detach().cpu() - b.detach()).abs().max()
        for a, b in zip(cuda_model.parameters(), model.parameters())
    ]
    assert all(torch.isfinite(m) for m in moved) and max(moved) > 0  # the step updated the weights
