"""The plugin vLLM loads does nothing unless PCIE_ALLREDUCE_ENABLE=1, and enabled it serves
only vLLM's group named exactly "tp" with peers."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from vllm_harness import (
    TINY_HIDDEN,
    capture_logs,
    init_vllm_groups,
    make_config,
    run_ranks,
    slot_of,
    teardown_vllm_groups,
    tiny_model_dir,
)

CUDA_COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cuda_communicator"
WRAPPED = "_pcie_allreduce_original_init"


def _flag_off(rank: int, world: int, init_file: str, root: str) -> dict[str, Any]:
    import torch
    import vllm.plugins

    out: dict[str, Any] = {}
    # vLLM's real discovery imports the entry-point module; then its hook runs.
    hooks = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    out["hook"] = f"{hooks['pcie_allreduce'].__module__}.{hooks['pcie_allreduce'].__name__}"
    loaded = set(sys.modules)
    out["communicator_imported_before"] = CUDA_COMMUNICATOR_MODULE in loaded
    vllm.plugins.load_general_plugins()  # what vLLM's worker calls: runs every hook once
    out["imported_by_register"] = sorted(set(sys.modules) - loaded)
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    out["wrapped"] = WRAPPED in CudaCommunicator.__dict__
    tp = init_vllm_groups(
        rank, world, init_file, config=make_config(tiny_model_dir(root)), plugins=False
    )
    out["communicator"] = type(tp.device_communicator).__name__
    out["slot"] = slot_of(tp)
    out["routed"] = sorted(
        n
        for n in (
            "reduce_scatter",
            "all_gather",
            "reduce_scatterv",
            "reduce_scatterv_into_output",
            "all_gatherv",
        )
        if n in tp.device_communicator.__dict__
    )
    t = torch.full((2, TINY_HIDDEN), float(rank + 1), dtype=torch.bfloat16)
    out["sum_ok"] = bool((tp.all_reduce(t).float() == world * (world + 1) / 2).all())
    teardown_vllm_groups()
    return out


def test_without_the_enable_flag_the_hook_imports_and_installs_nothing(tmp_path, clean_shm):
    for r in run_ranks(_flag_off, 2, str(tmp_path), our_env=False).values():
        assert r["hook"] == "pcie_allreduce.integrations.vllm.register"
        assert r["communicator_imported_before"] is False
        # The hook imported nothing (not even vLLM's communicator) and wrapped nothing; vLLM's
        # tp group (a real CudaCommunicator) keeps an empty slot and its own all-reduce.
        assert r["imported_by_register"] == []
        assert not r["wrapped"]
        assert r["communicator"] == "CudaCommunicator" and r["slot"] is None
        assert r["routed"] == []  # its reduce-scatter and all-gather are vLLM's methods
        assert r["sum_ok"]


@pytest.mark.parametrize("value", ["0", ""])
def test_enable_0_or_empty_installs_nothing(value, monkeypatch):
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from pcie_allreduce.integrations import vllm as adapter

    monkeypatch.setenv("PCIE_ALLREDUCE_ENABLE", value)
    adapter.register()
    assert WRAPPED not in CudaCommunicator.__dict__


def test_a_bad_enable_value_fails_loudly_naming_the_flag(monkeypatch):
    from pcie_allreduce.integrations import vllm as adapter

    monkeypatch.setenv("PCIE_ALLREDUCE_ENABLE", "maybe")
    with pytest.raises(ValueError, match="PCIE_ALLREDUCE_ENABLE"):
        adapter.register()


NEAR_MISSES = ["attention_tp", "moe_tp", "tp_moe", "pdmux_prefill_tp", "TP", None, "tp:0"]


def _eligibility(rank: int, world: int, init_file: str, root: str) -> dict[str, Any]:
    logs = capture_logs()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    config = make_config(tiny_model_dir(root))
    tp = init_vllm_groups(rank, world, init_file, config=config)
    out: dict[str, Any] = {"tp": type(slot_of(tp)).__name__, "near_misses": {}}
    with set_current_vllm_config(config):
        for name in NEAR_MISSES:
            g = ps.init_model_parallel_group([list(range(world))], rank, "gloo", group_name=name)
            out["near_misses"][str(name)] = (
                type(g.device_communicator).__name__,
                g.unique_name,
                slot_of(g),
            )
            g.destroy()
    # World size 1: vLLM builds no device communicator for a one-rank group at all, so the
    # real CudaCommunicator is built directly over a one-rank group named tp.
    singles = [torch.distributed.new_group([r], backend="gloo") for r in range(world)]
    with set_current_vllm_config(config):
        single = CudaCommunicator(
            cpu_group=singles[rank],
            device=torch.device("cpu"),
            device_group=singles[rank],
            unique_name="tp:9",
        )
    out["world1"] = (single.world_size, single.fi_pcie_ipc_ar_comm)
    single.destroy()
    # Dual-batch overlap: two micro-batches reduce at once, so the tp group gets nothing.
    ps.destroy_model_parallel()
    dbo = make_config(tiny_model_dir(root))
    dbo.parallel_config.enable_dbo = True
    with set_current_vllm_config(dbo):
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    out["dbo"] = (ps.get_tp_group().unique_name, slot_of(ps.get_tp_group()))
    out["dbo_lines"] = logs.matching("dual-batch overlap")
    teardown_vllm_groups()
    return out


def test_only_the_group_named_exactly_tp_with_peers_is_served(tmp_path, clean_shm):
    for rank, r in enumerate(run_ranks(_eligibility, 2, str(tmp_path)).values()):
        assert r["tp"] == "VllmPcieAllReduce"
        for name, (communicator, unique, slot) in r["near_misses"].items():
            # vLLM built its CUDA communicator for each (so the slot existed to fill).
            assert communicator == "CudaCommunicator", name
            assert unique.rsplit(":", 1)[0] == (name if name != "None" else "anonymous")
            assert slot is None, name
        assert r["world1"] == (1, None)
        assert r["dbo"][0].startswith("tp:") and r["dbo"][1] is None
        assert len(r["dbo_lines"]) == (1 if rank == 0 else 0)
