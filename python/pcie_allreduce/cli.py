"""`pcie-allreduce` (also `python -m pcie_allreduce`): topo, bench, tune, doctor."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .native import _C
from . import plan as plan_mod
from . import topology as topo_mod


def _summaries(world: int, island_of: List[int]) -> List[Dict[str, Any]]:
    rows = []
    for algorithm in plan_mod.ALGORITHMS:
        why = _C.why_unsupported(algorithm, world, island_of)
        if why is not None:
            rows.append({"algorithm": algorithm, "supported": False, "reason": why})
            continue
        for direction in ("push", "pull"):
            for staged in (True, False):
                for protocol in ("flag", "ll"):
                    if _C.why_unsupported(algorithm, world, island_of, direction, staged,
                                          protocol) is not None:
                        continue  # LL is push-only and unstaged
                    s = _C.build_schedule(algorithm, world, island_of, direction, staged,
                                          protocol)
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
    print("The host shared-memory transport serves CPU tensors here: "
          "`pcie-allreduce bench --transport host`.")
    return 0


def _topo_report(topo: Any) -> Dict[str, Any]:
    island_of = topo.island_of() if len(topo.islands()) > 1 else []
    world = topo.world
    return {
        "gpus": world,
        "islands": topo.islands(),
        "table_key": topo.table_key(),
        "fingerprint": topo.fingerprint(),
        "has_nvlink": topo.has_nvlink(),
        "island_algorithms": topo.why_not_two_equal_islands() or "available",
        "schedules": _summaries(world, island_of) if 2 <= world <= 8 else [],
    }


def _print_schedules(rows: List[Dict[str, Any]]) -> None:
    """One line per schedule; the cost columns are per call and CTA for the worst rank:
    system fences, waits polling a peer, local wait rounds, LL operands polled, fabric hops."""
    print(f"{'algorithm':<16}{'dir':<6}{'staged':<8}{'proto':<6}{'ok':<4}{'stages':>7}"
          f"{'out/stage':>10}{'in/stage':>9}{'xisland':>8}"
          f"{'fences':>8}{'peerpoll':>9}{'waits':>6}{'llpoll':>7}{'hops':>5}")
    for r in rows:
        if not r["supported"]:
            print(f"{r['algorithm']:<16}-- {r['reason']}")
            continue
        c = r["cost"]
        print(f"{r['algorithm']:<16}{r['direction']:<6}{str(r['staged']).lower():<8}"
              f"{r['protocol']:<6}{'yes' if r['verified'] else 'NO':<4}{r['stages']:>7}"
              f"{r['max_outbound_per_stage']:>10}{r['max_inbound_per_stage']:>9}"
              f"{r['cross_island_elements']:>8g}{c['system_fences']:>8}{c['peer_polls']:>9}"
              f"{c['local_waits']:>6}{c['data_polls']:>7}{c['fabric_hops']:>5}")


def _print_topo(topo: Any, report: Dict[str, Any]) -> None:
    print(topo.describe())
    print(f"table key:   {report['table_key']}")
    print(f"fingerprint: {report['fingerprint']}")
    if topo.has_nvlink():
        print("NVLink present: the serving engine's own custom all-reduce should take this host; "
              "pcie_allreduce declines by itself here.")
    print(f"island algorithms: {report['island_algorithms']}")
    if not report["schedules"]:
        print(f"(no schedules: world size {topo.world} is outside 2..8)")
        return
    print()
    _print_schedules(report["schedules"])


def cmd_topo(args: argparse.Namespace) -> int:
    text: Optional[str] = None
    if args.nvidia_smi_topo:
        text = Path(args.nvidia_smi_topo).read_text()
    else:
        text = topo_mod.nvidia_smi_topo_text()
    if text is None:
        return _describe_host(args.json)
    topo = _C.Topology.from_nvidia_smi(text)
    report = _topo_report(topo)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_topo(topo, report)
    return 0


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b").rstrip("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcie-allreduce", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("topo", help="topology, islands, fingerprint and schedule summaries")
    t.add_argument("--nvidia-smi-topo", metavar="FILE", help="parse this `nvidia-smi topo -m` text")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=cmd_topo)

    b = sub.add_parser("bench", help="ours vs the fallback, nccl-tests columns, verified")
    b.add_argument("--transport", choices=["auto", "host", "cuda", "hostmem"], default="auto",
                   help="cuda: GPUs over P2P (host memory if the P2P check fails); hostmem: GPUs "
                   "through shared pinned host memory even where P2P works")
    b.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on host)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    b.add_argument("--min-bytes", type=_parse_bytes, default=_parse_bytes("1K"))
    b.add_argument("--max-bytes", type=_parse_bytes, default=_parse_bytes("1M"))
    b.add_argument("--step-factor", type=int, default=2)
    b.add_argument("--iters", type=int, default=0, help="timed iterations (0 = adaptive)")
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--table", help="tuning table CSV file (default: PCIE_ALLREDUCE_TABLE/seed)")
    b.add_argument("--graph", action="store_true", help="time under CUDA-graph replay (cuda)")
    b.add_argument("--json", metavar="FILE", help="also write the rows as JSON")

    def run_bench(args: argparse.Namespace) -> int:
        from .bench import main as bench_main

        return bench_main(args)

    b.set_defaults(func=run_bench)

    u = sub.add_parser("tune", help="measure this host once and write its tuning cache")
    u.add_argument("--transport", choices=["auto", "host", "cuda", "hostmem"], default="auto",
                   help="as for bench")
    u.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on host)")
    u.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], action="append",
                   help="dtype to tune (repeat for several; default: bf16, fp16 and fp32)")
    u.add_argument("--max-bytes", type=_parse_bytes, default=_parse_bytes("256K"),
                   help="largest message tuned (default 256K); larger ones keep the seed's rows")
    u.add_argument("--budget", type=float, default=120.0, help="seconds for the whole tune")
    u.add_argument("--force", action="store_true", help="measure even if a cache exists")
    u.add_argument("--json", metavar="FILE", help="also write the report as JSON")

    def run_tune(args: argparse.Namespace) -> int:
        from .bench import tune_main

        args.dtype = args.dtype or ["bf16", "fp16", "fp32"]
        return tune_main(args)

    u.set_defaults(func=run_tune)

    from . import doctor

    doctor.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:
        print(f"pcie-allreduce {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
