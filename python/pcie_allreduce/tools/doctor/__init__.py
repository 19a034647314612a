"""`pcie-allreduce doctor`: can this backend run on this box, and if not, why not.

An inference-server operator runs it once per host. It gathers, in order:

1. the GPUs and their topology (NVML when ``pynvml`` imports, else ``nvidia-smi``), the NUMA
   node of every GPU, its islands and any NVLink pair;
2. a real peer write-and-verify for every ordered GPU pair, in a subprocess, cached per
   driver and set of GPUs; it always tests peer-to-peer (``p2p``);
3. the transport a communicator would use (``verdict.transport_report``): ``cuda_ipc``, or
   ``cuda_host`` when P2P failed on some pair in auto mode or host memory is forced; a P2P
   failure only blocks with PCIE_ALLREDUCE_TRANSPORT=cuda_ipc;
4. IOMMU/ACS hints from the kernel command line and the IOMMU groups, never fatal (``iommu``);
5. which tuning table a communicator would use here, and whether this host has a cache
   (``tables``);
6. without GPUs: a real world-2 all-reduce on ``host_shm`` (``host_transport``);

and ends with one verdict line (``verdict``; the text form: ``report``). Exit status: 0 when
the backend can run here, 1 when it cannot, 2 for a usage error (a bad ``--fixture``).

Every read of the machine (NVML, nvidia-smi, sysfs, /proc, the environment, subprocesses) goes
through a ``system.System``, so ``--fixture DIR`` can replay a recorded host instead
(``system.FixtureSystem``; the format is described in tests/python/fixtures/doctor/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ... import policy
from .host_transport import check_host_transport
from .inventory import gather_inventory, topology_report
from .iommu import iommu_report
from .p2p import P2PRunner, check_p2p
from .report import print_text
from .system import FixtureError, FixtureSystem, LiveSystem, System
from .tables import table_report
from .verdict import gpu_verdict, host_verdict, tactic_report, transport_mode, transport_report


def run(
    system: System, *, p2p_test: bool = True, p2p_runner: P2PRunner | None = None
) -> dict[str, Any]:
    """The whole diagnosis as one JSON-ready dict: ``ok`` and ``verdict``, then the sections."""
    inv = gather_inventory(system)
    mode, mode_error = transport_mode(system.env)
    if inv is None:
        p2p: dict[str, Any] = {"status": "not_applicable"}
        transport = transport_report(None, p2p, mode, mode_error)
        table = table_report(system, inv)
        host = check_host_transport(system)
        ok, verdict = host_verdict(host, table, mode_error)
        sections = dict(
            gpus={"count": 0, "probe": "none", "devices": [], "problems": []},
            topology={"known": False},
            p2p=p2p,
            transport=transport,
            iommu=iommu_report(system, None),
            table=table,
            host_transport=host,
            tactics=tactic_report(2, []),
            declines=[],
        )
    else:
        p2p = check_p2p(system, inv, skip=not p2p_test, runner=p2p_runner)
        transport = transport_report(inv, p2p, mode, mode_error)
        table = table_report(system, inv, transport["name"])
        tactics = tactic_report(inv.count, inv.island_of)
        ok, verdict, declines = gpu_verdict(inv, p2p, table, tactics, transport)
        sections = dict(
            gpus={
                "count": inv.count,
                "probe": inv.probe,
                "driver": inv.driver,
                "devices": inv.gpus,
                "problems": inv.problems,
            },
            topology=topology_report(inv),
            p2p=p2p,
            transport=transport,
            iommu=iommu_report(system, inv, p2p.get("failing", [])),
            table=table,
            host_transport={
                "status": "not_tested",
                "detail": "GPUs present: "
                f"`pcie-allreduce bench --transport {policy.HOST_SHM}` checks it",
            },
            tactics=tactics,
            declines=declines,
        )
    if system.flags()[0].enable is False:
        verdict += " (note: PCIE_ALLREDUCE_ENABLE=0 in this environment turns it off)"
    return {"ok": ok, "verdict": verdict, "system": system.label, **sections}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds `doctor` to argparse subparsers ``sub``."""
    d = sub.add_parser(
        "doctor",
        help="can this backend run here, and if not, why not",
        description="Checks the GPUs, their topology and NVLink, a real peer write on every "
        "GPU pair, the transport a communicator would use (peer-to-peer, or shared pinned host "
        "memory where P2P fails), IOMMU/ACS hints, the tuning table in use and (without GPUs) "
        "the host transport, then prints a verdict. Exit status: 0 the backend can run here, 1 it "
        "cannot, 2 usage error.",
    )
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument(
        "--fixture",
        metavar="DIR",
        help="diagnose a recorded host instead of this one: DIR holds nvidia_smi_topo.txt, "
        "query_gpu.csv, cmdline, iommu_groups, numa_nodes, p2p.json, host_transport.json, env "
        "(see tests/python/fixtures/doctor/README.md); nothing is run",
    )
    d.add_argument(
        "--no-p2p-test",
        action="store_true",
        help="do not run the P2P write-and-verify subprocess (a cached result is still reported)",
    )
    d.set_defaults(func=main)
    return d


def main(args: argparse.Namespace) -> int:
    try:
        system: System = FixtureSystem(Path(args.fixture)) if args.fixture else LiveSystem()
        report = run(system, p2p_test=not args.no_p2p_test)
    except FixtureError as error:
        print(f"pcie-allreduce doctor: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_text(report)
    return 0 if report["ok"] else 1
