"""Messages larger than the workspace, streamed through it in rounds, on the host transport: real
processes, real shared memory, real gloo groups. A row's bits depend only on its data: the same
row reduced alone, inside a batch that fits the workspace, or inside one streamed through a
32-row workspace in many rounds gives the same bits on every rank, fused and unfused, flat and
with islands, whatever tactic the table picks per size (one reduction order per group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from pcie_allreduce.testing import fused_float64

EPS = 1e-6
HIDDEN = 256  # bf16: 512-byte rows
ROWS = 32  # the workspace holds 32 rows

# A table that changes family and protocol with the size (flat below 4 KiB, pull two-shot with
# LL in between, island two-shot above when the group has islands): every band computes the same
# tree, so a row's bits cannot depend on which band its batch falls in.
FLAT_TABLE = (
    "*,*,*,0,4096,oneshot,push,0,1,64,lamport\n"
    "*,*,*,4096,8192,twoshot,push,0,2,64,ll\n"
    "*,*,*,8192,*,twoshot,pull,1,2,64\n"
)
ISLAND_TABLE = (
    "*,*,*,0,4096,oneshot,push,0,1,64,lamport\n"
    "*,*,*,4096,8192,island_oneshot,push,0,2,64,ll\n"
    "*,*,*,8192,*,island_twoshot,pull,1,2,64\n"
)


def batch(rank: int, rows: int) -> torch.Tensor:
    """This rank's rows, with exponents spread wide so that sums round differently in
    different orders."""
    g = torch.Generator().manual_seed(97 + rank)
    x = torch.randn(rows, HIDDEN, generator=g)
    scale = torch.randint(-6, 7, (rows, HIDDEN), generator=g).float().exp2()
    return (x * scale).to(torch.bfloat16)


def same_bits_everywhere(t: torch.Tensor) -> bool:
    mine = t.contiguous().view(torch.uint8).clone()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _rows_whatever_their_batch(rank, world, islands, most, sizes):
    from pcie_allreduce import PcieAllReduce

    table = ISLAND_TABLE if islands else FLAT_TABLE
    x = batch(rank, most)
    g = torch.Generator().manual_seed(5)
    residual = torch.randn(most, HIDDEN, generator=g).to(torch.bfloat16)
    weight = torch.randn(HIDDEN, generator=g).to(torch.bfloat16)
    with PcieAllReduce(
        None, "cpu", max_numel=ROWS * HIDDEN, table=table, islands=islands, timeout_s=60
    ) as ar:
        assert ar.decline_reason(x) is None, "a streamed message must run on the kernels"
        whole = ar.all_reduce(x)
        y_all, r_all = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        assert same_bits_everywhere(whole) and same_bits_everywhere(y_all)
        # Within rounding of float64 (the sum's two roundings, the add, the norm).
        y64, _ = fused_float64([batch(q, most) for q in range(world)], residual, weight, EPS)
        scale = y64.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
        assert bool(((y_all.double() - y64).abs() <= 8 * 2.0**-8 * scale).all())
        tactics = set()
        for rows in sizes:
            for start in sorted({0, (most - rows) // 2, most - rows}):
                part = slice(start, start + rows)
                tactics.add(ar.chosen_tactic(x[part]))
                got = ar.all_reduce(x[part])
                assert torch.equal(got, whole[part]), f"all_reduce rows {part}"
                y, r = ar.all_reduce_add_rms_norm(x[part], residual[part], weight, EPS)
                assert torch.equal(y, y_all[part]), f"fused rows {part}: y"
                assert torch.equal(r, r_all[part]), f"fused rows {part}: residual_out"
        stats = ar.stats()
    return sorted(tactics), stats["calls"], stats["declines"], stats["fused_declines"]


@pytest.mark.parametrize(
    "world,islands",
    [
        (2, None),
        (3, None),
        (4, [[0, 1], [2, 3]]),
        (4, [[0, 2], [1, 3]]),
        (6, [[0, 1, 2], [3, 4, 5]]),
    ],
    ids=["w2", "w3", "w4-halves", "w4-interleaved", "w6-halves"],
)
def test_a_rows_bits_do_not_depend_on_its_batch_or_the_rounds_that_carry_it(
    world, islands, clean_shm
):
    sizes = (1, 2, 7, 8, 15, 31, 32, 33, 63, 64, 65, 100, 129)
    results = run_ranks(_rows_whatever_their_batch, world, islands, 130, sizes, timeout=600)
    tactics, calls, declines, fused_declines = results.values()[0]
    assert not declines and not fused_declines, (declines, fused_declines)
    # The table's bands were all crossed: small calls, LL, and the streamed rounds.
    assert len(tactics) == 3, tactics
    assert all(r == results.values()[0] for r in results.values())


def test_batches_of_up_to_1024_rows_at_world_8(clean_shm):
    sizes = (1, 33, 255, 513, 1023)
    results = run_ranks(
        _rows_whatever_their_batch, 8, [[0, 1, 2, 3], [4, 5, 6, 7]], 1024, sizes, timeout=600
    ).values()
    assert not results[0][2] and not results[0][3]


# The collectives' rows: a change of protocol and direction at 4 KiB (and island two-shot above
# it where the group has islands), so the rounds of one message may run on different tactics.
def collective_rows(islands) -> str:
    large = "island_twoshot,pull,1,2,64" if islands else "twoshot,pull,0,2,64"
    return (
        "*,*,*,0,4096,reduce_scatter:twoshot,push,0,1,64,lamport\n"
        f"*,*,*,4096,*,reduce_scatter:{large}\n"
        "*,*,*,0,4096,all_gather:twoshot,push,0,1,64,ll\n"
        "*,*,*,4096,*,all_gather:twoshot,pull,0,2,64\n"
    )


def _collectives_whatever_the_workspace(rank, world, islands, rows_per_rank):
    from pcie_allreduce import PcieAllReduce

    table = (ISLAND_TABLE if islands else FLAT_TABLE) + collective_rows(islands)
    x = batch(rank, world * rows_per_rank)  # the reduce-scatter's input
    mine = batch(100 + rank, rows_per_rank)  # the all-gather's
    assert x.numel() > ROWS * HIDDEN, "the messages stream through the small workspace"
    results = {}
    for name, max_numel in (("streamed", ROWS * HIDDEN), ("whole", world * rows_per_rank * HIDDEN)):
        with PcieAllReduce(
            None, "cpu", max_numel=max_numel, table=table, islands=islands, timeout_s=60
        ) as ar:
            for op, t in (("reduce_scatter", x), ("all_gather", mine)):
                assert ar.collective_decline_reason(t, op) is None, (name, op)
            results[name] = (
                ar.reduce_scatter(x),
                ar.all_gather(mine),
                ar.chosen_collective_tactic(x, "reduce_scatter"),
                ar.stats()["collectives"],
            )
            if name == "whole":
                results["all_reduce"] = ar.all_reduce(x)
    rs, ag, tactic, stats = results["streamed"]
    whole_rs, whole_ag, _, _ = results["whole"]
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    m = rows_per_rank
    return {
        "rs_same_as_whole": torch.equal(rs, whole_rs),
        "ag_same_as_whole": torch.equal(ag, whole_ag),
        "ag_moves_every_bit": torch.equal(ag, torch.cat(gathered)),
        "rs_is_the_all_reduces_chunk": torch.equal(
            rs, results["all_reduce"][rank * m : (rank + 1) * m]
        ),
        "ag_same_everywhere": same_bits_everywhere(ag),
        "declines": {op: s.get("declines") for op, s in stats.items()},
        "tactic": tactic,
    }


@pytest.mark.parametrize(
    "world,islands,rows_per_rank",
    [
        (3, None, 11),
        (3, None, 40),
        (4, [[0, 1], [2, 3]], 33),
        (4, [[0, 2], [1, 3]], 9),
    ],
    ids=["w3-few-rounds", "w3-many-rounds", "w4-halves", "w4-interleaved"],
)
def test_reduce_scatter_and_all_gather_stream_with_the_same_bits_as_whole(
    world, islands, rows_per_rank, clean_shm
):
    results = run_ranks(
        _collectives_whatever_the_workspace, world, islands, rows_per_rank, timeout=300
    ).values()
    for rank, out in enumerate(results):
        assert not any(out["declines"].values()), out["declines"]
        for key in (
            "rs_same_as_whole",
            "ag_same_as_whole",
            "ag_moves_every_bit",
            "rs_is_the_all_reduces_chunk",
            "ag_same_everywhere",
        ):
            assert out[key], f"rank {rank}: {key} ({out['tactic']})"


def _cap(rank, world):
    from pcie_allreduce import PcieAllReduce

    x = batch(rank, 65)
    out = {}
    with PcieAllReduce(None, "cpu", max_numel=ROWS * HIDDEN, stream_max_numel=64 * HIDDEN) as ar:
        out["at_cap"] = ar.decline_reason(x[:64])
        out["above_cap"] = ar.decline_reason(x)
        before = x.clone()
        total = x.clone()
        dist.all_reduce(total)
        got = ar.all_reduce(x)  # declined: the group's all-reduce, the input untouched
        assert torch.equal(x, before)
        assert torch.equal(got, total)
        out["declines"] = ar.stats()["declines"]
    with PcieAllReduce(None, "cpu", max_numel=ROWS * HIDDEN, stream_max_numel=0) as ar:
        out["off"] = ar.decline_reason(x[:33])
    with PcieAllReduce(None, "cpu", max_numel=ROWS * HIDDEN, stream_max_numel=64 * HIDDEN) as ar:
        # The collectives stream to the same cap (the message: the all-gather's output).
        out["rs_at_cap"] = ar.collective_decline_reason(x[:64], "reduce_scatter")
        out["rs_above_cap"] = ar.collective_decline_reason(x[:66], "reduce_scatter")
        out["ag_at_cap"] = ar.collective_decline_reason(x[:32], "all_gather")
        out["ag_above_cap"] = ar.collective_decline_reason(x[:33], "all_gather")
    return out


def test_streaming_stops_at_its_cap_and_says_too_large_above_it(clean_shm):
    out = run_ranks(_cap, 2).values()[0]
    assert out == {
        "at_cap": None,
        "above_cap": "too_large",
        "declines": {"too_large": 1},
        "off": "too_large",
        "rs_at_cap": None,
        "rs_above_cap": "too_large",
        "ag_at_cap": None,
        "ag_above_cap": "too_large",
    }, out


def _disagree(rank, world):
    from pcie_allreduce import PcieAllReduce

    x = batch(rank, 4 * ROWS)
    with PcieAllReduce(
        None, "cpu", max_numel=ROWS * HIDDEN, stream_max_numel=4096 * (rank + 1)
    ) as ar:
        total = x.clone()
        dist.all_reduce(total)
        return ar.enabled, ar.disabled_reason, torch.equal(ar.all_reduce(x), total)


def test_ranks_that_would_stream_differently_turn_the_backend_off_everywhere(clean_shm):
    for enabled, reason, correct in run_ranks(_disagree, 2).values():
        assert not enabled and "ranks disagree on stream_max_numel" in reason, reason
        assert correct
