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
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .testing import DTYPES, count_wrong, rank_input


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


def _timed(fn, iters: int, sync) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


_GRAPH_CALLS = 20  # calls captured per graph under --graph; times are per call
# --transport values that run on GPUs: cuda (P2P, host memory if P2P fails), hostmem (forced).
GPU_TRANSPORTS = ("cuda", "hostmem")


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


@dataclass
class _Rank:
    """One bench rank: its groups, device and communicator."""

    world: int
    group: Any
    cpu_group: Any  # gloo: object exchange and barriers
    device: torch.device
    ar: Any
    sync: Callable[[], None]


def _set_up(rank: int, world: int, port: int, opts: Dict[str, Any], max_numel: int) -> _Rank:
    """Joins the process group and builds the communicator for `max_numel` elements."""
    torch.set_num_threads(1)
    cuda = opts["transport"] in GPU_TRANSPORTS
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
    # --transport hostmem: the GPUs talk through shared pinned host memory even if P2P works.
    forced = "hostmem" if opts["transport"] == "hostmem" else None
    ar = PcieAllReduce(group, device, max_numel=max_numel, table=opts["table"], cpu_group=cpu_group,
                       transport=forced)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    return _Rank(world, group, cpu_group, device, ar, sync)


def _verify(r: _Rank, x: torch.Tensor, dtype_name: str) -> int:
    """Wrong elements of one all-reduce of x (at least 1 if the ranks' bits differ)."""
    out = r.ar.all_reduce(x)
    r.ar.synchronize()
    wrong = count_wrong(out, r.world, x.numel(), dtype_name)
    # Tensor-parallel replicas diverge unless every rank gets the same bits.
    as_int = torch.int16 if x.element_size() == 2 else torch.int32
    bits = out.cpu().view(as_int).long().sum().item()
    all_bits = [torch.zeros(1, dtype=torch.int64) for _ in range(r.world)]
    dist.all_gather(all_bits, torch.tensor([bits], dtype=torch.int64), group=r.cpu_group)
    if len({int(b.item()) for b in all_bits}) != 1:
        wrong = max(wrong, 1)
    return wrong


def _seconds_per_call(r: _Rank, fn: Callable[[], None], opts: Dict[str, Any]) -> float:
    """fn's time per call, the slowest rank's, after warm-up (under graph replay with --graph)."""
    for _ in range(opts["warmup"]):
        fn()
    if opts["graph"]:
        fn = _graphed(fn, _GRAPH_CALLS, r.device)
    iters = opts["iters"]
    if iters <= 0:
        probe = _agree_max(_timed(fn, 3, r.sync), r.cpu_group)
        iters = int(min(500, max(5, 0.1 / max(probe, 1e-7))))
    dist.barrier(group=r.cpu_group)
    per_call = _GRAPH_CALLS if opts["graph"] else 1
    return _agree_max(_timed(fn, iters, r.sync), r.cpu_group) / per_call


def _time_ours_and_fallback(
    r: _Rank, x: torch.Tensor, opts: Dict[str, Any]
) -> Tuple[float, float]:
    """Seconds per call of ours and of the group's own all-reduce, on the same input."""
    scratch = x.clone()

    def ours() -> None:
        r.ar.all_reduce(x)

    def fallback() -> None:
        scratch.copy_(x)
        dist.all_reduce(scratch, group=r.group)

    return _seconds_per_call(r, ours, opts), _seconds_per_call(r, fallback, opts)


def _row(size: int, numel: int, world: int, dtype_name: str, wrong: int, tactic: str,
         t_ours: float, t_fb: float) -> Dict[str, Any]:
    algbw = size / t_ours / 1e9
    return {
        "size": size,
        "count": numel,
        "type": dtype_name,
        "time_us": t_ours * 1e6,
        "algbw": algbw,
        "busbw": algbw * 2 * (world - 1) / world,
        "wrong": wrong,
        "fallback_us": t_fb * 1e6,
        "speedup": t_fb / t_ours,
        "tactic": tactic,
    }


def _worker(rank: int, world: int, port: int, opts: Dict[str, Any], queue: Any) -> None:
    dtype_name = opts["dtype"]
    dtype = DTYPES[dtype_name]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = sizes_between(opts["min_bytes"], opts["max_bytes"], opts["step_factor"], elem)
    max_numel = max(sizes) // elem
    max_numel += (-max_numel) % 8
    r = _set_up(rank, world, port, opts, max_numel)
    if rank == 0:
        s = r.ar.stats()
        print(f"# communicator transport: {s['transport']} ({s['transport_detail']})", flush=True)
    rows = []
    for size in sizes:
        numel = size // elem
        x = rank_input(rank, numel, dtype).to(r.device)
        wrong = _verify(r, x, dtype_name)
        tactic = r.ar.chosen_tactic(x)
        t_ours, t_fb = _time_ours_and_fallback(r, x, opts)
        row = _row(size, numel, world, dtype_name, wrong, tactic, t_ours, t_fb)
        rows.append(row)
        if rank == 0:
            print(_format_row(row), flush=True)
    stats = r.ar.stats()
    r.ar.destroy()
    if rank == 0:
        queue.put({"rows": rows, "stats": stats})
    dist.destroy_process_group()


def _format_row(r: Dict[str, Any]) -> str:
    return (
        f"{r['size']:>12} {r['count']:>10} {r['type']:>6} {r['time_us']:>10.2f} "
        f"{r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7} {r['fallback_us']:>12.2f} "
        f"{r['speedup']:>8.2f}x  {r['tactic']}"
    )


def _transport_and_world(args: argparse.Namespace, sizes: bool = True
                         ) -> Tuple[str, int, Optional[str]]:
    """(transport, world, why not): why not is None when this machine can run the request."""
    transport = args.transport
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if transport == "auto":
        transport = "cuda" if gpus >= 2 else "host"
    if transport in GPU_TRANSPORTS:
        if gpus < 2:
            return transport, 0, (
                f"--transport {transport} needs at least 2 GPUs, found {gpus}; "
                "use --transport host on this machine"
            )
        world = min(gpus, 8) if args.world is None else args.world
        if world > gpus:
            return transport, world, f"--world {world} > {gpus} GPUs"
    else:
        world = 2 if args.world is None else args.world
    if not 2 <= world <= 8:
        return transport, world, f"--world must be in 2..8, got {world}"
    if not sizes:
        return transport, world, _tune_problem(args)
    if args.graph and transport not in GPU_TRANSPORTS:
        return transport, world, "--graph needs --transport cuda or hostmem"
    return transport, world, _arguments_problem(args)


def _json_problem(args: argparse.Namespace) -> Optional[str]:
    """--json must name a file in a writable folder: found before the run, not after it."""
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return f"--json {args.json!r}: folder {folder!r} does not exist or is not writable"
    return None


def _tune_problem(args: argparse.Namespace) -> Optional[str]:
    if args.max_bytes < 16:
        return f"--max-bytes must be at least 16, got {args.max_bytes}"
    if not args.budget > 0:
        return f"--budget must be a positive number of seconds, got {args.budget}"
    return _json_problem(args)


def _arguments_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the size range, --table or --json, found before any rank starts."""
    if args.min_bytes > args.max_bytes:
        return "--min-bytes exceeds --max-bytes"
    elem = DTYPES[args.dtype].itemsize
    if not sizes_between(args.min_bytes, args.max_bytes, args.step_factor, elem):
        return (
            f"no message size in --min-bytes {args.min_bytes} .. --max-bytes {args.max_bytes}: "
            "sizes are multiples of 16 bytes; raise --max-bytes to at least 16"
        )
    if args.table is not None and not os.path.isfile(args.table):
        return f"--table {args.table!r}: no such file (expected a tuning-table CSV file)"
    return _json_problem(args)


def _print_header(transport: str, world: int, dtype_name: str) -> None:
    fallback = "nccl" if transport in GPU_TRANSPORTS else "gloo"
    print(
        f"# pcie-allreduce bench: transport={transport} world={world} dtype={dtype_name} "
        f"fallback={fallback} host={platform.node()} cpus={os.cpu_count()} "
        f"torch={torch.__version__}"
    )
    print(
        f"# {'':>34} {'pcie_allreduce':^36} {'fallback':>12}\n"
        f"# {'size(B)':>10} {'count':>10} {'type':>6} {'time(us)':>10} {'algbw':>8} "
        f"{'busbw':>8} {'#wrong':>7} {'time(us)':>12} {'speedup':>9}  tactic",
        flush=True,
    )


def _tune_worker(rank: int, world: int, port: int, opts: Dict[str, Any], queue: Any) -> None:
    """One rank of `pcie-allreduce tune`: builds the communicator and tunes it."""
    import logging

    from .errors import TuneError, TuneRefused

    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s")
    elem = min(DTYPES[d].itemsize for d in opts["dtypes"])  # room for max_bytes of each
    max_numel = max(8, opts["max_bytes"] // elem // 8 * 8)
    r = _set_up(rank, world, port, opts, max_numel)
    try:
        report = r.ar.tune(dtypes=opts["dtypes"], max_bytes=opts["max_bytes"],
                           budget_s=opts["budget_s"], force=opts["force"])
    except (TuneRefused, TuneError) as error:
        report = {"status": "refused" if isinstance(error, TuneRefused) else "failed",
                  "error": str(error), "measured": 0, "path": None}
    report["stats"] = r.ar.stats()
    r.ar.destroy()
    if rank == 0:
        queue.put(report)
    dist.destroy_process_group()


def _run_ranks(world: int, opts: Dict[str, Any], target: Callable[..., None] = _worker
               ) -> Optional[Dict[str, Any]]:
    """Spawns the ranks; rank 0's result, or None (said on stderr) if any rank failed."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, opts, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"pcie-allreduce: ranks {failed} failed", file=sys.stderr)
        return None
    return queue.get()


def main(args: argparse.Namespace) -> int:
    transport, world, why_not = _transport_and_world(args)
    if why_not is not None:
        print(f"pcie-allreduce bench: {why_not}", file=sys.stderr)
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
    _print_header(transport, world, args.dtype)
    result = _run_ranks(world, opts)
    if result is None:
        return 1
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


def _print_tune(report: Dict[str, Any]) -> None:
    print(f"# {'dtype':>5} {'bytes':>9} {'bucket':>19}  {'incumbent':<36} {'us':>8}  "
          f"{'chosen':<36} {'us':>8} {'fallback':>9} {'noise%':>6} {'rounds':>6}")
    for c in report["choices"]:
        hi = "*" if c["max_bytes"] < 0 else str(c["max_bytes"])
        mark = "*" if c["changed"] else " "
        print(f"  {c['dtype']:>5} {c['bytes']:>9} {c['min_bytes']:>9}..{hi:<8}  "
              f"{c['incumbent']:<36} {c['incumbent_us']:>8.2f} {mark}{c['winner']:<35} "
              f"{c['time_us']:>8.2f} {c['fallback_us']:>9.2f} {c['noise_pct']:>6.2f} "
              f"{c['rounds']:>6}")


def tune_main(args: argparse.Namespace) -> int:
    """`pcie-allreduce tune`: measures this host once and writes its tuning cache."""
    transport, world, why_not = _transport_and_world(args, sizes=False)
    if why_not is not None:
        print(f"pcie-allreduce tune: {why_not}", file=sys.stderr)
        return 2
    opts = {"transport": transport, "dtypes": args.dtype, "max_bytes": args.max_bytes,
            "budget_s": args.budget, "force": args.force, "table": None}
    print(f"# pcie-allreduce tune: transport={transport} world={world} "
          f"dtypes={','.join(args.dtype)} max_bytes={args.max_bytes} host={platform.node()}",
          flush=True)
    report = _run_ranks(world, opts, _tune_worker)
    if report is None:
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if report["status"] in ("refused", "failed"):
        print(f"pcie-allreduce tune: {report['error']}", file=sys.stderr)
        return 2 if report["status"] == "refused" else 1
    if report["status"] == "cached":
        print(f"# measured nothing: {report['path']} already holds this host's tuning "
              "(pass --force to measure again)")
        return 0
    _print_tune(report)
    print(f"# measured {report['measured']} (bucket, tactic) pairs in {report['seconds']:.1f} s; "
          f"* = the incumbent was beaten by more than the noise")
    if report["path"] is None:
        print(f"# not written: {report['problem']}", file=sys.stderr)
        return 1
    print(f"# wrote {report['path']}")
    for bad in report["excluded"]:
        print(f"# excluded (wrong sum on ranks {bad['ranks']}): {bad['tactic']} at "
              f"{bad['bytes']} B {bad['dtype']}", file=sys.stderr)
    return 0
