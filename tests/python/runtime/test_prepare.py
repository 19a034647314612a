"""prepare() and capture(): everything a graph capture would install is installed before it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_ranks

MAX_NUMEL = 8192
# Several tactics by size, an LL row (capacity-limited) and a fallback band.
TABLE = (
    "host,2,bf16,0,2048,oneshot,push,0,1,32,ll\n"
    "host,2,*,0,8192,oneshot,pull,0,1,32\n"
    "host,2,*,8192,12288,fallback\n"
    "host,2,*,12288,*,twoshot,push,1,2,32\n"
)


def _prepare(rank: int, world: int) -> dict[str, Any]:
    from pcie_allreduce import PcieAllReduce

    prepared = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL, table=TABLE)
    first = prepared.prepare()
    again = prepared.prepare(hidden=1024, max_rows=16)
    with prepared.capture():
        captures = prepared.stats()["captures"]
        try:
            prepared.tune(max_bytes=4096, budget_s=1.0)
            refused = ""
        except RuntimeError as error:
            refused = str(error)
    prepared.destroy()
    # Another communicator runs every admitted size of every dtype, then asks prepare() how
    # many programs it holds: prepare() alone must have installed exactly as many.
    used = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL, table=TABLE)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        step = 16 // torch.tensor([], dtype=dtype).element_size()
        for numel in range(step, MAX_NUMEL + 1, step * 7):
            used.all_reduce(torch.ones(numel, dtype=dtype))
    after_calls = used.prepare()["programs"]
    used.destroy()
    return {
        "first": first,
        "again": again,
        "captures": captures,
        "refused": refused,
        "after_calls": after_calls,
    }


def test_prepare_installs_every_program_a_call_could_need_and_capture_brackets_it(clean_shm, capfd):
    for r in run_ranks(_prepare, 2).values():
        assert r["first"]["programs"] == r["after_calls"] >= 3
        assert r["again"] == {
            "max_numel": MAX_NUMEL,
            "programs": r["first"]["programs"],
            "rows_covered": 8,
        }
        assert r["captures"] == 1 and "inside another autotune pass" in r["refused"]
    assert "batches of 9..16 rows go to the fallback" in capfd.readouterr().err


def _bad_prepare(rank: int, world: int) -> list:
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=MAX_NUMEL)
    out = []
    for kwargs in ({"hidden": 1024}, {"hidden": 0, "max_rows": 4}, {"hidden": 1.5, "max_rows": 2}):
        with pytest.raises(ValueError) as info:
            ar.prepare(**kwargs)
        out.append(str(info.value))
    ar.destroy()
    return out


def test_prepare_rejects_half_or_bad_sizes(clean_shm):
    messages = run_ranks(_bad_prepare, 2).values()[0]
    assert "give both or neither" in messages[0]
    assert "positive whole numbers" in messages[1] and "whole number" in messages[2]
