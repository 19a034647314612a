"""`pcie-allreduce bench`: spawns its own ranks, verifies every result against a float64
reference, and prints nccl-tests columns for pcie_allreduce beside the fallback (gloo on the
host transport, NCCL on GPUs) measured in the same run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative to the sum of |inputs|: one rounding of the result plus one of island partials.
_RTOL = {"bf16": 2.0**-6, "fp16": 2.0**-9, "fp32": 1e-5}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sizes_between(min_bytes: int, max_bytes: int, factor: int, elem: int) -> List[int]:
    """Message sizes in bytes: min, min*factor, ... up to max, each a multiple of 16 bytes."""
    out, size = [], max(16, min_bytes)
    while size <= max_bytes:
        rounded = max(16, size // 16 * 16)
        if rounded % elem == 0 and (not out or rounded != out[-1]):
            out.append(rounded)
        size *= max(2, factor)
    return out


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + numel)
    return torch.randn(numel, generator=g).to(dtype)


def reference(world: int, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, sum of magnitudes) of every rank's input in float64."""
    total = torch.zeros(numel, dtype=torch.float64)
    mag = torch.zeros(numel, dtype=torch.float64)
    for r in range(world):
        x = rank_input(r, numel, dtype).double()
        total += x
        mag += x.abs()
    return total, mag


def _timed(fn, iters: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


_GRAPH_CALLS = 20  # calls captured per graph under --graph; times are per call


def _graphed(fn, calls: int, device: torch.device):
    """Captures `calls` calls of fn into one CUDA graph; returns its replay."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize(device)
    return graph.replay


def _agree_max(value: float, group: Any) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _worker(rank: int, world: int, port: int, opts: Dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(1)
    cuda = opts["transport"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    from .communicator import PcieAllReduce

    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if cuda else group
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = _DTYPES[opts["dtype"]]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = sizes_between(opts["min_bytes"], opts["max_bytes"], opts["step_factor"], elem)
    max_numel = max(sizes) // elem
    max_numel += (-max_numel) % 8
    ar = PcieAllReduce(group, device, max_numel=max_numel, table=opts["table"], cpu_group=cpu_group)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    rows = []
    for size in sizes:
        numel = size // elem
        x = rank_input(rank, numel, dtype).to(device)
        out = ar.all_reduce(x)
        ar.synchronize()
        ref, mag = reference(world, numel, dtype)
        err = (out.cpu().double() - ref).abs()
        wrong = int((err > _RTOL[opts["dtype"]] * mag + 1e-6).sum().item())
        # Tensor-parallel replicas diverge unless every rank gets the same bits.
        bits = out.cpu().view(torch.int16 if elem == 2 else torch.int32).long().sum().item()
        all_bits: List[int] = [0] * world
        dist.all_gather_object(all_bits, bits, group=cpu_group)
        if len(set(all_bits)) != 1:
            wrong = max(wrong, 1)
        tactic = ar.chosen_tactic(x)

        scratch = x.clone()

        def ours() -> None:
            ar.all_reduce(x)

        def fallback() -> None:
            scratch.copy_(x)
            dist.all_reduce(scratch, group=group)

        times = []
        for fn in (ours, fallback):
            for _ in range(opts["warmup"]):
                fn()
            if opts["graph"]:
                fn = _graphed(fn, _GRAPH_CALLS, device)
            iters = opts["iters"]
            if iters <= 0:
                probe = _agree_max(_timed(fn, 3, sync), cpu_group)
                iters = int(min(500, max(5, 0.1 / max(probe, 1e-7))))
            dist.barrier(group=cpu_group)
            per_call = _GRAPH_CALLS if opts["graph"] else 1
            times.append(_agree_max(_timed(fn, iters, sync), cpu_group) / per_call)
        t_ours, t_fb = times
        algbw = size / t_ours / 1e9
        row = {
            "size": size,
            "count": numel,
            "type": opts["dtype"],
            "time_us": t_ours * 1e6,
            "algbw": algbw,
            "busbw": algbw * 2 * (world - 1) / world,
            "wrong": wrong,
            "fallback_us": t_fb * 1e6,
            "speedup": t_fb / t_ours,
            "tactic": tactic,
        }
        rows.append(row)
        if rank == 0:
            print(_format_row(row), flush=True)
    stats = ar.stats()
    ar.destroy()
    if rank == 0:
        queue.put({"rows": rows, "stats": stats})
    dist.destroy_process_group()


def _format_row(r: Dict[str, Any]) -> str:
    return (
        f"{r['size']:>12} {r['count']:>10} {r['type']:>6} {r['time_us']:>10.2f} "
        f"{r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7} {r['fallback_us']:>12.2f} "
        f"{r['speedup']:>8.2f}x  {r['tactic']}"
    )


def main(args: argparse.Namespace) -> int:
    transport = args.transport
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if transport == "auto":
        transport = "cuda" if gpus >= 2 else "host"
    if transport == "cuda":
        if gpus < 2:
            print(
                f"pcie-allreduce bench: --transport cuda needs at least 2 GPUs, found {gpus}; "
                "use --transport host on this machine",
                file=sys.stderr,
            )
            return 2
        world = args.world or min(gpus, 8)
        if world > gpus:
            print(f"pcie-allreduce bench: --world {world} > {gpus} GPUs", file=sys.stderr)
            return 2
    else:
        world = args.world or 2
    if not 2 <= world <= 8:
        print(f"pcie-allreduce bench: --world must be in 2..8, got {world}", file=sys.stderr)
        return 2
    if args.graph and transport != "cuda":
        print("pcie-allreduce bench: --graph needs --transport cuda", file=sys.stderr)
        return 2
    if args.min_bytes > args.max_bytes:
        print("pcie-allreduce bench: --min-bytes exceeds --max-bytes", file=sys.stderr)
        return 2
    opts = {
        "transport": transport,
        "dtype": args.dtype,
        "min_bytes": args.min_bytes,
        "max_bytes": args.max_bytes,
        "step_factor": args.step_factor,
        "iters": args.iters,
        "warmup": args.warmup,
        "table": args.table,
        "graph": args.graph,
    }
    fallback = "nccl" if transport == "cuda" else "gloo"
    print(
        f"# pcie-allreduce bench: transport={transport} world={world} dtype={args.dtype} "
        f"fallback={fallback} host={platform.node()} cpus={os.cpu_count()} torch={torch.__version__}"
    )
    print(
        f"# {'':>34} {'pcie_allreduce':^36} {'fallback':>12}\n"
        f"# {'size(B)':>10} {'count':>10} {'type':>6} {'time(us)':>10} {'algbw':>8} "
        f"{'busbw':>8} {'#wrong':>7} {'time(us)':>12} {'speedup':>9}  tactic",
        flush=True,
    )
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, opts, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"pcie-allreduce bench: ranks {failed} failed", file=sys.stderr)
        return 1
    result = queue.get()
    wrong = sum(r["wrong"] for r in result["rows"])
    print(f"# stats (rank 0): {json.dumps(result['stats'], sort_keys=True)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "transport": transport, **result}, f, indent=2)
    if wrong:
        print(f"# FAILED: {wrong} wrong elements", file=sys.stderr)
        return 1
    print("# all results verified against a float64 reference and identical on every rank")
    return 0
