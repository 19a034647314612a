"""What the slot reads from SGLang: workspace sizing, deterministic inference, SGLang's own
PCIe-IPC flag and its autotune switch, and the warm-up before graph capture."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run .ci/engine-sglang")

import sglang_ranks  # noqa: E402
from sglang_ranks import (  # noqa: E402
    lines,
    load_sglang_plugins,
    make_group,
    publish,
    run_ranks,
    unpublish,
)

ENV = {"PCIE_ALLREDUCE_ENABLE": "1", "PCIE_ALLREDUCE_DISABLE_AUTOTUNE": "1"}
HIDDEN = 128

# (published config or None, prepare's max_rows, PCIE_ALLREDUCE_MAX_NUMEL) per case.
SIZING = {
    "unpublished, no rows": (None, None, None),
    "unpublished, runner rows": (None, 12, None),
    "published, no speculation": ({"max_bs": 24}, 12, None),
    "published, speculation": (
        {"max_bs": 24, "speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 3},
        12,
        None,
    ),
    "published, draft tokens without an algorithm": (
        {"max_bs": 24, "speculative_num_draft_tokens": 3},
        12,
        None,
    ),
    "published, no decode graph": ({}, 12, None),
    "published, fewer rows than the runner's": ({"max_bs": 4}, 12, None),
    "explicit env": ({"max_bs": 24}, 12, "4096"),
}


def _sizing(rank: int, world: int) -> dict[str, Any]:
    load_sglang_plugins()
    out = {}
    for case, (config, rows, explicit) in SIZING.items():
        if config is None:
            unpublish()
        else:
            publish(**config)
        if explicit is None:
            os.environ.pop("PCIE_ALLREDUCE_MAX_NUMEL", None)
        else:
            os.environ["PCIE_ALLREDUCE_MAX_NUMEL"] = explicit
        seen = len(sglang_ranks.LOGS.records)
        tp = make_group(rank, "tp")
        slot = tp.pcie_ipc_comm
        outcome = slot.prepare(hidden=HIDDEN, max_rows=rows)
        how = slot.stats()["sizing"]
        out[case] = {
            "max_numel": slot.max_numel,
            "how": how,
            "covered": outcome["rows_covered"],
            "workspace": slot.communicator.max_numel,
            "said": [m for _, m in sglang_ranks.LOGS.records[seen:] if how in m],
        }
        tp.destroy()
    return out


def _expected(config: Any, rows: Any, explicit: Any) -> int:
    if explicit:
        return int(explicit)
    config = config or {}
    if config.get("max_bs"):
        draft = config.get("speculative_num_draft_tokens") or 1
        if not config.get("speculative_algorithm"):
            draft = 1
        return config["max_bs"] * draft * HIDDEN
    return (rows or 64) * HIDDEN


def test_workspace_sizing_from_sglangs_config_prepare_env_or_an_announced_guess():
    results = run_ranks(_sizing, env=ENV)
    for r in results:
        for case, (config, rows, explicit) in SIZING.items():
            got = r["value"][case]
            assert got["max_numel"] == got["workspace"] == _expected(config, rows, explicit), case
            known = rows or (config or {}).get("max_bs")  # prepare() checks what it can
            assert got["covered"] == (got["max_numel"] // HIDDEN if known else None), case
    sized = results[0]["value"]
    assert "guessing 64 rows" in sized["unpublished, no rows"]["how"]
    assert "PCIE_ALLREDUCE_MAX_NUMEL=4096" == sized["explicit env"]["how"]
    # A workspace smaller than the runner's widest decode is said once, on rank 0.
    assert [
        (rank, level)
        for rank, level, _ in lines(results, "batches of 5..12 rows go to the fallback")
    ] == [(0, "WARNING")]
    for rank, r in enumerate(results):
        for case, got in r["value"].items():
            # One line per build says how: rank 0's, or size_workspace's warning on each rank
            # when it had to guess.
            assert len(got["said"]) == (1 if rank == 0 or "guessing" in got["how"] else 0), (
                rank,
                case,
                got["said"],
            )


def _sweep(slot: Any) -> list[str]:
    import torch

    ar = slot.communicator
    return sorted(
        {
            ar.chosen_tactic(torch.empty(n, dtype=torch.bfloat16)).split("/")[0]
            for n in range(8, ar.max_numel + 1, 8 * 61)
        }
        | {ar.chosen_tactic(torch.empty(ar.max_numel, dtype=torch.bfloat16)).split("/")[0]}
    )


# (environment, published config) per case; the rest of the flags unset.
DETERMINISM = {
    "default": ({}, None),
    "SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1": (
        {"SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "1"},
        None,
    ),
    "1-stage all-reduce off wins over deterministic": (
        {"SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "1", "SGLANG_USE_1STAGE_ALLREDUCE": "0"},
        None,
    ),
    "1-stage all-reduce on alone": ({"SGLANG_USE_1STAGE_ALLREDUCE": "1"}, None),
    "published --enable-deterministic-inference": ({}, {"enable_deterministic_inference": True}),
    "1-stage all-reduce off wins over the published flag": (
        {"SGLANG_USE_1STAGE_ALLREDUCE": "0"},
        {"enable_deterministic_inference": True},
    ),
}
DETERMINISM_FLAGS = ("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "SGLANG_USE_1STAGE_ALLREDUCE")


def _determinism(rank: int, world: int) -> dict[str, Any]:
    import torch

    load_sglang_plugins()
    out = {}
    for case, (env, config) in DETERMINISM.items():
        for flag in DETERMINISM_FLAGS:
            os.environ.pop(flag, None)
        os.environ.update(env)
        if config is None:
            unpublish()
        else:
            publish(**config)
        tp = make_group(rank, "tp")
        slot = tp.pcie_ipc_comm
        slot.prepare(hidden=1024, max_rows=32)  # 64 KiB of bf16: above the seed's 32 KiB edge
        x = torch.full((32, 1024), float(rank + 1), dtype=torch.bfloat16)
        out[case] = {
            "table": slot.stats()["table_source"],
            "tactics": _sweep(slot),
            "deterministic": slot.stats()["deterministic"],
            "sum": tp._all_reduce_out_place(x, "auto").unique().tolist(),
        }
        tp.destroy()
    return out


def test_deterministic_inference_pins_oneshot_at_every_size_under_sglangs_precedence():
    results = run_ranks(_determinism, env=ENV)
    on = {
        "SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1",
        "1-stage all-reduce on alone",
        "published --enable-deterministic-inference",
    }
    for r in results:
        for case, got in r["value"].items():
            assert got["sum"] == [3.0], case
            if case in on:
                assert got["table"] == "table argument", case
                assert got["tactics"] == ["oneshot"], case
                assert got["deterministic"].startswith("on ("), case
            else:
                assert got["table"] == "embedded seed table", case
                assert "twoshot" in got["tactics"], case  # the sweep can tell them apart
                assert got["deterministic"].startswith("off ("), case
    value = results[0]["value"]
    assert (
        "SGLANG_USE_1STAGE_ALLREDUCE=0"
        in value["1-stage all-reduce off wins over deterministic"]["deterministic"]
    )
    assert "SGLANG_USE_1STAGE_ALLREDUCE=1" in value["1-stage all-reduce on alone"]["deterministic"]


def _both_flags(rank: int, world: int) -> dict[str, Any]:
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar

    destroyed = []
    real = pcie_ipc_ar.PcieIpcCommunicator.destroy

    def destroy(self):
        destroyed.append(type(self).__name__)
        real(self)

    pcie_ipc_ar.PcieIpcCommunicator.destroy = destroy
    load_sglang_plugins()
    out = {}
    tp = make_group(rank, "tp")
    out["slot"] = type(tp.pcie_ipc_comm).__name__
    out["destroyed"] = list(destroyed)
    tp.destroy()
    os.environ["SGLANG_ENABLE_DETERMINISTIC_INFERENCE"] = "1"  # SGLang then builds none
    tp = make_group(rank, "tp")
    out["deterministic slot"] = type(tp.pcie_ipc_comm).__name__
    out["destroyed after"] = list(destroyed)
    tp.destroy()
    return out


def test_with_sglangs_own_flag_too_exactly_one_backend_owns_the_slot_and_one_line_says_so():
    results = run_ranks(_both_flags, env={**ENV, "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"})
    for r in results:
        assert r["value"] == {
            "slot": "SglangPcieAllReduce",
            "destroyed": ["PcieIpcCommunicator"],
            "deterministic slot": "SglangPcieAllReduce",
            "destroyed after": ["PcieIpcCommunicator"],
        }
    said = lines(results, "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 both ask")
    assert [(rank, level) for rank, level, _ in said] == [(0, "WARNING"), (0, "WARNING")]
    assert "pcie_allreduce owns it" in said[0][2] and "was destroyed" in said[0][2]
    assert "deterministic inference keeps it off" in said[1][2]


def _warm_up(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    from pcie_allreduce.integrations import common

    common.WARMUP_TUNE_BUDGET_S = 3.0  # the first start on a host measures this long
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    load_sglang_plugins()
    out = {}

    def build_and_prepare(case: str) -> None:
        tp = make_group(rank, "tp")
        slot = tp.pcie_ipc_comm
        outcome = slot.prepare(hidden=64, max_rows=4)
        out[case] = {
            "outcome": outcome,
            "table": slot.stats()["table_source"],
            "files": sorted(p.name for p in Path(cache_dir).glob("*.csv")),
        }
        tp.destroy()

    build_and_prepare("PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1")
    os.environ.pop("PCIE_ALLREDUCE_DISABLE_AUTOTUNE")
    publish(disable_flashinfer_autotune=True)
    build_and_prepare("--disable-flashinfer-autotune")
    unpublish()
    build_and_prepare("first start")
    build_and_prepare("next start")
    return out


def test_prepare_warms_up_tunes_once_into_the_cache_unless_autotune_is_disabled(tmp_path):
    results = run_ranks(_warm_up, str(tmp_path), env=ENV)
    for r in results:
        value = r["value"]
        off = value["PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1"]
        assert not off["outcome"]["tuned"] and off["files"] == []
        assert "PCIE_ALLREDUCE_DISABLE_AUTOTUNE" in off["outcome"]["why_not_tuned"]
        engine_off = value["--disable-flashinfer-autotune"]
        assert not engine_off["outcome"]["tuned"] and engine_off["files"] == []
        assert engine_off["outcome"]["why_not_tuned"] == "the engine's autotune is disabled"
        for case in ("PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1", "--disable-flashinfer-autotune"):
            assert value[case]["outcome"]["programs"] > 0  # installed before any capture
        first = value["first start"]
        assert first["outcome"]["tuned"] and first["outcome"]["measured"] > 0
        assert len(first["files"]) == 1
        assert Path(first["outcome"]["path"]) == tmp_path / first["files"][0]
        assert first["table"] == f"cache {first['outcome']['path']}"
        nxt = value["next start"]
        assert nxt["table"] == first["table"]  # read at construction; nothing measured again
        assert not nxt["outcome"]["tuned"] and nxt["outcome"]["measured"] == 0
