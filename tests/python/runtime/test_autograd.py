"""Backward through the torch ops (python/pcie_allreduce/derivatives.py) on the host transport:
real processes, real gloo groups. Each rank's loss weighs the op's result with its own small
integers, so the analytic gradient (every rank's loss depends on every rank's input) is exact in
fp32; the fused op is checked against torch's own autograd of the unfused composition. Every
gradient is asked of torch.autograd.grad, which raises where autograd passed an op by (without a
formula torch only warns "silently incorrect" and leaves none). The mutating forms stay errors
when autograd would need them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import run_ranks

from pcie_allreduce.testing import rank_input

ROWS, HIDDEN, EPS = 2, 64, 1e-6
WORLDS = [2, 3]


def small_ints(shape, rank, salt=0):
    """Values in [rank, rank + 6]: sums and products of a few stay exact in fp32."""
    numel = torch.Size(shape).numel()
    return ((torch.arange(numel) * (3 + salt) + rank) % 7 + rank).float().view(shape)


def grads(outputs, inputs, weights):
    """The gradients of sum(output * weight); an input the graph does not reach raises."""
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    return torch.autograd.grad(loss, inputs)


def gradient(call, in_shape, out_shape, rank):
    """The gradient at x of this rank's loss sum(call(x) * weight), both of small integers."""
    x = small_ints(in_shape, rank).requires_grad_()
    return grads([call(x)], [x], [small_ints(out_shape, rank, salt=1)])[0]


def entries(ar, name, extra=(), world=()):
    """The two ways in: PcieAllReduce's method and the raw torch op, each given the tensors and
    then `extra` (the op also the world size where it takes one, then the handle)."""
    op = getattr(torch.ops.pcie_allreduce, name)
    return {
        f"PcieAllReduce.{name}": lambda *t: getattr(ar, name)(*t, *extra),
        f"torch op {name}": lambda *t: op(*t, *extra, *world, ar.handle),
    }


def _all_reduce(rank, world):
    from pcie_allreduce import PcieAllReduce

    shape = (ROWS, HIDDEN)
    expected = sum(small_ints(shape, q, salt=1) for q in range(world))
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        for label, call in entries(ar, "all_reduce").items():
            grad = gradient(call, shape, shape, rank)
            assert torch.equal(grad, expected), f"{label}: {grad} != {expected}"
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_gradient_is_the_all_reduce_of_the_gradient(clean_shm, world):
    run_ranks(_all_reduce, world)


def _scatter_and_gather(rank, world):
    from pcie_allreduce import PcieAllReduce

    full, part = (world * ROWS, HIDDEN), (ROWS, HIDDEN)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    # reduce_scatter's input meets every rank's weight on that rank's rows: its gradient is the
    # all-gather of the weights; all_gather's input meets every rank's weight rows of this rank.
    scatter_grad = torch.cat([small_ints(part, q, salt=1) for q in range(world)])
    gather_grad = sum(small_ints(full, q, salt=1)[mine] for q in range(world))
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        for label, scatter in entries(ar, "reduce_scatter", world=(world,)).items():
            assert torch.equal(gradient(scatter, full, part, rank), scatter_grad), label
        for label, gather in entries(ar, "all_gather", world=(world,)).items():
            assert torch.equal(gradient(gather, part, full, rank), gather_grad), label
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_and_all_gather_gradients_are_each_others_collective(clean_shm, world):
    run_ranks(_scatter_and_gather, world)


def fused_inputs(rank, seed):
    """x (this rank's), residual and weight (the same on every rank, as in a model), and the
    weights of this rank's loss on y and residual_out."""
    shape = (ROWS, HIDDEN)
    g = torch.Generator().manual_seed(seed)
    residual, weight = torch.randn(shape, generator=g), torch.randn(HIDDEN, generator=g)
    x = rank_input(rank, ROWS * HIDDEN, torch.float32, seed=seed).view(shape)
    loss_weights = [
        rank_input(rank, ROWS * HIDDEN, torch.float32, seed=seed + k).view(shape) for k in (1, 2)
    ]
    return x, residual, weight, loss_weights


def unfused_reference(rank, world, seed, use_residual_out):
    """torch's autograd of the composition, every rank's loss in one graph: x is shared by every
    rank's sum, residual and weight are each rank's own leaves. This rank's gradients."""
    xs, losses, mine = [], [], None
    for q in range(world):
        xs.append(fused_inputs(q, seed)[0].requires_grad_())
    total = sum(xs)
    for q in range(world):
        _, residual, weight, (gy, gr) = fused_inputs(q, seed)
        leaves = (residual.requires_grad_(), weight.requires_grad_())
        residual_out = total + residual
        y = F.rms_norm(residual_out, (HIDDEN,), weight, EPS)
        losses.append((y * gy).sum() + ((residual_out * gr).sum() if use_residual_out else 0))
        mine = leaves if q == rank else mine
    return torch.autograd.grad(sum(losses), [xs[rank], *mine])


def _fused(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        for label, call in entries(ar, "all_reduce_add_rms_norm", (EPS,)).items():
            for seed, use_residual_out in ((11, True), (23, False)):
                x, residual, weight, loss_weights = fused_inputs(rank, seed)
                inputs = [x.requires_grad_(), residual.requires_grad_(), weight.requires_grad_()]
                outputs = call(*inputs)
                if not use_residual_out:  # residual_out's gradient: none (zeros) reaches it
                    outputs, loss_weights = outputs[:1], loss_weights[:1]
                got = grads(outputs, inputs, loss_weights)
                expected = unfused_reference(rank, world, seed, use_residual_out)
                for name, g, e in zip(("x", "residual", "weight"), got, expected):
                    diff = (g - e).abs().max().item()
                    assert torch.allclose(g, e, rtol=1e-5, atol=1e-5), f"{label} {name}: {diff}"
    return True


@pytest.mark.parametrize("world", WORLDS)
def test_fused_gradients_match_torch_autograd_of_the_unfused_composition(clean_shm, world):
    run_ranks(_fused, world)


def _mutating_forms(rank, world):
    from pcie_allreduce import PcieAllReduce

    ops = torch.ops.pcie_allreduce
    shape = (ROWS, HIDDEN)
    errors = {}

    def refused(label, call):
        try:
            call()
        except RuntimeError as e:
            errors[label] = str(e)

    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        leaf = small_ints(shape, rank).requires_grad_()
        refused("in_place_leaf", lambda: ar.all_reduce_(leaf))
        refused("in_place", lambda: ops.all_reduce_(leaf * 1, ar.handle))
        refused(
            "into",
            lambda: ar.all_reduce(
                small_ints(shape, rank), out=torch.zeros(shape, requires_grad=True)
            ),
        )
        weight = torch.ones(HIDDEN)
        refused(
            "fused_in_place",
            lambda: ops.all_reduce_add_rms_norm_(
                leaf * 1, small_ints(shape, 0), weight, EPS, ar.handle
            ),
        )
        # Under no_grad the same calls run.
        with torch.no_grad():
            ar.all_reduce_(leaf)
        assert torch.equal(leaf.detach(), sum(small_ints(shape, q) for q in range(world)))
    return errors


def test_mutating_forms_refuse_tensors_that_require_grad(clean_shm):
    errors = run_ranks(_mutating_forms, 2)[0]["value"]
    assert (
        "leaf Variable that requires grad is being used in an in-place operation"
        in (errors["in_place_leaf"])
    )
    assert "all_reduce_ has no derivative" in errors["in_place"]
    assert "all_reduce(out=) has no derivative" in errors["into"]
    assert "all_reduce_add_rms_norm(out=x) has no derivative" in errors["fused_in_place"]


def _into_with_grad_input(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = small_ints((ROWS, HIDDEN), rank).requires_grad_()
        try:
            ar.all_reduce(x, out=torch.empty(ROWS, HIDDEN))
        except RuntimeError as e:
            return str(e)
    return None


def test_into_forms_refuse_an_input_that_requires_grad(clean_shm):
    error = run_ranks(_into_with_grad_input, 2)[0]["value"]
    assert error is not None and "all_reduce(out=) has no derivative" in error, error
    assert "the input, which it reads, requires grad" in error, error


def _opcheck(rank, world):
    from pcie_allreduce import PcieAllReduce

    ops = torch.ops.pcie_allreduce
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = rank_input(rank, 4 * HIDDEN, torch.float32).view(4, HIDDEN).requires_grad_()
        residual = torch.ones(4, HIDDEN, requires_grad=True)
        weight = torch.ones(HIDDEN, requires_grad=True)
        for op, args in (
            (ops.all_reduce, (x, ar.handle)),
            (ops.reduce_scatter, (x, world, ar.handle)),
            (ops.all_gather, (x, world, ar.handle)),
            (ops.all_reduce_add_rms_norm, (x, residual, weight, EPS, ar.handle)),
        ):
            torch.library.opcheck(op.default, args)
    return True


def test_functional_ops_pass_opcheck_with_inputs_that_require_grad(clean_shm):
    run_ranks(_opcheck, 2, timeout=400)
