"""`pfk::bilinear_rows` (kernels/bilinear_rows.py) against its reference, forward and backward, with and
without `dest`; skipping zero-weight samples changes nothing; `torch.library.opcheck` on the op and its
backward op. (The painting that calls it: tests/archs/painted_pillars/test_detector.py.)"""

from __future__ import annotations

import pytest
import torch

from kernels import bilinear_rows, bilinear_rows_reference


def _case(s: int, r: int = 50, c: int = 6, dead: float = 0.5, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """table [R, C], index [S, 4], weight [S, 4] with about `dead` of the samples all-zero weights and a
    few single zero taps (a corner off the map)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(r, c, generator=g)
    index = torch.randint(0, r, (s, 4), generator=g)  # repeated rows: index_add_ accumulates
    weight = torch.rand(s, 4, generator=g)
    weight[torch.rand(s, generator=g) < dead] = 0.0
    weight[torch.rand(s, 4, generator=g) < 0.1] = 0.0
    return table, index, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_dest", [False, True])
def test_op_forward_and_backward_equal_the_reference(dtype: torch.dtype, with_dest: bool) -> None:
    table, index, weight = _case(300)
    table = table.to(dtype).requires_grad_()
    dest, total = (torch.randperm(500)[:300], 500) if with_dest else (None, 0)
    out = bilinear_rows(table, index, weight, dest, total)
    assert out.dtype == torch.float32 and out.shape == (500 if with_dest else 300, 6)
    t64 = table.detach().double().requires_grad_()
    ref = bilinear_rows_reference(t64, index, weight.double(), dest, total)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(out, table, g)
    (want,) = torch.autograd.grad(ref, t64, g.double())
    assert grad.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5  # the bf16 gradient is rounded once
    torch.testing.assert_close(grad.double(), want, rtol=tol, atol=tol)


def test_skipped_samples_change_nothing() -> None:
    """Every sample with zero weights where unseen (what torch.compile runs) vs only the live samples sent
    to their rows by `dest` (what eager runs): bitwise the same values and table gradient, because a
    skipped sample would only add zeros."""
    table, index, weight = _case(2000, dead=0.6)
    live = weight.ne(0).any(1).nonzero().squeeze(1)
    t1, t2 = table.clone().requires_grad_(), table.clone().requires_grad_()
    dense = bilinear_rows(t1, index, weight)
    sparse = bilinear_rows(t2, index[live], weight[live], live, 2000)
    assert torch.equal(dense, sparse)
    assert dense[weight.eq(0).all(1)].eq(0).all()
    g = torch.randn(dense.shape)
    (a,) = torch.autograd.grad(dense, t1, g)
    (b,) = torch.autograd.grad(sparse, t2, g)
    assert torch.equal(a, b)


def test_no_live_sample_gives_zeros() -> None:
    table, index, weight = _case(40)
    table.requires_grad_()
    out = bilinear_rows(table, index, torch.zeros_like(weight))
    assert out.shape == (40, 6) and out.eq(0).all()
    (grad,) = torch.autograd.grad(out, table, torch.ones_like(out))
    assert grad.eq(0).all()


@pytest.mark.parametrize("with_dest", [False, True])
def test_opcheck(with_dest: bool) -> None:
    """Schema, fake (meta) kernel, autograd registration and AOT dispatch, for the op and its backward."""
    for dtype in (torch.float32, torch.bfloat16):
        table, index, weight = _case(64, r=20, c=5)
        table = table.to(dtype).requires_grad_()
        dest, total = (torch.randperm(100)[:64], 100) if with_dest else (None, 0)
        torch.library.opcheck(torch.ops.pfk.bilinear_rows.default, (table, index, weight, dest, total))
        grad = torch.randn(total or 64, 5)
        args = (grad, index, weight, dest, 20)
        torch.library.opcheck(torch.ops.pfk.bilinear_rows_backward.default, args)


def test_stays_one_op_under_torch_compile() -> None:
    """fullgraph compile keeps the op (no graph break, no trace into its body) and gives eager's values."""
    table, index, weight = _case(200)
    table.requires_grad_()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda t, i, w: bilinear_rows(t, i, w).sum(), backend=backend, fullgraph=True)
    torch.testing.assert_close(f(table, index, weight), bilinear_rows(table, index, weight).sum())
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.pfk.bilinear_rows.default in targets
    assert not any("index_select" in str(t) or "index_add" in str(t) for t in targets)


def test_bad_input_is_refused_with_the_argument_named() -> None:
    table, index, weight = _case(10)
    with pytest.raises(ValueError, match=r"bilinear_rows: index must have dtype in \(int64\)"):
        bilinear_rows(table, index.int(), weight)
    with pytest.raises(ValueError, match=r"bilinear_rows: index and weight must both be \[S, 4\]"):
        bilinear_rows(table, index[:, :3], weight[:, :3])
    with pytest.raises(ValueError, match=r"bilinear_rows: dest must be \[S\] with S = 10"):
        bilinear_rows(table, index, weight, torch.arange(9), 20)
