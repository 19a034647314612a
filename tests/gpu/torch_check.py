"""Torch-level device check: PcieAllReduce on CUDA tensors through the real cuda_ipc transport.

Two processes share GPU 0 (CUDA IPC handles between processes of one device are real IPC),
joined by a gloo group, so one GPU exercises construction, handle exchange, the torch ops,
CUDA-graph capture and replay, declines, destroy(), and the timeout path that turns a trapped
kernel into PcieAllReduceTimeout. Without MPS the two processes' kernels time-slice, so the
latencies printed here are not PCIe numbers. Prints PASS/FAIL lines; exits non-zero on failure.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import two_ranks

from pcie_allreduce.testing import DTYPES, count_wrong, rank_input

TABLES = {
    "oneshot/push/staged": "*,*,*,0,*,oneshot,push,1,4,256\n",
    "oneshot/pull/unstaged": "*,*,*,0,*,oneshot,pull,0,8,512\n",
    "twoshot/push/unstaged": "*,*,*,0,*,twoshot,push,0,16,256\n",
    "twoshot/pull/staged": "*,*,*,0,*,twoshot,pull,1,2,1024\n",
    # LL up to the LL slots' capacity (256 KiB), the flag protocol above it.
    "oneshot/push/unstaged/ll": "*,*,*,0,262144,oneshot,push,0,8,256,ll\n"
    "*,*,*,0,*,oneshot,push,0,8,256\n",
    "twoshot/push/unstaged/ll": "*,*,*,0,262144,twoshot,push,0,4,512,ll\n"
    "*,*,*,0,*,twoshot,push,0,4,512\n",
}


def check(out: torch.Tensor, world: int, numel: int, name: str, seed: int = 0) -> None:
    bad = count_wrong(out, world, numel, name, seed)
    if bad:
        raise AssertionError(f"{bad} of {numel} {name} elements off the float64 reference")
    bits = out.cpu().contiguous().view(torch.uint8)
    everyone = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(everyone, bits)
    if not all(torch.equal(everyone[0], e) for e in everyone):
        raise AssertionError("ranks got different bits")


def body(rank: int, world: int) -> list[str]:
    from pcie_allreduce import PcieAllReduce

    lines = []
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    for label, table in TABLES.items():
        with PcieAllReduce(None, dev, max_numel=1 << 17, table=table, timeout_s=30) as ar:
            assert ar.enabled, ar.disabled_reason
            calls = 0
            for name, dtype in DTYPES.items():
                for numel in (8, 1000, 4104, 1 << 16, 1 << 17):
                    x = rank_input(rank, numel, dtype, seed=calls).to(dev)
                    before = x.clone()
                    out = ar.all_reduce(x)
                    ar.synchronize()
                    assert torch.equal(x, before), "input modified"
                    check(out, world, numel, name, seed=calls)
                    calls += 1
            y = rank_input(rank, 4096, torch.float32, seed=99).to(dev)
            ar.all_reduce_(y)
            ar.synchronize()
            check(y, world, 4096, "fp32", seed=99)
            # CUDA graph: capture one call, replay with new inputs written before each replay.
            x = torch.empty(12288 // 2, dtype=torch.bfloat16, device=dev)
            x.copy_(rank_input(rank, x.numel(), torch.bfloat16, seed=0))
            ar.all_reduce(x)  # warm up outside capture
            ar.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = ar.all_reduce(x)
            for i in range(1, 41):
                x.copy_(rank_input(rank, x.numel(), torch.bfloat16, seed=i))
                graph.replay()
                ar.synchronize()
                check(y, world, x.numel(), "bf16", seed=i)
            # Time eager calls (processes time-slice one GPU: protocol + scheduling, not PCIe).
            z = rank_input(rank, 6144, torch.bfloat16).to(dev)
            dist.barrier()
            ar.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                ar.all_reduce(z)
            ar.synchronize()
            us = (time.perf_counter() - start) / 50 * 1e6
            stats = ar.stats()
            lines.append(
                f"PASS {label}: {calls + 41} checked calls + graph x40; 12 KiB eager "
                f"{us:.1f} us/call (time-sliced); calls={stats['calls']}"
            )
    # Reduce-scatter and all-gather on CUDA tensors: every tactic family, dim 0,
    # eager and under CUDA-graph replay; the reduce-scatter is its rows of the all-reduce's
    # bits, the all-gather every rank's bits; bytes after a one-chunk output stay untouched.
    for label, table in (
        ("flat lamport", "*,*,*,0,*,oneshot,push,0,8,256,lamport\n"),
        ("flat flag pull", "*,*,*,0,*,twoshot,pull,1,4,512\n"),
    ):
        with PcieAllReduce(None, dev, max_numel=1 << 17, table=table) as ar:
            checked = 0
            for dtype in DTYPES.values():
                for rows in (1, 3, 16):
                    x = rank_input(rank, 2 * rows * 4096, dtype, seed=rows).to(dev)
                    x = x.view(2 * rows, 4096)
                    room = torch.full((rows + 1, 4096), 7, dtype=dtype, device=dev)
                    part = ar.reduce_scatter(x, out=room[:rows])
                    whole = ar.all_reduce(x)
                    gathered = ar.all_gather(x[rows * rank : rows * (rank + 1)])
                    ar.synchronize()
                    assert torch.equal(part, whole[rows * rank : rows * (rank + 1)]), label
                    assert bool((room[rows] == 7).all()), f"{label}: wrote past its output"
                    inputs = [
                        rank_input(q, 2 * rows * 4096, dtype, seed=rows).view(2 * rows, 4096)
                        for q in range(world)
                    ]
                    expected = torch.cat(
                        [inputs[q][rows * q : rows * (q + 1)] for q in range(world)]
                    )
                    assert torch.equal(gathered.cpu(), expected), label
                    checked += 1
            x = torch.empty(2 * 3, 4096, dtype=torch.bfloat16, device=dev)
            x.copy_(rank_input(rank, x.numel(), torch.bfloat16, seed=5).view(2 * 3, 4096))
            ar.reduce_scatter(x)  # warm up outside capture
            ar.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                part = ar.reduce_scatter(x)
                gathered = ar.all_gather(part)
            for i in range(1, 21):
                x.copy_(rank_input(rank, x.numel(), torch.bfloat16, seed=300 + i).view(6, 4096))
                graph.replay()
                ar.synchronize()
                whole = ar.all_reduce(x)
                ar.synchronize()
                assert torch.equal(gathered, whole), f"{label}: graph replay {i}"
            lines.append(
                f"PASS collectives {label}: {checked} eager checks + graph x20; "
                f"{ar.stats()['collectives']}"
            )
    # Calls that switch streams with no wait between the streams: the communicator orders each
    # call after the previous stream's calls (an event), so no two run one generation at once.
    ll_table = TABLES["oneshot/push/unstaged/ll"]
    with PcieAllReduce(None, dev, max_numel=1 << 14, table=ll_table) as ar:
        side = torch.cuda.Stream(dev)
        inputs = [rank_input(rank, 4096, torch.bfloat16, seed=200 + i).to(dev) for i in range(20)]
        torch.cuda.synchronize(dev)
        outs = []
        for i, x in enumerate(inputs):
            with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream(dev)):
                outs.append(ar.all_reduce(x))
        torch.cuda.synchronize(dev)
        ar.synchronize()
        for i, out in enumerate(outs):
            check(out, world, 4096, "bf16", seed=200 + i)
        lines.append("PASS stream switches: 20 calls alternating two streams")
    # Declines go to the group's all-reduce and leave the input alone.
    # The self-test before serving, on the GPU with the seed table: every case bit-exact.
    with PcieAllReduce(None, dev, max_numel=65536) as ar:
        report = ar.stats()["self_test"]
        assert report["cases"] > 0 and report["failed"] == [], report
        lines.append(
            f"PASS self-test: {report['cases']} (op, dtype, tactic) cases bit-exact in "
            f"{report['seconds']:.2f} s"
        )
    with PcieAllReduce(None, dev, max_numel=1024) as ar:
        big = rank_input(rank, 4096, torch.float32).to(dev)
        before = big.clone()
        assert ar.decline_reason(big) == "too_large"
        out = ar.all_reduce(big)
        assert torch.equal(big, before)
        check(out, world, 4096, "fp32")
        assert ar.decline_reason(big.cpu()) == "device"
        try:  # a tensor on the wrong device is a programming error: it raises, it never declines
            ar.all_reduce(big.cpu())
            raise AssertionError("a CPU tensor was accepted by a CUDA communicator")
        except ValueError as error:
            assert "this communicator runs on cuda:0" in str(error), error
        lines.append(f"PASS declines: {ar.stats()['declines']}")
    # Timeout: rank 1 never calls; rank 0's kernel traps and names it (two_ranks.timeout_path).
    ar = PcieAllReduce(
        None, dev, max_numel=1024, timeout_s=2.0, table=TABLES["oneshot/push/staged"]
    )
    return two_ranks.timeout_path(rank, ar, dev, lines)


def main() -> int:
    return two_ranks.run(body, "torch check", world=2, timeout_s=300)


if __name__ == "__main__":
    sys.exit(main())
