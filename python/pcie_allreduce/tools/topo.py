"""`pcie-allreduce topo`: the topology, islands and fingerprint of a `nvidia-smi topo -m` text
(this host's, or a file), and each tactic's verified summary (cross-island traffic, streams per
stage), cost (system fences, peer polls, local wait rounds, LL polls, fabric hops) and the cost
model's time of one call (csrc/plan/cost_model.h) over P2P (cuda_ipc) and over pinned host
memory (cuda_host): serial round trips on the critical path, the busiest link's bytes and the
modelled microseconds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .. import plan as plan_mod
from .. import policy
from .. import topology as topo_mod
from ..native import _C

# The transports the cost model covers, and their column names.
MODELLED = (("cuda_ipc", "p2p"), ("cuda_host", "host"))


def _model(schedule: Any, nbytes: int) -> dict[str, Any]:
    out = {}
    for transport, _ in MODELLED:
        c = schedule.cost(nbytes, transport=transport)
        out[transport] = {
            k: c[k]
            for k in (
                "modelled_us",
                "latency_us",
                "bandwidth_us",
                "serial_round_trips",
                "busiest_link_bytes",
                "busiest_link",
                "critical_path",
            )
        }
    return out


def _summaries(world: int, island_of: list[int], nbytes: int) -> list[dict[str, Any]]:
    rows = []
    for algorithm in plan_mod.ALGORITHMS:
        why = _C.why_unsupported(algorithm, world, island_of)
        if why is not None:
            rows.append({"algorithm": algorithm, "supported": False, "reason": why})
            continue
        for direction in ("push", "pull"):
            for staged in (True, False):
                for protocol in plan_mod.PROTOCOLS:
                    if (
                        _C.why_unsupported(algorithm, world, island_of, direction, staged, protocol)
                        is not None
                    ):
                        continue  # LL is push-only and unstaged
                    s = _C.build_schedule(algorithm, world, island_of, direction, staged, protocol)
                    v = s.verify()
                    rows.append(
                        {
                            "algorithm": algorithm,
                            "direction": direction,
                            "staged": staged,
                            "protocol": protocol,
                            "supported": True,
                            "verified": v["ok"],
                            "stages": v["num_stages"],
                            "max_outbound_per_stage": v["max_outbound_per_stage"],
                            "max_inbound_per_stage": v["max_inbound_per_stage"],
                            "cross_island_elements": v["cross_island_elements"],
                            "cost": v["cost"],
                            "model_bytes": nbytes,
                            "model": _model(s, nbytes),
                        }
                    )
    return rows


def _describe_host(as_json: bool) -> int:
    """topo on a machine without GPUs: what the host transport has to work with."""
    host = topo_mod.describe_host()
    if as_json:
        print(json.dumps({"gpus": 0, "host": host}, indent=2))
        return 0
    print("No GPUs found (nvidia-smi unavailable and no --nvidia-smi-topo FILE given).")
    print(
        f"Host: {host['cpus']} CPUs ({host['cpu']}), {host['numa_nodes']} NUMA node(s), "
        f"/dev/shm free {host['dev_shm_free_bytes']} bytes."
    )
    print(
        f"The host shared-memory transport ({policy.HOST_SHM}) serves CPU tensors here: "
        f"`pcie-allreduce bench --transport {policy.HOST_SHM}`."
    )
    return 0


def _topo_report(topo: Any, nbytes: int) -> dict[str, Any]:
    island_of = policy.islands_for_table(topo)
    world = topo.world
    return {
        "gpus": world,
        "islands": topo.islands(),
        "table_key": topo.table_key(),
        "fingerprint": topo.fingerprint(),
        "has_nvlink": topo.has_nvlink(),
        "island_algorithms": topo.why_not_two_equal_islands() or "available",
        "schedules": _summaries(world, island_of, nbytes) if 2 <= world <= 8 else [],
    }


def _print_schedules(rows: list[dict[str, Any]]) -> None:
    """One line per schedule; the count columns are per call and CTA for the worst rank:
    system fences, waits polling a peer, local wait rounds, LL operands polled, fabric hops.
    The model columns, per transport: serial round trips on the critical path, the busiest
    link's KiB and the modelled µs of one call (`--json` has each critical path)."""
    nbytes = next((r["model_bytes"] for r in rows if r["supported"]), 0)
    model_head = "".join(f"{'rt':>4}{'KiB':>6}{name + ' us':>9}" for _, name in MODELLED)
    print(
        f"{'algorithm':<16}{'dir':<6}{'staged':<8}{'proto':<6}{'ok':<4}{'stages':>7}"
        f"{'out/stage':>10}{'in/stage':>9}{'xisland':>8}"
        f"{'fences':>8}{'peerpoll':>9}{'waits':>6}{'llpoll':>7}{'hops':>5}  {model_head}"
    )
    for r in rows:
        if not r["supported"]:
            print(f"{r['algorithm']:<16}-- {r['reason']}")
            continue
        c = r["cost"]
        model = "".join(
            f"{m['serial_round_trips']:>4}{m['busiest_link_bytes'] / 1024:>6.0f}"
            f"{m['modelled_us']:>9.2f}"
            for m in (r["model"][transport] for transport, _ in MODELLED)
        )
        print(
            f"{r['algorithm']:<16}{r['direction']:<6}{str(r['staged']).lower():<8}"
            f"{r['protocol']:<6}{'yes' if r['verified'] else 'NO':<4}{r['stages']:>7}"
            f"{r['max_outbound_per_stage']:>10}{r['max_inbound_per_stage']:>9}"
            f"{r['cross_island_elements']:>8g}{c['system_fences']:>8}{c['peer_polls']:>9}"
            f"{c['local_waits']:>6}{c['data_polls']:>7}{c['fabric_hops']:>5}  {model}"
        )
    print(
        f"(model: {nbytes} bytes per call, constants in csrc/plan/cost_model.h, "
        'docs/benchmarks.md "The cost model")'
    )


def _print_topo(topo: Any, report: dict[str, Any]) -> None:
    print(topo.describe())
    print(f"table key:   {report['table_key']}")
    print(f"fingerprint: {report['fingerprint']}")
    if topo.has_nvlink():
        print(
            "NVLink present: the serving engine's own custom all-reduce should take this host; "
            "pcie_allreduce declines by itself here."
        )
    print(f"island algorithms: {report['island_algorithms']}")
    if not report["schedules"]:
        print(f"(no schedules: world size {topo.world} is outside 2..8)")
        return
    print()
    _print_schedules(report["schedules"])


def main(args: argparse.Namespace) -> int:
    text: str | None = None
    if args.nvidia_smi_topo:
        text = Path(args.nvidia_smi_topo).read_text()
    else:
        text = topo_mod.nvidia_smi_topo_text()
    if text is None:
        return _describe_host(args.json)
    topo = _C.Topology.from_nvidia_smi(text)
    report = _topo_report(topo, args.model_bytes)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_topo(topo, report)
    return 0
