"""PcieAllReduce on the host shared-memory transport: real processes, real shared memory, real
gloo process groups, compared with gloo's own all-reduce and a float64 reference."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks, shm_entries

from pcie_allreduce.testing import DTYPES, count_wrong, rank_input

ALGORITHMS = ("oneshot", "twoshot", "island_oneshot", "island_twoshot")


def one_row(
    algorithm: str, direction: str, staged: bool, blocks: int = 1, protocol: str = "flag"
) -> str:
    return f"*,*,*,0,*,{algorithm},{direction},{int(staged)},{blocks},64,{protocol}\n"


def check_result(out, world, numel, dtype_name, seed=0):
    bad = count_wrong(out, world, numel, dtype_name, seed)
    assert bad == 0, f"{bad} of {numel} elements off the float64 reference"


def same_bits_everywhere(out: torch.Tensor) -> bool:
    mine = out.contiguous().view(torch.uint8).clone()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], e) for e in everyone)


def islands_for(world: int):
    return [list(range(world // 2)), list(range(world // 2, world))] if world % 2 == 0 else None


# ---------------------------------------------------------------- every tactic, every dtype
# (direction, staged, protocol): LL and lamport (flag-in-data) are push-only and unstaged.
TACTIC_SHAPES = [(d, st, "flag") for d in ("push", "pull") for st in (True, False)] + [
    ("push", False, "ll"),
    ("push", False, "lamport"),
]


def _every_tactic(rank, world, sizes, dtypes):
    from pcie_allreduce import PcieAllReduce

    max_numel = max(sizes)
    islands = islands_for(world)
    checked = []
    for algorithm in ALGORITHMS:
        if algorithm.startswith("island") and (islands is None or world < 4):
            continue
        for direction, staged, protocol in TACTIC_SHAPES:
            blocks = 1 if staged else 2  # unstaged runs two slices: per-block flags
            table = one_row(algorithm, direction, staged, blocks, protocol)
            with PcieAllReduce(
                None, "cpu", max_numel=max_numel, table=table, islands=islands
            ) as ar:
                for dtype_name in dtypes:
                    for numel in sizes:
                        x = rank_input(rank, numel, DTYPES[dtype_name], seed=3)
                        before = x.clone()
                        assert ar.decline_reason(x) is None, ar.decline_reason(x)
                        out = ar.all_reduce(x)
                        assert torch.equal(x, before), "input modified"
                        check_result(out, world, numel, dtype_name, seed=3)
                        assert same_bits_everywhere(out)
                        # gloo agrees within rounding
                        g = x.clone()
                        dist.all_reduce(g)
                        assert torch.allclose(out.float(), g.float(), rtol=0.05, atol=0.05)
                label = ar.chosen_tactic(x)
                assert label.startswith(f"{algorithm}/{direction}/"), label
                assert f"/{protocol}/" in label, label
                stats = ar.stats()
                assert stats["calls"][label] == len(dtypes) * len(sizes)
                assert "fallback" not in stats["calls"]
                checked.append(label)
    return checked


# numel values: 16 bytes of bf16, 8 elements; non-powers of two; up to max_numel.
SIZES = [8, 24, 1000, 4104, 12288]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_tactic_matches_gloo_and_float64_and_is_bitwise_identical(world, clean_shm):
    dtypes = ["bf16", "fp16", "fp32"] if world <= 4 else ["bf16", "fp32"]
    sizes = SIZES if world <= 4 else [8, 1000, 12288]
    results = run_ranks(_every_tactic, world, sizes, dtypes, timeout=600)
    labels = results[0]["value"]
    algorithms = 2 if world == 2 else 4  # island algorithms need two islands of two or more
    assert len(labels) == algorithms * len(TACTIC_SHAPES), labels


def _inplace(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=4096, table=one_row("twoshot", "pull", True)) as ar:
        x = rank_input(rank, 4096, torch.float32)
        y = ar.all_reduce_(x)
        assert y.data_ptr() == x.data_ptr()
        check_result(x, world, 4096, "fp32")
        out = torch.empty_like(x)
        z = rank_input(rank, 4096, torch.float32)
        ar.all_reduce(z, out=out)
        check_result(out, world, 4096, "fp32")
    return True


def test_in_place_and_out_arguments(clean_shm):
    run_ranks(_inplace, 3)


def _bad_out(rank, world):
    from pcie_allreduce import PcieAllReduce

    errors = {}
    with PcieAllReduce(None, "cpu", max_numel=4096, table=one_row("oneshot", "push", False)) as ar:
        buf = torch.cat([rank_input(rank, 4096, torch.float32), torch.zeros(4)])
        before = buf.clone()
        x = buf[:4096]
        cases = {
            "overlap": buf[4:4100],  # 16 bytes past the input's start: same shape, overlapping
            "shape": torch.empty(2048, dtype=torch.float32),
            "dtype": torch.empty(4096, dtype=torch.bfloat16),
        }
        for name, out in cases.items():
            try:
                ar.all_reduce(x, out=out)
                errors[name] = "no error"
            except ValueError as e:
                errors[name] = str(e)
        assert torch.equal(buf, before), "a refused call modified its buffers"
        # Nothing ran on any rank, so the ranks are still in step.
        check_result(ar.all_reduce(x.clone()), world, 4096, "fp32")
    return errors


def test_out_must_be_a_disjoint_tensor_of_the_same_shape_and_dtype(clean_shm):
    errors = run_ranks(_bad_out, 2)[0]["value"]
    assert "overlaps the input without being the same tensor" in errors["overlap"]
    assert "out must have the input's dtype, shape and device" in errors["shape"]
    assert "out must have the input's dtype, shape and device" in errors["dtype"]
    assert "Float [2048] on cpu" in errors["shape"], errors["shape"]


# ---------------------------------------------------------------- declines
def _declines(rank, world):
    from pcie_allreduce import PcieAllReduce

    reasons = {}
    with PcieAllReduce(
        None, "cpu", max_numel=1024, dtypes=("bf16", "fp32"), stream_max_numel=0
    ) as ar:
        cases = {
            "dtype": rank_input(rank, 64, torch.float16),
            "dtype64": rank_input(rank, 64, torch.float64),
            "not_16_byte_multiple": rank_input(rank, 6, torch.float32),
            "too_large": rank_input(rank, 2048, torch.float32),
        }
        for name, t in cases.items():
            before = t.clone()
            reasons[name] = ar.decline_reason(t)
            assert not ar.should_use(t)
            out = ar.all_reduce(t)
            assert torch.equal(t, before), f"{name}: declined input was modified"
            expected = t.clone()
            dist.all_reduce(expected)
            assert torch.equal(out, expected), f"{name}: fallback result differs from gloo"
        reasons["device"] = ar.decline_reason(torch.empty(64, device="meta"))
        stats = ar.stats()
    return reasons, stats


def test_declines_with_the_right_reason_and_leaves_input_untouched(clean_shm):
    results = run_ranks(_declines, 2)
    reasons, stats = results[0]["value"]
    assert reasons == {
        "dtype": "dtype",
        "dtype64": "dtype",
        "not_16_byte_multiple": "not_16_byte_multiple",
        "too_large": "too_large",
        "device": "device",
    }
    assert stats["calls"]["fallback"] == 4
    assert stats["declines"] == {
        "dtype": 2,
        "not_16_byte_multiple": 1,
        "too_large": 1,
    }


# ---------------------------------------------------------------- every rank takes the same path
def _layouts(rank, world):
    """Each rank passes the same (numel, dtype) with a different memory layout: the kernels
    run on every rank (a tensor's layout never changes the path), results are exact and
    bitwise identical, and nothing outside a view is touched."""
    from pcie_allreduce import PcieAllReduce

    numel = 1024
    with PcieAllReduce(None, "cpu", max_numel=4096, table=one_row("oneshot", "push", False)) as ar:
        buf = torch.zeros(3 * numel + 8)
        data = rank_input(rank, numel, torch.float32, seed=5)
        layouts = {  # rank 0: plain tensors; rank 1: offset (misaligned), strided, transposed
            "offset": data.clone() if rank == 0 else buf.clone()[1 : numel + 1].copy_(data),
            "strided": data.clone() if rank == 0 else buf.clone()[::3][:numel].copy_(data),
            "transposed": data.clone().reshape(32, 32)
            if rank == 0
            else data.reshape(32, 32).t().contiguous().t(),
        }
        for name, x in layouts.items():
            assert ar.decline_reason(x) is None, (name, ar.decline_reason(x))
            before = x.clone()
            out = ar.all_reduce(x)
            assert torch.equal(x, before), f"{name}: input modified"
            check_result(out.reshape(-1), world, numel, "fp32", seed=5)
            assert same_bits_everywhere(out.reshape(-1).contiguous())
        # In place on a strided view: the view gets the sum, the gaps between its elements do not.
        buf.fill_(7.0)
        view = buf[::2][:numel]
        view.copy_(data)
        ar.all_reduce_(view)
        check_result(view.clone(), world, numel, "fp32", seed=5)
        assert torch.equal(buf[1::2][:numel], torch.full((numel,), 7.0)), "wrote outside the view"
        # out= that is strided: staged too.
        wide = torch.zeros(2 * numel)
        ar.all_reduce(data, out=wide[::2])
        check_result(wide[::2].clone(), world, numel, "fp32", seed=5)
        assert torch.count_nonzero(wide[1::2]) == 0
        stats = ar.stats()
        errors = {}
        for name, call in {
            "expanded in place": lambda: ar.all_reduce_(torch.ones(1).expand(numel)),
            "expanded out": lambda: ar.all_reduce(data, out=torch.zeros(1).expand(numel)),
        }.items():
            try:
                call()
                errors[name] = "no error"
            except ValueError as e:
                errors[name] = str(e)
        # An expanded input out of place is fine: it is read, not written.
        summed = ar.all_reduce(torch.ones(1).expand(numel))
        assert torch.equal(summed, torch.full((numel,), float(world)))
    return stats, errors


def test_a_tensors_layout_never_changes_the_path(clean_shm):
    results = run_ranks(_layouts, 2)
    (stats0, errors), (stats1, _) = results[0]["value"], results[1]["value"]
    for stats in (stats0, stats1):
        assert "fallback" not in stats["calls"], stats
        assert stats["calls"] == {"oneshot/push/unstaged/flag/b1/t64": 5}
    assert stats0["staged"] == 2  # the strided in-place view and the strided out
    assert stats1["staged"] == 5
    assert "more than one element of the written-to tensor" in errors["expanded in place"]
    assert "more than one element of the written-to tensor" in errors["expanded out"]


def _two_threads(rank, world):
    """Rank 1 arrives late; meanwhile a second thread of rank 0 calls the same communicator."""
    import threading

    from pcie_allreduce import PcieAllReduce

    x = rank_input(rank, 1024, torch.float32)
    with PcieAllReduce(None, "cpu", max_numel=1024, timeout_s=20) as ar:
        if rank == 1:
            time.sleep(1.5)
            return check_result(ar.all_reduce(x), world, 1024, "fp32")
        first = {}
        thread = threading.Thread(target=lambda: first.update(out=ar.all_reduce(x)))
        thread.start()
        time.sleep(0.5)  # the first call is waiting for rank 1 now
        try:
            ar.all_reduce(x)
            second = "no error"
        except RuntimeError as e:
            second = str(e)
        thread.join()
        check_result(first["out"], world, 1024, "fp32")
        return second


def test_two_threads_on_one_communicator_get_a_clear_error(clean_shm):
    second = run_ranks(_two_threads, 2)[0]["value"]
    assert "entered one pcie_allreduce communicator at once" in second


def _table_fallback(rank, world):
    from pcie_allreduce import PcieAllReduce

    table = "*,*,*,0,1024,oneshot,push,0,1,64\n*,*,*,0,*,fallback,,,,\n"
    with PcieAllReduce(None, "cpu", max_numel=4096, table=table) as ar:
        small = rank_input(rank, 128, torch.float32)  # 512 bytes: kernels
        big = rank_input(rank, 1024, torch.float32)  # 4096 bytes: table says fallback
        assert ar.decline_reason(small) is None
        assert ar.decline_reason(big) == "table"
        assert ar.supports(big) is None  # can, but should not
        check_result(ar.all_reduce(big), world, 1024, "fp32")
        return ar.stats()


def test_table_fallback_is_counted_as_a_decline(clean_shm):
    stats = run_ranks(_table_fallback, 2)[0]["value"]
    assert stats["declines"] == {"table": 1}
    assert stats["calls"] == {"fallback": 1}


def _stats(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=1024, table=one_row("oneshot", "push", False)) as ar:
        for _ in range(3):
            ar.all_reduce(rank_input(rank, 1024, torch.bfloat16))  # 2048 bytes
        s = ar.stats()
        assert s["workspace_bytes"] > 3 * 2 * 1024 * 2
    return s


def test_stats_count_calls_and_bytes_per_peer(clean_shm):
    s = run_ranks(_stats, 3)[1]["value"]
    assert s["calls"] == {"oneshot/push/unstaged/flag/b1/t64": 3}
    # oneshot push: the whole message to each peer, three times; nothing to itself.
    assert s["bytes_sent_per_peer"] == [3 * 2048, 0, 3 * 2048]
    assert s["declines"] == {}


# ---------------------------------------------------------------- handshake
def _disagree(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=1024 if rank != 1 else 2048) as ar:
        x = rank_input(rank, 256, torch.float32)
        out = ar.all_reduce(x)
        check_result(out, world, 256, "fp32")
        return ar.enabled, ar.disabled_reason, ar.decline_reason(x)


def test_ranks_that_disagree_disable_the_backend_and_say_who_and_what(clean_shm):
    for enabled, reason, decline in run_ranks(_disagree, 3).values():
        assert not enabled
        assert decline == "disabled"
        assert "max_numel" in reason and "rank 1 has 2048" in reason and "rank 0 has 1024" in reason


# ---------------------------------------------------------------- failures
def _mismatched_shapes(rank, world):
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    ar = PcieAllReduce(
        None, "cpu", max_numel=4096, table=one_row("oneshot", "push", True), timeout_s=2.0
    )
    x = rank_input(rank, 1024 if rank == 0 else 2048, torch.float32)
    start = time.monotonic()
    try:
        ar.all_reduce(x)
    except PcieAllReduceTimeout as e:
        return {"elapsed": time.monotonic() - start, "message": str(e), "diag": e.diagnostic}
    finally:
        ar.destroy()
    return {"elapsed": time.monotonic() - start, "message": "no error"}


def test_mismatched_shapes_fail_with_a_clear_error_not_a_hang(clean_shm):
    for res in run_ranks(_mismatched_shapes, 2, timeout=120).values():
        assert res["message"] != "no error"
        assert res["elapsed"] < 10
        assert res["diag"]["kind"] in ("mismatch", "timeout")
        if res["diag"]["kind"] == "mismatch":
            assert "disagree" in res["message"] and "numel" in res["message"]


def _killed_peer(rank, world):
    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    # No self-test: the test counts the generations of its own calls from construction.
    ar = PcieAllReduce(
        None,
        "cpu",
        max_numel=4096,
        table=one_row("twoshot", "push", True),
        timeout_s=3.0,
        self_test=False,
    )
    try:
        for i in range(6):
            if rank == 2 and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.monotonic()
            ar.all_reduce(rank_input(rank, 4096, torch.float32))
        return {"message": "no error"}
    except PcieAllReduceTimeout as e:
        return {
            "elapsed": time.monotonic() - start,
            "message": str(e),
            "peer": e.peer,
            "diag": e.diagnostic,
        }
    finally:
        ar.destroy()


def test_a_killed_rank_is_named_within_the_timeout_and_nothing_is_left_in_dev_shm(clean_shm):
    before = shm_entries()
    start = time.monotonic()
    results = run_ranks(_killed_peer, 3, timeout=120, allow_failures=True)
    assert time.monotonic() - start < 90
    assert not results[2]["ok"]  # killed
    for r in (0, 1):
        res = results[r]
        assert res["ok"], res
        # The rank that hears nothing from rank 2 names it; the other may be stuck behind it.
        assert res["value"]["message"] != "no error"
        assert "timed out" in res["value"]["message"]
        # Rank 2 died before its 4th call; flags are double-buffered by generation parity, so
        # the flag still holds its 2nd call's generation.
        assert res["value"]["diag"]["generation_expected"] == 4
        assert res["value"]["diag"]["generation_seen"] == 2
    named = {results[r]["value"]["peer"] for r in (0, 1)}
    assert 2 in named, named
    assert shm_entries() - before == set()


def _wrap(rank, world):
    from pcie_allreduce import PcieAllReduce

    start = 2**32 - 5
    checked = 0
    for algorithm in ("oneshot", "twoshot"):
        with PcieAllReduce(
            None,
            "cpu",
            max_numel=512,
            table=one_row(algorithm, "pull", True, 3),
            initial_generation=start,
            self_test=False,  # the calls below are the ones that cross the wrap
        ) as ar:
            for i in range(12):  # generations 2^32-4 .. 2^32+7: across the wrap
                numel = 64 * (1 + i % 4)
                out = ar.all_reduce(rank_input(rank, numel, torch.float32, seed=i))
                check_result(out, world, numel, "fp32", seed=i)
                checked += 1
    return checked


def test_generations_wrap_around_2_pow_32(clean_shm):
    assert run_ranks(_wrap, 3).values() == [24, 24, 24]


def _many_calls(rank, world, calls):
    from pcie_allreduce import PcieAllReduce

    table = (
        "*,*,*,0,256,oneshot,push,0,1,64\n"
        "*,*,*,256,1024,twoshot,pull,1,2,64\n"
        "*,*,*,1024,4096,oneshot,pull,0,3,64\n"
        "*,*,*,4096,*,twoshot,push,0,1,64\n"
    )
    sizes = [8, 64, 200, 512, 1000, 2048]
    with PcieAllReduce(None, "cpu", max_numel=2048, table=table) as ar:
        for i in range(calls):
            numel = sizes[i % len(sizes)]
            # Small integers sum exactly in any order, so checking every call stays cheap.
            x = torch.arange(numel, dtype=torch.float32) % 13 + (rank + i % 5)
            expected = (torch.arange(numel, dtype=torch.float32) % 13) * world + sum(
                r + i % 5 for r in range(world)
            )
            out = ar.all_reduce(x)
            if not torch.equal(out, expected):
                raise AssertionError(f"call {i} (numel {numel}) wrong")
        return ar.stats()["calls"]


def test_ten_thousand_back_to_back_calls_with_changing_sizes_and_tactics(clean_shm):
    calls = run_ranks(_many_calls, 2, 10_000, timeout=600)[0]["value"]
    assert sum(calls.values()) == 10_000
    assert len(calls) == 4, calls  # every tactic of the table was used


# ---------------------------------------------------------------- torch integration
def _opcheck(rank, world):
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=1024) as ar:
        x = rank_input(rank, 256, torch.float32)
        torch.library.opcheck(torch.ops.pcie_allreduce.all_reduce.default, (x, ar.handle))
        y = rank_input(rank, 256, torch.float32)
        torch.library.opcheck(torch.ops.pcie_allreduce.all_reduce_.default, (y, ar.handle))
        z = torch.empty_like(x)
        torch.library.opcheck(torch.ops.pcie_allreduce.all_reduce_into.default, (x, ar.handle, z))

        @torch.compile(fullgraph=True, backend="aot_eager")
        def layer(t):
            return torch.ops.pcie_allreduce.all_reduce(t * 2, ar.handle) + 1

        out = layer(x)
        expected = torch.zeros(256, dtype=torch.float64)
        for r in range(world):
            expected += rank_input(r, 256, torch.float32).double() * 2
        assert torch.allclose(out.double(), expected + 1, rtol=1e-5, atol=1e-5)
    return True


def test_ops_pass_opcheck_and_trace_under_torch_compile(clean_shm):
    run_ranks(_opcheck, 2, timeout=400)


def _lifecycle(rank, world):
    from pcie_allreduce import PcieAllReduce

    ar = PcieAllReduce(None, "cpu", max_numel=512)
    x = rank_input(rank, 512, torch.float32)
    ar.all_reduce(x)
    ar.destroy()
    ar.destroy()  # idempotent
    try:
        torch.ops.pcie_allreduce.all_reduce(x, ar.handle)
    except ValueError as e:
        return str(e)
    return "no error"


def test_destroy_is_idempotent_and_releases_the_handle(clean_shm):
    for message in run_ranks(_lifecycle, 2).values():
        assert "no pcie_allreduce communicator has handle" in message
