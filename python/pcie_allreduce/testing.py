"""Inputs and float64 references for bench and tests.

Every rank's input is a function of (rank, numel, seed) alone, so any process can rebuild all
ranks' inputs and check a reduced result against their sum in float64.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

DTYPES: Dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
# Relative to the sum of |inputs|: one rounding of the result plus one of island partials.
RTOL: Dict[str, float] = {"bf16": 2.0**-6, "fp16": 2.0**-9, "fp32": 1e-5}
_ATOL = 1e-6


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """`rank`'s input: `numel` standard-normal values rounded to `dtype`, on the CPU."""
    g = torch.Generator().manual_seed(1000003 * seed + 7919 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def reference(
    world: int, numel: int, dtype: torch.dtype, seed: int = 0
) -> Tuple[torch.Tensor, torch.Tensor]:
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
