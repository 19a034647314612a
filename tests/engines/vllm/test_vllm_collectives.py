"""The tp group's reduce-scatter and all-gather in a real vLLM (0.33.0): GroupCoordinator's
``reduce_scatter`` / ``all_gather`` / ``reduce_scatterv`` / ``reduce_scatterv_into_output`` /
``all_gatherv`` and vLLM's ``vllm.reduce_scatter`` / ``vllm.all_gather`` custom ops reach
PcieAllReduce's kernels for the calls the slot admits, and vLLM's own CudaCommunicator method
(down to its pynccl call) for the rest; results against float64 sums (reduce-scatter) and
exact concatenations (all-gather). Two spawned ranks, gloo, our host transport.

On a CPU vLLM's pynccl is a disabled object whose reduce_scatter returns without writing, so
the communicator's ``pynccl_comm`` is replaced by :class:`GlooPyNccl`, which does what NCCL
would over the gloo device group and counts its calls: the declined calls run vLLM's real
CudaCommunicator code up to that object."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run .ci/engine-vllm")

from vllm_harness import (
    capture_logs,
    fake_cuda_streams,
    init_vllm_groups,  # noqa: E402
    make_config,
    run_ranks,
    slot_of,
    tiny_model_dir,
)

COLLECTIVES = ("reduce_scatter", "all_gather")
ROUTES = (
    "reduce_scatter",
    "all_gather",
    "reduce_scatterv",
    "reduce_scatterv_into_output",
    "all_gatherv",
)


class GlooPyNccl:
    """vLLM's PyNcclCommunicator as CudaCommunicator uses it, over the gloo device group (what
    NCCL computes), counting calls per method."""

    disabled = False
    available = True
    nccl_version = 0

    def __init__(self, group: Any) -> None:
        import collections

        import torch.distributed as dist

        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.calls: dict[str, int] = collections.Counter()

    def reduce_scatter(self, output: Any, input_: Any, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        self.calls["reduce_scatter"] += 1
        dist.reduce_scatter_tensor(output, input_.contiguous(), group=self.group)

    def reduce_scatterv(
        self, output: Any, input_: Any, sizes: Any, *args: Any, **kwargs: Any
    ) -> None:
        import torch.distributed as dist

        self.calls["reduce_scatterv"] += 1
        full = input_.clone()
        dist.all_reduce(full, group=self.group)
        start = sum(sizes[: self.rank])
        output.copy_(full[start : start + sizes[self.rank]])

    def all_gather(self, output: Any, input_: Any, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        self.calls["all_gather"] += 1
        dist.all_gather_into_tensor(output, input_.contiguous(), group=self.group)

    def all_reduce(self, input_: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        self.calls["all_reduce"] += 1
        out = input_.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def group_start(self) -> None:
        pass

    def group_end(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def _rs_wrong(
    result: Any, rank: int, world: int, shape: tuple, dtype: Any, seed: int, dim: int
) -> int:
    """Elements of ``result`` off vLLM's reduce-scatter of every rank's input along ``dim``
    (its own layout: movedim(0, dim), rows split by rank, moved back), float64 reference."""
    import torch

    from pcie_allreduce.testing import RTOL, reference

    numel = 1
    for n in shape:
        numel *= n
    total, mag = reference(world, numel, dtype, seed)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]

    def mine(t: Any) -> Any:
        rows = t.view(shape).movedim(0, dim)
        m = rows.shape[0] // world
        return rows[rank * m : (rank + 1) * m].movedim(0, dim)

    want, tol = mine(total), mine(mag)
    if tuple(result.shape) != tuple(want.shape):
        return -1
    err = (result.double() - want).abs()
    return int((err > RTOL[name] * tol + 1e-6).sum().item())


def _ag_exact(result: Any, world: int, shape: tuple, dtype: Any, seed: int, dim: int) -> bool:
    """Whether ``result`` is every rank's input concatenated along ``dim``, bit for bit."""
    import torch

    from pcie_allreduce.testing import rank_input

    numel = 1
    for n in shape:
        numel *= n
    want = torch.cat([rank_input(q, numel, dtype, seed).view(shape) for q in range(world)], dim=dim)
    return tuple(result.shape) == tuple(want.shape) and torch.equal(result, want)


def _collectives(rank: int, world: int, init_file: str, root: str) -> dict[str, Any]:
    logs = capture_logs()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from pcie_allreduce.testing import rank_input

    config = make_config(tiny_model_dir(root))  # workspace: 8 rows x 256 = 2048 elements
    tp = init_vllm_groups(rank, world, init_file, config=config)
    comm = tp.device_communicator
    adapter = slot_of(tp)
    ar = adapter.ar
    nccl = GlooPyNccl(comm.device_group)
    comm.pynccl_comm = nccl  # vLLM's NCCL call, over gloo (see the module docstring)
    # Another vLLM group over the same two ranks, with a CudaCommunicator of its own: the
    # plugin leaves it alone (a near-miss name; vLLM's dp/ep groups are size 1 here).
    with set_current_vllm_config(config):
        other = ps.init_model_parallel_group([[0, 1]], rank, "gloo", group_name="tp_other")
    other_nccl = GlooPyNccl(other.device_communicator.device_group)
    other.device_communicator.pynccl_comm = other_nccl

    out: dict[str, Any] = {
        "routed": sorted(n for n in ROUTES if n in comm.__dict__),
        # The class is vLLM's as shipped; other groups' communicators are untouched.
        "class_methods": sorted(
            n
            for n in ROUTES
            if getattr(CudaCommunicator, n).__module__ != CudaCommunicator.__module__
        ),
        "other_groups": {
            name: sorted(n for n in ROUTES if n in g.device_communicator.__dict__)
            for name, g in ((k, ref()) for k, ref in ps._groups.items())
            if g is not None and g is not tp and getattr(g, "device_communicator", None) is not None
        },
        "max_numel": ar.max_numel,
        "install_line": logs.matching("the slot also serves its"),
    }

    def snapshot() -> dict[str, Any]:
        s = adapter.stats().get("collectives") or {}
        return {
            c: (
                sum((s.get(c) or {}).get("calls", {}).values()),
                dict((s.get(c) or {}).get("declines", {})),
            )
            for c in COLLECTIVES
        }

    def run(label: str, call: Any, check: Any) -> None:
        before, nccl_before = snapshot(), dict(nccl.calls)
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
            "nccl": {
                k: v - nccl_before.get(k, 0)
                for k, v in nccl.calls.items()
                if v != nccl_before.get(k, 0)
            },
        }

    def x_of(shape: tuple, dtype: Any, seed: int) -> Any:
        numel = 1
        for n in shape:
            numel *= n
        return rank_input(rank, numel, dtype, seed).view(shape)

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    reasons = {}

    # ---- reduce-scatter: admitted along dim 0 and dim -1 (a transposed, strided input)
    x = x_of((4, 256), bf16, 1)
    reasons["rs small"] = ar.collective_decline_reason(x, "reduce_scatter")
    run(
        "rs dim 0",
        lambda: tp.reduce_scatter(x, dim=0),
        lambda r: _rs_wrong(r, rank, world, (4, 256), bf16, 1, 0) == 0,
    )
    x2 = x_of((256, 4), fp32, 2)
    run(
        "rs dim -1",
        lambda: tp.reduce_scatter(x2, dim=-1),
        lambda r: _rs_wrong(r, rank, world, (256, 4), fp32, 2, 1) == 0 and r.is_contiguous(),
    )
    # vLLM's custom op (what its compiled graphs call) reaches the same route.
    run(
        "rs custom op",
        lambda: torch.ops.vllm.reduce_scatter(x, 0, world, group_name=tp.unique_name),
        lambda r: _rs_wrong(r, rank, world, (4, 256), bf16, 1, 0) == 0,
    )
    # reduce_scatterv: equal sizes are a reduce-scatter; an output given is written in place.
    run(
        "rsv equal sizes",
        lambda: tp.reduce_scatterv(x, dim=0, sizes=[2, 2]),
        lambda r: _rs_wrong(r, rank, world, (4, 256), bf16, 1, 0) == 0,
    )
    into = torch.full((2, 256), float("nan"), dtype=bf16)
    run(
        "rsv into output",
        lambda: tp.reduce_scatterv_into_output(x, into, dim=0),
        lambda r: r is into and _rs_wrong(r, rank, world, (4, 256), bf16, 1, 0) == 0,
    )
    # Declined: larger than the workspace; unequal sizes. vLLM's own path, the right sum.
    big = x_of((32, 256), bf16, 3)
    reasons["rs big"] = ar.collective_decline_reason(big, "reduce_scatter")
    run(
        "rs too large",
        lambda: tp.reduce_scatter(big, dim=0),
        lambda r: _rs_wrong(r, rank, world, (32, 256), bf16, 3, 0) == 0,
    )

    def unequal_ok(r: Any) -> bool:
        from pcie_allreduce.testing import reference

        total, mag = reference(world, 4 * 256, bf16, 1)
        rows = (slice(0, 1), slice(1, 4))[rank]
        want, tol = total.view(4, 256)[rows], mag.view(4, 256)[rows]
        return tuple(r.shape) == tuple(want.shape) and bool(
            ((r.double() - want).abs() <= 2.0**-6 * tol + 1e-6).all()
        )

    run("rsv unequal sizes", lambda: tp.reduce_scatterv(x, dim=0, sizes=[1, 3]), unequal_ok)

    # ---- all-gather: admitted along dim 0 and dim -1, a list through all_gatherv
    g = x_of((2, 256), bf16, 4)
    reasons["ag small"] = ar.collective_decline_reason(g, "all_gather")
    run(
        "ag dim 0",
        lambda: tp.all_gather(g, dim=0),
        lambda r: _ag_exact(r, world, (2, 256), bf16, 4, 0),
    )
    g2 = x_of((3, 128), fp16, 5)
    run(
        "ag dim -1",
        lambda: tp.all_gather(g2, dim=-1),
        lambda r: _ag_exact(r, world, (3, 128), fp16, 5, 1),
    )
    run(
        "ag custom op",
        lambda: torch.ops.vllm.all_gather(g, 0, world, group_name=tp.unique_name),
        lambda r: _ag_exact(r, world, (2, 256), bf16, 4, 0),
    )
    run(
        "agv list",
        lambda: tp.all_gatherv([g, g2], dim=0),
        lambda r: (
            len(r) == 2
            and _ag_exact(r[0], world, (2, 256), bf16, 4, 0)
            and _ag_exact(r[1], world, (3, 128), fp16, 5, 0)
        ),
    )
    big_g = x_of((16, 256), fp32, 6)
    reasons["ag big"] = ar.collective_decline_reason(big_g, "all_gather")
    run(
        "ag too large",
        lambda: tp.all_gather(big_g, dim=0),
        lambda r: _ag_exact(r, world, (16, 256), fp32, 6, 0),
    )
    out["reasons"] = reasons
    # The other group: vLLM's path for a size our slot would take on tp; nothing counted.
    before_other = dict(other_nccl.calls)
    run(
        "other group rs",
        lambda: other.reduce_scatter(x, dim=0),
        lambda r: _rs_wrong(r, rank, world, (4, 256), bf16, 1, 0) == 0,
    )
    out["other group rs"]["other_nccl"] = {
        k: v - before_other.get(k, 0) for k, v in other_nccl.calls.items()
    }
    other.destroy()

    # Inside vLLM's real graph_capture() (only torch.cuda's stream objects faked): the slot's
    # capture() brackets the captured reduce-scatter and all-gather as it does the all-reduce.
    fake_cuda_streams()
    captures = adapter.stats()["captures"]

    def captured() -> Any:
        with ps.graph_capture(torch.device("cpu")):
            return tp.reduce_scatter(x, dim=0), tp.all_gather(g, dim=0)

    run(
        "in graph_capture",
        captured,
        lambda r: (
            _rs_wrong(r[0], rank, world, (4, 256), bf16, 1, 0) == 0
            and _ag_exact(r[1], world, (2, 256), bf16, 4, 0)
        ),
    )
    out["captures"] = adapter.stats()["captures"] - captures

    # vLLM's destroy: the summary line names the collectives; then every call is vLLM's again.
    ps.destroy_model_parallel()
    out["summary"] = logs.matching("pcie_allreduce[tp rank")
    out["slot_after"] = comm.fi_pcie_ipc_ar_comm
    ps.destroy_distributed_environment()
    return out


def test_tp_reduce_scatter_and_all_gather_reach_our_kernels_where_admitted(tmp_path, clean_shm):
    results = run_ranks(_collectives, 2, str(tmp_path)).values()
    for rank, r in enumerate(results):
        assert r["routed"] == sorted(ROUTES)
        assert r["class_methods"] == []
        assert r["other_groups"] and not any(r["other_groups"].values()), r["other_groups"]
        assert r["max_numel"] == 2048
        if rank == 0:
            assert "reduce_scatter, all_gather, reduce_scatterv" in r["install_line"][0]
        reasons = r["reasons"]
        assert reasons["rs small"] is None and reasons["ag small"] is None
        assert reasons["rs big"] and reasons["ag big"]
        ours_rs = {"ours": {"reduce_scatter": 1}, "declines": {}, "nccl": {}}
        ours_ag = {"ours": {"all_gather": 1}, "declines": {}, "nccl": {}}
        for label in (
            "rs dim 0",
            "rs dim -1",
            "rs custom op",
            "rsv equal sizes",
            "rsv into output",
        ):
            assert r[label] == {"ok": True, **ours_rs}, (label, r[label])
        for label in ("ag dim 0", "ag dim -1", "ag custom op"):
            assert r[label] == {"ok": True, **ours_ag}, (label, r[label])
        assert r["agv list"] == {"ok": True, "ours": {"all_gather": 2}, "declines": {}, "nccl": {}}
        # Declined: vLLM's CudaCommunicator ran them down to its pynccl call; our kernels not.
        assert r["rs too large"] == {
            "ok": True,
            "ours": {},
            "declines": {"reduce_scatter": {reasons["rs big"]: 1}},
            "nccl": {"reduce_scatter": 1},
        }
        assert r["rsv unequal sizes"] == {
            "ok": True,
            "ours": {},
            "declines": {"reduce_scatter": {"variable_sizes": 1}},
            "nccl": {"reduce_scatterv": 1},
        }
        assert r["ag too large"] == {
            "ok": True,
            "ours": {},
            "declines": {"all_gather": {reasons["ag big"]: 1}},
            "nccl": {"all_gather": 1},
        }
        assert r["other group rs"] == {
            "ok": True,
            "ours": {},
            "declines": {},
            "nccl": {},
            "other_nccl": {"reduce_scatter": 1},
        }
        assert r["in graph_capture"] == {
            "ok": True,
            "declines": {},
            "nccl": {},
            "ours": {"reduce_scatter": 1, "all_gather": 1},
        }
        assert r["captures"] == 1
        assert r["slot_after"] is None
        assert len(r["summary"]) == 1, r["summary"]
        line = r["summary"][0]
        assert "; reduce_scatter calls: " in line and "; all_gather calls: " in line
        assert f"; reduce_scatter declines: {reasons['rs big']} 1, variable_sizes 1" in line
        assert f"; all_gather declines: {reasons['ag big']} 1" in line
