"""The matching half of vLLM's fusion pass (vllm_fusion.py): which all-reduce + norm (+ quant)
subgraphs of a post-grad graph the pass rewrites, and what each leaves unused. Pure graph
inspection; importing it imports nothing of vLLM.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

from ..operations import nvfp4_scale_shape

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: QuantFP8's clamp bounds
NVFP4_BLOCK = 16


def _nvfp4_shapes(x: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """vLLM's scaled_fp4_quant outputs for ``x``: y_q ``[rows, hidden / 2]`` and the int32
    block scales ``[round_up(rows, 128), round_up(hidden / 16, 4) / 4]``."""
    hidden = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    padded_rows, columns = nvfp4_scale_shape(rows, hidden)
    return (rows, hidden // 2), (padded_rows, columns // 4)


def _val_of_item(node: Any, index: int, default: Any) -> Any:
    """The meta value of ``getitem(node, index)`` (a functionalized op's written tensor), or
    ``default`` (the buffer it was written into) where no such getitem exists."""
    for u in node.users:
        if u.args[1] == index and _val(u) is not None:
            return _val(u)
    return default


@dataclass
class _Match:
    """One all-reduce + norm (+ quant) the pass rewrites, and what the rewrite leaves unused."""

    norm: Any  # the vllm_ir norm node
    summed: Any  # the vllm.all_reduce node
    at: Any  # the op goes before it: the norm, or an earlier reader of the sum
    x: Any
    residual: Any
    weight: Any  # the raw weight (Gemma: w, not w.float() + 1)
    offset: float
    eps: float
    ys: list  # nodes holding the norm's y (the rms_norm node, or getitem(fused_add, 0))
    rs: list  # getitem(fused_add, 1) nodes (the residual out)
    quant: str | None = None
    scale: Any = None
    fp8_impl: str = "_C"  # FP8: the vLLM ops the graph held (vllm_fusion.FP8_IMPLS)
    quantised: list = field(default_factory=list)  # nodes holding y_q
    block_scales: list = field(default_factory=list)  # NVFP4: getitem(quant, 2)
    dead: list = field(default_factory=list)  # other nodes it replaces, erased once unused
    vals: list = field(default_factory=list)  # the meta values of the op's outputs


@dataclass
class _Quant:
    """A quantisation of the norm's y that our op computes, found in the graph."""

    quant: str  # "fp8" or "nvfp4"
    scale: Any  # the node of its fp32 scale (NVFP4: the global scale)
    fp8_impl: str  # FP8: the vLLM ops the graph held (vllm_fusion.FP8_IMPLS)
    quantised: list  # nodes holding y_q
    block_scales: list = field(default_factory=list)  # NVFP4: getitem(quant, 2)
    dead: list = field(default_factory=list)  # the nodes it replaces, erased once unused
    # The meta values of y_q (and NVFP4's block scales); empty: the match's own (already set)
    vals: list = field(default_factory=list)


# ---------------------------------------------------------------------- matching
def _order(graph: Any) -> dict[Any, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _match(node: Any, group_name: str, order: dict[Any, int]) -> _Match | None:
    import torch

    add_norm = torch.ops.vllm_ir.fused_add_rms_norm.default
    if node.op != "call_function":
        return None
    if node.target not in (add_norm, torch.ops.vllm_ir.rms_norm.default):
        return _match_norm_quant(node, group_name, order)
    with_residual = node.target is add_norm
    args = _norm_args(node, with_residual=with_residual)
    if args is None:
        return None
    summed, residual, weight, eps = args
    found = _reduced(node, summed, residual, weight, eps, group_name, order)
    if found is None:
        return None
    x, xv, raw_weight, offset, at = found
    if with_residual:
        ys: list[Any] = []
        rs: list[Any] = []
        for u in node.users:
            if u.target is not operator.getitem or u.args[1] not in (0, 1):
                return None
            (ys if u.args[1] == 0 else rs).append(u)
    else:
        ys, rs = [node], []
    m = _Match(node, summed, at, x, residual, raw_weight, offset, float(eps), ys, rs)
    if raw_weight is not weight:  # Gemma's w.to(float32) + c, left to other users if any
        m.dead += [weight, *weight.all_input_nodes]
    val = _val(node)
    m.vals = [val[0] if with_residual and val is not None else val, _val(summed)]
    if len(ys) == 1 and len(ys[0].users) == 1:
        _quant_after(m, xv, order)
    return m


def _reduced(
    node: Any,
    summed: Any,
    residual: Any,
    weight: Any,
    eps: Any,
    group_name: str,
    order: dict[Any, int],
) -> tuple[Any, Any, Any, float, Any] | None:
    """``(x, x's value, the raw weight, weight_offset, where the op goes)`` when ``node``
    normalises ``summed``, an all-reduce of ``x`` over ``group_name``, in a way our ops compute
    (the rules every pattern shares), else None. With a residual nothing else may read the sum
    (the op does not return it); without one the op goes before the sum's first reader (the op
    returns the sum), which must come after the weight and the residual."""
    import torch

    if (
        getattr(summed, "target", None) is not torch.ops.vllm.all_reduce.default
        or _group_of(summed) != group_name
        or isinstance(eps, bool)
        or not isinstance(eps, (int, float))
    ):
        return None
    x = summed.args[0] if summed.args else summed.kwargs.get("tensor")
    xv = _val(x)
    if xv is None or xv.dim() < 1 or not _same(_val(summed), xv):
        return None
    found = _weight_of(weight, xv)
    if found is None:
        return None
    raw_weight, offset = found
    if residual is not None and not _same(_val(residual), xv):
        return None
    others = [u for u in summed.users if u is not node]
    if residual is not None and others:
        return None  # the sum is used elsewhere: the all-reduce stays
    at = min([node, *others], key=order.__getitem__)
    if any(order[a] >= order[at] for a in (raw_weight, residual) if a is not None):
        return None
    return x, xv, raw_weight, offset, at


# vLLM's RMSNormQuantFusionPass (``fuse_norm_quant``) turns the IR norm + static per-tensor FP8
# quantisation into one of these before our pass runs; with the residual or without.
_NORM_QUANT_OPS = {
    "_C::fused_add_rms_norm_static_fp8_quant": True,
    "_C::rms_norm_static_fp8_quant": False,
}


def _match_norm_quant(node: Any, group_name: str, order: dict[Any, int]) -> _Match | None:
    """``auto_functionalized(_C.rms_norm_static_fp8_quant, result=, input=sum, weight=, scale=,
    epsilon=)`` or ``auto_functionalized(_C.fused_add_rms_norm_static_fp8_quant, result=,
    input=sum, residual=, weight=, scale=, epsilon=)`` (getitem 1: y_q; getitem 2: the updated
    residual, sum + residual) after an all-reduce over our group: the FP8 forms, with
    ``fp8_impl="_C_fused"`` (what a declined call runs). A weight of x's dtype only (vLLM's own
    check), a float8_e4m3fn result of x's shape, and the FP8 forms' rules for the scale."""
    with_residual = next(
        (r for name, r in _NORM_QUANT_OPS.items() if _functionalized(node, name, "")), None
    )
    if with_residual is None:
        return None
    kw = node.kwargs
    summed, residual, weight = kw.get("input"), kw.get("residual"), kw.get("weight")
    if with_residual != (residual is not None):
        return None
    found = _reduced(node, summed, residual, weight, kw.get("epsilon"), group_name, order)
    if found is None or found[2] is not weight:  # no Gemma offset: the kernel reads x's dtype
        return None
    x, xv, _, _, at = found
    fp8 = _fp8_result(kw.get("result"), xv)
    gets = _getitems(node, (1, 2) if with_residual else (1,))
    if fp8 is None or gets is None:
        return None
    rs = gets[2] if with_residual else []
    m = _Match(node, summed, at, x, residual, weight, 0.0, float(kw["epsilon"]), [], rs)
    second = _val_of_item(node, 2, _val(residual)) if with_residual else _val(summed)
    m.vals = [_val_of_item(node, 1, fp8), second]
    m.dead = [kw["result"]]
    return m if _take_quant(m, _Quant("fp8", kw.get("scale"), "_C_fused", gets[1]), order) else None


def _norm_args(node: Any, *, with_residual: bool) -> Any:
    """(sum, residual or None, weight, eps) of a vllm_ir norm node, or None when it has a
    ``variance_size`` or a missing weight (our ops normalise the whole row with a weight)."""
    names = (
        ["x", "x_residual", "weight", "epsilon", "variance_size"]
        if with_residual
        else ["x", "weight", "epsilon", "variance_size"]
    )
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    if values.get("variance_size") is not None or values.get("weight") is None:
        return None
    if "epsilon" not in values or "x" not in values:
        return None
    return (values["x"], values.get("x_residual"), values["weight"], values["epsilon"])


def _group_of(node: Any) -> str | None:
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("group_name")


def _val(node: Any) -> Any:
    return getattr(node, "meta", {}).get("val")


def _known(condition: Any) -> bool:
    """True when ``condition`` (over sizes that may be symbolic) holds for every size."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(condition))


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(_known(p == q) for p, q in zip(a, b))


def _same(a: Any, b: Any) -> bool:
    """Same dtype and shape (the residual, the sum: what our ops take beside x)."""
    return a is not None and b is not None and a.dtype == b.dtype and _same_shape(a.shape, b.shape)


def _weight_of(weight: Any, xv: Any) -> tuple[Any, float] | None:
    """(the weight our op takes, weight_offset): the norm's weight when it has x's dtype;
    Gemma's ``w.to(float32) + c`` (an fp32 weight formed in the graph from a ``w`` of x's
    dtype) gives ``(w, c)``, the offset added in fp32 as the graph adds it. None otherwise."""
    import torch

    v = _val(weight)
    if v is None or v.dim() != 1 or not _known(v.shape[0] == xv.shape[-1]):
        return None
    if v.dtype == xv.dtype:
        return weight, 0.0
    aten, prims = torch.ops.aten, torch.ops.prims
    if v.dtype != torch.float32 or getattr(weight, "target", None) not in (
        aten.add.Tensor,
        aten.add.Scalar,
    ):
        return None
    if weight.kwargs.get("alpha", 1) != 1 or len(weight.args) != 2:
        return None
    widened, offset = weight.args
    if not isinstance(offset, (int, float)):
        widened, offset = offset, widened
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        return None
    if not math.isfinite(offset) or not hasattr(widened, "target"):
        return None
    if widened.target is prims.convert_element_type.default and widened.args[1:] == (
        torch.float32,
    ):
        raw = widened.args[0]
    elif widened.target is aten._to_copy.default and widened.kwargs.get("dtype") == torch.float32:
        raw = widened.args[0]
    else:
        return None
    rv = _val(raw)
    if rv is None or rv.dtype != xv.dtype or not _same_shape(rv.shape, v.shape):
        return None
    return raw, float(offset)


def _only_user(node: Any) -> Any:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _quant_after(m: _Match, xv: Any, order: dict[Any, int]) -> None:
    """Fills the quantisation of ``m``'s y into ``m`` when y's only user is one our ops
    compute (and its scale is defined before the norm, where the op goes)."""
    y = m.ys[0]
    u = _only_user(y)
    found = _fp8_vllm_op(y, u, xv) or _fp8_native(y, u) or _nvfp4(y, u, xv)
    if found is not None:
        _take_quant(m, found, order)


def _take_quant(m: _Match, found: _Quant, order: dict[Any, int]) -> bool:
    """Fills a found quantisation into ``m`` when its scale is one fp32 defined before the op's
    place. The op's outputs are (y_q, residual_out[, block_scale]): y_q's value replaces y's."""
    import torch

    sv = _val(found.scale)
    if sv is None or sv.dtype != torch.float32 or sv.numel() != 1:
        return False
    if order.get(found.scale, len(order)) >= order[m.at]:
        return False  # the op goes where the sum is first read: the scale must be there
    m.quant, m.scale, m.fp8_impl = found.quant, found.scale, found.fp8_impl
    m.quantised, m.block_scales = found.quantised, found.block_scales
    m.dead += found.dead
    if found.vals:
        m.vals = [found.vals[0], m.vals[1], *found.vals[1:]]
    return True


def _is_op(target: Any, name: str, overload: str) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and (schema.name, schema.overload_name) == (name, overload)


def _functionalized(u: Any, name: str, overload: str) -> bool:
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    return (
        u is not None
        and u.target is auto_functionalized
        and bool(u.args)
        and _is_op(u.args[0], name, overload)
    )


def _getitems(node: Any, allowed: tuple[int, ...]) -> dict[int, list] | None:
    """``node``'s users by getitem index (None if any is something else)."""
    found: dict[int, list] = {i: [] for i in allowed}
    for u in node.users:
        if u.target is not operator.getitem or u.args[1] not in allowed:
            return None
        found[u.args[1]].append(u)
    return found


def _fp8_vllm_op(y: Any, u: Any, xv: Any) -> _Quant | None:
    """``auto_functionalized(_C.static_scaled_fp8_quant, result=, input=y, scale=,
    group_shape=[-1, -1])`` (MatcherQuantFP8 with vLLM's custom quant op)."""
    if not _functionalized(u, "_C::static_scaled_fp8_quant", ""):
        return None
    kw = u.kwargs
    group_shape = kw.get("group_shape")
    if kw.get("input") is not y or (group_shape is not None and list(group_shape) != [-1, -1]):
        return None
    result = _fp8_result(kw.get("result"), xv)
    gets = _getitems(u, (1,))
    if result is None or gets is None:
        return None
    result_node = kw["result"]
    return _Quant(
        "fp8", kw["scale"], "_C", gets[1], [], [u, result_node], [_val_of_item(u, 1, result)]
    )


def _fp8_result(result: Any, xv: Any) -> Any:
    """The value of a ``_C`` op's FP8 ``result`` buffer when it is float8_e4m3fn of x's shape."""
    import torch

    rv = _val(result)
    if rv is None or rv.dtype != torch.float8_e4m3fn or not _same_shape(rv.shape, xv.shape):
        return None
    return rv


def _fp8_native(y: Any, u: Any) -> _Quant | None:
    """QuantFP8.forward_native (static, per tensor) as Inductor's decompositions trace it:
    ``convert_element_type(y, float32) * reciprocal(scale)``, ``clamp_min(-448)``,
    ``clamp_max(448)`` (or one ``clamp``), ``convert_element_type(float8_e4m3fn)``."""
    import torch

    aten, prims = torch.ops.aten, torch.ops.prims
    convert = prims.convert_element_type.default
    if u is None or u.target is not convert or u.args[1:] != (torch.float32,):
        return None
    mul = _only_user(u)
    if mul is None or mul.target is not aten.mul.Tensor or len(mul.args) != 2:
        return None
    rcp = mul.args[1] if mul.args[0] is u else mul.args[0]
    if getattr(rcp, "target", None) is not aten.reciprocal.default:
        return None
    chain, node = [u, mul], _only_user(mul)
    bounds: list[tuple[str, Any]] = []
    while node is not None and len(bounds) < 2:
        if node.target is aten.clamp.default:
            lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
            bounds += [("min", lo), ("max", hi)]
        elif node.target in (aten.clamp_min.default, aten.clamp_max.default):
            bounds.append(("min" if node.target is aten.clamp_min.default else "max", node.args[1]))
        else:
            break
        chain.append(node)
        node = _only_user(node)
    if dict(bounds) != {"min": -FP8_MAX, "max": FP8_MAX} or len(bounds) != 2:
        return None
    if node is None or node.target is not convert or node.args[1:] != (torch.float8_e4m3fn,):
        return None
    return _Quant("fp8", rcp.args[0], "native", [node], [], [*chain, rcp], [_val(node)])


def _nvfp4(y: Any, u: Any, xv: Any) -> _Quant | None:
    """``auto_functionalized(_C.scaled_fp4_quant.out, input=y, input_scale=,
    is_sf_swizzled_layout=True, output=, output_scale=)``, outputs of vLLM's layout, on bf16 or
    fp16 rows of whole NVFP4 blocks."""
    import torch

    if not _functionalized(u, "_C::scaled_fp4_quant", "out"):
        return None
    kw = u.kwargs
    if kw.get("input") is not y or kw.get("is_sf_swizzled_layout") is not True:
        return None
    if xv.dtype not in (torch.bfloat16, torch.float16) or not _known(
        xv.shape[-1] % NVFP4_BLOCK == 0
    ):
        return None
    y_q, scales = _nvfp4_shapes(xv)
    output, output_scale = _val(kw.get("output")), _val(kw.get("output_scale"))
    if output is None or output.dtype != torch.uint8 or not _same_shape(output.shape, y_q):
        return None
    if output_scale is None or output_scale.dtype != torch.int32:
        return None
    if not _same_shape(output_scale.shape, scales):
        return None
    gets = _getitems(u, (1, 2))
    if gets is None:
        return None
    dead = [u, kw["output"], kw["output_scale"]]
    vals = [_val_of_item(u, 1, output), _val_of_item(u, 2, output_scale)]
    return _Quant("nvfp4", kw["input_scale"], "_C", gets[1], gets[2], dead, vals)
