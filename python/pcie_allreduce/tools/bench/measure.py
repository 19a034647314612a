"""What every bench mode measures with: the message sizes, seconds per call (the slowest
rank's, after warm-up, under CUDA-graph replay with --graph), the best of interleaved rounds,
and the check that every rank got the same bits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..ranks import Rank


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


def seconds_per_call(r: Rank, fn: Callable[[], None], opts: dict[str, Any]) -> float:
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


def best_of_rounds(
    r: Rank, variants: dict[str, Callable[[], None]], opts: dict[str, Any]
) -> dict[str, float]:
    """Each variant's best seconds per call over ``opts["rounds"]`` rounds, the variants
    interleaved in every round: a slow phase of the machine hits every variant alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(opts["rounds"]):
        for name, fn in variants.items():
            times[name].append(seconds_per_call(r, fn, opts))
    return {name: min(t) for name, t in times.items()}


def ranks_differ(r: Rank, *results: torch.Tensor) -> bool:
    """Whether any rank's results differ from the others' in their bits (a checksum of each
    rank's results, gathered): tensor-parallel replicas diverge unless every rank gets the
    same bits."""
    bits = 0
    for result in results:
        as_int = torch.int16 if result.element_size() == 2 else torch.int32
        bits += int(result.cpu().view(as_int).long().sum().item())
    all_bits = [torch.zeros(1, dtype=torch.int64) for _ in range(r.world)]
    dist.all_gather(all_bits, torch.tensor([bits], dtype=torch.int64), group=r.cpu_group)
    return len({int(b.item()) for b in all_bits}) != 1
