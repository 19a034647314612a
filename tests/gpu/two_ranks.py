"""Ranks that share GPU 0 for the device check: each a spawned process joined by a gloo group
(CUDA IPC handles between processes of one device are real IPC), each running
``body(rank, world) -> lines``; a line that starts with FAIL fails the check."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Body = Callable[[int, int], list[str]]


def finish(rank: int, lines: list[str]) -> None:
    """Reports this rank's lines and exits at once. A body whose CUDA context trapped calls it
    itself, with its tensors still alive: freeing one after a trap aborts the process."""
    with open(os.path.join(os.environ["TWO_RANKS_OUT"], f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines))
    os._exit(0)  # a trapped CUDA context must not run teardown


def _entry(body: Body, rank: int, world: int, init: str, out_dir: str) -> None:
    os.environ["TWO_RANKS_OUT"] = out_dir
    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        lines = body(rank, world)
    except BaseException:
        lines = ["FAIL " + traceback.format_exc()]
    finish(rank, lines)


def run(body: Body, name: str, world: int = 2, timeout_s: float = 300.0) -> int:
    """Runs ``body`` on ``world`` ranks, prints every rank's lines and ``name: PASS|FAIL``;
    returns the exit status. A rank that hangs past ``timeout_s`` is killed and fails."""
    if not torch.cuda.is_available():
        print("FAIL no CUDA device")
        return 1
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(body, r, world, init, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
        ok = True
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.txt")
            text = open(path).read() if os.path.exists(path) else "FAIL no result (hung or died)"
            print(f"--- rank {r}\n{text}")
            ok = ok and "FAIL" not in text
    print(f"{name}:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def timeout_path(rank: int, ar: Any, dev: torch.device, lines: list[str]) -> list[str]:
    """The timeout path at world 2 on a communicator with timeout_s 2: rank 1 never calls, so
    rank 0's kernel traps within the timeout and raises PcieAllReduceTimeout naming peer 1. A
    trapped kernel leaves the CUDA context unusable (freeing a tensor then aborts the process),
    so rank 0 reports and exits here without releasing anything; rank 1 returns its lines."""
    from pcie_allreduce import PcieAllReduceTimeout
    from pcie_allreduce.testing import rank_input

    dist.barrier()
    if rank == 1:
        time.sleep(8)
        lines.append("PASS timeout (rank 1 withheld its call)")
        return lines
    x = rank_input(rank, 1024, torch.bfloat16).to(dev)
    start = time.monotonic()
    try:
        out = ar.all_reduce(x)
        ar.synchronize()
        lines.append(f"FAIL no timeout ({out.shape})")
    except PcieAllReduceTimeout as e:
        took = time.monotonic() - start
        ok = e.peer == 1 and e.diagnostic.get("kind") == "timeout" and 1.5 <= took < 10.0
        lines.append(
            f"{'PASS' if ok else 'FAIL'} timeout after {took:.1f} s (timeout_s 2; "
            f"expected peer 1, kind timeout): {type(e).__name__}: {e}"
        )
    finish(rank, lines)
    return lines  # not reached: finish() exits
