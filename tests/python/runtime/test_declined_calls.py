"""Declined calls between kernel calls: a call takes a generation only once it has met its peers,
so no rank is ever two calls ahead of a peer (the slots' parity double buffer relies on it).
Ranks that disagree on the fused call's eps or row length fail at once instead of returning
different y.
Real processes (pinned to one core, so ranks interleave as badly as they can), real shared
memory, real gloo groups."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import run_ranks

HIDDEN = 64
ROWS = 4
# Messages of 8 KiB and more go to the group's own collective (kTable); smaller ones run on the
# kernels. max_numel below makes 64 Ki elements too large (kTooLarge).
TABLE = "*,*,*,0,8192,oneshot,push,0,1,32\n*,*,*,8192,*,fallback\n"
MAX_NUMEL = 16384


def _declined(ar, kind, rank, world, i):
    """One call of `kind` that the kernels decline; returns (what it returned, what it should)."""
    if kind == "empty_all_reduce":
        return ar.all_reduce(torch.empty(0)), torch.empty(0)
    if kind == "empty_reduce_scatter":
        return ar.reduce_scatter(torch.empty(0, HIDDEN)), torch.empty(0, HIDDEN)
    if kind == "empty_all_gather":
        return ar.all_gather(torch.empty(0, HIDDEN)), torch.empty(0, HIDDEN)
    if kind == "empty_fused":
        x = torch.empty(0, HIDDEN)
        y, residual = ar.all_reduce_add_rms_norm(x, x.clone(), torch.ones(HIDDEN), 1e-6)
        return torch.cat([y, residual]), torch.empty(0, HIDDEN)
    value = float(rank + i % 7)
    total = sum(float(r + i % 7) for r in range(world))
    if kind == "table":  # 8 KiB: the table's fallback band
        return ar.all_reduce(torch.full((2048,), value)), torch.full((2048,), total)
    if kind == "too_large":
        big = (4 * MAX_NUMEL,)
        return ar.all_reduce(torch.full(big, value)), torch.full(big, total)
    if kind == "dtype":  # float64: the kernels decline, gloo sums it
        x = torch.full((256,), value, dtype=torch.float64)
        return ar.all_reduce(x), torch.full((256,), total, dtype=torch.float64)
    if kind == "raising":  # no dtype the group's collective takes: raises on every rank alike
        try:
            ar.all_reduce(torch.ones(256, dtype=torch.uint16))
        except (RuntimeError, ValueError):
            return torch.zeros(1), torch.zeros(1)
        return torch.ones(1), torch.zeros(1)  # it must not have returned
    raise AssertionError(kind)


KINDS = (
    "empty_all_reduce",
    "empty_reduce_scatter",
    "empty_all_gather",
    "empty_fused",
    "table",
    "too_large",
    "dtype",
    "raising",
)


def _interleaved(rank, world, iterations, islands):
    """Kernel all-reduces of values that change every call, each followed by 0 to 3 declined
    calls of every kind in turn: every sum exact on every rank."""
    from pcie_allreduce import PcieAllReduce

    os.sched_setaffinity(0, {0})  # every rank on one core: the worst interleaving
    # stream_max_numel=0: a message above the workspace declines too_large instead of streaming.
    ar = PcieAllReduce(
        None,
        "cpu",
        max_numel=MAX_NUMEL,
        table=TABLE,
        timeout_s=20,
        islands=islands,
        stream_max_numel=0,
    )
    wrong = []
    declined = 0
    for i in range(iterations):
        x = torch.full((ROWS * HIDDEN,), float(rank * 1000 + i % 997))
        got = ar.all_reduce(x)
        expected = float(sum(r * 1000 + i % 997 for r in range(world)))
        if not torch.equal(got, torch.full_like(x, expected)):
            wrong.append(f"iteration {i}: kernel sum {got[:4].tolist()} != {expected}")
        for j in range(i % 4):
            kind = KINDS[(i + j) % len(KINDS)]
            result, expected_result = _declined(ar, kind, rank, world, i)
            declined += 1
            if not torch.equal(result, expected_result):
                wrong.append(f"iteration {i}: {kind} returned {result.flatten()[:4].tolist()}")
        if len(wrong) > 3:
            break
    stats = ar.stats()
    ar.destroy()
    return {"wrong": wrong, "declined": declined, "calls": stats["calls"]}


@pytest.mark.parametrize(
    "world,iterations,islands",
    [(2, 1200, None), (3, 600, None), (4, 300, [[0, 1], [2, 3]])],
    ids=["world2", "world3", "world4_islands"],
)
def test_declined_calls_between_kernel_calls_keep_every_sum_exact(
    world, iterations, islands, clean_shm
):
    results = run_ranks(_interleaved, world, iterations, islands, timeout=600).values()
    for rank, r in enumerate(results):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong']}"
        assert r["declined"] >= iterations, r
    assert len({str(r["calls"]) for r in results}) == 1, results


def _fused_disagreement(rank, world, what):
    """Every rank fuses the same message; `what` differs on rank 1: its eps, or its row length
    (the same numel split into rows of another hidden)."""
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    table = "*,*,*,0,*,oneshot,push,0,1,32\n"
    ar = PcieAllReduce(None, "cpu", max_numel=4096, table=table, timeout_s=5.0)
    hidden = 128 if (what == "hidden" and rank == 1) else 256
    eps = 1e-3 if (what == "eps" and rank == 1) else 1e-6
    x = torch.full((1024,), float(rank + 1)).view(-1, hidden)
    try:
        y, _ = ar.all_reduce_add_rms_norm(x, torch.zeros_like(x), torch.ones(hidden), eps)
        outcome = f"returned {float(y.flatten()[0])}"
    except PcieAllReduceTimeout as error:
        outcome = f"{error.diagnostic.get('kind')} naming rank {error.diagnostic.get('peer')}"
    ar.destroy()
    return outcome


@pytest.mark.parametrize("what", ["eps", "hidden"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_on_the_fused_calls_eps_or_rows_fail_naming_each_other(
    world, what, clean_shm
):
    outcomes = run_ranks(_fused_disagreement, world, what, timeout=120).values()
    for rank, outcome in enumerate(outcomes):
        assert "mismatch" in outcome, (rank, outcomes)
    assert "naming rank 1" in outcomes[0], outcomes
