"""Real multi-process groups for the tests: every rank is its own process with its own gloo
process group, and pcie_allreduce's host transport uses real POSIX shared memory between them."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared spawner
from spawned_ranks import fail_on_errors, leave_group, report, spawn_ranks  # noqa: E402

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
    env: dict[str, str],
    out_dir: str,
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)

    def body() -> Any:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        return fn(rank, world, *args)

    leave_group(report(rank, out_dir, body, on_error=lambda e: {"attrs": _attrs(e)}))


def _attrs(e: BaseException) -> dict[str, Any]:
    out = {}
    for name in ("diagnostic", "elapsed"):
        if hasattr(e, name):
            out[name] = getattr(e, name)
    return out


class RankResults(list):
    def values(self) -> list[Any]:
        return [r["value"] for r in self]


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    allow_failures: bool = False,
) -> RankResults:
    """Runs fn(rank, world, *args) in `world` spawned processes joined by a gloo group.

    Fails the test if any process hangs past `timeout` (it is killed) or, unless
    `allow_failures`, raises. Returns one result dict per rank ({"ok", "value"/"error"}).
    """
    results = RankResults(
        r
        if isinstance(r, dict)
        else {"ok": False, "error": f"exit code {r}", "type": "Died", "traceback": "", "attrs": {}}
        for r in spawn_ranks(_entry, world, fn, args, env or {}, timeout)
    )
    if not allow_failures:
        fail_on_errors(results)
    return results


@pytest.fixture
def clean_shm():
    """Asserts the test left no pcie_allreduce segment in /dev/shm."""
    before = shm_entries()
    yield
    leaked = shm_entries() - before
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"
