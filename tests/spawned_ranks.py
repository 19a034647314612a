"""Spawning test ranks, shared by the pytest suites (tests/python, tests/engines/*): every rank
is its own spawned process running ``entry(rank, world, init_file, fn, args, env, out_dir)``,
which pickles its result to ``out_dir/rank<r>.pkl``."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch.multiprocessing as mp


def spawn_ranks(entry: Callable[..., None], world: int, fn: Callable[..., Any], args: tuple,
                env: Dict[str, Any], timeout: float,
                started: Optional[Callable[[int], None]] = None) -> List[Any]:
    """Runs the ranks; fails the test if any hangs past ``timeout`` (they are killed). Returns
    each rank's pickled result, or its exit code (an int) when it died without one.
    ``started(pid)`` is called for every process started."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=entry, args=(r, world, init_file, fn, args, env, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
            if started is not None:
                started(p.pid)
        deadline = time.monotonic() + timeout
        hung = []
        for r, p in enumerate(procs):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                hung.append(r)
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            pytest.fail(f"ranks {hung} hung past {timeout} s")
        results: List[Any] = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(procs[r].exitcode)
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results


def fail_on_errors(results: List[Dict[str, Any]]) -> None:
    """Fails the test naming the first rank whose function raised."""
    for r, res in enumerate(results):
        if not res["ok"]:
            pytest.fail(f"rank {r} failed: {res['error']}\n{res['traceback']}")
