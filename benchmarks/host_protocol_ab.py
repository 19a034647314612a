"""Flag protocol vs LL and lamport (flag-in-data) on the host transport, side by side in one run.

Every candidate is a one-row tuning table forcing one tactic; all candidates live in the same
processes at once and are timed in interleaved rounds (the order rotates each round), so the
machine's fast and slow phases hit every candidate alike. Prints the median microseconds per
call (the slowest rank's) and each candidate's ratio to the first one.

    .venv/bin/python benchmarks/host_protocol_ab.py --world 2 --dtype bf16

With --seed-only it times just the embedded seed table's choice, which is how two builds of
the package are compared (run it alternately with each build first on PYTHONPATH; see
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CANDIDATES = {  # name -> one table row (topology ... threads, protocol)
    "oneshot/flag": "*,*,*,0,*,oneshot,push,0,1,32,flag",
    "oneshot/ll": "*,*,*,0,*,oneshot,push,0,1,32,ll",
    "twoshot/flag": "*,*,*,0,*,twoshot,push,0,1,32,flag",
    "twoshot/ll": "*,*,*,0,*,twoshot,push,0,1,32,ll",
    "oneshot/lamport": "*,*,*,0,*,oneshot,push,0,1,32,lamport",
    "twoshot/lamport": "*,*,*,0,*,twoshot,push,0,1,32,lamport",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from pcie_allreduce import PcieAllReduce
    from pcie_allreduce.testing import DTYPES, count_wrong, rank_input

    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 2
    max_numel = max(sizes) // elem
    candidates = {"seed": None} if args.seed_only else CANDIDATES
    comms = {
        name: PcieAllReduce(
            None, "cpu", max_numel=max_numel, table=None if row is None else row + "\n"
        )
        for name, row in candidates.items()
    }
    results: dict[int, dict[str, float]] = {}
    for size in sizes:
        x = rank_input(rank, size // elem, dtype)
        for name, ar in comms.items():  # verify, warm up
            out = ar.all_reduce(x)
            assert count_wrong(out, world, x.numel(), args.dtype) == 0, name
            for _ in range(20):
                ar.all_reduce(x)
        times: dict[str, list[float]] = {name: [] for name in comms}
        names = list(comms)
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                dist.barrier()
                t = torch.tensor([_time(lambda: comms[name].all_reduce(x), args.iters)])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[name].append(t.item())
        results[size] = {name: statistics.median(v) for name, v in times.items()}
    for ar in comms.values():
        ar.destroy()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=256 * 1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument(
        "--seed-only",
        action="store_true",
        help="time only the seed table's choice (to compare two builds)",
    )
    return p


def main() -> int:
    args = build_parser().parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world, port, args, queue))
        for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    results = queue.get()
    for proc in procs:
        proc.join()
    if args.seed_only:
        for size, t in results.items():
            print(f"{size} {t['seed'] * 1e6:.2f}")
        return 0
    names = list(CANDIDATES)
    print(
        f"# host transport, world {args.world}, {args.dtype}, {os.cpu_count()} CPUs; "
        f"median of {args.rounds} interleaved rounds x {args.iters} calls, slowest rank, us"
    )
    print(
        f"{'bytes':>8} "
        + " ".join(f"{n:>13}" for n in names)
        + "  ll/flag oneshot  ll/flag twoshot"
    )
    for size, t in results.items():
        cells = " ".join(f"{t[n] * 1e6:>13.2f}" for n in names)
        print(
            f"{size:>8} {cells}  {t['oneshot/ll'] / t['oneshot/flag']:>15.2f}"
            f"  {t['twoshot/ll'] / t['twoshot/flag']:>15.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
