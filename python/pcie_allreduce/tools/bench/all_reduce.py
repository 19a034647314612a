"""`pcie-allreduce bench` (the default mode): per message size, our all-reduce beside the
group's own on the same input, in nccl-tests columns, every result verified first."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...testing import DTYPES, count_wrong, rank_input
from ..ranks import Rank, set_up
from .measure import ranks_differ, seconds_per_call, sizes_between
from .report import Report, print_run


def _verify(r: Rank, x: torch.Tensor, dtype_name: str) -> int:
    """Wrong elements of one all-reduce of x (at least 1 if the ranks' bits differ)."""
    out = r.ar.all_reduce(x)
    r.ar.synchronize()
    wrong = count_wrong(out, r.world, x.numel(), dtype_name)
    if ranks_differ(r, out):
        wrong = max(wrong, 1)
    return wrong


def _time_ours_and_fallback(r: Rank, x: torch.Tensor, opts: dict[str, Any]) -> tuple[float, float]:
    """Seconds per call of ours and of the group's own all-reduce, on the same input."""
    scratch = x.clone()

    def ours() -> None:
        r.ar.all_reduce(x)

    def fallback() -> None:
        scratch.copy_(x)
        dist.all_reduce(scratch, group=r.group)

    return seconds_per_call(r, ours, opts), seconds_per_call(r, fallback, opts)


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


def worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
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
    report = Report(r, _format_row)
    for size in sizes:
        numel = size // elem
        x = rank_input(rank, numel, dtype).to(r.device)
        wrong = _verify(r, x, dtype_name)
        tactic = r.ar.chosen_tactic(x)
        t_ours, t_fb = _time_ours_and_fallback(r, x, opts)
        report.add(_row(size, numel, world, dtype_name, wrong, tactic, t_ours, t_fb))
    report.finish(queue)


def _format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['size']:>12} {r['count']:>10} {r['type']:>6} {r['time_us']:>10.2f} "
        f"{r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7} {r['fallback_us']:>12.2f} "
        f"{r['speedup']:>8.2f}x  {r['tactic']}"
    )


def print_header(transport: str, world: int, dtype_name: str) -> None:
    print_run("", transport, world, dtype_name)
    print(
        f"# {'':>34} {'pcie_allreduce':^36} {'fallback':>12}\n"
        f"# {'size(B)':>10} {'count':>10} {'type':>6} {'time(us)':>10} {'algbw':>8} "
        f"{'busbw':>8} {'#wrong':>7} {'time(us)':>12} {'speedup':>9}  tactic",
        flush=True,
    )
