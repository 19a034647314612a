"""Reduce-scatter and all-gather on the host shared-memory transport: real processes,
real shared memory, real gloo groups. Every tactic's reduce-scatter is, bit for bit, its rows of
the same table row's all-reduce (the same sums in the same order), within rounding of a float64
reference; every all-gather returns every rank's bits (NaN payloads included). Declines say why,
run the group's own collective and leave the input alone; bad arguments raise before any
communication; a rank in one collective and a peer in another fail naming each other."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from pcie_allreduce.testing import DTYPES, rank_input

ALGORITHMS = ("oneshot", "twoshot", "island_oneshot", "island_twoshot")
SHAPES = [(d, st, "flag") for d in ("push", "pull") for st in (True, False)] + [
    ("push", False, "ll"),
    ("push", False, "lamport"),
]
TWO_SHOT = {"oneshot": "twoshot", "island_oneshot": "island_twoshot"}
# torch 2.14 renamed the tensor forms (the old names warn).
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def one_row(algorithm, direction, staged, blocks, protocol):
    return f"*,*,*,0,*,{algorithm},{direction},{int(staged)},{blocks},64,{protocol}\n"


def random_bits(rank, numel, dtype, seed):
    """Every bit pattern the dtype has, NaNs and infinities included: what an all-gather must
    move untouched."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    width = torch.empty(0, dtype=dtype).element_size()
    ints = {2: torch.int16, 4: torch.int32}[width]
    info = torch.iinfo(ints)
    bits = torch.randint(info.min, info.max, (numel,), generator=g, dtype=ints).view(dtype)
    bits[:3] = torch.tensor([-0.0, 0.0, -0.0])  # -0 too, which lamport cannot carry
    return bits


def within_rounding(got, exact, mag, dtype_name):
    """The fp32 sum rounded to the dtype once (flat) or twice (island algorithms round each
    island's partial): an ulp of the result and of the magnitudes summed, plus fp32's error."""
    ulp = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-23}[dtype_name]
    bound = ulp * (exact.abs() + mag) + 2.0**-22 * mag + 1e-30
    return bool(((got.double() - exact).abs() <= bound).all())


def _every_tactic(rank, world, rows, hidden):
    from pcie_allreduce import PcieAllReduce

    islands = [list(range(world // 2)), list(range(world // 2, world))] if world >= 4 else None
    message = world * rows * hidden
    checked = 0
    for algorithm in ALGORITHMS:
        if algorithm.startswith("island") and islands is None:
            continue
        for direction, staged, protocol in SHAPES:
            blocks = 1 if staged else 2
            table = one_row(algorithm, direction, staged, blocks, protocol)
            expected_label = (
                f"{TWO_SHOT.get(algorithm, algorithm)}/{direction}/"
                f"{'staged' if staged else 'unstaged'}/{protocol}/b{blocks}/t64"
            )
            # An all-gather takes lamport's LL twin: lamport stores -0 as +0.
            gather_label = expected_label.replace("/lamport/", "/ll/")
            with PcieAllReduce(None, "cpu", max_numel=message, table=table, islands=islands) as ar:
                for dtype_name, dtype in DTYPES.items():
                    label = f"{expected_label} {dtype_name}"
                    xs = [
                        rank_input(r, message, dtype, seed=3).view(world * rows, hidden)
                        for r in range(world)
                    ]
                    x = xs[rank]
                    before = x.clone()
                    assert ar.collective_decline_reason(x, "reduce_scatter") is None, label
                    assert ar.chosen_collective_tactic(x, "reduce_scatter") == expected_label
                    got = ar.reduce_scatter(x)
                    assert torch.equal(x, before), f"{label}: the input changed"
                    assert got.shape == (rows, hidden), label
                    mine = slice(rank * rows, (rank + 1) * rows)
                    # The same sums as the all-reduce of this table row, in the same order.
                    assert torch.equal(got, ar.all_reduce(x)[mine]), f"{label}: not the sum's bits"
                    exact = sum(t.double() for t in xs)[mine]
                    mag = sum(t.double().abs() for t in xs)[mine]
                    assert within_rounding(got, exact, mag, dtype_name), label
                    out = torch.full((rows, hidden), 7.0, dtype=dtype)
                    assert ar.reduce_scatter(x, out=out) is out and torch.equal(out, got), label

                    piece = random_bits(rank, rows * hidden, dtype, 5).view(rows, hidden)
                    assert ar.chosen_collective_tactic(piece, "all_gather") == gather_label
                    gathered = ar.all_gather(piece)
                    assert gathered.shape == (world * rows, hidden), label
                    expected = torch.cat(
                        [
                            random_bits(r, rows * hidden, dtype, 5).view(rows, hidden)
                            for r in range(world)
                        ]
                    )
                    assert torch.equal(gathered.view(torch.uint8), expected.view(torch.uint8)), (
                        f"{label}: all-gather changed bits"
                    )
                    checked += 1
                stats = ar.stats()
                assert stats["collectives"]["reduce_scatter"]["calls"] == {
                    expected_label: 2 * len(DTYPES)
                }, stats
                assert stats["collectives"]["all_gather"]["calls"] == {gather_label: len(DTYPES)}, (
                    stats
                )
                assert stats["collectives"]["all_gather"]["declines"] == {}, stats
    return checked


@pytest.mark.parametrize("world,rows,hidden", [(2, 3, 1024), (4, 2, 520)])
def test_every_tactic_reduce_scatters_and_all_gathers_exactly(world, rows, hidden, clean_shm):
    counts = run_ranks(_every_tactic, world, rows, hidden, timeout=600).values()
    assert counts[0] > 0 and len(set(counts)) == 1


def _declines(rank, world):
    from pcie_allreduce import PcieAllReduce

    dtype = torch.bfloat16
    reasons = {}
    with PcieAllReduce(None, "cpu", max_numel=8192, dtypes=("bf16",), stream_max_numel=0) as ar:
        cases = {
            # A chunk of 1 x 12 bf16 is 24 bytes: not whole 16-byte vectors.
            "chunk": (world * 1, 12, dtype),
            "too_large": (world * 4, 2048, dtype),
            "dtype": (world * 2, 512, torch.float16),
        }
        for name, (rows, hidden, xdtype) in cases.items():
            x = rank_input(rank, rows * hidden, xdtype, seed=8).view(rows, hidden)
            before = x.clone()
            reasons[f"rs_{name}"] = ar.collective_decline_reason(x, "reduce_scatter")
            assert not ar.should_use_collective(x, "reduce_scatter")
            assert ar.chosen_collective_tactic(x, "reduce_scatter") == "fallback"
            got = ar.reduce_scatter(x)
            assert torch.equal(x, before), name
            ref = torch.empty(rows // world, hidden, dtype=xdtype)
            REDUCE_SCATTER(ref, x)
            assert torch.equal(got, ref), f"{name}: the fallback's reduce-scatter"

            piece = x[: rows // world]
            reasons[f"ag_{name}"] = ar.collective_decline_reason(piece, "all_gather")
            gathered = ar.all_gather(piece)
            ref = torch.empty(rows, hidden, dtype=xdtype)
            ALL_GATHER(ref, piece.contiguous())
            assert torch.equal(gathered, ref), f"{name}: the fallback's all-gather"
        # A strided input and a strided out are staged, not declined.
        wide = rank_input(rank, world * 8 * 128, dtype, seed=9).view(world * 8, 128)
        strided = wide[:, ::2]
        assert ar.collective_decline_reason(strided, "reduce_scatter") is None
        out = torch.empty(8, 128, dtype=dtype)[:, ::2]
        ar.reduce_scatter(strided, out=out)
        ref = torch.empty(8, 64, dtype=dtype)
        REDUCE_SCATTER(ref, strided.contiguous())
        exact = ref.double()
        assert (out.double() - exact).abs().max() <= 2.0**-7 * exact.abs().max() + 1e-3
        stats = ar.stats()
    return reasons, stats["collectives"], stats["staged"]


def test_declined_collectives_say_why_and_run_the_groups_own(clean_shm):
    for reasons, collectives, staged in run_ranks(_declines, 2, timeout=300).values():
        assert reasons == {
            "rs_chunk": "not_16_byte_multiple",
            "ag_chunk": "not_16_byte_multiple",
            "rs_too_large": "too_large",
            "ag_too_large": "too_large",
            "rs_dtype": "dtype",
            "ag_dtype": "dtype",
        }, reasons
        assert collectives["reduce_scatter"]["declines"] == {
            "not_16_byte_multiple": 1,
            "too_large": 1,
            "dtype": 1,
        }, collectives
        assert collectives["reduce_scatter"]["calls"]["fallback"] == 3, collectives
        assert sum(collectives["reduce_scatter"]["calls"].values()) == 4, collectives
        assert collectives["all_gather"]["calls"] == {"fallback": 3}, collectives
        assert staged >= 1


def _bad_arguments(rank, world):
    from pcie_allreduce import PcieAllReduce

    errors = {}
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = rank_input(rank, 4 * 64, torch.float32).view(4, 64)
        calls = {
            "indivisible": lambda: ar.reduce_scatter(x[:3]),
            "rs_out_shape": lambda: ar.reduce_scatter(x, out=torch.empty(4, 64)),
            "ag_out_shape": lambda: ar.all_gather(x, out=torch.empty(4, 64)),
            "out_dtype": lambda: ar.all_gather(x, out=torch.empty(8, 64, dtype=torch.float64)),
            "overlap": lambda: ar.reduce_scatter(x, out=x[:2]),
            "scalar": lambda: ar.all_gather(torch.tensor(1.0)),
            "collective": lambda: ar.collective_decline_reason(x, "broadcast"),
        }
        for name, call in calls.items():
            try:
                call()
                errors[name] = "no error"
            except (ValueError, RuntimeError) as e:
                errors[name] = f"{type(e).__name__}: {e}"
        # Nothing above reached a peer: the next calls still pair up.
        assert torch.equal(ar.all_gather(x)[rank * 4 : (rank + 1) * 4], x)
        assert ar.stats()["collectives"]["all_gather"]["calls"] != {}
    return errors


def test_bad_arguments_raise_before_any_communication(clean_shm):
    for errors in run_ranks(_bad_arguments, 2, timeout=200).values():
        assert "divisible by the world size 2" in errors["indivisible"], errors
        assert "shape [2, 64]" in errors["rs_out_shape"], errors
        assert "shape [8, 64]" in errors["ag_out_shape"], errors
        assert "ValueError" in errors["out_dtype"], errors
        assert "overlaps its input" in errors["overlap"], errors
        assert "at least one dimension" in errors["scalar"], errors
        assert "must be one of" in errors["collective"], errors


def _opcheck(rank, world):
    from pcie_allreduce import PcieAllReduce

    ops = torch.ops.pcie_allreduce
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = rank_input(rank, 4 * 64, torch.float32).view(4, 64)
        torch.library.opcheck(ops.reduce_scatter.default, (x, world, ar.handle))
        torch.library.opcheck(ops.reduce_scatter_into.default, (x, ar.handle, torch.empty(2, 64)))
        torch.library.opcheck(ops.all_gather.default, (x, world, ar.handle))
        torch.library.opcheck(ops.all_gather_into.default, (x, ar.handle, torch.empty(8, 64)))

        @torch.compile(fullgraph=True, backend="aot_eager")
        def sequence_parallel(h):
            part = ops.reduce_scatter(h * 2, world, ar.handle)
            return ops.all_gather(part + 1, world, ar.handle)

        got = sequence_parallel(x)
        ref = ar.all_gather(ar.reduce_scatter(x * 2) + 1)
        assert torch.equal(got, ref)
    return True


def test_collective_ops_pass_opcheck_and_trace_under_torch_compile(clean_shm):
    run_ranks(_opcheck, 2, timeout=400)


def _mixed_collectives(rank, world, protocol, mine, theirs):
    import time

    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    table = one_row("twoshot", "push", False, 1, protocol)
    ar = PcieAllReduce(None, "cpu", max_numel=4096, table=table, timeout_s=2.0)
    x = rank_input(rank, 4096, torch.bfloat16).view(8, 512)
    calls = {
        "all_reduce": lambda: ar.all_reduce(x),
        "reduce_scatter": lambda: ar.reduce_scatter(x),
        "all_gather": lambda: ar.all_gather(x[:4]),
    }
    start = time.monotonic()
    try:
        calls[mine if rank == 0 else theirs]()
    except PcieAllReduceTimeout as e:
        return {"elapsed": time.monotonic() - start, "message": str(e), "diag": e.diagnostic}
    finally:
        ar.destroy()
    return {"elapsed": time.monotonic() - start, "message": "no error"}


@pytest.mark.parametrize(
    "protocol,mine,theirs",
    [
        ("flag", "reduce_scatter", "all_reduce"),
        ("ll", "all_gather", "all_reduce"),
        ("lamport", "reduce_scatter", "all_gather"),
    ],
)
def test_ranks_in_different_collectives_fail_naming_each_other(protocol, mine, theirs, clean_shm):
    """Same message, same tactic, same generation: without their own signatures the steps of a
    reduce-scatter and an all-reduce would pair up and return garbage."""
    results = run_ranks(_mixed_collectives, 2, protocol, mine, theirs, timeout=120).values()
    for rank, res in enumerate(results):
        assert res["message"] != "no error", rank
        assert res["elapsed"] < 10
        assert res["diag"]["kind"] in ("mismatch", "ll_mismatch", "timeout", "ll_timeout"), res[
            "diag"
        ]
        assert res["diag"]["peer"] == 1 - rank, res["diag"]


def _table_rows(rank, world):
    from pcie_allreduce import PcieAllReduce

    table = (
        "*,*,*,0,*,reduce_scatter:twoshot,pull,1,1,64\n"
        "*,*,*,0,*,all_gather:fallback\n"
        "*,*,*,0,*,oneshot,push,0,2,64,ll\n"
    )
    with PcieAllReduce(None, "cpu", max_numel=4096, table=table) as ar:
        x = rank_input(rank, 8 * 256, torch.bfloat16, seed=4).view(8, 256)
        found = {
            c: ar.chosen_collective_tactic(x if c != "all_gather" else x[:4], c)
            for c in ar.COLLECTIVES
        }
        reason = ar.collective_decline_reason(x[:4], "all_gather")
        got = ar.reduce_scatter(x)
        assert torch.equal(got, ar.all_reduce(x)[rank * 4 : (rank + 1) * 4])
        gathered = ar.all_gather(x[:4])
        ref = torch.empty(8, 256, dtype=torch.bfloat16)
        ALL_GATHER(ref, x[:4].contiguous())
        assert torch.equal(gathered, ref)
        programs = ar.prepare()
        stats = ar.stats()
    return found, reason, stats["collectives"], programs


def test_table_rows_of_a_collective_decide_it_and_only_it(clean_shm):
    for found, reason, collectives, programs in run_ranks(_table_rows, 2, timeout=200).values():
        assert found == {
            "all_reduce": "oneshot/push/unstaged/ll/b2/t64",
            "reduce_scatter": "twoshot/pull/staged/flag/b1/t64",
            "all_gather": "fallback",
        }, found
        assert reason == "table"
        assert collectives["all_gather"] == {"calls": {"fallback": 1}, "declines": {"table": 1}}
        assert collectives["reduce_scatter"]["calls"] == {"twoshot/pull/staged/flag/b1/t64": 1}
        # The all-reduce and its fused form, and the reduce-scatter: the all-gather has none.
        assert programs["programs"] == 3, programs


def _refusals(ar, calls, tensors):
    """Makes each call, which must raise ValueError starting with its op's name and holding its
    fragment. Returns what went otherwise, and whether any tensor or counter changed."""
    before = ([t.clone() for t in tensors], ar.stats())
    wrong = {}
    for name, (call, fragment) in calls.items():
        op = name.split("(")[0].rstrip("_")
        try:
            call()
            wrong[name] = "no error"
        except ValueError as e:
            if not (str(e).startswith(f"{op}: ") and fragment in str(e)):
                wrong[name] = f"{e} (expected {op}: ... {fragment!r})"
        except Exception as e:  # noqa: BLE001 - the wrong kind of error is the finding
            wrong[name] = f"{type(e).__name__}: {e}"
    changed = ar.stats() != before[1] or any(
        not torch.equal(t, b) for t, b in zip(tensors, before[0])
    )
    return wrong, changed


def _meta_operands(rank, world):
    """A tensor on the meta device, as any operand: the torch ops would run their fake
    implementations and return without communicating. Each call raises on every rank before any
    communication, naming the op and the operand, counting and writing nothing."""
    from pcie_allreduce import PcieAllReduce

    meta = torch.device("meta")
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = rank_input(rank, world * 4 * 64, torch.float32).view(world * 4, 64)
        piece, gathered = x[:4].clone(), torch.zeros(world * 4, 64)
        calls = {
            "all_reduce(meta)": (lambda: ar.all_reduce(x.to(meta)), "the input is a Float"),
            "all_reduce_(meta)": (lambda: ar.all_reduce_(x.to(meta)), "on meta"),
            "all_reduce(out=meta)": (
                lambda: ar.all_reduce(x, out=torch.empty_like(x, device=meta)),
                "out is a Float",
            ),
            "reduce_scatter(out=meta)": (
                lambda: ar.reduce_scatter(x, out=torch.empty(4, 64, device=meta)),
                "out is a Float [4, 64] on meta",
            ),
            "all_gather(out=meta)": (
                lambda: ar.all_gather(piece, out=torch.empty(world * 4, 64, device=meta)),
                "this communicator runs on cpu",
            ),
            "all_gather(meta, out=cpu)": (
                lambda: ar.all_gather(piece.to(meta), out=gathered),
                "the input is a Float [4, 64] on meta",
            ),
        }
        wrong, changed = _refusals(ar, calls, (x, piece, gathered))
        # Nothing above reached a peer: the next call still pairs up.
        in_step = torch.equal(ar.all_gather(piece)[rank * 4 : (rank + 1) * 4], piece)
    return wrong, changed, in_step


@pytest.mark.parametrize("world", [2, 3])
def test_operands_on_the_meta_device_raise_naming_them(world, clean_shm):
    for wrong, changed, in_step in run_ranks(_meta_operands, world).values():
        assert not wrong, "\n".join(f"{name}: {e}" for name, e in wrong.items())
        assert not changed and in_step


def _group_dtypes(rank, world):
    """A dtype the group's own collective (gloo here) cannot take would raise inside gloo after
    the call took a generation. Each call raises on every rank before any communication, naming
    the op and the dtype, counting and writing nothing; what the kernels decline but gloo takes
    still runs gloo."""
    from pcie_allreduce import PcieAllReduce

    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = rank_input(rank, world * 4 * 64, torch.float32).view(world * 4, 64)
        piece = x[:4].clone()
        odd = x.to(torch.uint16)
        calls = {
            "reduce_scatter(uint16)": (lambda: ar.reduce_scatter(odd), "torch.uint16"),
            "all_reduce(int16)": (lambda: ar.all_reduce(x.to(torch.int16)), "torch.int16"),
            "all_reduce_(uint32)": (lambda: ar.all_reduce_(x.to(torch.uint32)), "torch.uint32"),
            "all_gather(float8)": (
                lambda: ar.all_gather(piece.to(torch.float8_e4m3fn)),
                "torch.float8_e4m3fn",
            ),
            "all_reduce_add_rms_norm(uint16)": (
                lambda: ar.all_reduce_add_rms_norm(odd, odd.clone(), odd[0], 1e-6),
                "x is torch.uint16",
            ),
        }
        wrong, changed = _refusals(ar, calls, (x, piece, odd))
        exact = []
        for dtype in (torch.float64, torch.int32):
            wide = x.mul(100).to(dtype)
            ref = torch.empty(4, 64, dtype=dtype)
            REDUCE_SCATTER(ref, wide)
            exact.append(torch.equal(ar.reduce_scatter(wide), ref))
        declined = ar.stats()["collectives"]["reduce_scatter"]["declines"]
        in_step = torch.equal(ar.all_gather(piece)[rank * 4 : (rank + 1) * 4], piece)
    return wrong, changed, exact, declined, in_step


@pytest.mark.parametrize("world", [2, 3])
def test_dtypes_the_groups_collective_cannot_take_raise_before_any_communication(world, clean_shm):
    for wrong, changed, exact, declined, in_step in run_ranks(_group_dtypes, world).values():
        assert not wrong, "\n".join(f"{name}: {e}" for name, e in wrong.items())
        assert not changed and in_step
        assert exact == [True, True] and declined == {"dtype": 2}, (exact, declined)
