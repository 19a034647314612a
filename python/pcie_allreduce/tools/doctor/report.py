"""The doctor's text report: one section per concern, then the verdict line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ... import policy
from .verdict import pairs_text


def _print_links(t: dict[str, Any]) -> None:
    links = t["links"]
    print(("        " + "".join(f"GPU{i:<4}" for i in range(len(links)))).rstrip())
    for i, row in enumerate(links):
        cells = "".join(f"{'X' if i == j else c:<7}" for j, c in enumerate(row))
        print(f"  GPU{i:<4}{cells}".rstrip())
    print("  islands: " + " ".join("{" + ",".join(map(str, i)) + "}" for i in t["islands"]))


def _print_gpus(report: dict[str, Any]) -> None:
    gpus = report["gpus"]
    print(f"GPUs ({gpus['probe']}, driver {gpus.get('driver') or 'unknown'})")
    for g in gpus["devices"]:
        numa = g["numa_node"] if g["numa_node"] is not None else "?"
        print(f"  GPU{g['index']}  {g['name']:<40} {g['bus_id'] or '?':<14} NUMA {numa}")
    for problem in gpus["problems"]:
        print(f"  ! {problem}")
    t = report["topology"]
    print("\nTopology")
    if not t["known"]:
        print("  unknown")
        return
    _print_links(t)
    print(f"  table key: {t['table_key']}; island algorithms: {t['island_algorithms']}")


def _print_p2p(p2p: dict[str, Any]) -> None:
    print("\nP2P write-and-verify")
    status = p2p.get("status")
    source = p2p.get("source", "")
    where = f" [{source}{': ' + p2p['cache_file'] if p2p.get('cache_file') else ''}]"
    if status == "ok":
        print(f"  ok on all {len(p2p['pairs'])} ordered pairs{where}")
    elif status == "failed":
        print(f"  FAILED: {pairs_text(p2p['failing'])}{where}")
        ok_pairs = sum(1 for p in p2p["pairs"] if p["status"] == "ok")
        print(f"  ok on {ok_pairs} of {len(p2p['pairs'])} ordered pairs")
    else:
        print(f"  {status}: {p2p.get('detail', '')}")


def _print_transport(transport: dict[str, Any]) -> None:
    print("\nTransport")
    mode = "" if transport["name"] == policy.HOST_SHM else f" (mode {transport['mode']})"
    print(f"  {transport['name']}{mode}: {transport['detail']}")


def _print_iommu(iommu: dict[str, Any]) -> None:
    print("\nIOMMU / ACS")
    flags = " ".join(iommu["cmdline_flags"]) or "(no IOMMU flags)"
    print(f"  kernel command line: {flags if iommu['cmdline_read'] else 'unreadable'}")
    groups = iommu["groups"]
    print(
        f"  IOMMU groups: {'none listed' if groups is None else groups}"
        + (f" {iommu['group_types']}" if set(iommu["group_types"]) - {"unknown"} else "")
        + f"; mode: {iommu['mode']}"
    )
    for hint in iommu["hints"]:
        print(f"  hint: {hint}")


def _print_table(table: dict[str, Any]) -> None:
    print("\nTuning table")
    env_table = table["env_table"]
    if env_table is None:
        print("  PCIE_ALLREDUCE_TABLE: unset")
    else:
        state = f"{env_table['rows']} rows" if env_table["ok"] else f"BROKEN: {env_table['error']}"
        print(f"  PCIE_ALLREDUCE_TABLE: {env_table['path']} ({state})")
    print(f"  cache folder: {table['cache_dir']}")
    cache = table.get("gpu_cache")
    if cache is not None:
        print(
            f"  GPU cache {cache['fingerprint']}: {cache['status']}"
            + (f" ({cache['problem']})" if cache.get("problem") else "")
        )
    for c in table["host_caches"]:
        print(
            f"  host cache {Path(c['path']).name}: {c['status']}"
            + (f" ({c['problem']})" if c.get("problem") else "")
        )
    print(f"  in use: {table['in_use']}")


def _print_tactics(tactics: dict[str, Any]) -> None:
    print(f"\nTactics (world {tactics['world']})")
    print(f"  can run: {', '.join(tactics['available']) or 'none'}")
    for algorithm, why in tactics["unavailable"].items():
        print(f"  not {algorithm}: {why}")


def print_text(report: dict[str, Any]) -> None:
    print(f"pcie-allreduce doctor: {report['system']}\n")
    if report["gpus"]["count"]:
        _print_gpus(report)
        _print_p2p(report["p2p"])
    else:
        print("GPUs: no GPU found (no NVML, no nvidia-smi GPUs, torch sees none)")
        host = report["host_transport"]
        print(f"\nHost shared-memory transport\n  {host['status']}: {host['detail']}")
    _print_transport(report["transport"])
    _print_iommu(report["iommu"])
    _print_table(report["table"])
    _print_tactics(report["tactics"])
    print(f"\nverdict: {report['verdict']}")
