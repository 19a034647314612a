"""vLLM's fused end of a layer on our kernels: a torch.compile post-grad pass and the ops it puts
in the graph.

vLLM fuses the tp all-reduce with the RMSNorm after it (and the residual add, and the static
FP8 or NVFP4 quantisation of the norm's output) in its own post-grad pass
(``AllReduceFusionPass``, FlashInfer's kernels, NVLink-class hosts only), eight patterns. Where
our slot is filled (``vllm.fill_slot``), ``PcieFusedAddRmsNormPass`` (:func:`fusion_pass_class`)
goes into the slot vLLM keeps for one custom post-grad pass,
``compilation_config.inductor_compile_config[current_platform.pass_key]``
(``"post_grad_custom_post_pass"``), unless something else already holds it; vLLM's
``PostGradPassManager`` runs it after its own fusion passes and before lowering its IR.

It rewrites ``vllm.all_reduce`` over the tp group followed by ``vllm_ir.fused_add_rms_norm`` or
``vllm_ir.rms_norm`` (a Gemma weight ``w.to(float32) + 1.0`` included), and optionally by vLLM's
static per-tensor FP8 quantisation (``_C.static_scaled_fp8_quant`` or QuantFP8's native torch
ops) or NVFP4 quantisation (``_C.scaled_fp4_quant.out``) of the norm, into one of the
:data:`FORMS` ops; so does the all-reduce followed by ``_C.rms_norm_static_fp8_quant`` or
``_C.fused_add_rms_norm_static_fp8_quant``, what vLLM's own RMSNormQuantFusionPass
(``fuse_norm_quant``, run before the custom slot) makes of the norm + static FP8. Each op is
functional (new outputs, inputs untouched) with the outputs of the nodes it replaces, and its
body makes one decision through the tp group's slot (``EngineSlot.all_reduce_rms_norm``: our
kernels when they take the tensors); otherwise it runs vLLM's own ``vllm.all_reduce``,
``vllm.ir.ops`` norm and quantisation op (or its ``_C`` norm + FP8 op): the graph's values
either way. Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .vllm_fusion_match import (
    FP8_MAX,
    _Match,
    _match,
    _nvfp4_shapes,
    _order,
)

logger = logging.getLogger("pcie_allreduce.vllm")

NAMESPACE = "pcie_allreduce_vllm"


@dataclass(frozen=True)
class Form:
    """One op the pass puts in the graph: ``NAMESPACE::name``."""

    name: str
    residual: bool  # takes the residual (adds it to the sum before the norm)
    quant: str | None  # None, "fp8" (static per-tensor float8_e4m3fn) or "nvfp4"

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def schema(self) -> str:
        """``(x, [residual,] weight, [scale,] eps, group_name, weight_offset[, fp8_impl])
        -> (y or y_q, residual_out[, block_scale])``; ``fp8_impl``: which of vLLM's FP8 ops
        the graph held, what a declined call runs (:data:`FP8_IMPLS`)."""
        args = ["Tensor x"] + ["Tensor residual"] * self.residual + ["Tensor weight"]
        args += ["Tensor scale"] * (self.quant is not None)
        args += ["float eps", "str group_name", "float weight_offset=0.0"]
        args += ['str fp8_impl="_C"'] * (self.quant == "fp8")
        outs = "(Tensor, Tensor, Tensor)" if self.quant == "nvfp4" else "(Tensor, Tensor)"
        return f"({', '.join(args)}) -> {outs}"


# Every form, with (residual, quant) as PcieAllReduce.all_reduce_rms_norm takes them. Outputs:
# y (x's dtype) or y_q (float8_e4m3fn like x; NVFP4: uint8 [rows, hidden / 2], rows = x's
# elements / hidden), then residual_out (sum + residual; without a residual the sum itself),
# then NVFP4's block scales as vLLM holds them (int32 [round_up(rows, 128),
# round_up(hidden / 16, 4) / 4], four float8_e4m3fn each, swizzled 128x4).
FORMS = {
    (True, None): Form("fused_add_rms_norm", True, None),
    (False, None): Form("rms_norm", False, None),
    (True, "fp8"): Form("fused_add_rms_norm_fp8", True, "fp8"),
    (False, "fp8"): Form("rms_norm_fp8", False, "fp8"),
    (True, "nvfp4"): Form("fused_add_rms_norm_nvfp4", True, "nvfp4"),
    (False, "nvfp4"): Form("rms_norm_nvfp4", False, "nvfp4"),
}
FUSED_OP = FORMS[(True, None)].qualname  # the all-reduce + residual add + RMSNorm op

# The FP8 forms' ``fp8_impl``: the vLLM ops the graph held after the all-reduce, which a
# declined call runs.
FP8_IMPLS = {
    "_C": "the IR norm, then _C.static_scaled_fp8_quant",
    "native": "the IR norm, then QuantFP8's native torch ops",
    "_C_fused": "_C.rms_norm_static_fp8_quant / _C.fused_add_rms_norm_static_fp8_quant",
}


_LIB: Any = None  # the torch.library.Library holding the forms, once defined


def define_fused_ops() -> dict[tuple[bool, str | None], Any]:
    """Defines every :data:`FORMS` op once per process and returns their overloads by
    ``(residual, quant)``."""
    global _LIB
    import torch

    if _LIB is None:
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        for form in FORMS.values():
            lib.define(form.name + form.schema)
            lib.impl(form.name, _kernel(form), "CompositeExplicitAutograd")
            torch.library.register_fake(form.qualname, _fake(form), lib=lib)
        _LIB = lib
    ns = getattr(torch.ops, NAMESPACE)
    return {key: getattr(ns, form.name).default for key, form in FORMS.items()}


def define_fused_op() -> Any:
    """The all-reduce + residual add + RMSNorm op, :data:`FUSED_OP`:
    ``(x, residual, weight, eps, group_name, weight_offset=0.0) -> (y, residual_out)`` with
    ``residual_out = sum_ranks(x) + residual``,
    ``y = rms_norm(residual_out) * (weight + weight_offset)``."""
    return define_fused_ops()[(True, None)]


@dataclass
class _Call:
    """One call of a form's op, its arguments by name."""

    form: Form
    x: Any
    residual: Any
    weight: Any
    scale: Any
    eps: float
    group_name: str
    weight_offset: float
    fp8_impl: str


def _call(form: Form, args: tuple, kwargs: dict[str, Any]) -> _Call:
    """The arguments of one call (the dispatcher leaves out trailing ones at their default)."""
    names = ["x"] + ["residual"] * form.residual + ["weight"] + ["scale"] * bool(form.quant)
    names += ["eps", "group_name", "weight_offset"] + ["fp8_impl"] * (form.quant == "fp8")
    values: dict[str, Any] = {
        "residual": None,
        "scale": None,
        "weight_offset": 0.0,
        "fp8_impl": "_C",
    }
    values.update(zip(names, args))
    values.update(kwargs)
    if values["fp8_impl"] not in FP8_IMPLS:
        raise ValueError(f"fp8_impl {values['fp8_impl']!r}: one of {sorted(FP8_IMPLS)}")
    return _Call(
        form,
        values["x"],
        values["residual"],
        values["weight"],
        values["scale"],
        float(values["eps"]),
        values["group_name"],
        float(values["weight_offset"]),
        values["fp8_impl"],
    )


def _kernel(form: Form) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _run_fused(_call(form, args, kwargs))

    return kernel


def _fake(form: Form) -> Callable[..., Any]:
    def fake(*args: Any, **kwargs: Any) -> Any:
        import torch

        c = _call(form, args, kwargs)
        x = c.x
        r = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if form.quant is None:
            return torch.empty(x.shape, dtype=x.dtype, device=x.device), r
        if form.quant == "fp8":
            return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device), r
        y_q, scales = _nvfp4_shapes(x)
        return (
            torch.empty(y_q, dtype=torch.uint8, device=x.device),
            r,
            torch.empty(scales, dtype=torch.int32, device=x.device),
        )

    return fake


def _run_fused(c: _Call) -> Any:
    """An op's body: one decision through the tp group's slot (our kernels when they take the
    tensors), else vLLM's own all-reduce (its dispatch, our slot included), norm and quant."""
    import torch
    from vllm.distributed import get_tp_group

    from .vllm import slot_of  # vllm.py imports this module: not at import time

    tp = get_tp_group()
    slot = slot_of(tp.device_communicator if tp.unique_name == c.group_name else None)
    fused = None
    if slot is not None:
        fused = slot.all_reduce_rms_norm(
            c.x,
            c.weight,
            c.eps,
            residual=c.residual,
            weight_offset=c.weight_offset,
            quant=c.form.quant,
            scale=c.scale,
        )
    if fused is None:
        return _run_unfused(c)
    if c.form.quant == "nvfp4":  # vLLM's layout: y_q [rows, hidden / 2], the scales as int32
        y_q, residual_out, block_scale = fused
        return y_q.view(-1, y_q.shape[-1]), residual_out, block_scale.view(torch.int32)
    return tuple(fused)


def _run_unfused(c: _Call) -> Any:
    """What the graph held, in vLLM's own ops: its all-reduce, then its IR norm (a Gemma weight
    ``weight.float() + weight_offset``, as the graph formed it) and its quantisation, or its
    ``_C`` norm + FP8 quantisation op."""
    import torch

    summed = torch.ops.vllm.all_reduce(c.x, group_name=c.group_name)
    if c.form.quant == "fp8" and c.fp8_impl == "_C_fused":
        outs = _vllm_norm_quant(c, summed)
    else:
        outs = _vllm_norm_then_quant(c, summed)
    # A custom op's outputs are new tensors, none an input or another output.
    seen = {t.data_ptr() for t in (c.x, c.residual, c.weight, c.scale) if t is not None}
    fresh = []
    for t in outs:
        if t.data_ptr() in seen:
            t = t.clone(memory_format=torch.contiguous_format)
        elif not t.is_contiguous():  # the fake's layout
            t = t.contiguous()
        seen.add(t.data_ptr())
        fresh.append(t)
    return tuple(fresh)


def _vllm_norm_quant(c: _Call, summed: Any) -> list:
    """vLLM's ``_C`` norm + static FP8 op on the sum (RMSNormQuantFusionPass's): y_q, and the
    residual updated in place (a copy of it: the op's inputs stay untouched) or the sum."""
    import torch

    y_q = torch.empty(summed.shape, dtype=torch.float8_e4m3fn, device=summed.device)
    if c.residual is None:
        torch.ops._C.rms_norm_static_fp8_quant(y_q, summed, c.weight, c.scale, c.eps)
        return [y_q, summed]
    residual_out = c.residual.clone(memory_format=torch.contiguous_format)
    torch.ops._C.fused_add_rms_norm_static_fp8_quant(
        y_q, summed, residual_out, c.weight, c.scale, c.eps
    )
    return [y_q, residual_out]


def _vllm_norm_then_quant(c: _Call, summed: Any) -> list:
    """vLLM's IR norm of the sum, then the quantisation the graph held."""
    import torch
    import vllm.ir.ops

    weight = c.weight if c.weight_offset == 0 else c.weight.float() + c.weight_offset
    if c.residual is None:
        y, residual_out = vllm.ir.ops.rms_norm(summed, weight, c.eps), summed
    else:
        y, residual_out = vllm.ir.ops.fused_add_rms_norm(summed, c.residual, weight, c.eps)
    outs = [y, residual_out]
    if c.form.quant == "fp8" and c.fp8_impl == "native":
        # QuantFP8.forward_native, static per-tensor, as the graph held it.
        outs[0] = (
            (y.to(torch.float32) * c.scale.to(torch.float32).reciprocal())
            .clamp(-FP8_MAX, FP8_MAX)
            .to(torch.float8_e4m3fn)
        )
    elif c.form.quant == "fp8":
        outs[0] = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=y.device)
        torch.ops._C.static_scaled_fp8_quant(outs[0], y, c.scale, [-1, -1])
    elif c.form.quant == "nvfp4":
        from vllm._custom_ops import create_fp4_output_tensors

        hidden = y.shape[-1]
        y_q, block_scale = create_fp4_output_tensors(y.numel() // hidden, hidden, y.device, True)
        torch.ops._C.scaled_fp4_quant.out(y, c.scale, True, output=y_q, output_scale=block_scale)
        outs = [y_q, residual_out, block_scale]
    return outs


def install_fusion_pass(config: Any, group_name: str, *, log: bool = True) -> bool:
    """Puts a ``PcieFusedAddRmsNormPass`` for ``group_name`` in vLLM's custom post-grad pass
    slot of ``config`` (the config vLLM's worker compiles with). False, with one line, when
    there is no config or the slot is already taken (the user's pass is kept)."""
    if config is None or getattr(config, "compilation_config", None) is None:
        return False
    from vllm.platforms import current_platform

    key = current_platform.pass_key
    inductor = config.compilation_config.inductor_compile_config
    held = inductor.get(key)
    cls = fusion_pass_class()
    if isinstance(held, cls):
        return True
    if held is not None:
        if log:
            logger.warning(
                "pcie_allreduce: vLLM's inductor_compile_config[%r] already holds %r; "
                "the fused all-reduce + RMSNorm pass is not installed (the group's "
                "all-reduce is still served)",
                key,
                held,
            )
        return False
    inductor[key] = cls(group_name)
    if log:
        logger.info(
            "pcie_allreduce: vLLM's compiled graphs get all-reduce + (residual add +) "
            "RMSNorm (+ FP8 / NVFP4 quantisation) fused for group %s "
            "(inductor_compile_config[%r])",
            group_name,
            key,
        )
    return True


_PASS_CLASS: Any = None


def fusion_pass_class() -> Any:
    """``PcieFusedAddRmsNormPass``: :class:`FusedAddRmsNormRewrite` as a vLLM ``InductorPass``
    (what vLLM's pass manager accepts), made on first use so that importing this module
    imports nothing of vLLM."""
    global _PASS_CLASS
    if _PASS_CLASS is None:
        from vllm.compilation.passes.inductor_pass import InductorPass

        _PASS_CLASS = type(
            "PcieFusedAddRmsNormPass",
            (FusedAddRmsNormRewrite, InductorPass),
            {"__module__": __name__},
        )
    return _PASS_CLASS


class FusedAddRmsNormRewrite:
    """A vLLM post-grad pass (as ``fusion_pass_class()``): every ``vllm.all_reduce(x,
    group_name)`` over our group whose result feeds a ``vllm_ir.fused_add_rms_norm(sum,
    residual, weight, eps)`` (its only user) or ``vllm_ir.rms_norm(sum, weight, eps)`` (the sum
    may have other users: the op returns it) becomes one :data:`FORMS` op with the same
    outputs, the norm's y quantised in it when its only user is vLLM's static per-tensor FP8
    quantisation (``_C.static_scaled_fp8_quant``, or QuantFP8's native ``to(float32) *
    scale.reciprocal()``, clamp to +-448, ``to(float8_e4m3fn)``) or its NVFP4 quantisation
    (``_C.scaled_fp4_quant.out``, swizzled scales); the same all-reduce feeding vLLM's
    ``_C.rms_norm_static_fp8_quant`` / ``_C.fused_add_rms_norm_static_fp8_quant`` becomes the
    FP8 form too. Only weights of the input's dtype, or Gemma's ``w.to(float32) + c`` of such a
    ``w`` (passed as ``w`` with ``weight_offset=c``), and no ``variance_size`` (what our ops
    compute)."""

    # Given by vLLM's InductorPass, the other base of fusion_pass_class().
    hash_dict: Callable[[Any], Any]
    hash_source: Callable[..., Any]

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.matched_count = 0
        self.matched_forms: dict[str, int] = {}  # per form's op name, in the last graph

    def uuid(self) -> Any:
        return self.hash_dict(
            {
                "source": self.hash_source(
                    Path(__file__).read_text()
                    + Path(__file__).with_name("vllm_fusion_match.py").read_text()
                ),
                "group": self.group_name,
            }
        )

    def __call__(self, graph: Any) -> None:
        ops = define_fused_ops()
        order = _order(graph)
        forms: dict[str, int] = {}
        for node in list(graph.nodes):
            m = _match(node, self.group_name, order)
            if m is None:
                continue
            form = _rewrite(graph, m, ops, self.group_name, order)
            forms[form.name] = forms.get(form.name, 0) + 1
            order = _order(graph)
        self.matched_forms = forms
        self.matched_count = sum(forms.values())
        if forms:
            graph.lint()
            logger.debug("pcie_allreduce: fused all-reduce + RMSNorm patterns: %s", forms)


# ---------------------------------------------------------------------- rewriting
def _rewrite(graph: Any, m: _Match, ops: dict, group_name: str, order: dict[Any, int]) -> Form:
    """Puts the form's op where the sum is first read, points the replaced outputs' users at
    its outputs and erases what is left unused."""
    form = FORMS[(m.residual is not None, m.quant)]
    args: tuple = (m.x,) + ((m.residual,) if m.residual is not None else ()) + (m.weight,)
    args += ((m.scale,) if m.quant else ()) + (m.eps, group_name, m.offset)
    args += (m.fp8_impl,) if m.quant == "fp8" else ()
    replaced = [
        m.quantised if m.quant else m.ys,
        m.rs if m.residual is not None else [m.summed],
        m.block_scales,
    ]
    with graph.inserting_before(m.at):
        out = graph.call_function(ops[(m.residual is not None, m.quant)], args)
    out.meta["val"] = tuple(m.vals)
    anchor, items = out, []
    for i, val in enumerate(m.vals):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (out, i))
        item.meta["val"] = val
        anchor = item
        items.append(item)
        for node in replaced[i]:
            node.replace_all_uses_with(item)
    erased = {*m.dead, *m.quantised, *m.block_scales, *m.ys, *m.rs, m.norm, m.summed}
    for node in sorted(erased, key=lambda n: order.get(n, -1), reverse=True):
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)
    for item in items:  # outputs nothing reads (the sum only the norm read)
        if not item.users:
            graph.erase_node(item)
    return form
