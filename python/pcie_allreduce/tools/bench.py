"""`pcie-allreduce bench`: spawns its own ranks, verifies every result against a float64
reference, and prints nccl-tests columns for pcie_allreduce beside the fallback (gloo on the
host transport, NCCL on GPUs) measured in the same run."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import policy
from ..testing import DTYPES, RTOL, count_wrong, fused_float64, rank_input, reference
from .ranks import GPU_TRANSPORTS, Rank, json_problem, run_ranks, set_up, transport_and_world


def sizes_between(min_bytes: int, max_bytes: int, factor: int, elem: int) -> list[int]:
    """Message sizes in bytes: min, min*factor, ... up to max, each a multiple of 16 bytes."""
    out: list[int] = []
    size = max(16, min_bytes)
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


def _verify(r: Rank, x: torch.Tensor, dtype_name: str) -> int:
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


def _seconds_per_call(r: Rank, fn: Callable[[], None], opts: dict[str, Any]) -> float:
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


def _time_ours_and_fallback(r: Rank, x: torch.Tensor, opts: dict[str, Any]) -> tuple[float, float]:
    """Seconds per call of ours and of the group's own all-reduce, on the same input."""
    scratch = x.clone()

    def ours() -> None:
        r.ar.all_reduce(x)

    def fallback() -> None:
        scratch.copy_(x)
        dist.all_reduce(scratch, group=r.group)

    return _seconds_per_call(r, ours, opts), _seconds_per_call(r, fallback, opts)


def _row(
    size: int,
    numel: int,
    world: int,
    dtype_name: str,
    wrong: int,
    tactic: str,
    t_ours: float,
    t_fb: float,
) -> dict[str, Any]:
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


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    dtype_name = opts["dtype"]
    dtype = DTYPES[dtype_name]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = sizes_between(opts["min_bytes"], opts["max_bytes"], opts["step_factor"], elem)
    max_numel = max(sizes) // elem
    max_numel += (-max_numel) % 8
    r = set_up(rank, world, port, opts, max_numel)
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
    _finish(r, rows, queue)


def _finish(r: Rank, rows: list[dict[str, Any]], queue: Any) -> None:
    """Destroys the communicator and the group; rank 0 hands back its rows and stats."""
    stats = r.ar.stats()
    rank = r.ar.rank
    r.ar.destroy()
    if rank == 0:
        queue.put({"rows": rows, "stats": stats})
    dist.destroy_process_group()


# ---------------------------------------------------------------- --fused
_EPS = 1e-6


def _fused_wrong(
    r: Rank,
    y: torch.Tensor,
    res_out: torch.Tensor,
    xs: list[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    dtype_name: str,
) -> int:
    """Elements of the fused result further from float64 than a few roundings of the dtype (at
    least 1 if the ranks' bits differ)."""
    y64, r64 = fused_float64(xs, residual.cpu(), weight.cpu(), _EPS)
    ulp = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-23}[dtype_name]
    wrong = 0
    for got, exact in ((y, y64), (res_out, r64)):
        scale = exact.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
        wrong += int(((got.cpu().double() - exact).abs() > 4 * ulp * scale + 1e-6).sum().item())
    as_int = torch.int16 if y.element_size() == 2 else torch.int32
    bits = y.cpu().view(as_int).long().sum().item() + res_out.cpu().view(as_int).long().sum().item()
    all_bits = [torch.zeros(1, dtype=torch.int64) for _ in range(r.world)]
    dist.all_gather(all_bits, torch.tensor([bits], dtype=torch.int64), group=r.cpu_group)
    return max(wrong, 1) if len({int(b.item()) for b in all_bits}) != 1 else wrong


def _fused_worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    dtype_name, hidden = opts["dtype"], opts["hidden"]
    dtype = DTYPES[dtype_name]
    elem = torch.tensor([], dtype=dtype).element_size()
    row_bytes = hidden * elem
    rows_list = [
        n
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
        if opts["min_bytes"] <= n * row_bytes <= opts["max_bytes"]
    ]
    r = set_up(rank, world, port, opts, max(rows_list) * hidden)
    g = torch.Generator().manual_seed(12345)  # the residual stream and weight: replicated
    weight = torch.randn(hidden, generator=g).to(dtype).to(r.device)
    out = []
    for rows in rows_list:
        xs = [rank_input(q, rows * hidden, dtype).view(rows, hidden) for q in range(world)]
        x = xs[rank].to(r.device)
        residual = torch.randn(rows, hidden, generator=g).to(dtype).to(r.device)
        y, res_out = r.ar.all_reduce_add_rms_norm(x, residual, weight, _EPS)
        r.ar.synchronize()
        wrong = _fused_wrong(r, y, res_out, xs, residual, weight, dtype_name)
        scratch = x.clone()

        def fused() -> None:
            r.ar.all_reduce_add_rms_norm(x, residual, weight, _EPS)

        def plain() -> None:
            r.ar.all_reduce(x)

        def unfused() -> None:
            s = r.ar.all_reduce(x)
            torch.nn.functional.rms_norm(s + residual, (hidden,), weight, _EPS)

        def fallback() -> None:
            scratch.copy_(x)
            dist.all_reduce(scratch, group=r.group)
            torch.nn.functional.rms_norm(scratch + residual, (hidden,), weight, _EPS)

        # Interleaved, in rounds: a slow phase of the machine hits every variant alike.
        times: dict[str, list[float]] = {k: [] for k in ("fused", "plain", "unfused", "fallback")}
        for _ in range(opts["rounds"]):
            for name, fn in (
                ("fused", fused),
                ("plain", plain),
                ("unfused", unfused),
                ("fallback", fallback),
            ):
                times[name].append(_seconds_per_call(r, fn, opts))
        best = {k: min(v) for k, v in times.items()}
        row = {
            "size": rows * row_bytes,
            "rows": rows,
            "hidden": hidden,
            "type": dtype_name,
            "fused_us": best["fused"] * 1e6,
            "plain_us": best["plain"] * 1e6,
            "unfused_us": best["unfused"] * 1e6,
            "fallback_us": best["fallback"] * 1e6,
            "fused_over_plain": best["fused"] / best["plain"],
            "unfused_over_fused": best["unfused"] / best["fused"],
            "fallback_over_fused": best["fallback"] / best["fused"],
            "wrong": wrong,
            "path": (r.ar.fused_decline_reason(x, residual, weight) or r.ar.chosen_tactic(x)),
        }
        out.append(row)
        if rank == 0:
            print(_format_fused_row(row), flush=True)
    _finish(r, out, queue)


# ---------------------------------------------------------------- --collective
_COLLECTIVE_SEED = 2
# torch 2.14 renamed the tensor forms (the old names warn); older torch has only those.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _collective_wrong(
    r: Rank, got: torch.Tensor, collective: str, numel: int, dtype: torch.dtype, dtype_name: str
) -> int:
    """Wrong elements of one reduce-scatter (against the float64 sum, as count_wrong judges an
    all-reduce) or all-gather (bit for bit) of a message of `numel` elements."""
    chunk = numel // r.world
    got = got.cpu().reshape(-1)
    if collective == "all_gather":
        expected = torch.cat(
            [rank_input(q, chunk, dtype, seed=_COLLECTIVE_SEED) for q in range(r.world)]
        )
        return int((got.view(torch.uint8) != expected.view(torch.uint8)).sum().item())
    total, mag = reference(r.world, numel, dtype, _COLLECTIVE_SEED)
    mine = slice(r.ar.rank * chunk, (r.ar.rank + 1) * chunk)
    err = (got.double() - total[mine]).abs()
    return int((err > RTOL[dtype_name] * mag[mine] + 1e-6).sum().item())


def _collective_worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    """Per message size (the reduce-scatter's input, the all-gather's output): ours, our
    all-reduce of the same message and the group's own collective, interleaved in rounds."""
    collective, dtype_name = opts["collective"], opts["dtype"]
    dtype = DTYPES[dtype_name]
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = [
        s
        for s in sizes_between(opts["min_bytes"], opts["max_bytes"], opts["step_factor"], elem)
        if s % (16 * world) == 0
    ]
    r = set_up(rank, world, port, opts, max(sizes) // elem)
    rows = []
    for size in sizes:
        numel = size // elem
        chunk = numel // world
        if collective == "reduce_scatter":
            x = rank_input(rank, numel, dtype, seed=_COLLECTIVE_SEED).to(r.device)
            out = torch.empty(chunk, dtype=dtype, device=r.device)
            whole = x
        else:
            x = rank_input(rank, chunk, dtype, seed=_COLLECTIVE_SEED).to(r.device)
            out = torch.empty(numel, dtype=dtype, device=r.device)
            whole = torch.cat([x] * world)
        got = r.ar.reduce_scatter(x) if collective == "reduce_scatter" else r.ar.all_gather(x)
        r.ar.synchronize()
        wrong = _collective_wrong(r, got, collective, numel, dtype, dtype_name)
        fb_out = torch.empty_like(out)

        def ours() -> None:
            if collective == "reduce_scatter":
                r.ar.reduce_scatter(x, out=out)
            else:
                r.ar.all_gather(x, out=out)

        def all_reduce() -> None:
            r.ar.all_reduce(whole)

        def fallback() -> None:
            if collective == "reduce_scatter":
                _REDUCE_SCATTER(fb_out, x, group=r.group)
            else:
                _ALL_GATHER(fb_out, x, group=r.group)

        times: dict[str, list[float]] = {k: [] for k in ("ours", "all_reduce", "fallback")}
        for _ in range(opts["rounds"]):
            for name, fn in (("ours", ours), ("all_reduce", all_reduce), ("fallback", fallback)):
                times[name].append(_seconds_per_call(r, fn, opts))
        best = {k: min(v) for k, v in times.items()}
        row = {
            "size": size,
            "count": numel,
            "type": dtype_name,
            "collective": collective,
            "time_us": best["ours"] * 1e6,
            "all_reduce_us": best["all_reduce"] * 1e6,
            "fallback_us": best["fallback"] * 1e6,
            "over_all_reduce": best["ours"] / best["all_reduce"],
            "speedup": best["fallback"] / best["ours"],
            "wrong": wrong,
            "tactic": r.ar.chosen_collective_tactic(x, collective),
        }
        rows.append(row)
        if rank == 0:
            print(_format_collective_row(row), flush=True)
    _finish(r, rows, queue)


def _format_collective_row(r: dict[str, Any]) -> str:
    return (
        f"{r['size']:>10} {r['count']:>9} {r['type']:>5} {r['time_us']:>9.2f} "
        f"{r['all_reduce_us']:>9.2f} {r['fallback_us']:>9.2f} {r['over_all_reduce']:>8.2f}x "
        f"{r['speedup']:>8.2f}x {r['wrong']:>6}  {r['tactic']}"
    )


def _print_collective_header(transport: str, world: int, dtype_name: str, collective: str) -> None:
    fallback = "nccl" if transport in GPU_TRANSPORTS else "gloo"
    print(
        f"# pcie-allreduce bench --collective {collective}: transport={transport} "
        f"world={world} dtype={dtype_name} fallback={fallback} host={platform.node()} "
        f"cpus={os.cpu_count()} torch={torch.__version__}"
    )
    print(
        f"# size: the whole message (the reduce-scatter's input, the all-gather's output). "
        f"ours: {collective}; all_reduce: our all-reduce of the same message; fallback: "
        f"{fallback}'s {collective}. Best of interleaved rounds, us per call."
    )
    print(
        f"# {'size(B)':>8} {'count':>9} {'type':>5} {'ours':>9} {'all_red':>9} "
        f"{'fallback':>9} {'ours/ar':>9} {'fb/ours':>9} {'#wrong':>6}  tactic",
        flush=True,
    )


def _format_fused_row(r: dict[str, Any]) -> str:
    return (
        f"{r['size']:>10} {r['rows']:>5} {r['type']:>5} {r['fused_us']:>9.2f} "
        f"{r['plain_us']:>9.2f} {r['unfused_us']:>9.2f} {r['fallback_us']:>9.2f} "
        f"{r['fused_over_plain']:>8.2f}x {r['unfused_over_fused']:>8.2f}x "
        f"{r['fallback_over_fused']:>8.2f}x {r['wrong']:>6}  {r['path']}"
    )


def _print_fused_header(transport: str, world: int, dtype_name: str, hidden: int) -> None:
    fallback = "nccl" if transport in GPU_TRANSPORTS else "gloo"
    print(
        f"# pcie-allreduce bench --fused: transport={transport} world={world} "
        f"dtype={dtype_name} hidden={hidden} fallback={fallback} host={platform.node()} "
        f"cpus={os.cpu_count()} torch={torch.__version__}"
    )
    print(
        "# fused: all_reduce_add_rms_norm; plain: our all_reduce alone; unfused: our "
        f"all_reduce + torch add + rms_norm; fallback: {fallback} + torch add + rms_norm. "
        "Best of interleaved rounds, us per call."
    )
    print(
        f"# {'size(B)':>8} {'rows':>5} {'type':>5} {'fused':>9} {'plain':>9} {'unfused':>9} "
        f"{'fallback':>9} {'fus/plain':>9} {'unf/fus':>9} {'fb/fus':>9} {'#wrong':>6}  path",
        flush=True,
    )


def _format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['size']:>12} {r['count']:>10} {r['type']:>6} {r['time_us']:>10.2f} "
        f"{r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7} {r['fallback_us']:>12.2f} "
        f"{r['speedup']:>8.2f}x  {r['tactic']}"
    )


def _arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the size range, --table or --json, found before any rank starts."""
    if args.min_bytes > args.max_bytes:
        return "--min-bytes exceeds --max-bytes"
    if getattr(args, "fused", False):
        row = args.hidden * DTYPES[args.dtype].itemsize
        if args.hidden < 1 or row % 16:
            return (
                f"--hidden {args.hidden}: a row of {args.dtype} must be a positive multiple "
                "of 16 bytes"
            )
        if not any(
            args.min_bytes <= n * row <= args.max_bytes
            for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
        ):
            return (
                f"no batch of 1, 2, 4, ... 1024 rows of {row} bytes lies in --min-bytes "
                f"{args.min_bytes} .. --max-bytes {args.max_bytes}"
            )
    elem = DTYPES[args.dtype].itemsize
    collective = getattr(args, "collective", "all_reduce")
    if collective != "all_reduce" and getattr(args, "fused", False):
        return "--fused is the all-reduce's; it does not combine with --collective " + collective
    world = getattr(args, "world", None) or 2
    if collective != "all_reduce" and not any(
        s % (16 * world) == 0
        for s in sizes_between(args.min_bytes, args.max_bytes, args.step_factor, elem)
    ):
        return (
            f"no message size in --min-bytes {args.min_bytes} .. --max-bytes "
            f"{args.max_bytes} splits into {world} chunks of whole 16-byte vectors"
        )
    if not sizes_between(args.min_bytes, args.max_bytes, args.step_factor, elem):
        return (
            f"no message size in --min-bytes {args.min_bytes} .. --max-bytes {args.max_bytes}: "
            "sizes are multiples of 16 bytes; raise --max-bytes to at least 16"
        )
    if args.table is not None and not os.path.isfile(args.table):
        return f"--table {args.table!r}: no such file (expected a tuning-table CSV file)"
    return json_problem(args)


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


def main(args: argparse.Namespace) -> int:
    transport, world, why_not = transport_and_world(args)
    if why_not is None and args.graph and transport not in GPU_TRANSPORTS:
        why_not = (
            f"--graph needs GPUs (--transport {policy.CUDA_IPC}, {policy.CUDA_HOST} or "
            f"{policy.AUTO} with 2 GPUs)"
        )
    why_not = why_not or _arguments_problem(args)
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
    if args.collective != "all_reduce":
        opts["collective"], opts["rounds"] = args.collective, 5
        _print_collective_header(transport, world, args.dtype, args.collective)
        result = run_ranks(world, opts, _collective_worker)
    elif args.fused:
        opts["hidden"], opts["rounds"] = args.hidden, 5
        _print_fused_header(transport, world, args.dtype, args.hidden)
        result = run_ranks(world, opts, _fused_worker)
    else:
        _print_header(transport, world, args.dtype)
        result = run_ranks(world, opts, _worker)
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
