"""Torch-level device check of the cuda_host transport (GPUs without peer-to-peer): PcieAllReduce
with every rank's workspace in POSIX shared memory pinned with cudaHostRegister, the same
kernels running over it.

Ranks are processes that share GPU 0 (two_ranks.run: world 2, then world 4), joined by a gloo
group. Without MPS their kernels time-slice the GPU, so this checks correctness and behaviour,
not latency: nothing here is timed (the loopback check's cuda_host table, pcie_gpu_check, is the
latency measurement). It covers:

  (a) transport="hostmem": stats()["transport"] == "cuda_host"; every table in TABLES (oneshot /
      twoshot x push / pull x staged / unstaged, and LL rows) x every dtype x several sizes,
      each call with new inputs, checked against the float64 reference and bitwise across
      ranks, the input untouched, and no call on the fallback;
  (b) CUDA-graph capture (inside ar.capture()) of three calls (three dtypes), replayed 100
      times with new inputs written before each replay, every replay checked (a flag and an
      LL table at world 2, the flag one at world 4);
  (c) the automatic switch: the P2P write-and-verify (construction.Builder.broken_pairs) faked to
      report rank 0 -> rank 1 broken; the default transport ("auto") moves to host memory and
      works, transport="p2p" declines no_p2p instead;
  (d) world 2 only: the timeout path (rank 1 withholds its call; rank 0 raises
      PcieAllReduceTimeout naming rank 1 within a 2 s timeout_s);
  (e) no /dev/shm/pcie_ar.* entry of these processes is left, after destroy() (each rank) and
      after every process has exited, the trapped one included (this script).

Prints PASS/FAIL lines; exits non-zero on failure. A world that runs past its deadline has its
ranks killed and fails.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import two_ranks

from pcie_allreduce.testing import DTYPES, count_wrong, rank_input

# Every flag tactic (oneshot / twoshot x push / pull x staged / unstaged) and the LL ones.
TABLES = {
    "oneshot/push/staged": "*,*,*,0,*,oneshot,push,1,4,256\n",
    "oneshot/push/unstaged": "*,*,*,0,*,oneshot,push,0,2,128\n",
    "oneshot/pull/staged": "*,*,*,0,*,oneshot,pull,1,8,256\n",
    "oneshot/pull/unstaged": "*,*,*,0,*,oneshot,pull,0,8,512\n",
    "twoshot/push/staged": "*,*,*,0,*,twoshot,push,1,4,1024\n",
    "twoshot/push/unstaged": "*,*,*,0,*,twoshot,push,0,16,256\n",
    "twoshot/pull/staged": "*,*,*,0,*,twoshot,pull,1,2,1024\n",
    "twoshot/pull/unstaged": "*,*,*,0,*,twoshot,pull,0,1,256\n",
    # LL up to the LL slots' capacity (256 KiB), the flag protocol above it.
    "oneshot/push/unstaged/ll": "*,*,*,0,262144,oneshot,push,0,8,256,ll\n"
    "*,*,*,0,*,oneshot,push,0,8,256\n",
    "twoshot/push/unstaged/ll": "*,*,*,0,262144,twoshot,push,0,4,512,ll\n"
    "*,*,*,0,*,twoshot,push,0,4,512\n",
}
# Each rank's segment holds (world + 3) x 2 data slots and as many LL slots (up to 2 x 256 KiB
# each): 1 << 16 keeps world 4's four segments near 42 MiB, inside a container's default 64 MiB
# /dev/shm.
MAX_NUMEL = 1 << 16
SIZES = (8, 1000, 4104, 1 << 15, 1 << 16)  # elements; 1 << 16 fp32 is past the LL rows (256 KiB)
# Flag (six staged waits per call at world 4) and LL; world 4 time-slices four processes, so
# only the first there.
GRAPH_TABLES = {2: ("twoshot/pull/staged", "oneshot/push/unstaged/ll"), 4: ("twoshot/pull/staged",)}
GRAPH_CALLS = (("bf16", 6144), ("fp16", 1000), ("fp32", 4104))  # captured in one graph
GRAPH_REPLAYS = 100
SHM_DIR = "/dev/shm"
SHM_PREFIX = "pcie_ar."
DEADLINE_S = {2: 100.0, 4: 120.0}  # per world; run.sh gives the whole script 240 s


def check(out: torch.Tensor, world: int, numel: int, name: str, seed: int = 0) -> None:
    """torch_check's check, gathering first: every rank then fails at the same point (all see
    the same bits), instead of one leaving the others blocked in the gather."""
    bits = out.cpu().contiguous().view(torch.uint8)
    everyone = [torch.empty_like(bits) for _ in range(world)]
    dist.all_gather(everyone, bits)
    if not all(torch.equal(everyone[0], e) for e in everyone):
        raise AssertionError("ranks got different bits")
    bad = count_wrong(out, world, numel, name, seed)
    if bad:
        raise AssertionError(f"{bad} of {numel} {name} elements off the float64 reference")


def shm_names(pid: int | None = None) -> set[str]:
    """The /dev/shm entries named pcie_ar.* (created by process `pid` when given: the names
    are "pcie_ar.<creator pid>.<random>.r<rank>")."""
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}."
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def fallback_calls(ar: Any) -> int:
    return int(ar.stats()["calls"].get("fallback", 0))


def forced_hostmem(rank: int, world: int, dev: torch.device, cls: Any) -> list[str]:
    """(a): every table x dtype x size on transport="hostmem"."""
    lines = []
    for index, (label, table) in enumerate(TABLES.items()):
        with cls(
            None, dev, max_numel=MAX_NUMEL, table=table, timeout_s=30, transport="hostmem"
        ) as ar:
            assert ar.enabled, ar.disabled_reason
            stats = ar.stats()
            assert stats["transport"] == "cuda_host", stats["transport"]
            left = shm_names(os.getpid())
            if left:  # unlinked once every rank has mapped it (retire_token)
                lines.append(f"FAIL {label}: still in {SHM_DIR} after construction: {sorted(left)}")
            calls = 0
            for name, dtype in DTYPES.items():
                for numel in SIZES:
                    seed = 10000 * world + 100 * index + calls  # new inputs on every call
                    x = rank_input(rank, numel, dtype, seed=seed).to(dev)
                    before = x.clone()
                    out = ar.all_reduce(x)
                    ar.synchronize()
                    assert torch.equal(x, before), f"{name} x {numel}: input modified"
                    check(out, world, numel, name, seed=seed)
                    calls += 1
            y = rank_input(rank, 4096, torch.float32, seed=99).to(dev)
            ar.all_reduce_(y)
            ar.synchronize()
            check(y, world, 4096, "fp32", seed=99)
            calls += 1
            stats = ar.stats()
            assert fallback_calls(ar) == 0, f"calls went to the fallback: {stats['calls']}"
            tactics = ", ".join(f"{k} x{v}" for k, v in sorted(stats["calls"].items()))
            lines.append(f"PASS {label}: {calls} checked calls on cuda_host ({tactics})")
    lines.append(f"     transport_detail: {stats['transport_detail']}")
    return lines


def graph_replay(rank: int, world: int, dev: torch.device, cls: Any, label: str) -> str:
    """(b): three calls captured in one graph, replayed with new inputs, every replay checked."""
    with cls(
        None, dev, max_numel=MAX_NUMEL, table=TABLES[label], timeout_s=30, transport="hostmem"
    ) as ar:
        assert ar.enabled, ar.disabled_reason
        assert ar.stats()["transport"] == "cuda_host", ar.stats()["transport"]
        xs = [torch.empty(n, dtype=DTYPES[name], device=dev) for name, n in GRAPH_CALLS]

        def load(i: int) -> None:
            for (name, n), x in zip(GRAPH_CALLS, xs):
                x.copy_(rank_input(rank, n, DTYPES[name], seed=500 + i))

        def verify(outs: list[torch.Tensor], i: int) -> None:
            for (name, n), out in zip(GRAPH_CALLS, outs):
                check(out, world, n, name, seed=500 + i)

        load(0)
        outs = [ar.all_reduce(x) for x in xs]  # warm up outside capture
        ar.synchronize()
        verify(outs, 0)
        graph = torch.cuda.CUDAGraph()
        with ar.capture(), torch.cuda.graph(graph):
            ys = [ar.all_reduce(x) for x in xs]
        for i in range(1, GRAPH_REPLAYS + 1):
            load(i)
            graph.replay()
            ar.synchronize()
            verify(ys, i)
        assert fallback_calls(ar) == 0, f"calls went to the fallback: {ar.stats()['calls']}"
        del graph
    return (
        f"PASS graph {label}: {len(GRAPH_CALLS)} calls captured, {GRAPH_REPLAYS} replays "
        "with new inputs, all checked"
    )


def automatic_switch(rank: int, world: int, dev: torch.device, cls: Any) -> list[str]:
    """(c): a failed P2P check moves the default transport to host memory; "p2p" declines."""
    from pcie_allreduce.construction import Builder

    lines = []
    real: Callable[[Any, Any], Any] = Builder.broken_pairs

    def broken_once(self: Any, comm: Any) -> Any:
        # The first write-and-verify (peer-to-peer) reports rank 0 -> rank 1 broken; any later
        # one (the check over host memory after the switch) is the real one.
        if getattr(self, "_hostmem_check_broke", False):
            return real(self, comm)
        self._hostmem_check_broke = True
        return [(0, 1)]

    Builder.broken_pairs = broken_once
    try:
        table = TABLES["oneshot/push/staged"]
        with cls(None, dev, max_numel=1 << 14, table=table, timeout_s=30) as ar:
            stats = ar.stats()
            assert ar.enabled, ar.disabled_reason
            assert stats["transport"] == "cuda_host", stats["transport"]
            detail = stats["transport_detail"]
            assert "rank 0 -> rank 1" in detail, detail
            x = rank_input(rank, 4096, torch.bfloat16, seed=300).to(dev)
            out = ar.all_reduce(x)
            ar.synchronize()
            check(out, world, 4096, "bf16", seed=300)
            assert fallback_calls(ar) == 0, f"calls went to the fallback: {ar.stats()['calls']}"
            lines.append(f"PASS automatic switch to cuda_host: {detail}")
        with cls(None, dev, max_numel=1 << 14, table=table, timeout_s=30, transport="p2p") as ar:
            assert not ar.enabled, "transport p2p stayed enabled after a failed P2P check"
            reason = ar.disabled_reason or ""
            assert reason.startswith("no_p2p"), reason
            x = rank_input(rank, 4096, torch.bfloat16, seed=301).to(dev)
            out = ar.all_reduce(x)  # the group's all-reduce
            ar.synchronize()
            check(out, world, 4096, "bf16", seed=301)
            lines.append(f"PASS transport p2p declines: {reason}")
    finally:
        Builder.broken_pairs = real
    return lines


def body(rank: int, world: int) -> list[str]:
    from pcie_allreduce import PcieAllReduce

    lines = [f"rank {rank} pid {os.getpid()}"]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    lines += forced_hostmem(rank, world, dev, PcieAllReduce)
    for label in GRAPH_TABLES[world]:
        lines.append(graph_replay(rank, world, dev, PcieAllReduce, label))
    lines += automatic_switch(rank, world, dev, PcieAllReduce)
    # (e) Every communicator above is destroyed: none of our names may be left.
    left = shm_names(os.getpid())
    lines.append(
        f"{'FAIL' if left else 'PASS'} {SHM_DIR} after destroy(): "
        f"{sorted(left) if left else 'nothing of this process left'}"
    )
    if world != 2:
        return lines
    # (d) Timeout: rank 1 never calls; rank 0's kernel traps and names it.
    ar = PcieAllReduce(
        None,
        dev,
        max_numel=1024,
        timeout_s=2.0,
        table=TABLES["oneshot/push/staged"],
        transport="hostmem",
    )
    assert ar.stats()["transport"] == "cuda_host", ar.stats()["transport"]
    return two_ranks.timeout_path(rank, ar, dev, lines)


def _kill_ranks(world: int, deadline_s: float) -> None:
    print(
        f"FAIL world {world}: still running after {deadline_s:.0f} s; killing its ranks", flush=True
    )
    for p in multiprocessing.active_children():  # the ranks two_ranks.run started
        p.kill()


def run_world(world: int) -> bool:
    """One two_ranks.run of `world` ranks, bounded by DEADLINE_S[world] in all (two_ranks joins
    its ranks one after another, each for up to its timeout), then the /dev/shm check."""
    before = shm_names()
    deadline = DEADLINE_S[world]
    watchdog = threading.Timer(deadline, _kill_ranks, args=(world, deadline))
    watchdog.daemon = True
    watchdog.start()
    try:
        ok = (
            two_ranks.run(body, f"hostmem check, world {world}", world=world, timeout_s=deadline)
            == 0
        )
    finally:
        watchdog.cancel()
    left = shm_names() - before
    if left:
        print(f"FAIL world {world}: left in {SHM_DIR} after every rank exited: {sorted(left)}")
    else:
        print(f"PASS world {world}: nothing new in {SHM_DIR} after every rank exited")
    return ok and not left


def main() -> int:
    # The automatic switch is checked with the default transport: no override from outside.
    os.environ.pop("PCIE_ALLREDUCE_TRANSPORT", None)
    try:
        fs = os.statvfs(SHM_DIR)
        print(
            f"{SHM_DIR}: {fs.f_bavail * fs.f_frsize / 2**20:.0f} MiB free of "
            f"{fs.f_blocks * fs.f_frsize / 2**20:.0f} MiB"
        )
    except OSError as error:
        print(f"{SHM_DIR}: {error}")
    results = [run_world(world) for world in (2, 4)]
    ok = all(results)
    print("hostmem check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
