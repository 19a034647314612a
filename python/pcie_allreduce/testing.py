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
    total: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) from an all-reduce result ``total``, operation for operation as
    plan/epilogue.h orders it: what the fused kernels must return bit for bit. Without a
    residual, residual_out is ``total`` itself; ``weight_offset`` is added to the weight in fp32
    (Gemma's convention; 0 leaves the weight as it is)."""
    dtype = total.dtype
    r = total if residual is None else (total.float() + residual.float()).to(dtype)
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
    w = weight.float() if weight_offset == 0 else weight.float() + weight_offset
    y = ((rf * rstd) * w).to(dtype)
    return y, r


FP8_MAX = 448.0


def fp8_static_quant(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's static per-tensor FP8 quantisation (``_C.static_scaled_fp8_quant``, vLLM 0.33
    csrc/quantization/w8a8/fp8/common.cuh) of ``y``, written from its arithmetic: times the IEEE
    reciprocal of the scale, ``fminf(v, 448)`` then ``fmaxf(v, -448)`` (a NaN becomes +448),
    float8_e4m3fn rounded to nearest even."""
    v = y.float() * torch.reciprocal(scale.float().reshape(()))
    v = torch.where(v < FP8_MAX, v, FP8_MAX)  # NaN compares false: +448, as fminf gives
    v = torch.where(v > -FP8_MAX, v, -FP8_MAX)
    return v.to(torch.float8_e4m3fn)


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


# ---------------------------------------------------------------- NVFP4 (plan/quant.h)
NVFP4_BLOCK = 16  # plan::kNvfp4Block
# e2m1's magnitudes by code (the sign is bit 3), and float8_e4m3fn's by byte 0x00..0x7E (0x7F
# is NaN): both ascending, so a code is its index and "ties to even" means the even index.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_VALUES = tuple(
    (m / 8.0) * 2.0**-6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
    for e in range(16)
    for m in range(8)
    if (e, m) != (15, 7)
)


def _round_to_grid(a: torch.Tensor, grid: tuple[float, ...]) -> torch.Tensor:
    """The index of the value of ``grid`` (ascending, from 0) nearest to each ``a`` (float64, 0 ..
    grid[-1]), ties to the even index."""
    g = torch.tensor(grid, dtype=torch.float64, device=a.device)
    hi = torch.searchsorted(g, a).clamp(1, len(grid) - 1)
    lo = hi - 1
    below = a - g[lo]  # exact: a and its neighbours are within a factor of 2, or one is 0
    above = g[hi] - a
    return torch.where(below < above, lo, torch.where(above < below, hi, lo + (lo & 1)))


# The swizzled 128x4 layout of the block scales (plan::nvfp4_scale_offset): the [padded_rows,
# 4 * k_tiles] matrix seen as [row tiles][(row / 32) % 4][row % 32][k tiles][column % 4] is stored
# as [row tiles][k tiles][row % 32][(row / 32) % 4][column % 4]: swapping axes 1 and 3, which is
# its own inverse.
_SWIZZLE = (0, 3, 2, 1, 4)


def _swizzle_shape(padded_rows: int, k_tiles: int) -> tuple[int, int, int, int, int]:
    return (padded_rows // 128, 4, 32, k_tiles, 4)


def nvfp4_quant(
    y: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's NVFP4 quantisation (``scaled_fp4_quant``) of ``y`` ([..., hidden], hidden % 16 ==
    0) as plan/quant.h defines it, written from its header in float32 ops: per block of 16
    consecutive elements of a row, amax = max |y| (NaN ignored; NaN only if all 16 are),
    SF = G * (amax * RN(1/6)), sf = e4m3(SF) (nearest, ties to even, saturating at 448; NaN stays
    NaN), out_scale = sf != 0 ? 1 / (sf * (1 / G)) : 0, q = e2m1(y * out_scale) (nearest on
    {0, 0.5, .., 6}, ties to the even code, saturating; -0 is 0x8, NaN 0x7). Returns (y_q, uint8
    [rows, hidden / 2], the even element in the low nibble; block_scale, uint8
    [round_up(rows, 128), 4 * k_tiles] in the swizzled 128x4 layout, padding zero)."""
    hidden = y.shape[-1]
    assert hidden % NVFP4_BLOCK == 0, hidden
    rows = y.numel() // hidden
    blocks = hidden // NVFP4_BLOCK
    v = y.reshape(rows, blocks, NVFP4_BLOCK).float()
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=y.device).reshape(())
    inv_g = torch.reciprocal(g)
    rcp6 = torch.reciprocal(torch.tensor(6.0, dtype=torch.float32, device=y.device))
    magnitude = v.abs()
    amax = torch.where(magnitude.isnan(), -1.0, magnitude).amax(-1)
    amax = torch.where(amax < 0, float("nan"), amax)
    sf = g * (amax * rcp6)
    # e4m3 of SF by hand: magnitude to the grid, saturating; the sign bit; NaN 0x7F.
    sf_abs = sf.abs().double()
    finite = torch.where(sf_abs > E4M3_VALUES[-1], E4M3_VALUES[-1], sf_abs).nan_to_num(0.0)
    sf_byte = _round_to_grid(finite, E4M3_VALUES) | (torch.signbit(sf).long() << 7)
    sf_byte = torch.where(sf.isnan(), 0x7F, sf_byte).to(torch.uint8)
    sf_value = sf_byte.view(torch.float8_e4m3fn).float()  # the byte's exact value
    out_scale = torch.where(
        sf_value != 0, torch.reciprocal(sf_value * inv_g), torch.zeros_like(sf_value)
    )
    q = v * out_scale.unsqueeze(-1)
    a = q.abs().double()
    code = _round_to_grid(torch.where(a > 6.0, 6.0, a).nan_to_num(0.0), E2M1_VALUES)
    code = code | (torch.signbit(q).long() << 3)
    code = torch.where(q.isnan(), 0x7, code).to(torch.uint8).reshape(rows, hidden // 2, 2)
    y_q = code[..., 0] | (code[..., 1] << 4)
    # The block scales' matrix, padding zero, in the swizzled layout.
    k_tiles = (blocks + 3) // 4
    padded = (rows + 127) // 128 * 128
    matrix = torch.zeros(padded, 4 * k_tiles, dtype=torch.uint8, device=y.device)
    matrix[:rows, :blocks] = sf_byte
    swizzled = matrix.reshape(_swizzle_shape(padded, k_tiles)).permute(_SWIZZLE)
    return y_q, swizzled.reshape(padded, 4 * k_tiles)


def nvfp4_dequant(
    y_q: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    rows: int,
    hidden: int,
) -> torch.Tensor:
    """The float32 [rows, hidden] that ``nvfp4_quant``'s (y_q, block_scale) stand for:
    e2m1 value * float(sf) / G per element (NaN where the code's block scale is NaN)."""
    blocks = hidden // NVFP4_BLOCK
    k_tiles = (blocks + 3) // 4
    padded = (rows + 127) // 128 * 128
    tiles = block_scale.reshape(-1).view(torch.uint8).reshape(padded // 128, k_tiles, 32, 4, 4)
    matrix = tiles.permute(_SWIZZLE).reshape(padded, 4 * k_tiles)
    sf = matrix[:rows, :blocks].view(torch.float8_e4m3fn).float()
    packed = y_q.reshape(rows, hidden // 2)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(rows, blocks, NVFP4_BLOCK)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=y_q.device)[(codes & 0x7).long()]
    values = torch.where((codes & 0x8) != 0, -values, values)
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=y_q.device).reshape(())
    return ((values * sf.unsqueeze(-1)) / g).reshape(rows, hidden)
