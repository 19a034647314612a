"""Stand-ins for vLLM's compiled ``torch.ops._C`` ops on a CPU-only host (the vLLM wheel in
.venv-vllm has no ``vllm._C``), with vLLM 0.33.0's schemas (csrc/torch_bindings.cpp), so that
vLLM's fusion code imports (``matcher_utils`` builds a dict of ``torch.ops._C.*`` at import) and
its pattern classes trace the graphs its matchers look for.

The two quantisation ops the all-reduce fusion patterns hold run here with vLLM's CUDA
arithmetic written in torch (``pcie_allreduce.testing``): ``static_scaled_fp8_quant`` and
``scaled_fp4_quant.out`` (the latter only where ``testing.nvfp4_quant`` exists); so do the two
norm + static FP8 ops vLLM's RMSNormQuantFusionPass puts in their place,
``rms_norm_static_fp8_quant`` and ``fused_add_rms_norm_static_fp8_quant``
(csrc/layernorm_quant_kernels.cu). The rest only have to exist; calling one raises.

``install()`` once per process, before anything imports
``vllm.compilation.passes.fusion.matcher_utils``."""

from __future__ import annotations

from typing import Any

_LIB: Any = None

# Only their names are needed (matcher_utils' QUANT_OPS and op constants).
_DECLARED = (
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox) -> ()",
    "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, "
    "Tensor? scale_ub) -> ()",
    # rms_quant_fusion (imported by allreduce_rms_fusion) names these at import.
    "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor weight, "
    "Tensor! scale, float epsilon, Tensor? scale_ub, Tensor!? residual) -> ()",
)
STATIC_FP8 = (
    "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
    "int[]? group_shape=None) -> ()"
)
NORM_FP8 = (
    "rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, Tensor scale, "
    "float epsilon) -> ()"
)
ADD_NORM_FP8 = (
    "fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor! residual, "
    "Tensor weight, Tensor scale, float epsilon) -> ()"
)
FP4 = (
    "scaled_fp4_quant(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout) "
    "-> (Tensor, Tensor)"
)
FP4_OUT = (
    "scaled_fp4_quant.out(Tensor input, Tensor input_scale, bool is_sf_swizzled_layout, *, "
    "Tensor(a!) output, Tensor(b!) output_scale) -> ()"
)


def _unavailable(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("a stand-in for vLLM's compiled op: not callable on this host")


def _static_fp8(result: Any, input: Any, scale: Any, group_shape: Any = None) -> None:
    from pcie_allreduce.testing import fp8_static_quant

    assert scale.numel() == 1 and group_shape in (None, [-1, -1]), (scale.shape, group_shape)
    result.copy_(fp8_static_quant(input, scale))


def _norm_fp8(result: Any, input: Any, weight: Any, scale: Any, epsilon: float) -> None:
    """The kernels' arithmetic, per row: the fp32 sum of squares of the (rounded) input,
    ``rsqrt(sum / hidden + eps)``, ``(scalar_t)(x * rsqrt)`` times the weight of the input's
    dtype rounded to it again (c10's operator*), then static_scaled_fp8_quant's conversion."""
    from pcie_allreduce.testing import fp8_static_quant

    assert weight.dtype == input.dtype and scale.numel() == 1, (weight.dtype, scale.shape)
    x = input.float()
    inv = (x * x).mean(-1, keepdim=True).add(epsilon).rsqrt()
    result.copy_(fp8_static_quant((x * inv).to(input.dtype) * weight, scale))


def _add_norm_fp8(
    result: Any, input: Any, residual: Any, weight: Any, scale: Any, epsilon: float
) -> None:
    """``residual = (scalar_t)(input + residual)`` in place, then the norm and quantisation of
    that rounded sum."""
    residual.copy_(input + residual)
    _norm_fp8(result, residual, weight, scale, epsilon)


def _fp4_out(input: Any, input_scale: Any, is_sf_swizzled_layout: bool, *, output, output_scale):  # noqa: ANN001, ANN202
    import torch

    from pcie_allreduce import testing

    assert is_sf_swizzled_layout
    quant = getattr(testing, "nvfp4_quant", None)
    if quant is None:
        raise NotImplementedError("pcie_allreduce.testing.nvfp4_quant does not exist yet")
    y_q, scales = quant(input.reshape(-1, input.shape[-1]), input_scale)
    output.copy_(y_q.view(output.shape))
    output_scale.copy_(scales.view(torch.int32).view(output_scale.shape))


def _fp4(input: Any, input_scale: Any, is_sf_swizzled_layout: bool) -> Any:
    from vllm._custom_ops import create_fp4_output_tensors

    n = input.shape[-1]
    output, output_scale = create_fp4_output_tensors(
        input.numel() // n, n, input.device, is_sf_swizzled_layout
    )
    _fp4_out(input, input_scale, is_sf_swizzled_layout, output=output, output_scale=output_scale)
    return output, output_scale


def install() -> None:
    """Defines the stand-ins (once; a no-op where vLLM's own ``_C`` is loaded)."""
    global _LIB
    import torch
    import vllm._custom_ops  # noqa: F401 - its register_fake guards are read before we define

    if _LIB is not None or hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    for schema in _DECLARED:
        lib.define(schema)
        lib.impl(schema.split("(", 1)[0], _unavailable, "CompositeExplicitAutograd")
    mutating = {  # ops that return nothing: their fakes too
        STATIC_FP8: _static_fp8,
        NORM_FP8: _norm_fp8,
        ADD_NORM_FP8: _add_norm_fp8,
    }
    for schema, kernel in mutating.items():
        lib.define(schema)
        lib.impl(schema.split("(", 1)[0], kernel, "CPU")
    lib.define(FP4)
    lib.define(FP4_OUT)
    lib.impl("scaled_fp4_quant", _fp4, "CPU")
    lib.impl("scaled_fp4_quant.out", _fp4_out, "CPU")

    for name in [*(s.split("(", 1)[0] for s in mutating), "scaled_fp4_quant.out"]:
        torch.library.register_fake(f"_C::{name}", lambda *args, **kwargs: None, lib=lib)

    @torch.library.register_fake("_C::scaled_fp4_quant", lib=lib)
    def _(input, input_scale, is_sf_swizzled_layout):  # noqa: ANN001, ANN202
        from vllm._custom_ops import create_fp4_output_tensors

        n = input.shape[-1]
        return create_fp4_output_tensors(input.numel() // n, n, input.device, is_sf_swizzled_layout)

    _LIB = lib
