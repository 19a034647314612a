"""SGLang's fused end of a layer on our kernels: all-reduce + residual add + RMSNorm.

SGLang's layer boundary offers it where its FlashInfer fusion applies
(``flashinfer_ar_fusion_applies``), and ``RMSNorm.forward_with_allreduce_fusion`` calls
``flashinfer_allreduce_residual_rmsnorm``, whose ``(None, None)`` means "not taken" (the caller
then all-reduces, adds and normalises itself, into a fresh residual). Two AROUND hooks
(SGLang's ``HookRegistry``): the gate (:func:`fusion_gate`) also opens when the tp group's
communicator is built and enabled and SGLang's own rules would allow a fusion
(:func:`fusion_off_reason`: no DP attention, no deterministic inference, no
``--enforce-disable-flashinfer-allreduce-fusion``, no CuTe DSL fusion) for a batch that fits the
workspace; the call (:func:`fused_call`) goes to the slot's ``fused_add_rms_norm`` (one
decision, ``PcieAllReduce.try_run``) when the group it reduces over (SGLang's
``resolve_fusion_group``) holds our slot and the kernels take the tensors, else to SGLang's own
function. Fresh ``(norm_out, residual_out)``, ``residual`` untouched, as FlashInfer's kernel
returns them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .sglang_config import read_config

# SGLang's fused all-reduce + residual add + RMSNorm call site, and the gate that offers it.
FUSED_TARGET = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"
FUSION_GATE_TARGET = (
    "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies"
)
_FUSED_SIGNATURE: inspect.Signature | None = None
_ENGINE_GATE: Callable[..., bool] | None = None  # SGLang's own flashinfer_ar_fusion_applies


def _tp_slot() -> Any:
    """Our slot in SGLang's ``tp`` coordinator, or None (no groups yet, or not ours)."""
    from sglang.srt.runtime_context import get_parallel

    from .sglang import slot_of  # sglang.py imports this module: not at import time

    try:
        tp = get_parallel().tp_group
    except (RuntimeError, ValueError, AttributeError):
        return None
    return slot_of(tp)


def fusion_gate(original: Callable[..., bool], batch_size: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``flashinfer_ar_fusion_applies(batch_size)``: SGLang's answer, or True where our
    communicator can take the fused call instead (``SglangPcieAllReduce.offers_fusion``)."""
    global _ENGINE_GATE
    _ENGINE_GATE = original
    if original(batch_size, *args, **kwargs):
        return True
    slot = _tp_slot()
    return slot is not None and slot.offers_fusion(batch_size)


def fused_call(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``flashinfer_allreduce_residual_rmsnorm``: our fused op when the group the call
    reduces over holds our slot and the kernels take it. Otherwise SGLang's own function where
    SGLang's own gate offered the call (FlashInfer's fusion), else ``(None, None)``, what that
    function returns when FlashInfer does not take a call: SGLang's caller then runs its unfused
    path (its all-reduce, then its add and norm into a fresh residual)."""
    global _FUSED_SIGNATURE
    if _FUSED_SIGNATURE is None:
        _FUSED_SIGNATURE = inspect.signature(original)
    try:
        bound = _FUSED_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    try:
        _, _, coordinator = resolve_fusion_group(use_attn_tp_group=call["use_attn_tp_group"])
    except (RuntimeError, ValueError, AttributeError):  # no groups: SGLang decides
        return original(*args, **kwargs)
    from .sglang import slot_of

    slot = slot_of(coordinator)
    if slot is not None:
        fused = slot.fused_add_rms_norm(
            call["input_tensor"], call["residual"], call["weight"], call["eps"]
        )
        if fused is not None:
            return fused
        rows = call["input_tensor"].shape[0] if call["input_tensor"].dim() else 0
        if _ENGINE_GATE is not None and not _ENGINE_GATE(rows):
            return None, None  # we opened the gate: SGLang's fallback, not FlashInfer's kernel
    return original(*args, **kwargs)


def fusion_off_reason(deterministic: bool) -> str | None:
    """Why SGLang would not fuse the all-reduce into the norm in this server, whatever the
    hardware (its own rules for its FlashInfer fusion), or None."""
    from sglang.srt.runtime_context import get_exec

    if deterministic:
        return "deterministic inference (SGLang turns its all-reduce fusion off there too)"
    enforce_off, _ = read_config(
        "get_exec().comm.enforce_disable_flashinfer_allreduce_fusion",
        lambda: get_exec().comm.enforce_disable_flashinfer_allreduce_fusion,
    )
    if enforce_off:
        return "--enforce-disable-flashinfer-allreduce-fusion"
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.flashinfer_comm_fusion import uses_cutedsl_ar_fusion

    try:
        if is_dp_attention_enabled():
            return "DP attention (the attention group is not the tp group)"
        if uses_cutedsl_ar_fusion():
            return "SGLang's CuTe DSL fusion owns the pattern"
    except (RuntimeError, ValueError, AttributeError) as error:
        return f"SGLang's config cannot be read ({error})"
    return None
