"""Two real ranks running SGLang's own distributed code on the CPU.

Every rank is a spawned process with its own gloo process group (what SGLang's launcher gives
a scheduler process), so SGLang's plugin loader, hook registry and GroupCoordinator run once
per process exactly as in a server. Groups are gloo,
``SGLANG_NCCL_SO_PATH=/nonexistent`` gives SGLang a disabled pynccl object (its
``_all_reduce_out_place`` asserts that one accelerated communicator exists), and the custom
all-reduce is off (it needs CUDA). Tensors are CPU tensors, so our slot runs the host transport.

The name is unique (not conftest) so that tests import it without colliding with other suites'
conftest modules, and spawned ranks can import it by name.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared spawner
from spawned_ranks import LogRecords, fail_on_errors, leave_group, report, spawn_ranks  # noqa: E402,E501

SHM_PREFIX = "pcie_ar."
TIMEOUT_S = 300.0  # a shared 2-core machine: generous, and only ever reached by a hang

# What every rank needs whatever the test: SGLang's pynccl loads no library (so it is a
# disabled object), and no rank waits forever.
BASE_ENV = {"SGLANG_NCCL_SO_PATH": "/nonexistent", "PCIE_ALLREDUCE_TIMEOUT_S": "60"}
# SGLang flags the tests set themselves, removed from what ranks inherit.
SCRUBBED = {
    "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
    "SGLANG_PCIE_IPC_MAX_NUMEL",
    "SGLANG_ENABLE_DETERMINISTIC_INFERENCE",
    "SGLANG_USE_1STAGE_ALLREDUCE",
    "SGLANG_PLUGINS",
    "SGLANG_PLATFORM",
}


def shm_entries() -> set:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIX)}


LOGS: LogRecords | None = None  # in a rank: its records so far


def _entry(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str | None],
    out_dir: str,
) -> None:
    faulthandler.enable()  # a crash in a rank prints where it was
    for name in list(os.environ):  # only the test's flags, not the caller's shell's
        if name in SCRUBBED or (
            name.startswith("PCIE_ALLREDUCE_") and name != "PCIE_ALLREDUCE_CACHE_DIR"
        ):
            del os.environ[name]
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    global LOGS
    logs = LOGS = LogRecords()
    ours = logging.getLogger("pcie_allreduce")
    ours.addHandler(logs)
    ours.setLevel(logging.DEBUG)

    def body() -> Any:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        return fn(rank, world, *args)

    leave_group(report(rank, out_dir, body, always=lambda: {"logs": logs.records}))


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 2,
    env: dict[str, str | None] | None = None,
) -> list[dict[str, Any]]:
    """fn(rank, world, *args) in `world` spawned processes joined by gloo; the test fails if a
    rank raises or hangs. Returns per rank {"value", "logs"}. ``env`` entries set to None are
    removed in the ranks."""
    results = spawn_ranks(_entry, world, fn, args, {**BASE_ENV, **(env or {})}, TIMEOUT_S)
    for r, res in enumerate(results):
        if not isinstance(res, dict):
            pytest.fail(f"rank {r} died (exit code {res})")
    fail_on_errors(results)
    return results


def lines(results: list[dict[str, Any]], needle: str) -> list[tuple]:
    """(rank, level, message) of every log record on any rank that contains `needle`."""
    return [
        (r, level, msg)
        for r, res in enumerate(results)
        for level, msg in res["logs"]
        if needle in msg
    ]


# ---------------------------------------------------------------------------- in the ranks
def load_sglang_plugins() -> None:
    """SGLang's own plugin loading, as run_scheduler_process does it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def make_group(rank: int, name: str | None = "tp", group_ranks: list | None = None):
    """A real SGLang GroupCoordinator over gloo (world 2 unless `group_ranks` says otherwise)."""
    from sglang.srt.distributed.parallel_state import init_model_parallel_group

    return init_model_parallel_group(
        group_ranks or [[0, 1]],
        rank,
        "gloo",
        use_pynccl=True,
        use_custom_allreduce=False,
        group_name=name,
    )


def publish(**fields: Any) -> None:
    """Publishes a real ServerArgs with `fields` through SGLang's RuntimeContext, so
    get_exec()/get_spec() answer from SGLang's own namespace projection.

    SGLang's test helper (override_server_args) runs the whole argument resolution, and
    publishing computes the derived leaves; both import the model configs, which need
    transformers (not installed in the CPU test venv). Neither is needed for the leaves the
    integration reads (none is derived), so resolution is skipped and the derived leaves are
    left out."""
    import sglang.srt.runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    if "max_bs" in fields:
        from sglang.srt.model_executor.cuda_graph_config import (
            Backend,
            CudaGraphConfig,
            PhaseConfig,
        )

        max_bs = fields.pop("max_bs")
        fields["cuda_graph_config"] = CudaGraphConfig(
            decode=PhaseConfig(backend=Backend.FULL, max_bs=max_bs)
        )
    saved = rc._install_derived_leaves
    rc._install_derived_leaves = lambda tops, server_args: None
    try:
        rc.get_context().set_server_args(ServerArgs(model_path="dummy", **fields))
    finally:
        rc._install_derived_leaves = saved


def unpublish() -> None:
    """Back to a process whose server args were never published (the accessors raise)."""
    import sglang.srt.runtime_context as rc

    ctx = rc.get_context()
    ctx._server_args = None
    ctx._config_bags = None
    ctx.parallel._config = None
