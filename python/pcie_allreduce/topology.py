"""Topology probing: which GPUs share an island, whether any pair is NVLink-connected, and a
description of hosts without GPUs. The parsing and the island derivation live in C++
(plan/topology); this module only gathers the inputs."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import policy
from .native import _C, Topology


def run_nvidia_smi(args: list[str]) -> str | None:
    """stdout of ``nvidia-smi ARGS``, or None when nvidia-smi is missing, fails or prints
    nothing, or prints bytes that are not UTF-8 (a broken driver install is a failed probe)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired, UnicodeDecodeError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def nvidia_smi_topo_text() -> str | None:
    """`nvidia-smi topo -m` output, or None when nvidia-smi is missing or fails."""
    return run_nvidia_smi(["topo", "-m"])


def nvidia_smi_query(fields: str) -> list[list[str]]:
    """`nvidia-smi --query-gpu=FIELDS` rows in nvidia-smi's GPU order (the order of `topo -m`
    rows), each a list of stripped values; [] when nvidia-smi is missing or fails."""
    out = run_nvidia_smi([f"--query-gpu={fields}", "--format=csv,noheader"]) or ""
    return [[v.strip() for v in line.split(",")] for line in out.splitlines() if line.strip()]


def nvidia_smi_bus_ids() -> list[str]:
    """PCI bus ids in nvidia-smi's GPU order (the order of `topo -m` rows)."""
    return [_norm_bus(row[0]) for row in nvidia_smi_query("pci.bus_id")]


def driver_version() -> str:
    """The NVIDIA driver's version (and the CUDA runtime torch was built with): part of the
    tuning cache's fingerprint, since a driver update can change which tactic wins."""
    rows = nvidia_smi_query("driver_version")
    return policy.driver_field(rows[0][0] if rows else "", torch.version.cuda)


def _norm_bus(bus_id: str) -> str:
    # nvidia-smi prints 00000000:41:00.0, CUDA 0000:41:00.0: compare the bus/device/function.
    return bus_id.strip().lower().split(":", 1)[-1] if bus_id.count(":") == 2 else bus_id.lower()


def probe() -> Topology | None:
    """This host's GPU topology from nvidia-smi, or None without GPUs or nvidia-smi."""
    text = nvidia_smi_topo_text()
    if text is None:
        return None
    return _C.Topology.from_nvidia_smi(text)


def host_devices() -> list[str]:
    """What the host transport runs on, for its fingerprint: the CPU model and the number of
    NUMA nodes."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    return [f"{model} ({os.cpu_count()} CPUs, {nodes} NUMA node(s))"]


def describe_host() -> dict[str, Any]:
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
    island_of: list[int] = field(default_factory=list)
    decline: str | None = None  # "nvlink" / "no_p2p" when the backend must not run
    detail: str = ""
    devices: list[str] = field(default_factory=list)  # every rank's GPU name, in rank order
    driver: str = ""
    links: str = ""  # the group's link classes (Topology.fingerprint of the group's subset)


def probe_cuda_group(
    gather: Callable[[Any, str], list[Any]], device: torch.device, given: Any | None = None
) -> GroupTopology:
    """Islands and NVLink for the GPUs of a group (collective: ``gather(obj, step)`` returns
    every rank's ``obj``, as :meth:`Bootstrap.gather` does)."""
    props = torch.cuda.get_device_properties(device)
    mine = {"bus": _norm_bus(getattr(props, "pci_bus_id", "") or ""), "name": props.name}
    everyone: list[dict[str, str]] = gather(mine, "topology probe")
    world = len(everyone)
    names = [e["name"] for e in everyone]
    topo = given if given is not None else probe()
    if topo is None:
        return GroupTopology(
            table_key="flat",
            island_of=[],
            detail="nvidia-smi unavailable: flat",
            devices=names,
            driver=policy.driver_field(None, torch.version.cuda),
        )
    result = _group_topology(topo, everyone, world)
    result.devices, result.driver = names, driver_version()
    return result


def _group_topology(topo: Any, everyone: list[dict[str, str]], world: int) -> GroupTopology:
    """Islands and NVLink of the group's GPUs within the host's topology."""
    order = nvidia_smi_bus_ids()
    try:
        gpu_index = [order.index(e["bus"]) for e in everyone]
    except ValueError:
        if topo.world != world:
            return GroupTopology(detail="could not map ranks to nvidia-smi GPUs: assuming flat")
        gpu_index = list(range(world))
    group_topo = topo.subset(gpu_index)  # rank r sees its own GPU's links
    nvlink = group_topo.nvlink_pairs()
    if nvlink:
        a, b = nvlink[0]
        return GroupTopology(
            table_key="nvlink",
            decline="nvlink",
            detail=f"ranks {a} and {b} are NVLink-connected; the engine's own custom all-reduce "
            "is faster there",
        )
    return GroupTopology(
        table_key=group_topo.table_key(),
        island_of=policy.islands_for_table(group_topo),
        links=group_topo.fingerprint(),
    )
