"""The call path both engine slots share (integrations/adapter.py), without an engine: one
decision per call, the calls the engine's path then runs counted per operation and reason and
merged into stats() and the summary line, outputs the engine owns written in place or through a
new tensor when they overlap the input. (The engines' own slots: tests/engines.)"""

from __future__ import annotations

from typing import Any

import torch
from conftest import run_ranks

from pcie_allreduce.integrations import adapter, common
from pcie_allreduce.testing import rank_input

ROWS, HIDDEN = 2, 64


class Slot(adapter.EngineSlot):
    ENGINE = "the test"
    off: str | None = None

    def slot_decline(self) -> str | None:
        return self.off or super().slot_decline()


def _core(rank: int, world: int) -> dict[str, Any]:
    from pcie_allreduce import PcieAllReduce

    numel = world * ROWS * HIDDEN
    slot = Slot(rank, world)
    out: dict[str, Any] = {"unbuilt": slot.run("all_reduce", torch.ones(8))}
    slot.ar = PcieAllReduce(None, "cpu", max_numel=numel, timeout_s=10, stream_max_numel=0)
    x = rank_input(rank, numel, torch.float32, seed=31).view(world * ROWS, HIDDEN)
    total = slot.ar.all_reduce(x)
    mine = total[rank * ROWS : (rank + 1) * ROWS]
    # Reduce-scatter into the engine's output: a separate tensor, then a slice of the input.
    output = torch.empty(ROWS * HIDDEN)
    out["rs_into"] = slot.reduce_scatter(x, output) is output and torch.equal(
        output.view_as(mine), mine
    )
    inplace = x.clone()
    overlapping = inplace[rank * ROWS : (rank + 1) * ROWS]
    out["rs_overlap"] = slot.reduce_scatter(inplace, overlapping) is overlapping
    out["rs_overlap_ok"] = torch.equal(overlapping, mine)
    # All-gather into a strided output.
    strided = torch.empty(HIDDEN, world * ROWS).t()
    out["ag_strided"] = slot.all_gather(mine.clone(), strided) is strided and torch.equal(
        strided, total
    )
    y, residual_out = slot.fused_add_rms_norm(x, torch.zeros_like(x), torch.ones(HIDDEN), 1e-6)
    out["fused_ok"] = torch.equal(residual_out, total)
    # Declines: the kernels', and the slot's own (an engine that turned it off).
    big = torch.ones(numel + 8 * world)
    out["declined"] = [
        slot.admits("all_reduce", big),
        slot.reduce_scatter(big),
        slot.all_gather(torch.ones(numel // world + 8)),
        slot.fused_add_rms_norm(x, x, torch.ones(HIDDEN, dtype=torch.float64), 1e-6),
    ]
    slot.off = "disabled by the test"
    out["declined"] += [slot.admits("all_reduce", x), slot.all_gather(mine)]
    out["stats"] = slot.stats()
    out["line"] = common.summary_line(slot)
    slot.close()
    return out


def test_the_shared_core_decides_once_counts_declines_and_writes_engine_outputs(clean_shm):
    for r in run_ranks(_core, 2).values():
        assert r["unbuilt"] is None
        assert r["rs_into"] and r["rs_overlap"] and r["rs_overlap_ok"] and r["ag_strided"]
        assert r["fused_ok"]
        assert r["declined"] == [False, None, None, None, False, None]
        s = r["stats"]
        engine = {"not_built": 1, "too_large": 1, "disabled by the test": 1}
        assert s["declines"] == engine and s["engine_fallback"] == 3
        assert s["fused_declines"] == {"dtype": 1} and s["fused_routed"] == 1
        assert s["collectives"]["reduce_scatter"]["declines"] == {"too_large": 1}
        assert s["collectives"]["all_gather"]["declines"] == {
            "too_large": 1,
            "disabled by the test": 1,
        }
        assert sum(s["collectives"]["reduce_scatter"]["calls"].values()) == 2
        assert "; fused add+rms_norm: 1 routed, declines: dtype 1" in r["line"]
        assert "; all_gather declines: disabled by the test 1, too_large 1" in r["line"]
