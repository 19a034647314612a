"""How SGLang's plugin loader installs us, and which groups get a communicator."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run .ci/engine-sglang")

from sglang_ranks import lines, load_sglang_plugins, make_group, run_ranks  # noqa: E402

ON = {"PCIE_ALLREDUCE_ENABLE": "1"}
OURS = "pcie_allreduce.integrations.sglang"
TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__"


def _our_modules() -> list:
    return sorted(
        m for m in sys.modules if m == "pcie_allreduce" or m.startswith("pcie_allreduce.")
    )


def _plugins_and_tp_group(rank: int, world: int) -> dict[str, Any]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_sglang_plugins()
    hooks = [
        (
            hook_type.value,
            f"{hook.__module__}.{hook.__qualname__}",
            source.plugin_name if source else None,
        )
        for hook_type, hook, source in HookRegistry._hooks.get(TARGET, [])
    ]
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    wrapped = hasattr(GroupCoordinator.__init__, "__wrapped__")
    tp = make_group(rank, "tp")
    slot = tp.pcie_ipc_comm
    out = {
        "hooks": hooks,
        "patched": TARGET in HookRegistry._patched,
        "wrapped": wrapped,
        "slot": type(slot).__module__ + "." + type(slot).__name__,
        "disabled": slot.disabled,
        "device": str(slot.device),
        "rank": slot.rank,
        "world": slot.world_size,
    }
    tp.destroy()
    return out


def test_load_plugins_applies_our_hook_and_the_tp_group_gets_our_slot():
    for rank, r in enumerate(run_ranks(_plugins_and_tp_group, env=ON)):
        value = r["value"]
        assert value["hooks"] == [("after", f"{OURS}._after_group_init", "pcie_allreduce")]
        assert value["patched"] and value["wrapped"]
        assert value["slot"] == f"{OURS}.SglangPcieAllReduce"
        assert value["disabled"] is False  # SGLang asks it, so the first reduction can build it
        assert (value["device"], value["rank"], value["world"]) == ("cpu", rank, 2)


def _flag_off(rank: int, world: int) -> dict[str, Any]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_sglang_plugins()
    after_plugins = {
        "ours_loaded": OURS in sys.modules,
        "our_modules": _our_modules(),
        "parallel_state": "sglang.srt.distributed.parallel_state" in sys.modules,
        "hooks": len(HookRegistry._hooks.get(TARGET, [])),
    }
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    after_plugins["wrapped"] = [
        hasattr(getattr(GroupCoordinator, m), "__wrapped__")
        for m in ("__init__", "_reduce_scatter_tensor", "_all_gather_into_tensor")
    ]
    tp = make_group(rank, "tp")
    slot = tp.pcie_ipc_comm
    after_plugins["slot"] = None if slot is None else type(slot).__name__
    after_plugins["our_modules_after_group"] = _our_modules()
    tp.destroy()
    return after_plugins


@pytest.mark.parametrize("flag", [None, "0"])
def test_flag_off_installs_nothing_and_imports_nothing_beyond_the_entry_point(flag):
    baseline = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, {OURS}; print(sorted(m for m in sys.modules if "
            "m == 'pcie_allreduce' or m.startswith('pcie_allreduce.')))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    for r in run_ranks(_flag_off, env={"PCIE_ALLREDUCE_ENABLE": flag}):
        value = r["value"]
        assert value["ours_loaded"]  # SGLang found the entry point and called register()
        assert str(value["our_modules"]) == baseline
        assert str(value["our_modules_after_group"]) == baseline
        # Nothing registered, so SGLang never resolved (imported) the hook target.
        assert not value["parallel_state"] and value["hooks"] == 0
        assert value["wrapped"] == [False, False, False]
        assert value["slot"] is None
        assert not r["logs"]


def _upstream_alone(rank: int, world: int) -> str:
    load_sglang_plugins()
    tp = make_group(rank, "tp")
    name = type(tp.pcie_ipc_comm).__name__
    tp.destroy()
    return name


def test_flag_off_leaves_sglangs_own_backend_in_the_slot():
    results = run_ranks(_upstream_alone, env={"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"})
    assert [r["value"] for r in results] == ["PcieIpcCommunicator"] * 2


NEAR_MISSES = ["attention_tp", "moe_tp", "pdmux_prefill_tp", "tp_", "TP", None]


def _near_misses(rank: int, world: int) -> dict[str, Any]:
    load_sglang_plugins()
    out = {}
    for name in NEAR_MISSES:
        group = make_group(rank, name)
        out[str(name)] = group.pcie_ipc_comm
        group.destroy()
    tp = make_group(rank, "tp")  # the same process does fill the real one
    out["tp"] = type(tp.pcie_ipc_comm).__name__
    tp.destroy()
    return out


def test_near_miss_group_names_get_nothing():
    for r in run_ranks(_near_misses, env=ON):
        value = r["value"]
        assert {name: value[str(name)] for name in NEAR_MISSES} == {
            name: None for name in NEAR_MISSES
        }
        assert value["tp"] == "SglangPcieAllReduce"
        assert len(lines([r], "is not the tensor-parallel group")) == len(NEAR_MISSES)


def _world_one(rank: int, world: int) -> dict[str, Any]:
    load_sglang_plugins()
    alone = make_group(rank, "tp", group_ranks=[[0], [1]])
    out = {"alone_world": alone.world_size, "alone": alone.pcie_ipc_comm}
    alone.destroy()
    pair = make_group(rank, "tp")
    out["pair"] = type(pair.pcie_ipc_comm).__name__
    pair.destroy()
    return out


def test_world_size_one_gets_nothing():
    for r in run_ranks(_world_one, env=ON):
        assert r["value"] == {"alone_world": 1, "alone": None, "pair": "SglangPcieAllReduce"}
        assert lines([r], "tensor-parallel world size 1")
