"""`pcie-allreduce bench`: spawns its own ranks, verifies every result against a float64
reference, and prints nccl-tests columns for pcie_allreduce beside the fallback (gloo on the
host transport, NCCL on GPUs) measured in the same run.

This module is the command: its arguments checked before any rank starts, the mode run, the
verdict. Each mode is a module with its rank's work, its verification and its columns
(``all_reduce``, ``fused``, ``collective``); ``measure`` is what they all time with."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ... import policy
from ...testing import DTYPES
from ..ranks import GPU_TRANSPORTS, json_problem, run_ranks, transport_and_world
from . import all_reduce, collective, fused
from .measure import sizes_between

__all__ = ["main", "sizes_between"]


def _arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the size range, --table or --json, found before any rank starts."""
    if args.min_bytes > args.max_bytes:
        return "--min-bytes exceeds --max-bytes"
    quant = getattr(args, "quant", None)
    if quant and not getattr(args, "fused", False):
        return "--quant quantises the fused call's y: it needs --fused"
    if quant == "nvfp4" and (args.dtype == "fp32" or args.hidden % 16):
        return "--quant nvfp4 needs --dtype bf16 or fp16 and --hidden a multiple of 16"
    if getattr(args, "fused", False):
        row = args.hidden * DTYPES[args.dtype].itemsize
        if args.hidden < 1 or row % 16:
            return (
                f"--hidden {args.hidden}: a row of {args.dtype} must be a positive multiple "
                "of 16 bytes"
            )
        if not any(args.min_bytes <= n * row <= args.max_bytes for n in fused.BATCH_ROWS):
            return (
                f"no batch of 1, 2, 4, ... 1024 rows of {row} bytes lies in --min-bytes "
                f"{args.min_bytes} .. --max-bytes {args.max_bytes}"
            )
    elem = DTYPES[args.dtype].itemsize
    collective_name = getattr(args, "collective", "all_reduce")
    if collective_name != "all_reduce" and getattr(args, "fused", False):
        return (
            "--fused is the all-reduce's; it does not combine with --collective " + collective_name
        )
    world = getattr(args, "world", None) or 2
    if collective_name != "all_reduce" and not any(
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
        "workspace": args.workspace,
    }
    if args.collective != "all_reduce":
        opts["collective"], opts["rounds"] = args.collective, 5
        collective.print_header(transport, world, args.dtype, args.collective)
        result = run_ranks(world, opts, collective.worker)
    elif args.fused:
        opts["hidden"], opts["rounds"] = args.hidden, 5
        opts["quant"] = getattr(args, "quant", None)
        if opts["quant"]:
            fused.print_quant_header(transport, world, args.dtype, args.hidden, opts["quant"])
        else:
            fused.print_header(transport, world, args.dtype, args.hidden)
        result = run_ranks(world, opts, fused.worker)
    else:
        all_reduce.print_header(transport, world, args.dtype)
        result = run_ranks(world, opts, all_reduce.worker)
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
