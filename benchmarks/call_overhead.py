"""Per-call time of each operation's public entry point at a small decode size on the host
transport (world 2, CPU processes): what the call path itself costs beside the kernels.

    python benchmarks/call_overhead.py [--world 2] [--calls 30000] [--json FILE]

Prints one line per entry point (best of 5 rounds of calls / 5, slowest rank's). To compare two
builds, run it alternately with each first on PYTHONPATH, several times, and compare the
per-pair ratios: this machine's slow and fast phases move both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 512  # one decode row of a small model, bf16: 1 KiB
ROUNDS = 5


def _entries(ar: object) -> dict[str, Callable[[], object]]:
    from pcie_allreduce import PcieAllReduce

    assert isinstance(ar, PcieAllReduce)
    x = torch.ones(HIDDEN, dtype=torch.bfloat16)
    rows = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    residual = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)
    in_place = torch.ops.pcie_allreduce.all_reduce_.default
    return {
        "all_reduce": lambda: ar.all_reduce(x),
        "all_reduce_": lambda: ar.all_reduce_(x.fill_(1.0)),
        "torch op all_reduce_": lambda: in_place(x.fill_(1.0), ar.handle),
        "all_reduce_add_rms_norm": lambda: ar.all_reduce_add_rms_norm(rows, residual, weight, 1e-6),
        "reduce_scatter": lambda: ar.reduce_scatter(rows),
        "all_gather": lambda: ar.all_gather(x),
    }


def _rank(rank: int, world: int, init: str, calls: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=1 << 16)
    times = {}
    for name, call in _entries(ar).items():
        for _ in range(calls // 10):  # warm-up: decisions made, caches hot
            call()
        best = float("inf")
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(calls // ROUNDS):
                call()
            best = min(best, (time.perf_counter() - start) / (calls // ROUNDS))
        times[name] = best * 1e6
    ar.destroy()
    slowest = [None] * world
    dist.all_gather_object(slowest, times)
    dist.destroy_process_group()
    if rank == 0:
        worst = {name: max(t[name] for t in slowest) for name in times}
        with open(out, "w") as f:
            json.dump(worst, f)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30000)
    parser.add_argument("--json", help="also write {entry: us per call} here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(
            _rank, args=(args.world, os.path.join(tmp, "init"), args.calls, out), nprocs=args.world
        )
        with open(out) as f:
            worst = json.load(f)
    import pcie_allreduce

    print(f"# call_overhead: world {args.world}, {HIDDEN} bf16, {pcie_allreduce.__file__}")
    for name, us in worst.items():
        print(f"{name:26s} {us:8.3f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(worst, f)


if __name__ == "__main__":
    main()
