"""What both engine adapters share: eligibility, workspace sizing, the deterministic table, the
warm-up and the closing stats line (the adapters themselves are tested against the real engines
in tests/engines)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import run_ranks

from pcie_allreduce import policy
from pcie_allreduce.integrations import common


@pytest.mark.parametrize(
    "name,world,ok",
    [
        ("tp", 2, True),
        ("tp", 8, True),
        ("tp", 1, False),
        ("attention_tp", 2, False),
        ("moe_tp", 4, False),
        ("pdmux_prefill_tp", 2, False),
        (None, 2, False),
        ("tp:0", 2, False),
    ],
)
def test_only_the_tensor_parallel_group_with_peers_is_served(name, world, ok):
    why = common.ineligible(name, world)
    assert (why is None) == ok
    if not ok:
        assert (repr(name) in why) if name != "tp" else ("world size 1" in why)


def test_sizing_explicit_env_wins_then_derived_then_an_announced_guess(monkeypatch, caplog):
    monkeypatch.setenv("PCIE_ALLREDUCE_MAX_NUMEL", "65536")
    s = common.size_workspace("vllm", max_bs=256, draft_tokens=4, hidden=8192)
    assert (s.max_numel, s.guessed) == (65536, False) and "PCIE_ALLREDUCE_MAX_NUMEL" in s.how
    monkeypatch.delenv("PCIE_ALLREDUCE_MAX_NUMEL")
    s = common.size_workspace("vllm", max_bs=256, draft_tokens=4, hidden=5120)
    assert s.max_numel == 256 * 4 * 5120 and not s.guessed and "x 4 token(s)" in s.how
    assert (
        common.size_workspace("sglang", max_bs=3, draft_tokens=None, hidden=100).max_numel == 304
    )  # 300 rounded up to whole 8-element groups
    with caplog.at_level(logging.WARNING, logger="pcie_allreduce"):
        s = common.size_workspace("sglang", max_bs=None, draft_tokens=None, hidden=4096)
    assert s.guessed and s.max_numel == policy.DEFAULT_ROWS * 4096
    assert "could not read the decode max batch" in caplog.text and "sglang" in caplog.text


def _deterministic(rank: int, world: int) -> dict[str, Any]:
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=1 << 15, table=common.deterministic_table("host"))
    chosen = {ar.chosen_tactic(torch.ones(n, dtype=torch.bfloat16)) for n in (8, 4096, 1 << 15)}
    warm = common.warm_up(ar, engine_autotune_disabled=False, hidden=4096, max_rows=4)
    ar.all_reduce(torch.ones(64))
    line = common.summary_line(ar)
    ar.destroy()
    return {"chosen": chosen, "warm": warm, "line": line}


def test_deterministic_mode_pins_oneshot_and_the_warm_up_leaves_a_given_table_alone(clean_shm):
    for r in run_ranks(_deterministic, 2).values():
        assert r["chosen"] == {"oneshot/push/unstaged/flag/b1/t32"}
        assert r["warm"]["tuned"] is False and "table was given" in r["warm"]["why_not_tuned"]
        # One tactic: its program and its fused program (all_reduce_add_rms_norm), and the
        # two-shot reduce-scatter's and all-gather's derived from it.
        assert r["warm"]["programs"] == 4 and r["warm"]["rows_covered"] == 8
        assert "enabled; calls: oneshot/push/unstaged/flag/b1/t32 1; declines: none" in r["line"]
        assert "table: table argument" in r["line"]


def _warm_up_tunes(rank: int, world: int, cache_dir: str) -> dict[str, Any]:
    import os

    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = cache_dir
    from pcie_allreduce import PcieAllReduce

    common.WARMUP_TUNE_BUDGET_S = 2.0
    ar = PcieAllReduce(None, "cpu", max_numel=1024)
    first = common.warm_up(ar, engine_autotune_disabled=False)
    skipped = common.warm_up(ar, engine_autotune_disabled=True)
    ar.destroy()
    return {"first": first, "skipped": skipped}


def test_the_warm_up_tunes_once_per_host_unless_the_engine_disables_autotune(tmp_path, clean_shm):
    for r in run_ranks(_warm_up_tunes, 2, str(tmp_path)).values():
        assert r["first"]["tuned"] and r["first"]["measured"] > 0
        assert r["first"]["path"].startswith(str(tmp_path))
        assert r["skipped"]["tuned"] is False and "engine" in r["skipped"]["why_not_tuned"]
