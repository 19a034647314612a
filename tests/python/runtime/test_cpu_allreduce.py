"""The CPU all-reduce's call path: the reduce kernels chosen per process (results identical
whichever runs), the GIL free while a rank waits for its peers, and no allocation in place."""

from __future__ import annotations

import time

import torch
from conftest import run_ranks

from pcie_allreduce import _C
from pcie_allreduce.testing import rank_input


def _special_inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values with NaNs, infinities and subnormals mixed in, different per rank."""
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-20, 20, (numel,), generator=g))
    x[3 + rank :: 89] = float("inf")
    x[5::83] = -float("inf")
    x[7::71] = torch.finfo(dtype).tiny / 4  # subnormal in dtype
    x[rank::97] = float("nan")
    return x.to(dtype)


def _results(rank, world, sizes):
    from pcie_allreduce import PcieAllReduce

    out = {}
    with PcieAllReduce(None, "cpu", max_numel=max(sizes)) as ar:
        for name, dtype in (
            ("bf16", torch.bfloat16),
            ("fp16", torch.float16),
            ("fp32", torch.float32),
        ):
            for numel in sizes:
                x = _special_inputs(rank, numel, dtype)
                y = ar.all_reduce(x)
                assert ar.chosen_tactic(x) != "fallback"
                out[(name, numel)] = y.view(torch.int16 if dtype != torch.float32 else torch.int32)
        return {"bits": out, "host_reduce": ar.stats()["host_reduce"]}


def test_every_reduce_kernel_gives_the_same_bits(clean_shm):
    """Each ISA the CPU runs, chosen with PCIE_ALLREDUCE_HOST_REDUCE, in its own processes:
    every rank's result is bitwise the same across ISAs (NaN sums are the canonical NaN),
    for sizes that take oneshot and twoshot and end in a vector tail."""
    world = 3  # three operands per sum; oneshot and twoshot
    isas = _C.host_reduce_isas()
    assert isas[0] == "scalar"
    sizes = [8, 8 * 37, 4104, 40000]
    runs = {}
    for isa in isas:
        results = run_ranks(_results, world, sizes, env={"PCIE_ALLREDUCE_HOST_REDUCE": isa})
        assert [r["value"]["host_reduce"] for r in results] == [isa] * world
        runs[isa] = [r["value"]["bits"] for r in results]
    reference = runs["scalar"]
    for isa, ranks in runs.items():
        for rank, bits in enumerate(ranks):
            for key, tensor in bits.items():
                assert torch.equal(tensor, reference[0][key]), (isa, rank, key)
    nan = {"bf16": 0x7FFF, "fp16": 0x7FFF, "fp32": 0x7FFFFFFF}
    for (name, numel), tensor in reference[0].items():
        assert (tensor[0::97] == nan[name]).all(), (name, numel)  # rank 0's NaNs, canonical


def _gil(rank, world):
    import threading

    from pcie_allreduce import PcieAllReduce

    x = rank_input(rank, 4096, torch.float32)
    out = torch.empty_like(x)
    calls = {
        "in_place": lambda: ar.all_reduce_(x),
        "out": lambda: ar.all_reduce(x, out=out),
        "new": lambda: ar.all_reduce(x),
    }
    seen = {}
    with PcieAllReduce(None, "cpu", max_numel=4096, timeout_s=20) as ar:
        ar.all_reduce_(x.clone())  # connected and warm
        for name, call in calls.items():
            if rank == 1:
                time.sleep(1.0)
                call()
                continue
            counter = [0]
            stop = threading.Event()

            def count():
                while not stop.is_set():
                    counter[0] += 1

            thread = threading.Thread(target=count)
            thread.start()
            time.sleep(0.05)
            before = counter[0]
            t0 = time.monotonic()
            call()
            seen[name] = {"waited": time.monotonic() - t0, "during": counter[0] - before}
            stop.set()
            thread.join()
    return seen


def test_a_waiting_rank_lets_other_python_threads_run(clean_shm):
    """Rank 1 arrives a second late to each call; meanwhile rank 0's other Python thread keeps
    counting, so each kind of call waits for its peer without holding the GIL."""
    seen = run_ranks(_gil, 2)[0]["value"]
    assert set(seen) == {"in_place", "out", "new"}
    for name, r in seen.items():
        assert r["waited"] > 0.5, (name, r)
        # Holding the GIL, the counter could not move at all during the wait.
        assert r["during"] > 10_000, (name, r)


def _no_allocation(rank, world):
    from pcie_allreduce import PcieAllReduce

    x = rank_input(rank, 1 << 16, torch.bfloat16)
    out = torch.empty_like(x)
    with PcieAllReduce(None, "cpu", max_numel=1 << 16) as ar:
        for _ in range(3):  # warm: programs installed, decisions cached
            ar.all_reduce_(x.clone())
            ar.all_reduce(x, out=out)
        with torch.autograd.profiler.profile(profile_memory=True) as prof:
            for _ in range(5):
                ar.all_reduce_(x)
                ar.all_reduce(x, out=out)
        allocated = sum(max(0, e.cpu_memory_usage) for e in prof.function_events)
        with torch.autograd.profiler.profile(profile_memory=True) as prof:
            ar.all_reduce(x)
        fresh = sum(max(0, e.cpu_memory_usage) for e in prof.function_events)
    return {"in_place_and_out": allocated, "out_of_place": fresh}


def test_in_place_and_out_calls_allocate_nothing(clean_shm):
    """Measured by the profiler's memory accounting: all_reduce_ and all_reduce(out=) allocate
    no tensor memory; the out-of-place call (the control) allocates its result."""
    r = run_ranks(_no_allocation, 2)[0]["value"]
    assert r["in_place_and_out"] == 0, r
    assert r["out_of_place"] >= (1 << 16) * 2, r
