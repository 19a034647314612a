"""The derivatives of the functional torch ops, registered by ``native.py`` once the extension
has defined the ops, so every caller (``PcieAllReduce``'s methods, the raw ops, a compiled
graph) gets them.

Each rank's loss is taken to depend on every rank's inputs (the sum over ranks, as with
``torch.distributed.nn.functional``): the gradient of ``all_reduce``'s input is the all-reduce
of its gradient; ``reduce_scatter`` and ``all_gather`` (dim 0) are each other's adjoints; the
fused ``all_reduce_add_rms_norm`` differentiates ``rms_norm(sum_ranks(x) + residual) * weight``,
whose gradient of ``x`` is all-reduced too. A backward therefore runs collectives through the
same communicator: every rank must run it, in the same order, with the same inputs requiring
grad (a rank that skips it leaves its peers waiting until the communicator's timeout).

The mutating forms (``all_reduce_``, ``*_into``) have no derivative: torch registers autograd
only for functional ops, and the extension refuses to write a tensor that requires grad while
grad mode is on (``csrc/comm/arguments.cc``).
"""

from __future__ import annotations

from typing import Any

import torch

_OPS = torch.ops.pcie_allreduce


def _all_reduce_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.handle = inputs[1]


def _all_reduce_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return _OPS.all_reduce(grad, ctx.handle), None


def _sized_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.world, ctx.handle = inputs[1], inputs[2]


def _reduce_scatter_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return _OPS.all_gather(grad, ctx.world, ctx.handle), None, None


def _all_gather_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return _OPS.reduce_scatter(grad, ctx.world, ctx.handle), None, None


def _fused_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, _, weight, ctx.eps, ctx.handle = inputs
    ctx.dtypes = (x.dtype, weight.dtype)
    ctx.save_for_backward(output[1], weight)  # residual_out: the norm's input


def _fused_backward(ctx: Any, grad_y: torch.Tensor, grad_residual_out: torch.Tensor) -> tuple:
    """rms_norm's backward at residual_out, in fp32: with n = r * rstd and g = grad_y * weight,
    grad_r = rstd * (g - n * mean(g * n)) + grad_residual_out, grad_weight = sum of grad_y * n
    over the rows; residual's gradient is grad_r, x's is its sum over the ranks."""
    residual_out, weight = ctx.saved_tensors
    x_dtype, weight_dtype = ctx.dtypes
    r = residual_out.float()
    rstd = torch.rsqrt(r.square().mean(-1, keepdim=True) + ctx.eps)
    n = r * rstd
    gy = grad_y.float()
    g = gy * weight.float()
    grad_r = rstd * (g - n * (g * n).mean(-1, keepdim=True)) + grad_residual_out.float()
    grad_r = grad_r.to(x_dtype)
    need_x, need_residual, need_weight = ctx.needs_input_grad[:3]
    grad_x = _OPS.all_reduce(grad_r, ctx.handle) if need_x else None
    grad_weight = None
    if need_weight:
        grad_weight = (gy * n).reshape(-1, n.shape[-1]).sum(0).to(weight_dtype)
    return grad_x, grad_r if need_residual else None, grad_weight, None, None


def register() -> None:
    """Registers every functional op's derivative; the ops must be defined (``_C`` loaded)."""
    for name, backward, setup in (
        ("all_reduce", _all_reduce_backward, _all_reduce_setup),
        ("reduce_scatter", _reduce_scatter_backward, _sized_setup),
        ("all_gather", _all_gather_backward, _sized_setup),
        ("all_reduce_add_rms_norm", _fused_backward, _fused_setup),
    ):
        torch.library.register_autograd(f"pcie_allreduce::{name}", backward, setup_context=setup)
