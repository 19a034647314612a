"""vLLM's fused end of a layer on our kernels: a torch.compile post-grad pass and the op it puts
in the graph.

vLLM fuses all-reduce + residual add + RMSNorm in its own post-grad pass
(``AllReduceFusionPass``, FlashInfer's kernel, NVLink-class hosts only). Where our slot is
filled (``vllm.fill_slot``), ``PcieFusedAddRmsNormPass`` (:func:`fusion_pass_class`) goes into
the slot vLLM keeps for one custom post-grad pass,
``compilation_config.inductor_compile_config[current_platform.pass_key]``
(``"post_grad_custom_post_pass"``), unless something else already holds it; vLLM's
``PostGradPassManager`` runs it after its own fusion passes and before lowering its IR. It
rewrites ``vllm.all_reduce`` over the tp group followed by ``vllm_ir.fused_add_rms_norm`` (or
``vllm_ir.rms_norm``) into :data:`FUSED_OP`, whose body makes one decision through the tp
group's slot (``EngineSlot.fused_add_rms_norm``: our kernels when they take the tensors) and
otherwise runs vLLM's own ``vllm.all_reduce`` then ``vllm.ir.ops.fused_add_rms_norm``: the
graph's values either way. Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pcie_allreduce.vllm")

FUSED_OP = "pcie_allreduce_vllm::fused_add_rms_norm"  # what the fusion pass puts in the graph

_FUSED_OP_DEFINED = False


def define_fused_op() -> Any:
    """Defines :data:`FUSED_OP` once per process (a functional op: new outputs, inputs
    untouched) and returns it: ``(x, residual, weight, eps, group_name) -> (y, residual_out)``
    with ``residual_out = sum_ranks(x) + residual``, ``y = rms_norm(residual_out) * weight``."""
    global _FUSED_OP_DEFINED
    import torch

    namespace, name = FUSED_OP.split("::")
    if not _FUSED_OP_DEFINED:

        @torch.library.custom_op(
            FUSED_OP,
            mutates_args=(),
            schema=(
                "(Tensor x, Tensor residual, Tensor weight, float eps, str group_name) "
                "-> (Tensor, Tensor)"
            ),
        )
        def fused_add_rms_norm(x, residual, weight, eps, group_name):  # noqa: ANN001, ANN202
            return _run_fused(x, residual, weight, eps, group_name)

        @fused_add_rms_norm.register_fake
        def _(x, residual, weight, eps, group_name):  # noqa: ANN001, ANN202
            return torch.empty_like(x), torch.empty_like(residual)

        _FUSED_OP_DEFINED = True
    return getattr(getattr(torch.ops, namespace), name).default


def _run_fused(x: Any, residual: Any, weight: Any, eps: float, group_name: str) -> Any:
    """The op's body: one decision through the tp group's slot (our kernels when they take the
    tensors), else vLLM's own all-reduce (its dispatch, our slot included) and vLLM's
    fused_add_rms_norm."""
    import torch
    import vllm.ir.ops
    from vllm.distributed import get_tp_group

    from .vllm import slot_of  # vllm.py imports this module: not at import time

    tp = get_tp_group()
    slot = slot_of(tp.device_communicator if tp.unique_name == group_name else None)
    fused = slot.fused_add_rms_norm(x, residual, weight, eps) if slot is not None else None
    if fused is not None:
        return fused
    summed = torch.ops.vllm.all_reduce(x, group_name=group_name)
    y, residual_out = vllm.ir.ops.fused_add_rms_norm(summed, residual, weight, eps)
    inputs = {t.data_ptr() for t in (x, residual, weight)}  # a custom op's outputs are new
    y = y.clone() if y.data_ptr() in inputs else y
    residual_out = (
        residual_out.clone() if residual_out.data_ptr() in inputs | {y.data_ptr()} else residual_out
    )
    return y, residual_out


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
            "pcie_allreduce: vLLM's compiled graphs get all-reduce + residual add + "
            "RMSNorm fused for group %s (inductor_compile_config[%r])",
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
    group_name)`` over our group whose result only feeds
    ``vllm_ir.fused_add_rms_norm(sum, residual, weight, eps)`` becomes one
    :data:`FUSED_OP` node (same outputs); ``vllm_ir.rms_norm(sum, weight, eps)`` becomes the
    op with a zero residual (its ``residual_out`` is the sum, for the sum's other users).
    Only weights of the input's dtype and no ``variance_size`` (what our op computes)."""

    # Given by vLLM's InductorPass, the other base of fusion_pass_class().
    hash_dict: Callable[[Any], Any]
    hash_source: Callable[..., Any]

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.matched_count = 0

    def uuid(self) -> Any:
        return self.hash_dict(
            {"source": self.hash_source(FusedAddRmsNormRewrite), "group": self.group_name}
        )

    def __call__(self, graph: Any) -> None:
        import torch

        all_reduce = torch.ops.vllm.all_reduce.default
        add_norm = torch.ops.vllm_ir.fused_add_rms_norm.default
        norm = torch.ops.vllm_ir.rms_norm.default
        fused = define_fused_op()
        order = {node: i for i, node in enumerate(graph.nodes)}
        matched = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (add_norm, norm):
                continue
            args = _norm_args(node, with_residual=node.target is add_norm)
            if args is None:
                continue
            summed, residual, weight, eps = args
            if (
                getattr(summed, "target", None) is not all_reduce
                or _group_of(summed) != self.group_name
                or not _same_dtype(summed, weight)
            ):
                continue
            others = [u for u in summed.users if u is not node]
            if node.target is add_norm and others:
                continue  # the sum is used elsewhere: the all-reduce stays
            if any(order[u] < order[node] for u in others):
                continue
            x = summed.args[0]
            with graph.inserting_before(node):
                if residual is None:
                    residual = graph.call_function(torch.ops.aten.zeros_like.default, (x,))
                    residual.meta["val"] = x.meta.get("val")
                out = graph.call_function(fused, (x, residual, weight, float(eps), self.group_name))
            val = node.meta.get("val")
            if node.target is add_norm:
                out.meta["val"] = val
                node.replace_all_uses_with(out)
            else:
                out.meta["val"] = (val, summed.meta.get("val"))
                with graph.inserting_after(out):
                    y = graph.call_function(operator.getitem, (out, 0))
                    y.meta["val"] = val
                with graph.inserting_after(y):
                    total = graph.call_function(operator.getitem, (out, 1))
                    total.meta["val"] = summed.meta.get("val")
                node.replace_all_uses_with(y)
                summed.replace_all_uses_with(total)
            graph.erase_node(node)
            graph.erase_node(summed)
            matched += 1
        self.matched_count = matched
        if matched:
            graph.lint()
            logger.debug("pcie_allreduce: fused %d all-reduce + RMSNorm pattern(s)", matched)


def _norm_args(node: Any, *, with_residual: bool) -> Any:
    """(sum, residual or None, weight, eps) of a vllm_ir norm node, or None when it has a
    ``variance_size`` or a missing weight (our op normalises the whole row with a weight)."""
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


def _same_dtype(a: Any, b: Any) -> bool:
    va, vb = getattr(a, "meta", {}).get("val"), getattr(b, "meta", {}).get("val")
    return va is not None and vb is not None and va.dtype == vb.dtype
