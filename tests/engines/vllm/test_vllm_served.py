"""The tp group of a real vLLM, built the way vLLM's worker builds it: the plugin vLLM loads
fills CudaCommunicator's PCIe slot, vLLM's own all-reduce dispatch reaches it for admitted
tensors and runs its own fallback for the rest, graph_capture() enters it, and vLLM's destroy
releases it while the groups live."""

from __future__ import annotations

from typing import Any

from vllm_harness import (
    TINY_HIDDEN,
    capture_logs,
    fake_cuda_streams,
    init_vllm_groups,
    make_config,
    run_ranks,
    slot_of,
    tiny_model_dir,
)


def _served(rank: int, world: int, init_file: str, root: str) -> dict[str, Any]:
    logs = capture_logs()
    import sys

    import torch
    import vllm.plugins

    # vLLM's worker loads its general plugins before building groups: our hook wraps
    # CudaCommunicator's constructor (importing vLLM's communicator module to do so).
    loaded = set(sys.modules)
    vllm.plugins.load_general_plugins()
    imported = set(sys.modules) - loaded
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    config = make_config(tiny_model_dir(root))
    tp = init_vllm_groups(rank, world, init_file, config=config, plugins=False)
    comm = tp.device_communicator
    adapter = slot_of(tp)
    out: dict[str, Any] = {
        "plugin_imported": sorted(
            m
            for m in imported
            if "cuda_communicator" in m or m == "pcie_allreduce.integrations.vllm"
        ),
        "wrapped": "_pcie_allreduce_original_init" in CudaCommunicator.__dict__,
        "communicator": type(comm).__name__,
        "is_cuda_communicator": isinstance(comm, CudaCommunicator),
        "slot": f"{type(adapter).__module__}.{type(adapter).__name__}",
        "max_numel": adapter.ar.max_numel,
        "expected_numel": config.scheduler_config.max_num_seqs
        * (1 + config.num_speculative_tokens)
        * config.model_config.get_hidden_size(),
        "enabled": adapter.ar.enabled,
        "slot_state": (adapter.disabled, adapter.initialized),
        "transport": adapter.transport,
        "install_lines": logs.matching("vLLM group tp"),
    }

    def calls() -> int:
        return sum(adapter.stats()["calls"].values())

    def declines() -> dict[str, int]:
        return dict(adapter.stats()["declines"])

    # An admitted tensor: vLLM's tp_group.all_reduce -> CudaCommunicator.all_reduce -> slot.
    rows = adapter.ar.max_numel // TINY_HIDDEN // 2
    small = torch.full((rows, TINY_HIDDEN), float(rank + 1), dtype=torch.bfloat16)
    before = (calls(), declines())
    result = tp.all_reduce(small)
    out["small"] = {
        "sum_ok": bool((result.float() == world * (world + 1) / 2).all()),
        "input_kept": bool((small.float() == rank + 1).all()),
        "calls": calls() - before[0],
        "declines_same": declines() == before[1],
    }
    # Declined: larger than the workspace, and a dtype the kernels do not run. vLLM's own
    # fallback (torch.distributed on its device group here) must produce the sum.
    declined = {}
    for label, t in (
        (
            "too_large",
            torch.full(
                (2 * adapter.ar.max_numel // TINY_HIDDEN, TINY_HIDDEN),
                float(rank + 1),
                dtype=torch.float32,
            ),
        ),
        ("dtype", torch.full((rows, TINY_HIDDEN), rank + 1, dtype=torch.int64)),
    ):
        before = (calls(), declines())
        r = tp.all_reduce(t)
        after = declines()
        declined[label] = {
            "sum_ok": bool((r.double() == world * (world + 1) / 2).all()),
            "our_calls": calls() - before[0],
            "new_declines": {
                k: after.get(k, 0) - before[1].get(k, 0)
                for k in after
                if after.get(k, 0) != before[1].get(k, 0)
            },
            "why": adapter.ar.decline_reason(t),
        }
    out["declined"] = declined
    out["engine_fallback"] = adapter.stats()["engine_fallback"]

    # vLLM's real graph_capture(): only torch.cuda's stream objects are faked on this host.
    fake_cuda_streams()
    captures = adapter.stats()["captures"]
    with ps.graph_capture(torch.device("cpu")) as ctx:
        out["capture_stream"] = type(ctx.stream).__name__
        inside = tp.all_reduce(small)
    out["captures"] = adapter.stats()["captures"] - captures
    out["inside_sum_ok"] = bool((inside.float() == world * (world + 1) / 2).all())

    # vLLM's real destroy: CudaCommunicator.destroy releases the slot before the groups go.
    seen: dict[str, Any] = {}
    release = adapter.ar.destroy

    def destroy_spy() -> None:
        seen["groups_alive"] = hasattr(tp, "cpu_group") and hasattr(tp, "device_group")
        seen["gloo_size"] = torch.distributed.get_world_size(tp.cpu_group)
        release()

    adapter.ar.destroy = destroy_spy
    ps.destroy_model_parallel()
    out["destroy"] = dict(seen)
    out["slot_after"] = comm.fi_pcie_ipc_ar_comm
    adapter.destroy()  # idempotent: no second summary line
    out["summary"] = logs.matching("pcie_allreduce[tp rank")
    out["stats_after"] = adapter.stats()
    ps.destroy_distributed_environment()
    return out


def test_the_real_tp_group_dispatches_captures_and_destroys_through_our_slot(tmp_path, clean_shm):
    results = run_ranks(_served, 2, str(tmp_path)).values()
    for rank, r in enumerate(results):
        assert r["plugin_imported"] == [
            "pcie_allreduce.integrations.vllm",
            "vllm.distributed.device_communicators.cuda_communicator",
        ]
        assert r["wrapped"]
        assert r["is_cuda_communicator"], r["communicator"]
        assert r["slot"] == "pcie_allreduce.integrations.vllm.VllmPcieAllReduce"
        assert r["enabled"] and r["transport"] == "host_shm"
        assert r["slot_state"] == (False, True)  # vLLM reads .disabled; .initialized as theirs
        # Sized from the resolved config: no CUDA graphs on the CPU platform, so the
        # scheduler's max_num_seqs requests of one token, times the model's hidden size.
        assert r["max_numel"] == r["expected_numel"]
        assert len(r["install_lines"]) == (1 if rank == 0 else 0)
        if rank == 0:
            assert f"= {r['expected_numel']} elements" in r["install_lines"][0]
            assert "max_num_seqs" in r["install_lines"][0]

        assert r["small"] == {"sum_ok": True, "input_kept": True, "calls": 1, "declines_same": True}
        for label, d in r["declined"].items():
            assert d["sum_ok"], (label, d)
            assert d["our_calls"] == 0, (label, d)  # vLLM's chain ran it, not ours
            assert d["why"] == label and d["new_declines"] == {label: 1}, (label, d)
        assert r["engine_fallback"] == 2

        assert r["capture_stream"] == "FakeStream"
        assert r["captures"] == 1 and r["inside_sum_ok"]

        assert r["destroy"] == {"groups_alive": True, "gloo_size": 2}
        assert r["slot_after"] is None
        assert len(r["summary"]) == 1, r["summary"]
        line = r["summary"][0]
        assert f"pcie_allreduce[tp rank {rank}/2]: enabled" in line
        assert "too_large 1" in line and "dtype 1" in line
        assert r["stats_after"]["captures"] == 1
