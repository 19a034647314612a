"""The cost model's report for decode-size messages: modelled microseconds of one call for every
tactic on four GPU targets, for the executor as it is built today and for variants the model can
price (the first look at an LL group made serially, one load per delivery copy, and parallel
re-looks of missed operands, which the executor does not do yet), and the critical path of the
best tactic of each target. No GPU needed: it is arithmetic on the step lists
(csrc/plan/cost_model.h). These numbers are modelled, not measured.

    .venv/bin/python benchmarks/cost_model_report.py [--bytes 12288] [--paths] [--fused]
        [--collective] [--json FILE]

The output is deterministic: the same tree gives the same report (benchmarks/tables.py relies
on it to check the modelled tables of docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

TARGETS = (
    ("world 2, P2P", [0, 0], "cuda_ipc"),
    ("world 8 (4+4), P2P", [0, 0, 0, 0, 1, 1, 1, 1], "cuda_ipc"),
    ("world 2, cuda_host", [0, 0], "cuda_host"),
    ("world 4, cuda_host", [0] * 4, "cuda_host"),
)

# Executor variants the model prices: without the parallel first look of an LL group (and
# without one-load delivery), without one-load delivery, the executor as built (the decode-shaped
# kernels every LL and lamport row launches on), and the large-message kernels.
CURRENT = "current"
LARGE = "large-message kernels"
EXECUTORS = (
    ("serial first look", {"parallel_first_look": False, "multi_destination_copies": False}),
    ("one load per copy", {"multi_destination_copies": False}),
    (CURRENT, {}),
    # The same tactic launched with more than 256 threads: the large-message kernels' groups of
    # two (lamport four, sm_100+) and their missed operands awaited one at a time.
    (
        LARGE,
        {"first_look_group": 2, "dense_first_look_group": 4, "parallel_relooks": False},
    ),
)


def label(t: dict[str, Any]) -> str:
    return (
        f"{t['algorithm']}/{t['direction']}/{'staged' if t['staged'] else 'unstaged'}/"
        f"{t['protocol']}"
    )


def _schedule(t: dict[str, Any], island_of: list[int]) -> Any:
    from pcie_allreduce.native import _C

    return _C.build_schedule(
        t["algorithm"], len(island_of), island_of, t["direction"], t["staged"], t["protocol"]
    )


def _cost(c: dict[str, Any], tactic: str) -> dict[str, Any]:
    return {"tactic": tactic, "us": c["modelled_us"], "rt": c["serial_round_trips"]}


def report(nbytes: int) -> dict[str, Any]:
    """Every target's ranked tactics (the six best today, under every executor variant), its
    best tactic fused with the residual add + RMSNorm epilogue, and its best reduce-scatter and
    all-gather beside its best all-reduce, all at ``nbytes``."""
    from pcie_allreduce.native import _C
    from pcie_allreduce.tuning import model

    targets = []
    for name, island_of, transport in TARGETS:
        ranked = {
            ex: model.rank_tactics(len(island_of), island_of, transport, nbytes, executor=over)
            for ex, over in EXECUTORS
        }
        by_label = {ex: {label(t): t for t in rows} for ex, rows in ranked.items()}
        tactics = [
            {
                "tactic": label(t),
                "us": {ex: by_label[ex][label(t)]["modelled_us"] for ex, _ in EXECUTORS},
                "rt": {ex: by_label[ex][label(t)]["serial_round_trips"] for ex, _ in EXECUTORS},
            }
            for t in ranked[CURRENT][:6]
        ]
        best = ranked[CURRENT][0]
        plain = _schedule(best, island_of)
        fused = _C.with_epilogue(plain).cost(nbytes, transport=transport)
        collectives = {"all_reduce": _cost(best, label(best))}
        for collective in ("reduce_scatter", "all_gather"):
            top = model.rank_tactics(
                len(island_of), island_of, transport, nbytes, collective=collective
            )[0]
            collectives[collective] = _cost(top, label(top))
        paths = {}
        for ex, over in EXECUTORS:
            c = _schedule(ranked[ex][0], island_of).cost(nbytes, transport=transport, executor=over)
            paths[ex] = {
                "tactic": label(ranked[ex][0]),
                **{k: c[k] for k in ("latency_us", "bandwidth_us", "modelled_us")},
                **{k: c[k] for k in ("busiest_link_bytes", "busiest_link", "critical_path")},
            }
        targets.append(
            {
                "name": name,
                "transport": transport,
                "world": len(island_of),
                "tactics": tactics,
                "fused": {
                    **_cost(fused, label(best)),
                    "plain_us": best["modelled_us"],
                    "plain_rt": best["serial_round_trips"],
                    "added": list(fused["critical_path"][-3:]),
                },
                "collectives": collectives,
                "paths": paths,
            }
        )
    return {
        "bytes": nbytes,
        "executor": dict(_C.executor_model()),
        "constants": dict(_C.latency_model()),
        "targets": targets,
    }


def _print(rep: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"executor today: {rep['executor']}")
    print(f"constants: {rep['constants']}")
    for t in rep["targets"]:
        print(f"\n### {t['name']}, {rep['bytes']} bytes")
        print("| tactic | " + " | ".join(f"{ex} µs (rt)" for ex, _ in EXECUTORS) + " |")
        print("|---|" + "---|" * len(EXECUTORS))
        for row in t["tactics"]:
            cells = " | ".join(f"{row['us'][ex]:.2f} ({row['rt'][ex]})" for ex, _ in EXECUTORS)
            print(f"| {row['tactic']} | {cells} |")
        if args.fused:
            f = t["fused"]
            print(
                f"\nfused ({f['tactic']}): {f['us']:.2f} µs ({f['rt']} rt) against "
                f"{f['plain_us']:.2f} µs ({f['plain_rt']} rt) plain; added: "
                + "; ".join(f["added"])
            )
        if args.collective:
            ar = t["collectives"]["all_reduce"]
            for collective in ("reduce_scatter", "all_gather"):
                c = t["collectives"][collective]
                print(
                    f"\n{collective} ({c['tactic']}): {c['us']:.2f} µs ({c['rt']} rt), "
                    f"{c['us'] / ar['us']:.2f}x the all-reduce's {ar['us']:.2f} µs ({ar['tactic']})"
                )
        if args.paths:
            for ex, p in t["paths"].items():
                print(
                    f"\n{ex}: {p['tactic']} = {p['latency_us']:.2f} latency + "
                    f"{p['bandwidth_us']:.2f} bandwidth ({p['busiest_link_bytes']:.0f} B on "
                    f"{p['busiest_link']}) = {p['modelled_us']:.2f} µs"
                )
                for link in p["critical_path"]:
                    print(f"    {link}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bytes", type=int, default=12288)
    ap.add_argument("--paths", action="store_true", help="print each target's critical path")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="also each target's best tactic with the fused all-reduce + residual "
        "add + RMSNorm epilogue, beside it plain",
    )
    ap.add_argument(
        "--collective",
        action="store_true",
        help="also each target's best reduce-scatter and all-gather of the same "
        "message, beside its best all-reduce",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the whole report as JSON")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    rep = report(args.bytes)
    _print(rep, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
