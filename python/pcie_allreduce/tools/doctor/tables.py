"""Which tuning table a communicator here would use: PCIE_ALLREDUCE_TABLE (and whether it
parses), this host's cache for the GPUs' fingerprint on the transport they would run, the host
transport's caches per world size, else the embedded seed (``policy.table_request``)."""

from __future__ import annotations

import re
from typing import Any

import torch

from ... import files, policy
from ...native import _C
from ...tuning import cache
from .inventory import Inventory
from .system import System


def _env_table(system: System) -> dict[str, Any] | None:
    request = policy.table_request(None, system.flags()[0].table)
    if request.path is None:
        return None
    path = system.resolve(request.path)
    report: dict[str, Any] = {"path": str(path), "ok": False}
    try:
        text = files.read_small(path, in_cache=False).decode("utf-8")
        table = _C.TuningTable.parse(text, str(path))
    except FileNotFoundError:
        report["error"] = "no such file (expected a tuning-table CSV file)"
    except IsADirectoryError:
        report["error"] = "is a directory (expected a tuning-table CSV file)"
    except UnicodeDecodeError as error:
        report["error"] = f"not a text tuning table (not UTF-8 at byte {error.start})"
    except (OSError, ValueError) as error:
        report["error"] = str(error)
    else:
        report.update(ok=True, rows=len(table))
    return report


def _cache_status(read: cache.CacheRead) -> dict[str, Any]:
    if read.text is not None:
        status = "valid"
    elif read.problem is None:
        status = "missing"
    elif read.problem.startswith("foreign") or read.problem.startswith("format"):
        status = "foreign"
    elif read.problem.startswith("refused"):
        status = "refused"  # not a regular file of this user in a private folder (files.py)
    else:
        status = "corrupt"
    out: dict[str, Any] = {"path": str(read.path), "status": status}
    if read.problem:
        out["problem"] = read.problem
    return out


def fingerprint_driver(inv: Inventory) -> str:
    """The driver field of a CUDA cache fingerprint (``policy.driver_field``: without
    nvidia-smi only the CUDA runtime)."""
    return policy.driver_field(None if inv.probe == "torch" else inv.driver, torch.version.cuda)


def fingerprint_links(inv: Inventory) -> str:
    """The links field of a CUDA cache fingerprint: the link classes of the group's GPUs, as
    the communicator computes them (``Topology.subset(ranks).fingerprint()``; empty when
    nvidia-smi could not be read)."""
    if inv.probe == "torch" or inv.topology is None:
        return ""
    return inv.topology.subset(list(range(inv.count))).fingerprint()


def gpu_cache_report(
    system: System, inv: Inventory, transport: str = policy.CUDA_IPC
) -> dict[str, Any]:
    """This host's cache file for ``transport`` (cuda_ipc or cuda_host), as the communicator's
    rank 0 reads it."""
    key = policy.table_key(transport, inv.table_key)
    fields = policy.fingerprint_fields(
        transport,
        inv.count,
        key,
        inv.island_of,
        [g["name"] for g in inv.gpus],
        fingerprint_driver(inv),
        links=fingerprint_links(inv),
    )
    fp = policy.fingerprint(fields)
    path = cache.cache_path(fp, system.cache_dir())
    return {"fingerprint": fp, **_cache_status(cache.read_cache(path, fp))}


def host_cache_reports(system: System) -> list[dict[str, Any]]:
    """Every host-transport cache file, checked against this host's fingerprint for its world."""
    out = []
    devices = system.host_devices()
    host = policy.HOST_SHM
    for path in sorted(system.cache_dir().glob(f"{host}-w*-*.csv")):
        match = re.match(rf"{host}-w(\d+)-", path.name)
        if match is None:
            continue
        world = int(match.group(1))
        fields = policy.fingerprint_fields(host, world, policy.table_key(host), [], devices, "")
        fp = policy.fingerprint(fields)
        out.append({"world": world, "fingerprint": fp, **_cache_status(cache.read_cache(path, fp))})
    return out


def table_report(
    system: System, inv: Inventory | None, transport: str = policy.CUDA_IPC
) -> dict[str, Any]:
    """Which table a communicator would use: PCIE_ALLREDUCE_TABLE, this host's cache (for the
    GPUs: the cache of ``transport``, the one the communicator would run), or the embedded seed
    table."""
    seed = _C.TuningTable.parse(_C.TuningTable.embedded_text(), "embedded")
    report: dict[str, Any] = {
        "cache_dir": str(system.cache_dir()),
        "env_table": _env_table(system),
        "embedded_rows": len(seed),
    }
    if inv is not None and inv.count >= 2:
        report["gpu_cache"] = gpu_cache_report(system, inv, transport)
    report["host_caches"] = host_cache_reports(system)
    env_table = report["env_table"]
    gpu_cache = report.get("gpu_cache")
    valid_host = [c["path"] for c in report["host_caches"] if c["status"] == "valid"]
    if env_table is not None:
        report["in_use"] = f"PCIE_ALLREDUCE_TABLE {env_table['path']}" + (
            "" if env_table["ok"] else " (broken: communicators raise at construction)"
        )
    elif gpu_cache is not None and gpu_cache["status"] == "valid":
        report["in_use"] = f"this host's tuning cache {gpu_cache['path']}"
    elif inv is None and valid_host:
        report["in_use"] = "this host's tuning cache " + ", ".join(valid_host)
    else:
        report["in_use"] = f"{policy.SEED_SOURCE} ({len(seed)} rows)"
    return report
