"""The cost model's report for the decode-size targets (issue 23): modelled microseconds of one
call for every tactic, for the executor before item 1, before item 2, today's, and today's with
the change the model prices that it does not make yet (parallel re-looks of missed operands), and
the critical path of the best tactic of each target. No GPU needed: it is arithmetic on the step
lists (csrc/plan/cost_model.h).

    .venv/bin/python benchmarks/cost_model_report.py [--bytes 12288] [--paths] [--fused]
        [--collective]
"""

from __future__ import annotations

import argparse
from typing import Any

from pcie_allreduce.native import _C
from pcie_allreduce.tuning import model

TARGETS = (
    ("world 2, P2P", [0, 0], "cuda_ipc"),
    ("world 8 (4+4), P2P", [0, 0, 0, 0, 1, 1, 1, 1], "cuda_ipc"),
    ("world 2, cuda_host", [0, 0], "cuda_host"),
    ("world 4, cuda_host", [0] * 4, "cuda_host"),
)

# The executor before issue 23's item 1 (serial first look, one load per copy), before item 2
# (one load per copy), today's, and a change the model prices that the executor does not make
# yet (docs/benchmarks.md, "Issue 23").
EXECUTORS = (
    ("before item 1", {"parallel_first_look": False, "multi_destination_copies": False}),
    ("before item 2", {"multi_destination_copies": False}),
    ("today", {}),
    ("+ parallel re-looks", {"parallel_relooks": True}),
)


def label(t: dict[str, Any]) -> str:
    return (
        f"{t['algorithm']}/{t['direction']}/{'staged' if t['staged'] else 'unstaged'}/"
        f"{t['protocol']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bytes", type=int, default=12288)
    ap.add_argument("--paths", action="store_true", help="print each target's critical path")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="also each target's best tactic with the fused all-reduce + residual "
        "add + RMSNorm epilogue (issue 24), beside it plain",
    )
    ap.add_argument(
        "--collective",
        action="store_true",
        help="also each target's best reduce-scatter and all-gather of the same "
        "message (issue 25), beside its best all-reduce",
    )
    args = ap.parse_args()
    print(f"executor today: {_C.executor_model()}")
    print(f"constants: {_C.latency_model()}")
    for name, island_of, transport in TARGETS:
        print(f"\n### {name}, {args.bytes} bytes")
        ranked: dict[str, list[dict[str, Any]]] = {
            ex: model.rank_tactics(len(island_of), island_of, transport, args.bytes, executor=over)
            for ex, over in EXECUTORS
        }
        print("| tactic | " + " | ".join(f"{ex} µs (rt)" for ex, _ in EXECUTORS) + " |")
        print("|---|" + "---|" * len(EXECUTORS))
        by_label = {ex: {label(t): t for t in rows} for ex, rows in ranked.items()}
        for t in ranked["today"][:6]:
            cells = " | ".join(
                f"{by_label[ex][label(t)]['modelled_us']:.2f} "
                f"({by_label[ex][label(t)]['serial_round_trips']})"
                for ex, _ in EXECUTORS
            )
            print(f"| {label(t)} | {cells} |")
        if args.fused:
            best = ranked["today"][0]
            plain = _C.build_schedule(
                best["algorithm"],
                len(island_of),
                island_of,
                best["direction"],
                best["staged"],
                best["protocol"],
            )
            a = plain.cost(args.bytes, transport=transport)
            b = _C.with_epilogue(plain).cost(args.bytes, transport=transport)
            print(
                f"\nfused ({label(best)}): {b['modelled_us']:.2f} µs "
                f"({b['serial_round_trips']} rt) against {a['modelled_us']:.2f} µs "
                f"({a['serial_round_trips']} rt) plain; added: "
                + "; ".join(link for link in b["critical_path"][-3:])
            )
        if args.collective:
            best_ar = ranked["today"][0]
            for collective in ("reduce_scatter", "all_gather"):
                best = model.rank_tactics(
                    len(island_of), island_of, transport, args.bytes, collective=collective
                )[0]
                print(
                    f"\n{collective} ({label(best)}): {best['modelled_us']:.2f} µs "
                    f"({best['serial_round_trips']} rt), "
                    f"{best['modelled_us'] / best_ar['modelled_us']:.2f}x the all-reduce's "
                    f"{best_ar['modelled_us']:.2f} µs ({label(best_ar)})"
                )
        if args.paths:
            for ex, over in EXECUTORS:
                best = ranked[ex][0]
                s = _C.build_schedule(
                    best["algorithm"],
                    len(island_of),
                    island_of,
                    best["direction"],
                    best["staged"],
                    best["protocol"],
                )
                c = s.cost(args.bytes, transport=transport, executor=over)
                print(
                    f"\n{ex}: {label(best)} = {c['latency_us']:.2f} latency + "
                    f"{c['bandwidth_us']:.2f} bandwidth ({c['busiest_link_bytes']:.0f} B on "
                    f"{c['busiest_link']}) = {c['modelled_us']:.2f} µs"
                )
                for link in c["critical_path"]:
                    print(f"    {link}")


if __name__ == "__main__":
    main()
