"""vLLM's compiled graphs: the all-reduce + residual add + RMSNorm at the end of a layer reaches
PcieAllReduce.all_reduce_add_rms_norm through the pass the plugin puts in vLLM's custom
post-grad pass slot, on real vLLM groups (2 spawned ranks, gloo, our host transport)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run .ci/engine-vllm")

import vllm_harness as h  # noqa: E402

HIDDEN, ROWS, EPS = 256, 4, 1e-6


def _inputs(rank: int, rows: int, dtype: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2)]
    residual = torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64)
    return xs, residual, weight


def _reference(xs: Any, residual: Any, weight: Any, dtype: Any) -> Any:
    """float64 from the rounded inputs: residual_out = sum + residual, y = rms_norm * weight."""
    from pcie_allreduce.testing import fused_float64

    return fused_float64([x.to(dtype) for x in xs], residual.to(dtype), weight.to(dtype), EPS)


def _graphs(tp_name: str, dtype: Any) -> dict[str, Any]:
    """make_fx graphs of the unfused pattern as vLLM's compiled models hold it."""
    import torch
    import vllm.ir.ops
    from torch.fx.experimental.proxy_tensor import make_fx

    def add_norm(residual, x, weight):  # noqa: ANN001, ANN202
        summed = torch.ops.vllm.all_reduce(x, group_name=tp_name)
        return vllm.ir.ops.fused_add_rms_norm(summed, residual, weight, EPS)

    def norm(x, weight):  # noqa: ANN001, ANN202
        summed = torch.ops.vllm.all_reduce(x, group_name=tp_name)
        return vllm.ir.ops.rms_norm(summed, weight, EPS), summed

    r, x, w = (
        torch.empty(ROWS, HIDDEN, dtype=dtype),
        torch.empty(ROWS, HIDDEN, dtype=dtype),
        torch.empty(HIDDEN, dtype=dtype),
    )
    return {
        "add_norm": make_fx(add_norm, tracing_mode="fake")(r, x, w),
        "norm": make_fx(norm, tracing_mode="fake")(x, w),
    }


def _targets(gm: Any) -> list:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _fused_rank(rank: int, world: int, init_file: str, model_dir: str) -> dict[str, Any]:
    import torch
    from vllm.platforms import current_platform

    from pcie_allreduce.integrations import vllm as ours

    config = h.make_config(model_dir)
    tp = h.init_vllm_groups(rank, world, init_file, config=config)
    slot = h.slot_of(tp)
    held = config.compilation_config.inductor_compile_config.get(current_platform.pass_key)
    out: dict[str, Any] = {
        "pass": type(held).__name__,
        "group": getattr(held, "group_name", None),
        "tp": tp.unique_name,
    }
    # vLLM's own pass manager takes it (the check its backend makes before adding it).
    from vllm.compilation.passes.inductor_pass import InductorPass

    out["is_inductor_pass"] = isinstance(held, InductorPass)
    dtype = torch.bfloat16
    xs, residual, weight = _inputs(rank, ROWS, dtype)
    x, res, w = xs[rank].to(dtype), residual.to(dtype), weight.to(dtype)
    res_before = res.clone()
    y_ref, r_ref = _reference(xs, residual, weight, dtype)
    errors, targets = {}, {}
    for name, gm in _graphs(tp.unique_name, dtype).items():
        before = _targets(gm)
        held(gm.graph)
        gm.recompile()
        targets[name] = (before, _targets(gm), held.matched_count)
        if name == "add_norm":
            y, r = gm(res, x, w)
            errors[name] = (
                (y.double() - y_ref).abs().max().item(),
                (r.double() - r_ref).abs().max().item(),
            )
        else:
            y, s = gm(x, w)
            s_ref = sum(t.to(dtype).double() for t in xs)
            y_only = s_ref * (s_ref.pow(2).mean(-1, keepdim=True) + EPS).rsqrt() * w.double()
            errors[name] = (
                (y.double() - y_only).abs().max().item(),
                (s.double() - s_ref).abs().max().item(),
            )
    out.update(targets=targets, errors=errors, residual_untouched=torch.equal(res, res_before))
    out["routed"] = slot.stats()["fused_routed"]

    # Declined (float64 is no dtype of ours): the op runs vLLM's all-reduce and norm instead.
    op = ours.define_fused_op()
    xd, rd, wd = xs[rank], residual.clone(), weight
    y, r = op(xd, rd, wd, EPS, tp.unique_name)
    yd_ref, rd_ref = _reference(xs, residual, weight, torch.float64)
    out["declined_error"] = max((y - yd_ref).abs().max().item(), (r - rd_ref).abs().max().item())
    stats = slot.stats()
    out["fused_declines"] = stats["fused_declines"]
    out["routed_after"] = stats["fused_routed"]
    from pcie_allreduce.testing import fused_kernel_calls

    # The add form's kernel calls, and the plain norm's (its own entry in the collectives).
    norm_calls = (stats["collectives"].get("all_reduce_rms_norm") or {}).get("calls") or {}
    out["kernel_fused_calls"] = (
        fused_kernel_calls(stats),
        sum(n for path, n in norm_calls.items() if path != "unfused"),
    )
    h.teardown_vllm_groups()
    return out


def test_the_pass_in_vllms_slot_rewrites_all_reduce_and_norm_into_our_fused_op(tmp_path, clean_shm):
    model_dir = h.tiny_model_dir(str(tmp_path))
    for v in h.run_ranks(_fused_rank, 2, model_dir).values():
        assert v["pass"] == "PcieFusedAddRmsNormPass" and v["is_inductor_pass"]
        assert v["group"] == v["tp"] == "tp:0"
        # The plain norm (a model's first layer) becomes the form without the residual add.
        ops = {"add_norm": "fused_add_rms_norm", "norm": "rms_norm"}
        for name, (before, after, matched) in v["targets"].items():
            assert "vllm.all_reduce.default" in before, before
            assert matched == 1
            assert "vllm.all_reduce.default" not in after, after
            assert f"pcie_allreduce_vllm.{ops[name]}.default" in after, after
            assert not any(t.startswith("vllm_ir.") for t in after), after
        # bf16: y and residual_out each rounded once (half an ulp of values up to ~8, 2^-5).
        for name, (err_y, err_r) in v["errors"].items():
            assert err_y <= 0.07 and err_r <= 0.07, (name, err_y, err_r)
        assert v["residual_untouched"]
        assert v["routed"] == 2
        assert v["declined_error"] < 1e-5  # vLLM's norm computes in fp32
        assert v["fused_declines"] == {"dtype": 1} and v["routed_after"] == 2
        assert v["kernel_fused_calls"] == (1, 1)


def _flag_off_rank(rank: int, world: int, init_file: str, model_dir: str) -> dict[str, Any]:
    from vllm.platforms import current_platform

    config = h.make_config(model_dir)
    h.init_vllm_groups(rank, world, init_file, config=config)
    held = config.compilation_config.inductor_compile_config.get(current_platform.pass_key)
    h.teardown_vllm_groups()
    return {"held": repr(held)}


def test_flag_off_leaves_vllms_pass_slot_empty(tmp_path, clean_shm):
    model_dir = h.tiny_model_dir(str(tmp_path))
    for v in h.run_ranks(_flag_off_rank, 2, model_dir, our_env=False).values():
        assert v["held"] == "None"
