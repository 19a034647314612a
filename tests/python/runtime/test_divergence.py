"""Issue 26, item 1: after a call the ranks took on different paths, no rank returns a sum that
mixes in another call's data. Real processes, a real gloo group, the host transport."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from conftest import run_ranks


def _one_rank_declines_then_both_call_again(rank, world):
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    ar = PcieAllReduce(None, "cpu", max_numel=1024, timeout_s=1.0)
    first = None
    if rank == 0:
        # Too large for the workspace: the group's own all-reduce, while rank 1 runs the kernels.
        out = ar.all_reduce(torch.full((2048,), 7.0))
        first = float(out[0])
    else:
        try:
            ar.all_reduce(torch.full((256,), 100.0))
            first = "returned"
        except PcieAllReduceTimeout as error:
            first = f"timeout naming rank {error.diagnostic['peer']}"
        # The application's own collective on the group meets rank 0's fallback, so rank 0 can
        # go on to its next call.
        dist.all_reduce(torch.zeros(2048))
    # The same shape on both ranks now. Rank 1 failed: it must refuse at once. Rank 0 must not
    # sum the 100s rank 1 left for the abandoned call (1 + 100 = 101, not 1 + 2 = 3).
    start = time.monotonic()
    try:
        out = ar.all_reduce(torch.full((256,), float(rank + 1)))
        second = f"returned {float(out[0])}"
    except PcieAllReduceTimeout as error:
        second = f"raised naming rank {error.diagnostic['peer']}"
    elapsed = time.monotonic() - start
    ar.destroy()
    return {"first": first, "second": second, "elapsed": elapsed}


def test_a_call_one_rank_sent_to_the_fallback_never_mixes_into_the_next(clean_shm):
    res = run_ranks(_one_rank_declines_then_both_call_again, 2, timeout=120).values()
    assert res[1]["first"] == "timeout naming rank 0", res
    assert res[0]["first"] == 7.0, res  # 7 + rank 1's zeros through the group's all-reduce
    assert res[1]["second"] == "raised naming rank 0" and res[1]["elapsed"] < 0.5, res
    assert res[0]["second"] == "raised naming rank 1", res  # it returned 101.0 before
