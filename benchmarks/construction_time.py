"""Time to construct and destroy a PcieAllReduce on the host transport (every exchange of
construction and the destroy() barrier), the slowest rank's median over repetitions.

    .venv/bin/python benchmarks/construction_time.py --world 4 --reps 20

Compare two builds by running it alternately with each build first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, reps: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    from pcie_allreduce import PcieAllReduce

    seconds = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        PcieAllReduce(None, "cpu", max_numel=1 << 16).destroy()
        seconds.append(time.perf_counter() - start)
    slowest = [torch.zeros(reps, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(slowest, torch.tensor(seconds, dtype=torch.float64))
    if rank == 0:
        queue.put(statistics.median(torch.stack(slowest).max(0).values.tolist()))
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, args.reps, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    import pcie_allreduce

    print(
        f"construction+destroy world={args.world} reps={args.reps} "
        f"package={os.path.dirname(pcie_allreduce.__file__)}: "
        f"median {queue.get() * 1e3:.2f} ms (slowest rank)"
    )


if __name__ == "__main__":
    main()
