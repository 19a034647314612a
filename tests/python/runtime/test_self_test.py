"""The self-test before serving, on the host shared-memory transport with real processes, shared
memory and gloo groups: at construction every (op, dtype, tactic) the table can choose runs once
on known data and is compared bit for bit with the host's reference; a wrong executor (a mutant
of the host executor on one rank) makes every rank withdraw the tactics it breaks, so their calls
go to the fallback with the right answer, counted under ``self_test``, never served wrong."""

from __future__ import annotations

import pytest
import torch
from conftest import run_ranks

from pcie_allreduce.testing import count_wrong, rank_input

# Two tactics, so a size picks each: the one-shot below 4 KiB, the two-shot above.
TABLE = "*,*,*,0,4096,oneshot,push,0,2,64\n*,*,*,4096,*,twoshot,pull,1,2,64\n"
OPS = {
    "all_reduce",
    "all_reduce_add_rms_norm",
    "reduce_scatter",
    "all_gather",
    "all_reduce_rms_norm",
    "all_reduce_add_rms_norm_fp8",
    "all_reduce_rms_norm_fp8",
    "all_reduce_add_rms_norm_nvfp4",
    "all_reduce_rms_norm_nvfp4",
}


def _clean(rank, world, islands):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=16384, table=TABLE, islands=islands) as ar:
        report = ar.stats()["self_test"]
        stats = ar.stats()
        ops = {c["op"] for c in ar.self_test(again=True)["failed"]}
        # Run again: the same cases, no failures; nothing was counted as a call.
        again = ar.self_test(again=True)
        out = ar.all_reduce(rank_input(rank, 1000, torch.bfloat16))
        wrong = count_wrong(out, world, 1000, "bf16")
        return {
            "cases": report["cases"],
            "failed": report["failed"],
            "again": again["cases"],
            "again_failed": again["failed"],
            "calls": stats["calls"],
            "declines": stats["declines"],
            "ops": ops,
            "wrong": wrong,
            "tactic": ar.tactic("all_reduce", out),
            "seconds": report["seconds"],
        }


@pytest.mark.parametrize("world,islands", [(3, None), (4, [[0, 1], [2, 3]])])
def test_every_chosen_tactic_passes_and_counts_nothing(clean_shm, world, islands):
    results = run_ranks(_clean, world, islands).values()
    for r in results:
        # Both tactics for every op and dtype (NVFP4: bf16 and fp16 only): 2 x (9 x 3 - 2).
        assert r["cases"] == 50, r
        assert r["failed"] == [] and r["again_failed"] == [], r
        assert r["again"] == r["cases"]
        assert r["calls"] == {} and r["declines"] == {}, r
        assert r["ops"] == set() and r["wrong"] == 0
        assert r["tactic"].startswith("oneshot/push")


def _mutant(rank, world, islands, mutant, on_rank):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=16384, table=TABLE, islands=islands) as ar:
        if rank == on_rank:
            ar._comm.set_host_mutant_for_testing(mutant)
        report = ar.self_test(again=True)
        x = rank_input(rank, 3000, torch.float32, seed=4)
        before = x.clone()
        declined = ar.decline("all_reduce", x)
        out = ar.all_reduce(x)
        # The fused form at a one-shot size: declined as well.
        weight = torch.ones(512)
        fused = ar.decline("all_reduce_add_rms_norm", x[:512].view(1, 512), weight)
        return {
            "failed": [
                (f["op"], f["dtype"], f["tactic"], tuple(f["ranks"])) for f in report["failed"]
            ],
            "detail": [f["detail"] for f in report["failed"]],
            "declined": declined,
            "fused": fused,
            "wrong": count_wrong(out, world, 3000, "fp32", seed=4),
            "untouched": torch.equal(x, before),
            "declines": ar.stats()["declines"],
            "total": ar.stats()["self_test"],
        }


@pytest.mark.parametrize(
    "world,islands,mutant",
    [
        (3, None, "reverse_operands"),  # an ordering bug: invisible with two operands
        (4, [[0, 1], [2, 3]], "drop_operand"),
        (2, None, "drop_operand"),
    ],
)
def test_a_wrong_executor_on_one_rank_is_withdrawn_on_every_rank(clean_shm, world, islands, mutant):
    on_rank = world - 1
    results = run_ranks(_mutant, world, islands, mutant, on_rank).values()
    failed = results[0]["failed"]
    # Every tactic of every op that sums (the all-gather moves bits, so no mutant of a sum can
    # reach it), in every dtype: 2 x (9 x 3 - 2) cases, less the all-gather's 2 x 3.
    assert len(failed) == 44, failed
    assert {op for op, _, _, _ in failed} == OPS - {"all_gather"}
    for r in results:
        # Every rank withdrew the same tactics, naming the ranks that saw wrong bits (the
        # mutant's rank always) and what they saw.
        assert r["failed"] == failed
        assert all(on_rank in ranks for _, _, _, ranks in r["failed"])
        assert all(" element " in d and ", expected 0x" in d for d in r["detail"]), r["detail"]
        # The calls go to the fallback, counted once under self_test, with the right sum and
        # the input untouched.
        assert r["declined"] == "self_test" and r["fused"] == "self_test", r
        assert r["wrong"] == 0 and r["untouched"], r
        assert r["declines"] == {"self_test": 1}, r
        # Construction's run (all passed) and this one.
        assert r["total"]["cases"] == 100 and len(r["total"]["failed"]) == 44


def test_a_mutant_that_changes_no_bit_withdraws_nothing(clean_shm):
    # Two islands of two: each group's sum has two operands, which commute; reversing them
    # changes no bit, so nothing is withdrawn (no false alarm).
    results = run_ranks(_mutant, 4, [[0, 1], [2, 3]], "reverse_operands", 3).values()
    for r in results:
        assert r["failed"] == [] and r["declined"] is None and r["wrong"] == 0, r
        assert r["declines"] == {}


def _off(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=4096, table=TABLE) as ar:
        return ar.stats()["self_test"]["cases"]


def test_pcie_allreduce_self_test_0_turns_it_off(clean_shm, monkeypatch):
    monkeypatch.setenv("PCIE_ALLREDUCE_SELF_TEST", "0")
    assert run_ranks(_off, 2).values() == [0, 0]
