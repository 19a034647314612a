"""`pcie-allreduce bench --fused`: per batch of rows of --hidden, the fused all-reduce +
residual add + RMSNorm beside our all-reduce alone, the unfused path (ours + torch add and
rms_norm) and the fallback's, interleaved in rounds, every result verified first.

With ``--quant fp8|nvfp4`` the fused call quantises y (``all_reduce_rms_norm(quant=...)``): it is
timed beside the plain fused call, the unfused path (ours + torch add and rms_norm + the engine's
quantisation written in torch) and the fallback's, and its bytes are verified against that
quantisation of the plain fused call's y (which is verified against float64)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...testing import DTYPES, fp8_static_quant, fused_float64, nvfp4_quant, rank_input
from ..ranks import Rank, set_up
from .measure import best_of_rounds, ranks_differ
from .report import Report, fallback_name, print_run

BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # the batches timed, in rows
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
    return max(wrong, 1) if ranks_differ(r, y, res_out) else wrong


# The static scales of the quantised forms: FP8's per-tensor scale and NVFP4's global scale
# (448 * 6 / amax) for rms-normalised rows of standard-normal weights (|y| up to about 5).
_SCALES = {"fp8": 5.0 / 448.0, "nvfp4": 448.0 * 6.0 / 5.0}


def _quantised(y: torch.Tensor, quant: str, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The engine's quantisation of y, in torch (what the quantised fused call must equal)."""
    return (fp8_static_quant(y, scale),) if quant == "fp8" else nvfp4_quant(y, scale)


def _quant_wrong(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the quantised outputs that differ from the reference's."""
    return sum(
        int((g.cpu().view(torch.uint8) != w.cpu().view(torch.uint8)).sum().item())
        for g, w in zip(got, want, strict=True)
    )


def worker(rank: int, world: int, port: int, opts: dict[str, Any], queue: Any) -> None:
    """Times the fused call (``--quant``: the quantised fused call, beside the plain fused one
    instead of our all-reduce alone) with the unfused path and the fallback, which end with the
    engine's quantisation in torch when there is one."""
    dtype_name, hidden, quant = opts["dtype"], opts["hidden"], opts.get("quant")
    dtype = DTYPES[dtype_name]
    row_bytes = hidden * torch.tensor([], dtype=dtype).element_size()
    rows_list = [n for n in BATCH_ROWS if opts["min_bytes"] <= n * row_bytes <= opts["max_bytes"]]
    r = set_up(rank, world, port, opts, max(rows_list) * hidden)
    g = torch.Generator().manual_seed(12345)  # the residual stream and weight: replicated
    weight = torch.randn(hidden, generator=g).to(dtype).to(r.device)
    scale = None
    if quant:
        scale = torch.tensor([_SCALES[quant]], dtype=torch.float32, device=r.device)
    subject = "quant" if quant else "fused"  # the timed call's name in the row
    report = Report(r, _format_quant_row if quant else _format_row)
    for rows in rows_list:
        xs = [rank_input(q, rows * hidden, dtype).view(rows, hidden) for q in range(world)]
        x = xs[rank].to(r.device)
        residual = torch.randn(rows, hidden, generator=g).to(dtype).to(r.device)
        y, res_out = r.ar.all_reduce_add_rms_norm(x, residual, weight, _EPS)
        got = None
        if quant:
            got = r.ar.all_reduce_rms_norm(
                x, weight, _EPS, residual=residual, quant=quant, scale=scale
            )
        r.ar.synchronize()
        wrong = _fused_wrong(r, y, res_out, xs, residual, weight, dtype_name)
        if got is not None:
            assert quant is not None and scale is not None
            wrong += _quant_wrong((got[0], *got[2:]), _quantised(y.cpu(), quant, scale.cpu()))
            wrong += int(not torch.equal(got[1], res_out))
            wrong = max(wrong, 1) if ranks_differ(r, *got) else wrong
        scratch = x.clone()

        def normed(s: torch.Tensor) -> None:  # the unfused paths' end: norm (and quantisation)
            n = torch.nn.functional.rms_norm(s + residual, (hidden,), weight, _EPS)
            if quant:
                assert scale is not None
                _quantised(n, quant, scale)

        def fused() -> None:
            r.ar.all_reduce_add_rms_norm(x, residual, weight, _EPS)

        def quantised() -> None:
            r.ar.all_reduce_rms_norm(x, weight, _EPS, residual=residual, quant=quant, scale=scale)

        def plain() -> None:
            r.ar.all_reduce(x)

        def unfused() -> None:
            normed(r.ar.all_reduce(x))

        def fallback() -> None:
            scratch.copy_(x)
            dist.all_reduce(scratch, group=r.group)
            normed(scratch)

        variants = (
            {"quant": quantised, "plain": fused} if quant else {"fused": fused, "plain": plain}
        )
        best = best_of_rounds(r, {**variants, "unfused": unfused, "fallback": fallback}, opts)
        if quant:
            op = f"all_reduce_add_rms_norm_{quant}"
            path = r.ar.decline(op, x, weight) or r.ar.tactic(op, x, weight)
        else:
            path = r.ar.fused_decline_reason(x, residual, weight) or r.ar.chosen_tactic(x)
        row = {
            "size": rows * row_bytes,
            "rows": rows,
            "hidden": hidden,
            "type": dtype_name,
            **({"quant": quant} if quant else {}),
            f"{subject}_us": best[subject] * 1e6,
            "plain_us": best["plain"] * 1e6,
            "unfused_us": best["unfused"] * 1e6,
            "fallback_us": best["fallback"] * 1e6,
            f"{subject}_over_plain": best[subject] / best["plain"],
            f"unfused_over_{subject}": best["unfused"] / best[subject],
            f"fallback_over_{subject}": best["fallback"] / best[subject],
            "wrong": wrong,
            "path": path,
        }
        report.add(row)
    report.finish(queue)


def _format(r: dict[str, Any], subject: str) -> str:
    return (
        f"{r['size']:>10} {r['rows']:>5} {r['type']:>5} {r[subject + '_us']:>9.2f} "
        f"{r['plain_us']:>9.2f} {r['unfused_us']:>9.2f} {r['fallback_us']:>9.2f} "
        f"{r[subject + '_over_plain']:>8.2f}x {r['unfused_over_' + subject]:>8.2f}x "
        f"{r['fallback_over_' + subject]:>8.2f}x {r['wrong']:>6}  {r['path']}"
    )


def _format_row(r: dict[str, Any]) -> str:
    return _format(r, "fused")


def _format_quant_row(r: dict[str, Any]) -> str:
    return _format(r, "quant")


def print_header(transport: str, world: int, dtype_name: str, hidden: int) -> None:
    fallback = fallback_name(transport)
    print_run(" --fused", transport, world, dtype_name, f" hidden={hidden}")
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


def print_quant_header(
    transport: str, world: int, dtype_name: str, hidden: int, quant: str
) -> None:
    fallback = fallback_name(transport)
    print_run(f" --fused --quant {quant}", transport, world, dtype_name, f" hidden={hidden}")
    print(
        f"# quant: all_reduce_add_rms_norm_{quant}; plain: all_reduce_add_rms_norm (y not "
        "quantised); "
        f"unfused: our all_reduce + torch add + rms_norm + {quant} quantisation in torch; "
        f"fallback: {fallback} + the same. Best of interleaved rounds, us per call."
    )
    print(
        f"# {'size(B)':>8} {'rows':>5} {'type':>5} {'quant':>9} {'plain':>9} {'unfused':>9} "
        f"{'fallback':>9} {'q/plain':>9} {'unf/q':>9} {'fb/q':>9} {'#wrong':>6}  path",
        flush=True,
    )
