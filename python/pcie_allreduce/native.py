"""The compiled extension, loaded once, when the runtime first needs it.

Loading ``pcie_allreduce._C`` runs its ``TORCH_LIBRARY`` block, which defines the torch ops
``torch.ops.pcie_allreduce.{all_reduce, all_reduce_, all_reduce_into}`` and the fused
``all_reduce_add_rms_norm{,_,_into}``, ``reduce_scatter{,_into}`` and
``all_gather{,_into}``, and the functional ops' derivatives (``csrc/bindings/derivatives.cc``,
so autograd never passes one by silently); this module then registers their fake
implementations, so ``torch.compile`` can trace a call before any op runs.
``import pcie_allreduce`` does not import this module: a disabled engine plugin loads neither
the extension nor torch. Every module that needs the extension imports ``_C`` from here.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeAlias

import torch

_C = importlib.import_module("pcie_allreduce._C")

# The extension's classes, for annotations. It ships no type stub, so to mypy they are Any, as
# every attribute of _C is; the names still say which class a value is.
Topology: TypeAlias = Any
Schedule: TypeAlias = Any


@torch.library.register_fake("pcie_allreduce::all_reduce")
def _all_reduce_fake(inp: torch.Tensor, handle: int) -> torch.Tensor:
    return torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)


@torch.library.register_fake("pcie_allreduce::all_reduce_")
def _all_reduce_inplace_fake(inp: torch.Tensor, handle: int) -> None:
    return None


@torch.library.register_fake("pcie_allreduce::all_reduce_into")
def _all_reduce_into_fake(inp: torch.Tensor, handle: int, out: torch.Tensor) -> None:
    return None


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm")
def _all_reduce_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle: int
):
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
    )


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm_")
def _all_reduce_add_rms_norm_inplace_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, handle: int
) -> None:
    return None


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm_into")
def _all_reduce_add_rms_norm_into_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    handle: int,
    out: torch.Tensor,
    residual_out: torch.Tensor,
) -> None:
    return None


def _collective_shape(inp: torch.Tensor, world: int, scatter: bool) -> list:
    shape = list(inp.shape)
    if shape:
        shape[0] = shape[0] // world if scatter else shape[0] * world
    return shape


@torch.library.register_fake("pcie_allreduce::reduce_scatter")
def _reduce_scatter_fake(inp: torch.Tensor, world: int, handle: int) -> torch.Tensor:
    return torch.empty(_collective_shape(inp, world, True), dtype=inp.dtype, device=inp.device)


@torch.library.register_fake("pcie_allreduce::reduce_scatter_into")
def _reduce_scatter_into_fake(inp: torch.Tensor, handle: int, out: torch.Tensor) -> None:
    return None


@torch.library.register_fake("pcie_allreduce::all_gather")
def _all_gather_fake(inp: torch.Tensor, world: int, handle: int) -> torch.Tensor:
    return torch.empty(_collective_shape(inp, world, False), dtype=inp.dtype, device=inp.device)


@torch.library.register_fake("pcie_allreduce::all_gather_into")
def _all_gather_into_fake(inp: torch.Tensor, handle: int, out: torch.Tensor) -> None:
    return None
