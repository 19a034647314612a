"""What a bench run reports: its first line (the mode, the run, the fallback and the machine),
each row as it is measured (printed by rank 0), and each rank's end (rank 0 hands its rows and
stats back to the command, which prints the verdict)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..ranks import GPU_TRANSPORTS, Rank


def fallback_name(transport: str) -> str:
    """The group whose own collectives ours are measured beside."""
    return "nccl" if transport in GPU_TRANSPORTS else "gloo"


def print_run(mode: str, transport: str, world: int, dtype_name: str, detail: str = "") -> None:
    """``# pcie-allreduce bench<mode>: transport=.. world=.. dtype=..<detail> fallback=..
    host=.. cpus=.. torch=..``: what ran, and where."""
    print(
        f"# pcie-allreduce bench{mode}: transport={transport} world={world} dtype={dtype_name}"
        f"{detail} fallback={fallback_name(transport)} host={platform.node()} "
        f"cpus={os.cpu_count()} torch={torch.__version__}"
    )


class Report:
    """One rank's rows: rank 0 prints each as it is measured; ``finish`` ends the rank."""

    def __init__(self, r: Rank, format_row: Callable[[dict[str, Any]], str]) -> None:
        self.r, self.format_row = r, format_row
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.r.ar.rank == 0:
            print(self.format_row(row), flush=True)

    def finish(self, queue: Any) -> None:
        """Destroys the communicator and the group; rank 0 hands back its rows and stats."""
        stats = self.r.ar.stats()
        rank = self.r.ar.rank
        self.r.ar.destroy()
        if rank == 0:
            queue.put({"rows": self.rows, "stats": stats})
        dist.destroy_process_group()
