"""Inputs and float64 references for bench and tests.

Every rank's input is a function of (rank, numel, seed) alone, so any process can rebuild all
ranks' inputs and check a reduced result against their sum in float64.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
# Relative to the sum of |inputs|: one rounding of the result plus one of island partials.
RTOL: dict[str, float] = {"bf16": 2.0**-6, "fp16": 2.0**-9, "fp32": 1e-5}
_ATOL = 1e-6


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """`rank`'s input: `numel` standard-normal values rounded to `dtype`, on the CPU."""
    g = torch.Generator().manual_seed(1000003 * seed + 7919 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def reference(
    world: int, numel: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, sum of magnitudes) of every rank's input in float64."""
    total = torch.zeros(numel, dtype=torch.float64)
    mag = torch.zeros(numel, dtype=torch.float64)
    for r in range(world):
        x = rank_input(r, numel, dtype, seed).double()
        total += x
        mag += x.abs()
    return total, mag


def count_wrong(out: torch.Tensor, world: int, numel: int, dtype_name: str, seed: int = 0) -> int:
    """Elements of `out` (any device) further from the float64 sum of every rank's input than
    RTOL[dtype_name] times the sum of magnitudes (plus 1e-6)."""
    total, mag = reference(world, numel, DTYPES[dtype_name], seed)
    err = (out.cpu().double() - total).abs()
    return int((err > RTOL[dtype_name] * mag + _ATOL).sum().item())


# ---------------------------------------------------------------- the fused epilogue
NORM_PARTIALS = 2048  # plan::kNormPartials


def fused_in_order(
    total: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) from an all-reduce result ``total``, operation for operation as
    plan/epilogue.h orders it: what the fused kernels must return bit for bit."""
    dtype = total.dtype
    r = (total.float() + residual.float()).to(dtype)
    rf = r.float()
    sq = rf * rf
    hidden = rf.shape[-1]
    part = torch.zeros(*rf.shape[:-1], NORM_PARTIALS, dtype=torch.float32)
    for base in range(0, hidden, NORM_PARTIALS):
        n = min(NORM_PARTIALS, hidden - base)
        part[..., :n] = part[..., :n] + sq[..., base : base + n]
    h = NORM_PARTIALS // 2
    while h >= 1:
        part = part[..., :h] + part[..., h : 2 * h]
        h //= 2
    mean = part / torch.full_like(part, float(hidden))
    # fp64 sqrt rounded to fp32 is the IEEE fp32 sqrt; torch's vectorised fp32 sqrt on the CPU
    # is not correctly rounded.
    root = torch.sqrt((mean + torch.tensor(eps, dtype=torch.float32)).double()).float()
    rstd = torch.reciprocal(root)
    y = ((rf * rstd) * weight.float()).to(dtype)
    return y, r


def fused_float64(
    xs, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) in float64 from every rank's x: the exact target."""
    total = torch.zeros(xs[0].shape, dtype=torch.float64)
    for x in xs:
        total += x.double()
    r = total + residual.double()
    rstd = 1.0 / torch.sqrt((r * r).mean(-1, keepdim=True) + eps)
    return r * rstd * weight.double(), r


def fused_kernel_calls(stats) -> int:
    """Fused calls a communicator's kernels ran: its ``stats()["fused_calls"]`` over every
    tactic ("unfused" counts the calls it declined and ran unfused)."""
    return sum(n for path, n in (stats.get("fused_calls") or {}).items() if path != "unfused")
