"""Topology probing: which GPUs share an island, whether any pair is NVLink-connected, and a
description of hosts without GPUs. The parsing and the island derivation live in C++
(plan/topology); this module only gathers the inputs."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from . import _C


def nvidia_smi_topo_text() -> Optional[str]:
    """`nvidia-smi topo -m` output, or None when nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def nvidia_smi_bus_ids() -> List[str]:
    """PCI bus ids in nvidia-smi's GPU order (the order of `topo -m` rows)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run(
            [exe, "--query-gpu=pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [_norm_bus(line) for line in done.stdout.splitlines() if line.strip()]


def _norm_bus(bus_id: str) -> str:
    # nvidia-smi prints 00000000:41:00.0, CUDA 0000:41:00.0: compare the bus/device/function.
    return bus_id.strip().lower().split(":", 1)[-1] if bus_id.count(":") == 2 else bus_id.lower()


def probe() -> Optional["_C.Topology"]:
    """This host's GPU topology from nvidia-smi, or None without GPUs or nvidia-smi."""
    text = nvidia_smi_topo_text()
    if text is None:
        return None
    return _C.Topology.from_nvidia_smi(text)


def describe_host() -> Dict[str, Any]:
    """What a machine without GPUs offers the host transport."""
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").exists() else None
    return {
        "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "numa_nodes": len(nodes),
        "dev_shm_free_bytes": shm.free if shm else None,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


@dataclass
class GroupTopology:
    """What a CUDA communicator needs to know about its group's GPUs."""

    table_key: str = "flat"
    island_of: List[int] = field(default_factory=list)
    decline: Optional[str] = None  # "nvlink" / "no_p2p" when the backend must not run
    detail: str = ""
    fingerprint: str = ""


def _group_links(topo: "_C.Topology", gpu_index: List[int]) -> List[List[str]]:
    return [[topo.link(a, b) for b in gpu_index] for a in gpu_index]


def probe_cuda_group(
    cpu_group: Any, device: torch.device, given: Optional[Any] = None
) -> GroupTopology:
    """Islands and NVLink for the GPUs of a group (collective over its gloo `cpu_group`)."""
    import torch.distributed as dist

    props = torch.cuda.get_device_properties(device)
    mine = {"bus": _norm_bus(getattr(props, "pci_bus_id", "") or ""), "name": props.name}
    world = dist.get_world_size(cpu_group)
    everyone: List[Dict[str, str]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=cpu_group)
    topo = given if given is not None else probe()
    if topo is None:
        return GroupTopology(table_key="flat", island_of=[], detail="nvidia-smi unavailable: flat")
    order = nvidia_smi_bus_ids()
    try:
        gpu_index = [order.index(e["bus"]) for e in everyone]
    except ValueError:
        if topo.world != world:
            return GroupTopology(detail="could not map ranks to nvidia-smi GPUs: assuming flat")
        gpu_index = list(range(world))
    links = _group_links(topo, gpu_index)
    if any(c.startswith("NV") for row in links for c in row):
        pairs = [(a, b) for a in range(world) for b in range(world) if links[a][b].startswith("NV")]
        return GroupTopology(
            table_key="nvlink",
            decline="nvlink",
            detail=f"ranks {pairs[0][0]} and {pairs[0][1]} are NVLink-connected; the engine's "
            "own custom all-reduce is faster there",
        )
    # Islands: components of "better than SYS" among the group's GPUs.
    island_of = list(range(world))
    for a in range(world):
        for b in range(world):
            if a != b and links[a][b] != "SYS":  # "X": two ranks on one GPU
                lo, hi = sorted((island_of[a], island_of[b]))
                island_of = [lo if i == hi else i for i in island_of]
    ids = sorted(set(island_of))
    island_of = [ids.index(i) for i in island_of]
    islands = [[r for r in range(world) if island_of[r] == i] for i in range(len(ids))]
    key = _C.Topology.from_islands(islands).table_key()
    return GroupTopology(table_key=key, island_of=island_of if len(ids) > 1 else [])
