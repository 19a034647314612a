"""`pcie-allreduce bench --collective reduce_scatter|all_gather`: per message size (the
reduce-scatter's input, the all-gather's output), ours beside our all-reduce of the same message
and the group's own collective, interleaved in rounds, every result verified first."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...testing import DTYPES, RTOL, rank_input, reference
from ..ranks import Rank, set_up
from .measure import best_of_rounds, sizes_between
from .report import Report, fallback_name, print_run

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


def worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
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
    report = Report(r, _format_row)
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

        variants = {"ours": ours, "all_reduce": all_reduce, "fallback": fallback}
        best = best_of_rounds(r, variants, opts)
        report.add(
            {
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
        )
    report.finish(queue)


def _format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['size']:>10} {r['count']:>9} {r['type']:>5} {r['time_us']:>9.2f} "
        f"{r['all_reduce_us']:>9.2f} {r['fallback_us']:>9.2f} {r['over_all_reduce']:>8.2f}x "
        f"{r['speedup']:>8.2f}x {r['wrong']:>6}  {r['tactic']}"
    )


def print_header(transport: str, world: int, dtype_name: str, collective: str) -> None:
    fallback = fallback_name(transport)
    print_run(f" --collective {collective}", transport, world, dtype_name)
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
