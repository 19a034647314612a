"""What the CLI's rank-spawning commands (bench, tune) share: the transport and world a request
names on this machine, the ranks spawned (one process each, joined by a process group) and each
rank's communicator."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import policy
from ..testing import DTYPES

# What runs on GPUs: auto (cuda_ipc, moving to cuda_host when the P2P check fails), cuda_ipc
# (declines no_p2p instead), cuda_host (host memory even where P2P works).
GPU_TRANSPORTS = policy.CUDA_MODES


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Rank:
    """One spawned rank: its groups, device and communicator."""

    world: int
    group: Any
    cpu_group: Any  # gloo: object exchange and barriers
    device: torch.device
    ar: Any
    sync: Callable[[], None]


def set_up(rank: int, world: int, port: int, opts: dict[str, Any], max_numel: int) -> Rank:
    """Joins the process group and builds the communicator for `max_numel` elements: its
    workspace, or with ``opts["workspace"]`` (bytes) a smaller one that the larger messages
    stream through."""
    torch.set_num_threads(1)
    stream = None
    if opts.get("workspace"):
        elem = torch.tensor([], dtype=DTYPES[opts["dtype"]]).element_size()
        small = max(8, opts["workspace"] // elem // 8 * 8)
        if small < max_numel:
            stream, max_numel = max_numel, small
    cuda = opts["transport"] in GPU_TRANSPORTS
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    from ..communicator import PcieAllReduce

    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo") if cuda else group
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    # auto: the communicator's own choice (PCIE_ALLREDUCE_TRANSPORT, else auto).
    forced = opts["transport"] if opts["transport"] in (policy.CUDA_IPC, policy.CUDA_HOST) else None
    ar = PcieAllReduce(
        group,
        device,
        max_numel=max_numel,
        table=opts["table"],
        cpu_group=cpu_group,
        transport=forced,
        stream_max_numel=stream,
    )
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    return Rank(world, group, cpu_group, device, ar, sync)


def transport_and_world(args: argparse.Namespace) -> tuple[str, int, str | None]:
    """(transport, world, why not): why not is None when this machine can run the request.
    The transport is host_shm or one of GPU_TRANSPORTS (auto: GPUs when there are two)."""
    try:
        transport = policy.canonical(args.transport, "--transport")
    except ValueError as error:
        return policy.AUTO, 0, str(error)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if transport == policy.AUTO and gpus < 2:
        transport = policy.HOST_SHM
    if transport in GPU_TRANSPORTS:
        if gpus < 2:
            return (
                transport,
                0,
                (
                    f"--transport {args.transport} needs at least 2 GPUs (transport {transport}), "
                    f"found {gpus}; use --transport {policy.HOST_SHM} on this machine"
                ),
            )
        world = min(gpus, 8) if args.world is None else args.world
        if world > gpus:
            return transport, world, f"--world {world} > {gpus} GPUs"
    else:
        world = 2 if args.world is None else args.world
    if not 2 <= world <= 8:
        return transport, world, f"--world must be in 2..8, got {world}"
    return transport, world, None


def json_problem(args: argparse.Namespace) -> str | None:
    """--json must name a file in a writable folder: found before the run, not after it."""
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return f"--json {args.json!r}: folder {folder!r} does not exist or is not writable"
    return None


def run_ranks(
    world: int, opts: dict[str, Any], target: Callable[..., None]
) -> dict[str, Any] | None:
    """Spawns the ranks; rank 0's result, or None (said on stderr) if any rank failed."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
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
