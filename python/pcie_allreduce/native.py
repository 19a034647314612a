"""The compiled extension, loaded once, when the runtime first needs it.

Loading ``pcie_allreduce._C`` runs its ``TORCH_LIBRARY`` block, which defines the torch ops
``torch.ops.pcie_allreduce.{all_reduce, all_reduce_, all_reduce_into}``, the fused
``all_reduce_add_rms_norm{,_,_into}``, ``all_reduce_rms_norm{,_into}`` and the quantised
``all_reduce_{add_,}rms_norm_{fp8,nvfp4}{,_into}``, ``reduce_scatter{,_into}`` and
``all_gather{,_into}``, and the functional ops' derivatives (``csrc/bindings/derivatives.cc``,
so autograd never passes one by silently); this module then registers their fake
implementations, so ``torch.compile`` can trace a call before any op runs, and their Meta
kernels, which refuse a real call with an operand on the meta device.
``import pcie_allreduce`` does not import this module: a disabled engine plugin loads neither
the extension nor torch. Every module that needs the extension imports ``_C`` from here.
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn, TypeAlias

import torch

from .operations import nvfp4_scale_shape

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


def _like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm")
def _all_reduce_add_rms_norm_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    handle: int,
    weight_offset: float = 0.0,
):
    return _like(x), _like(residual)


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm_")
def _all_reduce_add_rms_norm_inplace_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    handle: int,
    weight_offset: float = 0.0,
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
    weight_offset: float = 0.0,
) -> None:
    return None


@torch.library.register_fake("pcie_allreduce::all_reduce_rms_norm")
def _all_reduce_rms_norm_fake(
    x: torch.Tensor, weight: torch.Tensor, eps: float, handle: int, weight_offset: float = 0.0
):
    return _like(x), _like(x)


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm_fp8")
def _all_reduce_add_rms_norm_fp8_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    handle: int,
    weight_offset: float = 0.0,
):
    return _like(x, torch.float8_e4m3fn), _like(residual)


@torch.library.register_fake("pcie_allreduce::all_reduce_rms_norm_fp8")
def _all_reduce_rms_norm_fp8_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    handle: int,
    weight_offset: float = 0.0,
):
    return _like(x, torch.float8_e4m3fn), _like(x)


def _nvfp4_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's y_q (two e2m1 codes a byte) and its swizzled block scales (plan/quant.h)."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    y_q = torch.empty((*x.shape[:-1], hidden // 2), dtype=torch.uint8, device=x.device)
    shape = nvfp4_scale_shape(rows, hidden)
    scales = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    return y_q, scales


@torch.library.register_fake("pcie_allreduce::all_reduce_add_rms_norm_nvfp4")
def _all_reduce_add_rms_norm_nvfp4_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    handle: int,
    weight_offset: float = 0.0,
):
    y_q, scales = _nvfp4_outputs(x)
    return y_q, _like(residual), scales


@torch.library.register_fake("pcie_allreduce::all_reduce_rms_norm_nvfp4")
def _all_reduce_rms_norm_nvfp4_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    handle: int,
    weight_offset: float = 0.0,
):
    y_q, scales = _nvfp4_outputs(x)
    return y_q, _like(x), scales


for _into in (
    "all_reduce_rms_norm_into",
    "all_reduce_add_rms_norm_fp8_into",
    "all_reduce_rms_norm_fp8_into",
    "all_reduce_add_rms_norm_nvfp4_into",
    "all_reduce_rms_norm_nvfp4_into",
):
    torch.library.register_fake(f"pcie_allreduce::{_into}")(lambda *args, **kwargs: None)


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


# A real call (torch.compile's FakeTensors take the fakes above, never these) reaches an op's Meta
# kernel when any operand is on the meta device, where register_fake put the fake too: it would
# return empty tensors without communicating. Each op's Meta kernel is instead the extension's own
# argument check, which refuses the call before any communication (ValueError naming the operand),
# as it refuses a tensor on any other device than the communicator's.
def _refuse(
    op: str,
    handle: int,
    inp: torch.Tensor,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    block_scale: torch.Tensor | None = None,
) -> NoReturn:
    _C.lookup_communicator(handle).check(
        op, inp, out, residual, weight, residual_out, scale, weight_offset, block_scale
    )
    raise ValueError(f"{op}: an operand is on the meta device, which holds no data to communicate")


_FUSED = "all_reduce_add_rms_norm"
_NORM, _FUSED_FP8, _NORM_FP8 = "all_reduce_rms_norm", f"{_FUSED}_fp8", "all_reduce_rms_norm_fp8"
_FUSED_FP4, _NORM_FP4 = f"{_FUSED}_nvfp4", "all_reduce_rms_norm_nvfp4"


def _fused_nvfp4_into_meta(
    x, residual, weight, scale, eps, handle, out, residual_out, block_scale, weight_offset=0.0
):
    _refuse(
        _FUSED_FP4,
        handle,
        x,
        out,
        residual,
        weight,
        residual_out,
        scale,
        weight_offset,
        block_scale,
    )


_META_KERNELS: dict[str, Any] = {
    "all_reduce": lambda inp, handle: _refuse("all_reduce", handle, inp),
    "all_reduce_": lambda inp, handle: _refuse("all_reduce", handle, inp, inp),
    "all_reduce_into": lambda inp, handle, out: _refuse("all_reduce", handle, inp, out),
    _FUSED: lambda x, residual, weight, eps, handle, weight_offset=0.0: _refuse(
        _FUSED, handle, x, None, residual, weight, weight_offset=weight_offset
    ),
    f"{_FUSED}_": lambda x, residual, weight, eps, handle, weight_offset=0.0: _refuse(
        _FUSED, handle, x, x, residual, weight, residual, weight_offset=weight_offset
    ),
    f"{_FUSED}_into": (
        lambda x, residual, weight, eps, handle, out, residual_out, weight_offset=0.0: _refuse(
            _FUSED, handle, x, out, residual, weight, residual_out, None, weight_offset
        )
    ),
    _NORM: lambda x, weight, eps, handle, weight_offset=0.0: _refuse(
        _NORM, handle, x, None, None, weight, weight_offset=weight_offset
    ),
    f"{_NORM}_into": lambda x, weight, eps, handle, out, residual_out, weight_offset=0.0: _refuse(
        _NORM, handle, x, out, None, weight, residual_out, None, weight_offset
    ),
    _FUSED_FP8: lambda x, residual, weight, scale, eps, handle, weight_offset=0.0: _refuse(
        _FUSED_FP8, handle, x, None, residual, weight, None, scale, weight_offset
    ),
    f"{_FUSED_FP8}_into": (
        lambda x, residual, weight, scale, eps, handle, out, residual_out, weight_offset=0.0: (
            _refuse(
                _FUSED_FP8, handle, x, out, residual, weight, residual_out, scale, weight_offset
            )
        )
    ),
    _NORM_FP8: lambda x, weight, scale, eps, handle, weight_offset=0.0: _refuse(
        _NORM_FP8, handle, x, None, None, weight, None, scale, weight_offset
    ),
    f"{_NORM_FP8}_into": (
        lambda x, weight, scale, eps, handle, out, residual_out, weight_offset=0.0: _refuse(
            _NORM_FP8, handle, x, out, None, weight, residual_out, scale, weight_offset
        )
    ),
    _FUSED_FP4: lambda x, residual, weight, scale, eps, handle, weight_offset=0.0: _refuse(
        _FUSED_FP4, handle, x, None, residual, weight, None, scale, weight_offset
    ),
    f"{_FUSED_FP4}_into": _fused_nvfp4_into_meta,
    _NORM_FP4: lambda x, weight, scale, eps, handle, weight_offset=0.0: _refuse(
        _NORM_FP4, handle, x, None, None, weight, None, scale, weight_offset
    ),
    f"{_NORM_FP4}_into": (
        lambda x, weight, scale, eps, handle, out, residual_out, block_scale, weight_offset=0.0: (
            _refuse(
                _NORM_FP4,
                handle,
                x,
                out,
                None,
                weight,
                residual_out,
                scale,
                weight_offset,
                block_scale,
            )
        )
    ),
    "reduce_scatter": lambda inp, world, handle: _refuse("reduce_scatter", handle, inp),
    "reduce_scatter_into": lambda inp, handle, out: _refuse("reduce_scatter", handle, inp, out),
    "all_gather": lambda inp, world, handle: _refuse("all_gather", handle, inp),
    "all_gather_into": lambda inp, handle, out: _refuse("all_gather", handle, inp, out),
}
for _name, _kernel in _META_KERNELS.items():
    torch.library.impl(f"pcie_allreduce::{_name}", "Meta", _kernel)
