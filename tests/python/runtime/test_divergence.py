"""After a call the ranks took on different paths, no rank returns a sum that mixes in another
call's data, and no rank waits past the timeout: the kernel rank times out naming its peer, and
the rank in the group's own collective (which its peers never enter) times out too, instead of
blocking until a peer process exits. Real processes, a real gloo group, the host transport."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import run_ranks

TIMEOUT_S = 2.0


def _one_rank_declines_then_all_call_again(rank, world):
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    ar = PcieAllReduce(None, "cpu", max_numel=1024, timeout_s=TIMEOUT_S, stream_max_numel=0)
    start = time.monotonic()
    try:
        # Rank 0's tensor is too large for the workspace: the group's own all-reduce, which its
        # peers, running the kernels on theirs, never enter.
        out = ar.all_reduce(torch.full((2048,) if rank == 0 else (256,), 100.0 * (rank + 1)))
        first = f"returned {float(out[0])}"
    except PcieAllReduceTimeout as error:
        d = error.diagnostic
        first = f"{d['kind']} naming rank {d['peer']}"
    first_s = time.monotonic() - start
    # The same shape on every rank now. Every communicator failed: each must refuse at once, and
    # none may sum what a peer left for the abandoned call.
    start = time.monotonic()
    try:
        out = ar.all_reduce(torch.full((256,), float(rank + 1)))
        second = f"returned {float(out[0])}"
    except PcieAllReduceTimeout as error:
        second = f"raised ({error.diagnostic['kind']})"
    second_s = time.monotonic() - start
    ar.destroy()
    return {"first": first, "first_s": first_s, "second": second, "second_s": second_s}


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_one_rank_sent_to_the_fallback_never_mixes_into_the_next(world, clean_shm):
    res = run_ranks(_one_rank_declines_then_all_call_again, world, timeout=120).values()
    assert res[0]["first"] == "fallback_timeout naming rank None", res
    for r in res[1:]:
        assert r["first"] == "timeout naming rank 0", res
    for r in res:
        assert r["first_s"] < TIMEOUT_S + 3.0, res  # the timeout and slack, not a peer's exit
        assert r["second"].startswith("raised") and r["second_s"] < 0.5, res
