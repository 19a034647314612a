"""`pcie-allreduce` (also `python -m pcie_allreduce`): topo, bench, tune, doctor.

The command line of the tools (``pcie_allreduce.tools``): this module only parses arguments;
each command's module is imported when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from . import policy

_TRANSPORT_HELP = (
    f"{policy.AUTO} (default): GPUs when there are two ({policy.CUDA_IPC}, moving to "
    f"{policy.CUDA_HOST} when the P2P check fails), else {policy.HOST_SHM} (CPU processes); "
    f"{policy.CUDA_IPC}: GPUs over P2P only; {policy.CUDA_HOST}: GPUs through shared pinned "
    f"host memory even where P2P works. Aliases: "
    + ", ".join(f"{a} = {n}" for a, n in policy.ALIASES.items())
)


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b").rstrip("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _command(module: str) -> Callable[[argparse.Namespace], int]:
    """The ``main(args)`` of ``pcie_allreduce.tools.<module>``, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f".tools.{module}", __package__).main(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcie-allreduce", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("topo", help="topology, islands, fingerprint and schedule summaries")
    t.add_argument("--nvidia-smi-topo", metavar="FILE", help="parse this `nvidia-smi topo -m` text")
    t.add_argument("--json", action="store_true")
    t.add_argument(
        "--model-bytes",
        type=_parse_bytes,
        default=12288,
        metavar="BYTES",
        help="message size of the cost model's columns (default 12288: one decode "
        "row of 6144 bf16)",
    )
    t.set_defaults(func=_command("topo"))

    b = sub.add_parser("bench", help="ours vs the fallback, nccl-tests columns, verified")
    b.add_argument("--transport", default=policy.AUTO, help=_TRANSPORT_HELP)
    b.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on host)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    b.add_argument("--min-bytes", type=_parse_bytes, default=_parse_bytes("1K"))
    b.add_argument("--max-bytes", type=_parse_bytes, default=_parse_bytes("1M"))
    b.add_argument("--step-factor", type=int, default=2)
    b.add_argument("--iters", type=int, default=0, help="timed iterations (0 = adaptive)")
    b.add_argument("--warmup", type=int, default=5)
    b.add_argument("--table", help="tuning table CSV file (default: PCIE_ALLREDUCE_TABLE/seed)")
    b.add_argument("--graph", action="store_true", help="time under CUDA-graph replay (GPUs)")
    b.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    b.add_argument(
        "--fused",
        action="store_true",
        help="the fused all-reduce + residual add + RMSNorm, in rows of --hidden, "
        "beside our all-reduce alone, the unfused path (ours + torch add and "
        "rms_norm) and the fallback's",
    )
    b.add_argument("--hidden", type=int, default=4096, help="--fused: elements per row")
    b.add_argument(
        "--quant",
        choices=["fp8", "nvfp4"],
        default=None,
        help="--fused: quantise y (FP8 at a static scale, or NVFP4), timed beside the plain "
        "fused call, the unfused path with the quantisation in torch, and the fallback's",
    )
    b.add_argument(
        "--workspace",
        type=_parse_bytes,
        default=None,
        metavar="BYTES",
        help="all-reduce and --fused: the communicator's workspace (default: the largest "
        "message); larger messages stream through it in rounds",
    )
    b.add_argument(
        "--collective",
        choices=["all_reduce", "reduce_scatter", "all_gather"],
        default="all_reduce",
        help="reduce_scatter or all_gather (dim 0, per message size): ours beside "
        "our all-reduce of the same message and the fallback's own collective",
    )
    b.set_defaults(func=_command("bench"))

    u = sub.add_parser("tune", help="measure this host once and write its tuning cache")
    u.add_argument("--transport", default=policy.AUTO, help="as for bench")
    u.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on host)")
    u.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        action="append",
        help="dtype to tune (repeat for several; default: bf16, fp16 and fp32)",
    )
    u.add_argument(
        "--max-bytes",
        type=_parse_bytes,
        default=_parse_bytes("256K"),
        help="largest message tuned (default 256K); larger ones keep the seed's rows",
    )
    u.add_argument("--budget", type=float, default=120.0, help="seconds for the whole tune")
    u.add_argument("--force", action="store_true", help="measure even if a cache exists")
    u.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    u.set_defaults(func=_command("tune"))

    from .tools import doctor

    doctor.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:
        print(f"pcie-allreduce {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
