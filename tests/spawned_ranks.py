"""Spawning test ranks, shared by the pytest suites (tests/python, tests/engines/*): every rank
is its own spawned process running ``entry(rank, world, init_file, fn, args, env, out_dir)``,
which pickles its result to ``out_dir/rank<r>.pkl``."""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


def spawn_ranks(
    entry: Callable[..., None],
    world: int,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, Any],
    timeout: float,
    started: Callable[[int], None] | None = None,
) -> list[Any]:
    """Runs the ranks; fails the test if any hangs past ``timeout`` (they are killed). Returns
    each rank's pickled result, or its exit code (an int) when it died without one.
    ``started(pid)`` is called for every process started."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=entry, args=(r, world, init_file, fn, args, env, tmp))
            for r in range(world)
        ]
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
        results: list[Any] = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(procs[r].exitcode)
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results


def fail_on_errors(results: list[dict[str, Any]]) -> None:
    """Fails the test naming the first rank whose function raised."""
    for r, res in enumerate(results):
        if not res["ok"]:
            pytest.fail(f"rank {r} failed: {res['error']}\n{res['traceback']}")


def report(
    rank: int,
    out_dir: str,
    body: Callable[[], Any],
    on_error: Callable[[BaseException], dict[str, Any]] = lambda e: {},
    always: Callable[[], dict[str, Any]] = dict,
) -> dict[str, Any]:
    """In a rank: runs ``body()`` and pickles what spawn_ranks reads back, ``{"ok": True,
    "value"}`` or ``{"ok": False, "error", "type", "traceback", **on_error(e)}``, each with
    ``always()`` added. Returns that dict."""
    result: dict[str, Any]
    try:
        result = {"ok": True, "value": body()}
    except BaseException as e:  # report everything, SystemExit from a test body included
        result = {
            "ok": False,
            "error": repr(e),
            "type": type(e).__name__,
            "traceback": traceback.format_exc(),
            **on_error(e),
        }
    result.update(always())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    return result


def leave_group(result: dict[str, Any]) -> None:
    """In a rank whose body succeeded: destroys the default process group (best effort; after
    a failure a peer may be gone and the collective teardown would hang)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized() and result["ok"]:
            dist.destroy_process_group()
    except Exception:
        pass


class LogRecords(logging.Handler):
    """Every record of the loggers it is added to, in this rank, as (level, message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))

    def matching(self, text: str) -> list[str]:
        return [m for _, m in self.records if text in m]
