"""A process whose construction timed out exits cleanly.

A construction that times out leaves a daemon thread blocked in gloo for each peer that never
arrived. When every process then exits at once, a peer's exit wakes that thread while the
interpreter finalizes; Python ends it with pthread_exit, whose forced unwind through pybind11
calls std::terminate (without the exit hook: SIGABRT in 20 of 24 processes). The bootstrap's
exit hook aborts those waits and joins their threads first. Real processes, a real gloo group;
each rank's exit status is checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

_RANK = r"""
import os, sys, time
import torch.distributed as dist
rank, world, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
if rank < world - 1:  # the last rank never constructs: every other one times out waiting for it
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout
    try:
        PcieAllReduce(None, "cpu", max_numel=1024, timeout_s=1.0)
        print("constructed", flush=True)
    except PcieAllReduceTimeout as error:
        print("timed out naming rank", error.diagnostic["peer"], flush=True)
# Every process leaves at the same moment (a rendezvous outside gloo), the way a launcher's
# processes exit together after a failed start.
store = dist.FileStore(f"{folder}/leave", world)
store.set(f"here{rank}", "1")
store.wait([f"here{r}" for r in range(world)])
sys.exit(0)
"""


@pytest.mark.parametrize("attempt", range(3))
def test_processes_whose_construction_timed_out_exit_cleanly_together(attempt, tmp_path, clean_shm):
    world = 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(world), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        if r < world - 1:
            assert out.strip() == f"timed out naming rank {world - 1}", (r, out, err)
        assert p.returncode == 0 and "terminate called" not in err, (r, p.returncode, err[-2000:])
