"""The tp group's reduce-scatter and all-gather in a real SGLang (0.5.23): its public
``reduce_scatter_tensor`` / ``reduce_scatter_along_dim`` / ``all_gather_into_tensor``, the layer
boundary's ``tp_reduce_scatter`` and ``attn_tp_reduce_scatter`` (in place: the output is a slice
of the input) and DP attention's ``attn_tp_all_gather_into_tensor``, through SGLang's
``reg_*`` custom ops, reach PcieAllReduce's kernels for the calls the slot admits (stats count
them), and SGLang's own path (its torch.distributed call here, pynccl being disabled on a CPU)
for the rest and for every other group. Results against float64 sums (reduce-scatter) and
exact concatenations (all-gather). Two spawned ranks, gloo, our host transport."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run .ci/engine-sglang")

from sglang_ranks import lines, load_sglang_plugins, make_group, publish, run_ranks  # noqa: E402

ENV = {"PCIE_ALLREDUCE_ENABLE": "1", "PCIE_ALLREDUCE_DISABLE_AUTOTUNE": "1"}
HIDDEN, ROWS = 256, 8  # workspace: 2048 elements
COLLECTIVES = ("reduce_scatter", "all_gather")


def _sum_rows_wrong(
    result: Any, rank: int, world: int, shape: tuple, dtype: Any, seed: int, dim: int = 0
) -> int:
    """Elements of ``result`` off this rank's share (along ``dim``) of the float64 sum of every
    rank's input; -1 for a wrong shape."""
    import torch

    from pcie_allreduce.testing import RTOL, reference

    numel = shape[0] * shape[1]
    total, mag = reference(world, numel, dtype, seed)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    want = total.view(shape).tensor_split(world, dim=dim)[rank]
    tol = mag.view(shape).tensor_split(world, dim=dim)[rank]
    if tuple(result.shape) != tuple(want.shape):
        return -1
    return int(((result.double() - want).abs() > RTOL[name] * tol + 1e-6).sum().item())


def _gathered_exact(result: Any, world: int, shape: tuple, dtype: Any, seed: int) -> bool:
    import torch

    from pcie_allreduce.testing import rank_input

    want = torch.cat(
        [rank_input(q, shape[0] * shape[1], dtype, seed).view(shape) for q in range(world)]
    )
    return torch.equal(result.reshape(want.shape), want)


def _register_ops_for_cpu(ps: Any) -> None:
    """SGLang registers its ``reg_reduce_scatter_tensor`` / ``reg_all_gather_into_tensor``
    custom ops for the CUDA dispatch key only; the same bodies (SGLang's functions) are
    registered for the CPU key here, so CPU tensors take SGLang's real CUDA call path:
    ``reduce_scatter_tensor`` -> the custom op -> ``_reduce_scatter_tensor``."""
    from sglang.srt.utils.common import sglang_lib

    for name in ("reg_reduce_scatter_tensor", "reg_all_gather_into_tensor"):
        sglang_lib.impl(name, getattr(ps, name).__wrapped__, "CPU")


def _collectives(rank: int, world: int) -> dict[str, Any]:
    import torch
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.layer_boundary import ops as boundary
    from sglang.srt.runtime_context import get_parallel

    import pcie_allreduce.integrations.sglang as ours
    from pcie_allreduce.testing import rank_input

    load_sglang_plugins()
    publish(tp_size=world)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
    tp = make_group(rank, "tp")
    # Plain TP as SGLang's initialize_model_parallel states it: attention TP is the tp group.
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
    other = make_group(rank, "attention_tp")  # a group the plugin leaves alone
    _register_ops_for_cpu(ps)
    slot = tp.pcie_ipc_comm

    # SGLang's own path: _reduce_scatter_tensor / _all_gather_into_tensor call these (pynccl
    # is disabled on a CPU); counting them shows which path ran each call.
    engine = {"reduce_scatter": 0, "all_gather": 0}
    real_rs, real_ag = ps.reduce_scatter_single, ps.all_gather_single

    def rs_spy(*args: Any, **kwargs: Any) -> Any:
        engine["reduce_scatter"] += 1
        return real_rs(*args, **kwargs)

    def ag_spy(*args: Any, **kwargs: Any) -> Any:
        engine["all_gather"] += 1
        return real_ag(*args, **kwargs)

    ps.reduce_scatter_single, ps.all_gather_single = rs_spy, ag_spy

    from sglang.srt.plugins.hook_registry import HookRegistry

    out: dict[str, Any] = {
        # Registered through SGLang's plugin loader, as pcie_allreduce's hooks.
        "hooks": [
            [
                (t.value, f"{h.__module__}.{h.__qualname__}", src.plugin_name if src else None)
                for t, h, src in HookRegistry._hooks.get(target, [])
            ]
            for target in (ours.REDUCE_SCATTER_TARGET, ours.ALL_GATHER_TARGET)
        ],
        "hooked": [
            getattr(getattr(ps.GroupCoordinator, m), "__wrapped__", None) is not None
            for m in ("_reduce_scatter_tensor", "_all_gather_into_tensor")
        ],
    }

    def snapshot() -> dict[str, Any]:
        s = slot.stats().get("collectives") or {}
        return {
            c: (
                sum((s.get(c) or {}).get("calls", {}).values()),
                dict((s.get(c) or {}).get("declines", {})),
            )
            for c in COLLECTIVES
        }

    def run(label: str, call: Any, check: Any) -> None:
        before, engine_before = snapshot(), dict(engine)
        captures = slot.stats().get("captures", 0)
        result = call()
        after = snapshot()
        out[label] = {
            "ok": check(result),
            "ours": {
                c: after[c][0] - before[c][0] for c in COLLECTIVES if after[c][0] != before[c][0]
            },
            "declines": {
                c: {
                    k: v - before[c][1].get(k, 0)
                    for k, v in after[c][1].items()
                    if v != before[c][1].get(k, 0)
                }
                for c in COLLECTIVES
                if after[c][1] != before[c][1]
            },
            "engine": {
                c: engine[c] - engine_before[c]
                for c in COLLECTIVES
                if engine[c] != engine_before[c]
            },
            "captures": slot.stats().get("captures", 0) - captures,
        }

    def x_of(shape: tuple, dtype: Any, seed: int) -> Any:
        return rank_input(rank, shape[0] * shape[1], dtype, seed).view(shape)

    bf16, fp32 = torch.bfloat16, torch.float32
    x = x_of((4, HIDDEN), bf16, 1)

    def public_rs(inp: Any, group: Any = tp) -> Any:
        output = torch.empty((inp.shape[0] // world,) + tuple(inp.shape[1:]), dtype=inp.dtype)
        group.reduce_scatter_tensor(output, inp)
        return output

    def public_ag(inp: Any) -> Any:
        output = torch.empty((world * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype)
        tp.all_gather_into_tensor(output, inp)
        return output

    # Before prepare() built the communicator: SGLang's path, counted.
    run(
        "rs before prepare",
        lambda: public_rs(x),
        lambda r: _sum_rows_wrong(r, rank, world, (4, HIDDEN), bf16, 1) == 0,
    )
    slot.prepare(hidden=HIDDEN, max_rows=ROWS)  # as SGLang's runner calls it
    out["max_numel"] = slot.max_numel

    # ---- admitted
    run(
        "rs public",
        lambda: public_rs(x),
        lambda r: _sum_rows_wrong(r, rank, world, (4, HIDDEN), bf16, 1) == 0,
    )
    x2 = x_of((HIDDEN, 4), fp32, 2)
    run(
        "rs along dim -1",
        lambda: tp.reduce_scatter_along_dim(x2, dim=-1),
        lambda r: _sum_rows_wrong(r, rank, world, (HIDDEN, 4), fp32, 2, dim=1) == 0,
    )
    run(
        "boundary tp_reduce_scatter",
        lambda: boundary.tp_reduce_scatter(x, None),
        lambda r: r[1] is None and _sum_rows_wrong(r[0], rank, world, (4, HIDDEN), bf16, 1) == 0,
    )
    h = x.clone()

    def in_place(r: Any) -> bool:  # SGLang returns the slice of its input it scattered into
        base = h.tensor_split(world)[rank]
        return (
            r.data_ptr() == base.data_ptr()
            and _sum_rows_wrong(r, rank, world, (4, HIDDEN), bf16, 1) == 0
        )

    run(
        "boundary attn_tp_reduce_scatter (in place)",
        lambda: boundary.attn_tp_reduce_scatter(h),
        in_place,
    )
    g = x_of((2, HIDDEN), bf16, 3)
    run(
        "ag public", lambda: public_ag(g), lambda r: _gathered_exact(r, world, (2, HIDDEN), bf16, 3)
    )

    def dp_gather() -> Any:
        output = torch.empty(world * 2, HIDDEN, dtype=bf16)
        dp_attention.attn_tp_all_gather_into_tensor(output, g)
        return output

    run(
        "dp attention attn_tp_all_gather_into_tensor",
        dp_gather,
        lambda r: _gathered_exact(r, world, (2, HIDDEN), bf16, 3),
    )
    # A decision made inside a CUDA graph capture (simulated) enters the capture bracket.
    ours._stream_capturing = lambda device: True
    try:
        run(
            "rs in capture",
            lambda: public_rs(x),
            lambda r: _sum_rows_wrong(r, rank, world, (4, HIDDEN), bf16, 1) == 0,
        )
    finally:
        ours._stream_capturing = lambda device: False
    run(
        "ag after capture",
        lambda: public_ag(g),
        lambda r: _gathered_exact(r, world, (2, HIDDEN), bf16, 3),
    )

    # ---- declined: larger than the workspace; SGLang's path, the right result
    big = x_of((32, HIDDEN), bf16, 4)
    out["rs big reason"] = slot.communicator.collective_decline_reason(big, "reduce_scatter")
    run(
        "rs too large",
        lambda: public_rs(big),
        lambda r: _sum_rows_wrong(r, rank, world, (32, HIDDEN), bf16, 4) == 0,
    )
    big_g = x_of((16, HIDDEN), fp32, 5)
    out["ag big reason"] = slot.communicator.collective_decline_reason(big_g, "all_gather")
    run(
        "ag too large",
        lambda: public_ag(big_g),
        lambda r: _gathered_exact(r, world, (16, HIDDEN), fp32, 5),
    )
    # ---- another group: SGLang's path, nothing counted by us
    run(
        "other group rs",
        lambda: public_rs(x, other),
        lambda r: _sum_rows_wrong(r, rank, world, (4, HIDDEN), bf16, 1) == 0,
    )

    ps.reduce_scatter_single, ps.all_gather_single = real_rs, real_ag
    other.destroy()
    tp.destroy()
    return out


def test_tp_reduce_scatter_and_all_gather_reach_our_kernels_where_admitted():
    results = run_ranks(_collectives, env=ENV)
    for rank, res in enumerate(results):
        r = res["value"]
        assert r["hooks"] == [
            [
                (
                    "around",
                    "pcie_allreduce.integrations.sglang._reduce_scatter_hook",
                    "pcie_allreduce",
                )
            ],
            [("around", "pcie_allreduce.integrations.sglang._all_gather_hook", "pcie_allreduce")],
        ]
        assert r["hooked"] == [True, True]
        assert r["max_numel"] == HIDDEN * ROWS
        assert r["rs before prepare"] == {
            "ok": True,
            "ours": {},
            "declines": {"reduce_scatter": {"not_built": 1}},
            "engine": {"reduce_scatter": 1},
            "captures": 0,
        }
        for label in (
            "rs public",
            "rs along dim -1",
            "boundary tp_reduce_scatter",
            "boundary attn_tp_reduce_scatter (in place)",
        ):
            assert r[label] == {
                "ok": True,
                "ours": {"reduce_scatter": 1},
                "declines": {},
                "engine": {},
                "captures": 0,
            }, (label, r[label])
        for label in ("ag public", "dp attention attn_tp_all_gather_into_tensor"):
            assert r[label] == {
                "ok": True,
                "ours": {"all_gather": 1},
                "declines": {},
                "engine": {},
                "captures": 0,
            }, (label, r[label])
        assert r["rs in capture"] == {
            "ok": True,
            "ours": {"reduce_scatter": 1},
            "declines": {},
            "engine": {},
            "captures": 1,
        }
        assert r["ag after capture"]["ok"] and r["ag after capture"]["ours"] == {"all_gather": 1}
        rs_big, ag_big = r["rs big reason"], r["ag big reason"]
        assert rs_big and ag_big
        assert r["rs too large"] == {
            "ok": True,
            "ours": {},
            "declines": {"reduce_scatter": {rs_big: 1}},
            "engine": {"reduce_scatter": 1},
            "captures": 0,
        }
        assert r["ag too large"] == {
            "ok": True,
            "ours": {},
            "declines": {"all_gather": {ag_big: 1}},
            "engine": {"all_gather": 1},
            "captures": 0,
        }
        assert r["other group rs"] == {
            "ok": True,
            "ours": {},
            "declines": {},
            "engine": {"reduce_scatter": 1},
            "captures": 0,
        }
        summary = lines([res], f"pcie_allreduce[tp rank {rank}/2]: enabled")
        assert len(summary) == 1, res["logs"]
        line = summary[0][2]
        assert "; reduce_scatter calls: " in line and "; all_gather calls: " in line
        assert f"; reduce_scatter declines: not_built 1, {rs_big} 1" in line
        assert f"; all_gather declines: {ag_big} 1" in line
