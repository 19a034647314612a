"""vLLM's own PCIe flag set as well (one owner, one line, vLLM's warm-up reaching our setup),
deterministic inference (VLLM_BATCH_INVARIANT: the pinned one-tactic table), and the warm-up
(tunes once per host, follows vLLM's autotune switch)."""

from __future__ import annotations

from typing import Any

import pytest
import vllm_harness
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

UPSTREAM_FLAG = "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC"


def _both_flags(rank: int, world: int, init_file: str, root: str) -> dict[str, Any]:
    logs = capture_logs()
    import os
    from pathlib import Path
    from types import SimpleNamespace

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators import flashinfer_pcie_ipc_all_reduce as fi
    from vllm.model_executor.warmup import flashinfer_autotune_cache

    built, destroyed = [], []
    theirs = fi.FlashInferPcieIpcAllReduce
    real_init, real_destroy = theirs.__init__, theirs.destroy

    def init_spy(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)

    def destroy_spy(self: Any) -> None:
        destroyed.append(self)
        real_destroy(self)

    theirs.__init__, theirs.destroy = init_spy, destroy_spy

    def phase(tp: Any) -> dict[str, Any]:
        adapter = slot_of(tp)
        ours = [(level, m) for level, m in logs.records if UPSTREAM_FLAG in m]
        return {
            "owner": type(adapter).__name__,
            "built": len(built),
            "destroyed_theirs": len(destroyed) == len(built)
            and all(b is d for b, d in zip(built, destroyed)),
            "conflict_lines": ours,
            "install_lines": logs.matching("vLLM group tp"),
            "stats": adapter.stats(),
            "max_numel": adapter.ar.max_numel,
        }

    # 1: both flags. vLLM builds its FlashInferPcieIpcAllReduce, we replace it.
    config = make_config(tiny_model_dir(root), graphs=True)
    tp = init_vllm_groups(rank, world, init_file, config=config)
    out: dict[str, Any] = {"both": phase(tp)}
    # vLLM's kernel warm-up for its flag calls setup() on whatever holds the slot.
    adapter = slot_of(tp)
    prepared = []
    real_prepare = adapter.ar.prepare

    def prepare_spy(hidden: Any = None, max_rows: Any = None) -> dict[str, Any]:
        prepared.append((hidden, max_rows))
        return real_prepare(hidden, max_rows)

    adapter.ar.prepare = prepare_spy
    flashinfer_autotune_cache.resolve_flashinfer_autotune_file = lambda runner: (
        Path(root) / f"flashinfer-rank{rank}" / "autotune_configs.json"
    )
    fi.warmup_flashinfer_pcie_ipc_allreduce(
        SimpleNamespace(vllm_config=config, model_config=config.model_config, model_runner=None)
    )
    out["setup_prepared"] = prepared
    out["setup_expected"] = (
        config.model_config.get_hidden_size(),
        max(config.compilation_config.cudagraph_capture_sizes),
    )

    # 2: deterministic inference (vLLM then builds no FlashInfer PCIe backend of its own),
    # with the workspace set explicitly.
    ps.destroy_model_parallel()
    logs.records.clear()
    built.clear()
    destroyed.clear()
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["PCIE_ALLREDUCE_MAX_NUMEL"] = "8192"
    config = make_config(tiny_model_dir(root))
    with set_current_vllm_config(config):
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tp = ps.get_tp_group()
    adapter = slot_of(tp)
    out["deterministic"] = phase(tp)
    sizes = [8, 64, 512, 4096, 8192]
    out["tactics"] = {
        adapter.ar.chosen_tactic(torch.empty(n, dtype=dtype))
        for n in sizes
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
    }
    sums = []
    for n in sizes:
        x = torch.full(
            (n // TINY_HIDDEN or 1, min(n, TINY_HIDDEN)), float(rank + 1), dtype=torch.bfloat16
        )
        sums.append(bool((tp.all_reduce(x).float() == world * (world + 1) / 2).all()))
    out["sums_ok"] = all(sums)
    out["calls"] = adapter.stats()["calls"]
    teardown_vllm_groups()
    return out


@pytest.fixture(scope="module")
def both_flags(tmp_path_factory):
    before, first = vllm_harness.shm_entries(), len(vllm_harness.SPAWNED_PIDS)
    results = run_ranks(
        _both_flags, 2, str(tmp_path_factory.mktemp("both")), env={UPSTREAM_FLAG: "1"}
    ).values()
    assert vllm_harness.leaked_since(before, first) == set()
    return results


def test_with_vllms_own_pcie_flag_too_we_own_the_slot_and_say_so_once(both_flags):
    for rank, r in enumerate(both_flags):
        both = r["both"]
        assert both["owner"] == "VllmPcieAllReduce"
        assert both["built"] == 1 and both["destroyed_theirs"]  # theirs was built, then freed
        assert len(both["conflict_lines"]) == (1 if rank == 0 else 0)
        if rank == 0:
            level, line = both["conflict_lines"][0]
            assert level == "WARNING"
            assert "PCIE_ALLREDUCE_ENABLE=1" in line and "pcie_allreduce owns" in line
            assert "FlashInferPcieIpcAllReduce was built and is destroyed" in line
        # vLLM's warm-up for its flag reached our setup() with the model's hidden size and
        # vLLM's largest capture size.
        assert r["setup_prepared"] == [r["setup_expected"]]
        assert both["stats"]["table_source"] == "embedded seed table"


def test_batch_invariant_mode_pins_one_oneshot_tactic_for_every_size(both_flags):
    for rank, r in enumerate(both_flags):
        d = r["deterministic"]
        assert d["owner"] == "VllmPcieAllReduce" and d["built"] == 0
        assert d["stats"]["deterministic"] is True
        assert d["stats"]["table_source"] == "table argument"
        assert d["max_numel"] == 8192  # PCIE_ALLREDUCE_MAX_NUMEL
        assert len(r["tactics"]) == 1 and next(iter(r["tactics"])).startswith("oneshot/")
        assert r["sums_ok"] and set(r["calls"]) == r["tactics"]
        # One line still says who owns the slot, and why vLLM built nothing of its own.
        assert len(d["conflict_lines"]) == (1 if rank == 0 else 0)
        if rank == 0:
            assert "under VLLM_BATCH_INVARIANT=1" in d["conflict_lines"][0][1]
            assert "deterministic" in d["install_lines"][0]
            assert "PCIE_ALLREDUCE_MAX_NUMEL=8192" in d["install_lines"][0]


def _warm_up(rank: int, world: int, init_file: str, root: str, cache_dir: str) -> dict[str, Any]:
    import os

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from pcie_allreduce.integrations import common

    common.WARMUP_TUNE_BUDGET_S = 2.0  # instead of a minute on a host without a cache
    phases: dict[str, Any] = {}
    for name, autotune in (("engine_autotune_off", False), ("first", True), ("second", True)):
        config = make_config(tiny_model_dir(root), flashinfer_autotune=autotune)
        if not phases:
            tp = init_vllm_groups(rank, world, init_file, config=config)
        else:
            with set_current_vllm_config(config):
                ps.initialize_model_parallel(tensor_model_parallel_size=world)
            tp = ps.get_tp_group()
        adapter = slot_of(tp)
        phases[name] = {
            "warm_up": adapter.warm_up,
            "table_source": adapter.stats()["table_source"],
            "cache_files": sorted(os.listdir(cache_dir)),
        }
        ps.destroy_model_parallel()
    teardown_vllm_groups()
    return phases


def test_the_warm_up_tunes_once_per_host_unless_vllm_turned_autotune_off(tmp_path, clean_shm):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"PCIE_ALLREDUCE_ENABLE": "1", "PCIE_ALLREDUCE_CACHE_DIR": str(cache)}
    results = run_ranks(_warm_up, 2, str(tmp_path), str(cache), env=env, our_env=False)
    for r in results.values():
        off, first, second = (r[k] for k in ("engine_autotune_off", "first", "second"))
        assert off["warm_up"]["tuned"] is False
        assert "the engine's autotune is disabled" in off["warm_up"]["why_not_tuned"]
        assert off["cache_files"] == [] and off["table_source"] == "embedded seed table"
        # Installed programs for every admitted size either way.
        assert off["warm_up"]["programs"] >= 1
        assert first["warm_up"]["tuned"] is True and first["warm_up"]["measured"] > 0
        assert first["warm_up"]["path"].startswith(str(cache)) and first["cache_files"]
        assert first["table_source"].startswith("cache ")
        # The next start on this host loads the cache and measures nothing.
        assert second["warm_up"]["tuned"] is False and second["warm_up"]["measured"] == 0
        assert second["table_source"] == first["table_source"]
