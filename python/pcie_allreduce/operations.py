"""The names of the operations (the extension's, ``_C.operations()``: what ``try_run`` and the
torch ops take), in a module that imports nothing, so the engine adapters can name them without
loading torch or the extension."""

from __future__ import annotations

ALL_REDUCE, FUSED = "all_reduce", "all_reduce_add_rms_norm"
REDUCE_SCATTER, ALL_GATHER = "reduce_scatter", "all_gather"
# The other fused forms (vLLM's all-reduce fusion patterns): without the residual add (a model's
# first layer), and with y quantised (FP8 at a static per-tensor scale, NVFP4), each with or
# without the residual.
NORM, FUSED_FP8, NORM_FP8 = "all_reduce_rms_norm", f"{FUSED}_fp8", "all_reduce_rms_norm_fp8"
FUSED_FP4, NORM_FP4 = f"{FUSED}_nvfp4", "all_reduce_rms_norm_nvfp4"
QUANTS = ("fp8", "nvfp4")
FUSED_FORMS = {  # (with a residual, quantised) -> the operation
    (True, None): FUSED,
    (False, None): NORM,
    (True, "fp8"): FUSED_FP8,
    (False, "fp8"): NORM_FP8,
    (True, "nvfp4"): FUSED_FP4,
    (False, "nvfp4"): NORM_FP4,
}
OPS = (ALL_REDUCE, FUSED, REDUCE_SCATTER, ALL_GATHER, *FUSED_FORMS.values())
OPS = tuple(dict.fromkeys(OPS))  # FUSED once


def nvfp4_scale_shape(rows: int, hidden: int) -> tuple[int, int]:
    """NVFP4's block-scale bytes for ``rows`` rows of ``hidden``: ``[round_up(rows, 128),
    round_up(hidden / 16, 4)]``, vLLM's swizzled 128x4 layout (plan/quant.h)."""
    return (rows + 127) // 128 * 128, (hidden // 16 + 3) // 4 * 4
