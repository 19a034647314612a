"""SGLang's fused all-reduce + residual add + RMSNorm call site (the layer boundary's gate
``flashinfer_ar_fusion_applies``, ``RMSNorm.forward_with_allreduce_fusion`` and the boundary's
``fused_ffn_input``) reaching PcieAllReduce.all_reduce_add_rms_norm, and its decline path."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run .ci/engine-sglang")

from sglang_ranks import load_sglang_plugins, make_group, publish, run_ranks  # noqa: E402

ENV = {"PCIE_ALLREDUCE_ENABLE": "1", "PCIE_ALLREDUCE_DISABLE_AUTOTUNE": "1"}
HIDDEN, ROWS, EPS = 256, 4, 1e-6


def _inputs(rows: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2)]
    residual = torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64)
    return xs, residual, weight


def _error(xs: Any, residual: Any, weight: Any, dtype: Any, y: Any, r: Any) -> float:
    """Largest distance from the float64 result of the rounded inputs."""
    from pcie_allreduce.testing import fused_float64

    y_ref, r_ref = fused_float64(
        [x.to(dtype) for x in xs], residual.to(dtype), weight.to(dtype), EPS
    )
    return max((y.double() - y_ref).abs().max().item(), (r.double() - r_ref).abs().max().item())


def _sglang_tp(rank: int, world: int) -> Any:
    """SGLang's WORLD and tp groups over gloo, stated in SGLang's parallel context as its
    initialize_model_parallel states them for plain TP (attention TP and MoE TP are the tp
    group itself: ``_ATTN_TP = _TP``, ``_MOE_TP = _TP``)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    load_sglang_plugins()
    publish(tp_size=world)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    tp = make_group(rank, "tp")
    get_parallel().override_permanently(
        tp_rank=rank,
        tp_group=tp,
        attn_tp_group=tp,
        attn_tp_rank=rank,
        attn_tp_size=world,
        moe_tp_group=tp,
        moe_tp_rank=rank,
        moe_tp_size=world,
        moe_ep_size=1,
        attn_dcp_size=1,
    )
    return tp


def _fused(rank: int, world: int, enabled: bool) -> dict[str, Any]:
    import torch
    from sglang.srt.layers.layer_boundary.fusions import allreduce as boundary_fusions
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.layers.layernorm import RMSNorm

    tp = _sglang_tp(rank, world)
    slot = tp.pcie_ipc_comm
    if enabled:
        slot.prepare(hidden=HIDDEN, max_rows=ROWS)  # as SGLang's runner calls it
    out: dict[str, Any] = {"slot": type(slot).__name__ if slot is not None else None}
    gate = add_norm.flashinfer_ar_fusion_applies
    out["gate"] = [bool(gate(n)) for n in (0, 1, ROWS, ROWS + 1)]
    out["boundary_sees_same_gate"] = boundary_fusions.flashinfer_ar_fusion_applies is gate

    dtype = torch.bfloat16
    norm = RMSNorm(HIDDEN, eps=EPS).to(dtype)
    xs, residual, weight = _inputs(ROWS)
    with torch.no_grad():
        norm.weight.copy_(weight.to(dtype))
    x, res = xs[rank].to(dtype), residual.to(dtype)
    plan = type("Plan", (), {"norm": norm})()
    # SGLang's event loop runs the model under its DynamicGradMode (inference mode, else
    # no_grad), so RMSNorm's weight, an nn.Parameter that requires grad, is not tracked there.
    with torch.inference_mode():
        # The boundary's attention -> FFN step: the fused kernel when the gate is open, else None
        # (the boundary then runs its unfused all-reduce and norm).
        result = boundary_fusions.fused_ffn_input(plan, x.clone(), res, None)
    out["boundary_error"] = (
        _error(xs, residual, weight, dtype, *result) if result is not None else None
    )
    if not enabled:  # SGLang's fused op has no CPU kernel: nothing more to call on a CPU
        tp.destroy()
        return out
    with torch.inference_mode():
        # The real RMSNorm entry the boundary calls.
        before = res.clone()
        y, r = norm.forward_with_allreduce_fusion(x.clone(), res)
        out["norm_error"] = _error(xs, residual, weight, dtype, y, r)
        out["fresh"] = r.data_ptr() != res.data_ptr() and torch.equal(res, before)
        out["routed"] = slot.stats()["fused_routed"]

        # Declined: more rows than the workspace holds. SGLang's own path (its all-reduce, then
        # its norm into a fresh residual) gives the same result.
        big_xs, big_res, _ = _inputs(2 * ROWS)
        bx, bres = big_xs[rank].to(dtype), big_res.to(dtype)
        bbefore = bres.clone()
        y, r = norm.forward_with_allreduce_fusion(bx.clone(), bres)
        out["declined_error"] = _error(big_xs, big_res, weight, dtype, y, r)
        out["declined_residual_untouched"] = torch.equal(bres, bbefore)

    # Declined: grad mode on, so the weight is tracked and our op, which has no derivative in
    # this form, leaves the call to SGLang's path, which keeps the graph.
    y, r = norm.forward_with_allreduce_fusion(x.clone(), res)
    out["tracked_error"] = _error(xs, residual, weight, dtype, y, r)
    out["tracked_keeps_graph"] = y.requires_grad
    stats = slot.stats()
    out["routed_after"] = stats["fused_routed"]
    out["fused_declines"] = stats["fused_declines"]
    from pcie_allreduce.testing import fused_kernel_calls

    out["kernel_fused_calls"] = fused_kernel_calls(stats)
    tp.destroy()
    return out


# bf16: y and residual_out are each rounded once (half an ulp of values up to ~8 is 2^-5).
BF16_TOLERANCE = 0.07


def test_sglang_fused_call_site_reaches_our_op_and_declines_to_sglangs_path():
    for r in run_ranks(_fused, True, env=ENV):
        v = r["value"]
        assert v["slot"] == "SglangPcieAllReduce"
        assert v["gate"] == [False, True, True, False]  # rows fit the workspace (ROWS x HIDDEN)
        assert v["boundary_sees_same_gate"]
        assert v["norm_error"] <= BF16_TOLERANCE and v["boundary_error"] <= BF16_TOLERANCE
        assert v["fresh"]  # FlashInfer's contract: a new residual, the input one untouched
        assert v["routed"] == 2
        assert v["declined_error"] <= BF16_TOLERANCE and v["declined_residual_untouched"]
        assert v["tracked_error"] <= BF16_TOLERANCE and v["tracked_keeps_graph"]
        assert v["routed_after"] == 2
        assert v["fused_declines"] == {"too_large": 1, "autograd": 1}
        assert v["kernel_fused_calls"] == 2
        summary = [m for _, m in r["logs"] if "fused add+rms_norm: 2 routed" in m]
        assert len(summary) == 1, r["logs"]


def test_without_the_flag_sglangs_gate_stays_shut():
    for r in run_ranks(_fused, False, env={"PCIE_ALLREDUCE_ENABLE": None}):
        v = r["value"]
        assert v["slot"] is None
        assert v["gate"] == [False, False, False, False]  # a CPU: no FlashInfer fusion
        assert v["boundary_error"] is None  # the boundary's fused step is not taken
