"""`pcie-allreduce tune`: spawns the ranks like bench, calls ``PcieAllReduce.tune()`` on each,
prints one line per size bucket and writes this host's tuning cache."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from typing import Any

import torch.distributed as dist

from ..errors import TuneError, TuneRefused
from ..testing import DTYPES
from .ranks import json_problem, run_ranks, set_up, transport_and_world


def _tune_worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    """One rank of `pcie-allreduce tune`: builds the communicator and tunes it."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    elem = min(DTYPES[d].itemsize for d in opts["dtypes"])  # room for max_bytes of each
    max_numel = max(8, opts["max_bytes"] // elem // 8 * 8)
    r = set_up(rank, world, port, opts, max_numel)
    try:
        report = r.ar.tune(
            dtypes=opts["dtypes"],
            max_bytes=opts["max_bytes"],
            budget_s=opts["budget_s"],
            force=opts["force"],
        )
    except (TuneRefused, TuneError) as error:
        report = {
            "status": "refused" if isinstance(error, TuneRefused) else "failed",
            "error": str(error),
            "measured": 0,
            "path": None,
        }
    report["stats"] = r.ar.stats()
    r.ar.destroy()
    if rank == 0:
        queue.put(report)
    dist.destroy_process_group()


def _tune_problem(args: argparse.Namespace) -> str | None:
    if args.max_bytes < 16:
        return f"--max-bytes must be at least 16, got {args.max_bytes}"
    if not 0 < args.budget < float("inf"):
        return f"--budget must be a positive, finite number of seconds, got {args.budget}"
    return json_problem(args)


def _print_tune(report: dict[str, Any]) -> None:
    print(
        f"# {'op':<14} {'dtype':>5} {'bytes':>9} {'bucket':>19}  {'incumbent':<36} {'us':>8}  "
        f"{'chosen':<36} {'us':>8} {'fallback':>9} {'noise%':>6} {'rounds':>6}"
    )
    for c in report["choices"]:
        hi = "*" if c["max_bytes"] < 0 else str(c["max_bytes"])
        mark = "*" if c["changed"] else " "
        print(
            f"  {c['op']:<14} {c['dtype']:>5} {c['bytes']:>9} {c['min_bytes']:>9}..{hi:<8}  "
            f"{c['incumbent']:<36} {c['incumbent_us']:>8.2f} {mark}{c['winner']:<35} "
            f"{c['time_us']:>8.2f} {c['fallback_us']:>9.2f} {c['noise_pct']:>6.2f} "
            f"{c['rounds']:>6}"
        )


def main(args: argparse.Namespace) -> int:
    """`pcie-allreduce tune`: measures this host once and writes its tuning cache."""
    transport, world, why_not = transport_and_world(args)
    why_not = why_not or _tune_problem(args)
    if why_not is not None:
        print(f"pcie-allreduce tune: {why_not}", file=sys.stderr)
        return 2
    dtypes = args.dtype or list(DTYPES)
    opts = {
        "transport": transport,
        "dtypes": dtypes,
        "max_bytes": args.max_bytes,
        "budget_s": args.budget,
        "force": args.force,
        "table": None,
    }
    print(
        f"# pcie-allreduce tune: transport={transport} world={world} "
        f"dtypes={','.join(dtypes)} max_bytes={args.max_bytes} host={platform.node()}",
        flush=True,
    )
    report = run_ranks(world, opts, _tune_worker)
    if report is None:
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if report["status"] in ("refused", "failed"):
        print(f"pcie-allreduce tune: {report['error']}", file=sys.stderr)
        return 2 if report["status"] == "refused" else 1
    if report["status"] == "cached":
        print(
            f"# measured nothing: {report['path']} already holds this host's tuning "
            "(pass --force to measure again)"
        )
        return 0
    _print_tune(report)
    print(
        f"# measured {report['measured']} (bucket, tactic) pairs in {report['seconds']:.1f} s; "
        f"* = the incumbent was beaten by more than the noise"
    )
    if report["path"] is None:
        print(f"# not written: {report['problem']}", file=sys.stderr)
        return 1
    print(f"# wrote {report['path']}")
    for bad in report["excluded"]:
        print(
            f"# excluded (wrong result on ranks {bad['ranks']}): {bad['op']} {bad['tactic']} at "
            f"{bad['bytes']} B {bad['dtype']}",
            file=sys.stderr,
        )
    return 0
