"""The host transport's arithmetic is the GPU's whatever floating-point mode the caller set:
``torch.set_flush_denormal(True)`` turns on x86's flush-to-zero and denormals-are-zero in the
calling thread, which is the thread our host executor sums in. Under it a sum whose value is
subnormal would flush to a signed zero (-0 from a negative one, which a lamport writer stores as
+0: its owner and its peers would disagree), and a subnormal operand would count as zero. Real
processes, real shared memory, worlds 3 and 4, islands included: every rank's result is the
group's tree computed with subnormals, bit for bit, in flush mode as outside it, and the fused
call's outputs are the same bits in both modes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

NUMEL = 4096
HIDDEN = 256


def tiny_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """k * 2^-130 (bf16) or k * 2^-140 (fp32), k in [-48, 48]: subnormal and low normal values
    whose sums often cancel into the subnormal range (or to a zero from a negative sum)."""
    g = torch.Generator().manual_seed(31 + rank)
    k = torch.randint(-48, 49, (NUMEL,), generator=g).double()
    scale = 2.0**-130 if dtype == torch.bfloat16 else 2.0**-140
    x = (k * scale).to(dtype)
    assert torch.equal(x.double(), k * scale), "every value is exact in the dtype"
    return x


def tree(xs: list[torch.Tensor], islands: list[list[int]] | None) -> torch.Tensor:
    """The group's one reduction order (docs/design.md): fp32 sums from +0 in rank order,
    rounded to the dtype; with two islands each island's sum rounded first."""
    dtype = xs[0].dtype

    def total(ranks):
        acc = torch.zeros(NUMEL, dtype=torch.float32)
        for r in ranks:
            acc = acc + xs[r].float()
        return acc.to(dtype)

    if islands is None:
        return total(range(len(xs)))
    acc = torch.zeros(NUMEL, dtype=torch.float32)
    for island in islands:
        acc = acc + total(island).float()
    return acc.to(dtype)


def _flushed_and_not(rank, world, islands, table, dtype):
    from pcie_allreduce import PcieAllReduce

    torch.set_flush_denormal(False)
    xs = [tiny_input(q, dtype) for q in range(world)]
    want = tree(xs, islands)
    residual = tiny_input(world, dtype).view(-1, HIDDEN)
    weight = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = {}
    with PcieAllReduce(None, "cpu", table=table, islands=islands, timeout_s=60) as ar:
        assert ar.decline_reason(xs[rank]) is None
        out["tactic"] = ar.chosen_tactic(xs[rank])
        plain = ar.all_reduce(xs[rank])
        rows = xs[rank].view(-1, HIDDEN)
        fused_plain = ar.all_reduce_add_rms_norm(rows, residual, weight, 1e-6)
        assert torch.set_flush_denormal(True), "x86 flushes denormals"
        try:
            flushed = ar.all_reduce(xs[rank])
            fused_flushed = ar.all_reduce_add_rms_norm(rows, residual, weight, 1e-6)
            # The caller's mode is the caller's: still set after our call.
            out["still_flushing"] = bool((torch.tensor([2.0**-140]) * 0.5 == 0).item())
        finally:
            torch.set_flush_denormal(False)
    mine = flushed.view(torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine.contiguous())
    out["same_on_every_rank"] = all(torch.equal(everyone[0], e) for e in everyone)
    out["plain_is_tree"] = torch.equal(plain.view(torch.uint8), want.view(torch.uint8))
    out["flushed_is_tree"] = torch.equal(flushed.view(torch.uint8), want.view(torch.uint8))
    out["subnormal_results"] = int(((want != 0) & (want.float().abs() < 2.0**-126)).sum())
    # The epilogue's products of subnormal sums: the same bits in flush mode as outside it.
    out["fused_unchanged"] = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(fused_plain, fused_flushed)
    )
    out["negative_zeros"] = int(((flushed == 0) & torch.signbit(flushed)).sum())
    return out


@pytest.mark.parametrize(
    "world,islands,row",
    [
        (3, None, "twoshot,push,0,2,64,lamport"),
        (4, [[0, 1], [2, 3]], "island_twoshot,push,0,2,64,lamport"),
        (4, [[0, 2], [1, 3]], "oneshot,push,0,2,64,lamport"),
        (4, [[0, 1], [2, 3]], "twoshot,pull,0,2,64"),
    ],
    ids=["w3-twoshot-lamport", "w4-island-twoshot-lamport", "w4-interleaved-oneshot", "w4-flag"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sums_keep_their_subnormals_under_torch_set_flush_denormal(
    world, islands, row, dtype, clean_shm
):
    table = f"*,*,*,0,*,{row}\n"
    results = run_ranks(_flushed_and_not, world, islands, table, dtype).values()
    for rank, out in enumerate(results):
        assert out["tactic"].startswith(row.split(",")[0]), out["tactic"]
        assert out["subnormal_results"] > NUMEL // 8, "the data reaches the subnormal range"
        assert out["plain_is_tree"], f"rank {rank}: the sum without flush mode"
        assert out["flushed_is_tree"], f"rank {rank}: the sum under flush mode lost subnormals"
        assert out["negative_zeros"] == 0, f"rank {rank}: a sum came out -0"
        assert out["same_on_every_rank"]
        assert out["fused_unchanged"], f"rank {rank}: the fused call under flush mode"
        assert out["still_flushing"], "the caller's floating-point mode was not given back"
