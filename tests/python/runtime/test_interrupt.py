"""Ctrl-C inside a call on the host transport surfaces as KeyboardInterrupt
within a fraction of a second, whatever the timeout (0 waits forever), and leaves the
communicator failed, not silently out of step with its peers. Real processes, a real gloo group;
the signal is a real SIGINT the rank sends itself while its peer stays away."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks


def _interrupted_while_the_peer_stays_away(rank, world, timeout_s, in_place, declined=False):
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    ar = PcieAllReduce(None, "cpu", max_numel=1024, timeout_s=timeout_s, stream_max_numel=0)
    out = {}
    if rank == 0:
        # Python's own Ctrl-C handler, as an operator's server has it: a process started in the
        # background (CI) inherits SIGINT ignored, and Python then installs none.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sent = {}

        def ctrl_c() -> None:
            sent["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Timer(0.5, ctrl_c)
        timer.start()
        # Declined: too large for the workspace, so the wait is in the group's own all-reduce.
        x = torch.ones(2048 if declined else 256)
        try:
            if in_place:
                ar.all_reduce_(x)
            else:
                ar.all_reduce(x)
            out["first"] = "returned"
        except KeyboardInterrupt:
            out["first"] = "KeyboardInterrupt"
            out["after_signal_s"] = time.monotonic() - sent["at"]
        timer.join()
        try:
            ar.all_reduce(torch.ones(256))
            out["second"] = "returned"
        except PcieAllReduceTimeout as error:
            out["second"] = str(error)
            out["kind"] = error.diagnostic["kind"]
    if declined:
        # Rank 0's abandoned all-reduce is still pending in the group: no collective of the group
        # may follow it. Rank 1 waits long enough for rank 0's attempts instead.
        time.sleep(3.0 if rank == 1 else 0.0)
    else:
        # Rank 1 never calls: it waits for rank 0 to be done with its attempts.
        dist.barrier()
    ar.destroy()
    return out


@pytest.mark.parametrize("timeout_s,in_place", [(0.0, True), (30.0, False)])
def test_ctrl_c_ends_a_wait_at_once_and_leaves_the_communicator_failed(
    timeout_s, in_place, clean_shm
):
    res = run_ranks(
        _interrupted_while_the_peer_stays_away, 2, timeout_s, in_place, timeout=120
    ).values()[0]
    assert res["first"] == "KeyboardInterrupt", res
    assert res["after_signal_s"] < 1.0, (
        res
    )  # a wait asks every 20 ms; the deadline is 30 s or never
    assert res["kind"] == "interrupted", res
    assert "rank 0 was interrupted" in res["second"] and "failed earlier" in res["second"], res


@pytest.mark.parametrize("timeout_s", [0.0, 30.0])
def test_ctrl_c_ends_a_wait_in_the_groups_own_collective_at_once(timeout_s, clean_shm):
    res = run_ranks(
        _interrupted_while_the_peer_stays_away, 2, timeout_s, False, True, timeout=120
    ).values()[0]
    assert res["first"] == "KeyboardInterrupt", res
    assert res["after_signal_s"] < 1.0, res  # the fallback's wait asks every 20 ms
    assert res["kind"] == "interrupted", res
    assert "group's own collective" in res["second"] and "failed earlier" in res["second"], res
