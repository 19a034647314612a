"""Real multi-process groups for the tests: every rank is its own process with its own gloo
process group, and pcie_allreduce's host transport uses real POSIX shared memory between them."""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch.multiprocessing as mp

SHM_PREFIX = "pcie_ar."

# No test reads or writes the developer's own tuning cache (~/.cache/pcie_allreduce): a cache
# left there by a real tune would change which tactic the seed-table tests see. Tests of the
# cache point PCIE_ALLREDUCE_CACHE_DIR at their own tmp_path. Spawned ranks import this module
# too and inherit the pytest process's folder.
if mp.parent_process() is None:
    _CACHE = tempfile.mkdtemp(prefix="pcie_ar_test_cache.")
    os.environ["PCIE_ALLREDUCE_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, True)


def shm_entries() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIX)}


def _entry(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple,
    env: Dict[str, str],
    out_dir: str,
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        result = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as e:  # report everything, including SystemExit from the test body
        result = {"ok": False, "error": repr(e), "type": type(e).__name__,
                  "traceback": traceback.format_exc(), "attrs": _attrs(e)}
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized() and result["ok"]:
            dist.destroy_process_group()
    except Exception:
        pass


def _attrs(e: BaseException) -> Dict[str, Any]:
    out = {}
    for name in ("diagnostic", "elapsed"):
        if hasattr(e, name):
            out[name] = getattr(e, name)
    return out


class RankResults(list):
    def values(self) -> List[Any]:
        return [r["value"] for r in self]


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 180.0,
    env: Optional[Dict[str, str]] = None,
    allow_failures: bool = False,
) -> RankResults:
    """Runs fn(rank, world, *args) in `world` spawned processes joined by a gloo group.

    Fails the test if any process hangs past `timeout` (it is killed) or, unless
    `allow_failures`, raises. Returns one result dict per rank ({"ok", "value"/"error"}).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_entry, args=(r, world, init_file, fn, args, env or {}, tmp))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        hung = []
        import time

        deadline = time.monotonic() + timeout
        for r, p in enumerate(procs):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                hung.append(r)
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            pytest.fail(f"ranks {hung} hung past {timeout} s")
        results = RankResults()
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append({"ok": False, "error": f"exit code {procs[r].exitcode}",
                                "type": "Died", "traceback": "", "attrs": {}})
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    if not allow_failures:
        for r, res in enumerate(results):
            if not res["ok"]:
                pytest.fail(f"rank {r} failed: {res['error']}\n{res['traceback']}")
    return results


@pytest.fixture
def clean_shm():
    """Asserts the test left no pcie_allreduce segment in /dev/shm."""
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"
