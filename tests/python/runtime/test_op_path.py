"""The one call path every operation shares (the all-reduce, the fused all-reduce + residual add +
RMSNorm, reduce-scatter and all-gather): a table change reaches every operation's decision on
every rank, whatever each rank asked before it; trial() leaves every operation's counters and
decisions as they were. Real processes, real shared memory, real gloo groups, worlds 2 and 3."""

from __future__ import annotations

import pytest
import torch
from conftest import run_ranks

from pcie_allreduce.testing import rank_input

ROWS, HIDDEN = 3, 64
# Row A's reduce-scatter and all-gather take its all-reduce choice in two-shot form; row B is a
# two-shot of another direction, staging and launch shape, so every operation's label changes.
TABLE_A = "*,*,*,0,*,oneshot,push,1,1,64\n"
TABLE_B = "*,*,*,0,*,twoshot,pull,0,2,64\n"
LABEL_A_ALL_REDUCE = "oneshot/push/staged/flag/b1/t64"
LABEL_A_HALVES = "twoshot/push/staged/flag/b1/t64"
LABEL_B = "twoshot/pull/unstaged/flag/b2/t64"


def _tensors(rank, world, dtype=torch.float32):
    """The message (world x ROWS rows of HIDDEN), one rank's piece of it, a residual and a
    weight: what every operation of the test takes."""
    x = rank_input(rank, world * ROWS * HIDDEN, dtype, seed=11).view(world * ROWS, HIDDEN)
    piece = rank_input(rank, ROWS * HIDDEN, dtype, seed=12).view(ROWS, HIDDEN)
    residual = rank_input(0, world * ROWS * HIDDEN, dtype, seed=13).view(world * ROWS, HIDDEN)
    weight = rank_input(0, HIDDEN, dtype, seed=14)
    return x, piece, residual, weight


def _labels(ar, x, piece):
    return (
        ar.chosen_tactic(x),
        ar.chosen_collective_tactic(x, "reduce_scatter"),
        ar.chosen_collective_tactic(piece, "all_gather"),
    )


def _run_every_op(ar, rank, x, piece, residual, weight):
    """One call of each operation on the kernels; checks each against the all-reduce."""
    total = ar.all_reduce(x)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    assert torch.equal(ar.reduce_scatter(x), total[mine])
    gathered = ar.all_gather(piece)
    assert torch.equal(gathered[mine], piece)
    y, residual_out = ar.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual_out, total + residual)
    return y


def _table_change(rank, world, ask_first):
    """Every rank runs every operation under table A (or, with ask_first, only rank 0 asks which
    tactics the collectives would take, which decides them there alone), then installs table B:
    every operation's next call runs B's tactic on every rank."""
    from pcie_allreduce import PcieAllReduce

    x, piece, residual, weight = _tensors(rank, world)
    with PcieAllReduce(None, "cpu", max_numel=x.numel(), table=TABLE_A, timeout_s=10) as ar:
        if ask_first:
            if rank == 0:
                assert _labels(ar, x, piece) == (LABEL_A_ALL_REDUCE, LABEL_A_HALVES, LABEL_A_HALVES)
        else:
            _run_every_op(ar, rank, x, piece, residual, weight)
        ar.install_table(TABLE_B, "table B")
        assert _labels(ar, x, piece) == (LABEL_B, LABEL_B, LABEL_B)
        _run_every_op(ar, rank, x, piece, residual, weight)
        s = ar.stats()
        calls = 0 if ask_first else 1
        assert s["calls"].get(LABEL_B) == 2, s  # the fused call counts as the all-reduce it holds
        assert s["fused_calls"] == {LABEL_B: 1, **({LABEL_A_ALL_REDUCE: 1} if calls else {})}, s
        for name in ("reduce_scatter", "all_gather"):
            expected = {LABEL_B: 1, **({LABEL_A_HALVES: 1} if calls else {})}
            assert s["collectives"][name]["calls"] == expected, (name, s)
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ask_first", [False, True], ids=["ran_before", "rank0_asked_before"])
def test_a_new_table_decides_every_operation_on_every_rank(world, ask_first, clean_shm):
    assert run_ranks(_table_change, world, ask_first, timeout=240).values() == [True] * world


def _every_op_and_decline(ar, rank, world, x, piece, residual, weight):
    """Each operation on the kernels, and declined: too large (all-reduce, reduce-scatter,
    all-gather: the group's own collective) and a weight of another dtype (the fused call: its
    unfused path)."""
    _run_every_op(ar, rank, x, piece, residual, weight)
    big = torch.ones(x.numel() + 4 * world)
    assert ar.decline_reason(big) == "too_large"
    assert torch.equal(ar.all_reduce(big), big * world)
    assert ar.collective_decline_reason(big, "reduce_scatter") == "too_large"
    assert torch.equal(ar.reduce_scatter(big), torch.full((big.numel() // world,), world * 1.0))
    long_piece = torch.ones(x.numel() // world + 4)
    assert ar.collective_decline_reason(long_piece, "all_gather") == "too_large"
    assert torch.equal(ar.all_gather(long_piece), torch.ones(long_piece.numel() * world))
    assert ar.fused_decline_reason(x, residual, weight.double()) == "dtype"
    ar.all_reduce_add_rms_norm(x, residual, weight.double(), 1e-6)


def _trial(rank, world):
    """Counters and decisions after a trial() of table B are the ones before it, for every
    operation: calls per tactic, declines per reason, the fused and collective tables, bytes per
    peer, staged calls; and the next calls run table A's tactics again."""
    from pcie_allreduce import PcieAllReduce

    x, piece, residual, weight = _tensors(rank, world)
    with PcieAllReduce(
        None, "cpu", max_numel=x.numel(), table=TABLE_A, timeout_s=10, stream_max_numel=0
    ) as ar:
        _every_op_and_decline(ar, rank, world, x, piece, residual, weight)
        ar.all_reduce(x.t())  # a staged call
        before, labels = ar.stats(), _labels(ar, x, piece)
        assert before["staged"] == 1 and before["fused_declines"] == {"dtype": 1}, before
        with ar.trial() as use:
            use(TABLE_B)
            assert _labels(ar, x, piece) == (LABEL_B, LABEL_B, LABEL_B)
            _every_op_and_decline(ar, rank, world, x, piece, residual, weight)
            ar.all_reduce(x.t())
            assert ar.stats() != before
        assert ar.stats() == before
        assert _labels(ar, x, piece) == labels
        _run_every_op(ar, rank, x, piece, residual, weight)
        after = ar.stats()
        assert after["fused_calls"][LABEL_A_ALL_REDUCE] == 2, after
        for name in ("reduce_scatter", "all_gather"):
            assert after["collectives"][name]["calls"][LABEL_A_HALVES] == 2, (name, after)
            assert LABEL_B not in after["collectives"][name]["calls"], (name, after)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_trial_leaves_every_operation_as_it_was(world, clean_shm):
    assert run_ranks(_trial, world, timeout=240).values() == [True] * world
