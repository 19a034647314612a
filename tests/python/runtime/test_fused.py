"""The fused all-reduce + residual add + RMSNorm on the host shared-memory transport:
real processes, real shared memory, real gloo groups. Every tactic's fused result is, bit for
bit, plan/epilogue.h's arithmetic applied to the plain all-reduce's result (the host executor's
epilogue), within rounding of a float64 reference, the same on every rank, and the same for a row
whatever batch it is in; declined calls give the same bits through the unfused path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from pcie_allreduce.testing import DTYPES, fused_float64, fused_in_order, rank_input

ALGORITHMS = ("oneshot", "twoshot", "island_oneshot", "island_twoshot")
SHAPES = [(d, st, "flag") for d in ("push", "pull") for st in (True, False)] + [
    ("push", False, "ll"),
    ("push", False, "lamport"),
]
EPS = 1e-6


def one_row(algorithm, direction, staged, blocks, protocol):
    return f"*,*,*,0,*,{algorithm},{direction},{int(staged)},{blocks},64,{protocol}\n"


def replicated(shape, dtype, seed):
    """The residual stream and the weight: the same on every rank, as in a model."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def same_bits_everywhere(t: torch.Tensor) -> bool:
    mine = t.contiguous().view(torch.uint8).clone()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], e) for e in everyone)


def within_rounding(got: torch.Tensor, exact: torch.Tensor, dtype_name: str) -> bool:
    """|got - exact| within a few roundings of the dtype (the sum, the add, the output) plus the
    fp32 norm's, relative to the row's scale."""
    ulp = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-23}[dtype_name]
    scale = exact.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
    return bool(((got.double() - exact).abs() <= 4 * ulp * scale + 1e-6).all())


def _every_tactic(rank, world, hidden, rows):
    from pcie_allreduce import PcieAllReduce

    islands = [list(range(world // 2)), list(range(world // 2, world))] if world >= 4 else None
    numel = hidden * rows
    checked = 0
    for algorithm in ALGORITHMS:
        if algorithm.startswith("island") and islands is None:
            continue
        for direction, staged, protocol in SHAPES:
            table = one_row(algorithm, direction, staged, 1 if staged else 2, protocol)
            with PcieAllReduce(None, "cpu", max_numel=numel, table=table, islands=islands) as ar:
                for dtype_name, dtype in DTYPES.items():
                    xs = [
                        rank_input(r, numel, dtype, seed=5).view(rows, hidden) for r in range(world)
                    ]
                    x = xs[rank]
                    residual = replicated((rows, hidden), dtype, 11)
                    weight = replicated((hidden,), dtype, 13)
                    before = (x.clone(), residual.clone())
                    assert ar.fused_decline_reason(x, residual, weight) is None
                    y, res_out = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
                    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
                    # Bit for bit: plan/epilogue.h on the same tactic's plain all-reduce.
                    y_ref, r_ref = fused_in_order(ar.all_reduce(x), residual, weight, EPS)
                    label = f"{algorithm}/{direction}/{protocol} {dtype_name}"
                    assert torch.equal(res_out, r_ref), f"{label}: residual_out"
                    assert torch.equal(y, y_ref), f"{label}: y"
                    y64, r64 = fused_float64(xs, residual, weight, EPS)
                    assert within_rounding(res_out, r64, dtype_name), label
                    assert within_rounding(y, y64, dtype_name), label
                    assert same_bits_everywhere(y) and same_bits_everywhere(res_out), label
                    checked += 1
                stats = ar.stats()
                assert sum(stats["fused_calls"].values()) == len(DTYPES), stats
                assert "unfused" not in stats["fused_calls"], stats
    return checked


@pytest.mark.parametrize("world,hidden,rows", [(2, 4096, 3), (4, 2056, 2)])
def test_every_tactic_fused_is_the_epilogue_of_its_all_reduce_bit_for_bit(
    world, hidden, rows, clean_shm
):
    counts = run_ranks(_every_tactic, world, hidden, rows, timeout=600).values()
    assert counts[0] > 0 and len(set(counts)) == 1


def _batch_invariant(rank, world):
    from pcie_allreduce import PcieAllReduce

    hidden, most = 4096, 256
    dtype = torch.bfloat16
    # The seed table decides every size (its tactics change with the size on the way to 256
    # rows), and the workspace holds 200 rows: larger batches take the unfused path (streaming
    # off; test_streaming.py streams them).
    with PcieAllReduce(None, "cpu", max_numel=200 * hidden, stream_max_numel=0) as ar:
        x = rank_input(rank, most * hidden, dtype, seed=9).view(most, hidden)
        residual = replicated((most, hidden), dtype, 21)
        weight = replicated((hidden,), dtype, 22)
        y_all, r_all = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        paths = set()
        for rows in (1, 2, 3, 7, 16, 64, 100, 200, 255):
            for start in (0, most - rows):
                part = slice(start, start + rows)
                paths.add(ar.fused_decline_reason(x[part], residual[part], weight) or "fused")
                y, r = ar.all_reduce_add_rms_norm(x[part], residual[part], weight, EPS)
                assert torch.equal(y, y_all[part]), f"rows {part}: y differs from the 256-row batch"
                assert torch.equal(r, r_all[part]), f"rows {part}: residual_out differs"
        paths.add(ar.fused_decline_reason(x, residual, weight) or "fused")
        tactics = {ar.chosen_tactic(x[:n]) for n in (1, 16, 200)}
        return sorted(paths), sorted(tactics), ar.stats()["fused_calls"]


def test_a_rows_result_does_not_depend_on_its_batch(clean_shm):
    paths, tactics, calls = run_ranks(_batch_invariant, 2, timeout=600)[0]["value"]
    # Both paths were crossed: the kernels and the unfused path agree bit for bit.
    assert paths == ["fused", "too_large"], paths
    assert calls["unfused"] >= 1 and sum(calls.values()) > calls["unfused"], calls


def _declines(rank, world):
    from pcie_allreduce import PcieAllReduce

    dtype = torch.bfloat16
    out = {}
    with PcieAllReduce(
        None, "cpu", max_numel=4 * 4096, dtypes=("bf16", "fp32"), stream_max_numel=0
    ) as ar:
        cases = {
            # 4100 bf16 elements are 8200 bytes: not whole 16-byte vectors.
            "hidden": (2, 4100, dtype, dtype),
            "weight_dtype": (2, 4096, dtype, torch.float32),
            "too_large": (8, 4096, dtype, dtype),
            "dtype": (2, 4096, torch.float16, torch.float16),
        }
        for name, (rows, hidden, xdtype, wdtype) in cases.items():
            x = rank_input(rank, rows * hidden, xdtype, seed=4).view(rows, hidden)
            residual = replicated((rows, hidden), xdtype, 31)
            weight = replicated((hidden,), wdtype, 32)
            before = (x.clone(), residual.clone())
            out[name] = ar.fused_decline_reason(x, residual, weight)
            assert not ar.should_use_fused(x, residual, weight)
            y, r = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
            assert torch.equal(x, before[0]) and torch.equal(residual, before[1]), name
            total = x.clone()
            dist.all_reduce(total)
            y_ref, r_ref = fused_in_order(
                total, residual, weight.to(xdtype) if name != "weight_dtype" else weight, EPS
            )
            assert torch.equal(r, r_ref), f"{name}: residual_out"
            if name != "weight_dtype":
                assert torch.equal(y, y_ref), f"{name}: y"
            y64, r64 = fused_float64(
                [
                    rank_input(q, rows * hidden, xdtype, seed=4).view(rows, hidden)
                    for q in range(world)
                ],
                residual,
                weight,
                EPS,
            )
            assert within_rounding(y, y64, "bf16"), name
        stats = ar.stats()
    return out, stats["fused_declines"], stats["fused_calls"]


def test_declined_fused_calls_say_why_and_return_the_same_result(clean_shm):
    reasons, declines, calls = run_ranks(_declines, 2)[0]["value"]
    assert reasons == {
        "hidden": "hidden",
        "weight_dtype": "dtype",
        "too_large": "too_large",
        "dtype": "dtype",
    }
    assert declines == {"hidden": 1, "dtype": 2, "too_large": 1}
    assert calls == {"unfused": 4}


def _in_place_and_bad_arguments(rank, world):
    from pcie_allreduce import PcieAllReduce

    dtype = torch.bfloat16
    rows, hidden = 2, 1024
    errors = {}
    with PcieAllReduce(None, "cpu", max_numel=rows * hidden) as ar:
        x = rank_input(rank, rows * hidden, dtype, seed=6).view(rows, hidden)
        residual = replicated((rows, hidden), dtype, 41)
        weight = replicated((hidden,), dtype, 42)
        y_ref, r_ref = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        # In place, as the engines' fused_add_rms_norm: y into x, residual_out into residual.
        xi, ri = x.clone(), residual.clone()
        y, r = ar.all_reduce_add_rms_norm(xi, ri, weight, EPS, out=xi, residual_out=ri)
        assert y is xi and r is ri and torch.equal(xi, y_ref) and torch.equal(ri, r_ref)
        # One in place, one given; and both given.
        xi, out_r = x.clone(), torch.empty_like(residual)
        ar.all_reduce_add_rms_norm(xi, residual, weight, EPS, out=xi, residual_out=out_r)
        assert torch.equal(xi, y_ref) and torch.equal(out_r, r_ref)
        out_y, out_r = torch.empty_like(x), torch.empty_like(residual)
        ar.all_reduce_add_rms_norm(x, residual, weight, EPS, out=out_y, residual_out=out_r)
        assert torch.equal(out_y, y_ref) and torch.equal(out_r, r_ref)
        # Strided operands are staged; the path and the bits stay.
        wide = torch.zeros(rows, 2 * hidden, dtype=dtype)
        wide[:, ::2] = x
        y, r = ar.all_reduce_add_rms_norm(wide[:, ::2], residual, weight, EPS)
        assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
        assert ar.stats()["staged"] >= 1
        bad = {
            "residual_shape": (x, residual[:1], weight, {}),
            "weight_shape": (x, residual, weight[:-8], {}),
            "out_overlaps_residual": (x, residual, weight, {"out": residual}),
            "residual_out_is_x": (x, residual, weight, {"residual_out": x}),
        }
        for name, (a, b, w, kw) in bad.items():
            try:
                ar.all_reduce_add_rms_norm(a, b, w, EPS, **kw)
                errors[name] = "no error"
            except (ValueError, RuntimeError) as e:
                errors[name] = str(e)
        # Nothing ran for the refused calls: the ranks are still in step.
        y, _ = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(y, y_ref)
    return errors


def test_in_place_variants_and_bad_arguments(clean_shm):
    errors = run_ranks(_in_place_and_bad_arguments, 2)[0]["value"]
    assert "residual must have x's dtype, shape and device" in errors["residual_shape"]
    assert "weight must be [hidden] = [1024]" in errors["weight_shape"]
    assert "may not overlap" in errors["out_overlaps_residual"]
    assert "may not overlap" in errors["residual_out_is_x"]


def _opcheck(rank, world):
    from pcie_allreduce import PcieAllReduce

    ops = torch.ops.pcie_allreduce
    with PcieAllReduce(None, "cpu", max_numel=4096) as ar:
        x = rank_input(rank, 2 * 256, torch.float32).view(2, 256)
        residual = replicated((2, 256), torch.float32, 51)
        weight = replicated((256,), torch.float32, 52)
        torch.library.opcheck(
            ops.all_reduce_add_rms_norm.default, (x, residual, weight, EPS, ar.handle)
        )
        torch.library.opcheck(
            ops.all_reduce_add_rms_norm_.default,
            (x.clone(), residual.clone(), weight, EPS, ar.handle),
        )
        torch.library.opcheck(
            ops.all_reduce_add_rms_norm_into.default,
            (x, residual, weight, EPS, ar.handle, torch.empty_like(x), torch.empty_like(residual)),
        )

        @torch.compile(fullgraph=True, backend="aot_eager")
        def layer_end(h, res):
            y, r = ops.all_reduce_add_rms_norm(h * 2, res, weight, EPS, ar.handle)
            return y + 1, r

        y, r = layer_end(x, residual)
        y_ref, r_ref = ar.all_reduce_add_rms_norm(x * 2, residual, weight, EPS)
        assert torch.equal(y, y_ref + 1) and torch.equal(r, r_ref)
    return True


def test_fused_ops_pass_opcheck_and_trace_under_torch_compile(clean_shm):
    run_ranks(_opcheck, 2, timeout=400)


def _fused_against_plain(rank, world, protocol):
    import time

    from pcie_allreduce import PcieAllReduce, PcieAllReduceTimeout

    table = one_row("oneshot", "push", False, 1, protocol)
    ar = PcieAllReduce(None, "cpu", max_numel=4096, table=table, timeout_s=2.0)
    x = rank_input(rank, 4096, torch.bfloat16).view(4, 1024)
    residual = replicated((4, 1024), torch.bfloat16, 61)
    weight = replicated((1024,), torch.bfloat16, 62)
    start = time.monotonic()
    try:
        if rank == 0:
            ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        else:
            ar.all_reduce(x)
    except PcieAllReduceTimeout as e:
        return {"elapsed": time.monotonic() - start, "message": str(e), "diag": e.diagnostic}
    finally:
        ar.destroy()
    return {"elapsed": time.monotonic() - start, "message": "no error"}


@pytest.mark.parametrize("protocol", ["flag", "ll", "lamport"])
def test_a_rank_in_the_fused_call_and_a_peer_in_the_plain_one_fail_naming_each_other(
    protocol, clean_shm
):
    """Same tensor, same tactic, same generation: the steps would pair up and each rank return
    what the other did not compute. The fused call's signature differs, so both fail at once."""
    for rank, res in enumerate(run_ranks(_fused_against_plain, 2, protocol, timeout=120).values()):
        assert res["message"] != "no error", rank
        assert res["elapsed"] < 10
        assert res["diag"]["kind"] in ("mismatch", "ll_mismatch", "timeout"), res["diag"]
        assert res["diag"]["peer"] == 1 - rank, res["diag"]


def _bad_output_combinations(rank, world):
    """Every combination of out / residual_out the caller may pass (None, x, residual, a given
    tensor, overlapping views, another dtype, shape or device), a weight inside an output, and
    operands on the meta device: each raises ValueError on every rank before any rank talks,
    naming the fused call and the argument, and leaves every tensor as it was."""
    from pcie_allreduce import PcieAllReduce

    dtype = torch.bfloat16
    rows, hidden = 2, 512
    meta = torch.device("meta")
    # x and residual are the first rows of buffers one row longer: the row after them is a view
    # that overlaps them partially.
    xbuf = rank_input(rank, (rows + 1) * hidden, dtype, seed=7).view(rows + 1, hidden)
    rbuf = replicated((rows + 1, hidden), dtype, 71)
    x, residual = xbuf[:rows], rbuf[:rows]
    weight = replicated((hidden,), dtype, 72)
    given = torch.zeros(rows, hidden, dtype=dtype)
    cases = {
        # exactly one in place
        "out=x residual_out=x": ({"out": x, "residual_out": x}, "residual_out overlaps x"),
        "out=x residual_out=fp32": (
            {"out": x, "residual_out": torch.zeros(rows, hidden)},
            "residual_out must have x's dtype, shape and device",
        ),
        "out=x residual_out=broadcastable": (
            {"out": x, "residual_out": torch.zeros(2, rows, hidden, dtype=dtype)},
            "residual_out must have x's dtype, shape and device",
        ),
        "out=x residual_out=overlapping residual": (
            {"out": x, "residual_out": rbuf[1:]},
            "residual_out overlaps residual",
        ),
        "out=x residual_out=meta": (
            {"out": x, "residual_out": torch.empty(rows, hidden, dtype=dtype, device=meta)},
            "residual_out is a BFloat16 [2, 512] on meta",
        ),
        "residual_out=residual out=residual": (
            {"out": residual, "residual_out": residual},
            "out overlaps residual",
        ),
        "residual_out=residual out=fp32": (
            {"out": torch.zeros(rows, hidden), "residual_out": residual},
            "out must have x's dtype, shape and device",
        ),
        "residual_out=residual out=broadcastable": (
            {"out": torch.zeros(2, rows, hidden, dtype=dtype), "residual_out": residual},
            "out must have x's dtype, shape and device",
        ),
        "residual_out=residual out=overlapping x": (
            {"out": xbuf[1:], "residual_out": residual},
            "out overlaps x",
        ),
        # both given, or both in place
        "out=given residual_out=given": (
            {"out": given, "residual_out": given},
            "out overlaps residual_out",
        ),
        "residual_out=x": ({"residual_out": x}, "residual_out overlaps x"),
        "out=residual": ({"out": residual}, "out overlaps residual"),
        # a weight inside an output
        "weight in out": ({"out": given, "weight": given[0]}, "out overlaps weight"),
        "weight in x, in place": (
            {"out": x, "residual_out": residual, "weight": x[1]},
            "out overlaps weight",
        ),
        "weight in residual, residual_out=residual": (
            {"out": x, "residual_out": residual, "weight": residual[0]},
            "residual_out overlaps weight",
        ),
        # operands on the meta device
        "weight on meta": ({"weight": weight.to(meta)}, "weight is a BFloat16 [512] on meta"),
        "residual on meta": ({"residual": residual.to(meta)}, "residual is a BFloat16"),
        "x on meta": ({"x": x.to(meta)}, "x is a BFloat16 [2, 512] on meta"),
        "out on meta": (
            {"out": given.to(meta), "residual_out": torch.zeros_like(residual)},
            "out is a BFloat16 [2, 512] on meta",
        ),
    }
    errors = {}
    with PcieAllReduce(None, "cpu", max_numel=rows * hidden) as ar:
        y_ref, r_ref = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        everything = (xbuf, rbuf, weight, given)
        before = [t.clone() for t in everything]
        for name, (kwargs, fragment) in cases.items():
            args = {"x": x, "residual": residual, "weight": weight, **kwargs}
            try:
                ar.all_reduce_add_rms_norm(
                    args["x"], args["residual"], args["weight"], EPS,
                    out=args.get("out"), residual_out=args.get("residual_out"),
                )  # fmt: skip
                errors[name] = "no error"
            except ValueError as e:
                errors[name] = str(e) if fragment in str(e) else f"{e} (expected {fragment!r})"
            except Exception as e:  # noqa: BLE001 - the wrong kind of error is the finding
                errors[name] = f"{type(e).__name__}: {e}"
            changed = [i for i, (t, b) in enumerate(zip(everything, before)) if not t.equal(b)]
            if changed:
                errors[name] += f" (tensors {changed} were written)"
                for t, b in zip(everything, before):
                    t.copy_(b)
        # Nothing above reached a peer: the ranks are still in step.
        y, r = ar.all_reduce_add_rms_norm(x, residual, weight, EPS)
        in_step = torch.equal(y, y_ref) and torch.equal(r, r_ref)
        fused = ar.stats()["fused_calls"]
    return errors, in_step, sum(fused.values())


@pytest.mark.parametrize("world", [2, 3])
def test_every_combination_of_outputs_is_checked_before_any_rank_talks(world, clean_shm):
    for errors, in_step, calls in run_ranks(_bad_output_combinations, world).values():
        wrong = {
            name: e
            for name, e in errors.items()
            if not e.startswith("all_reduce_add_rms_norm: ") or "(expected" in e or "written" in e
        }
        assert not wrong, "\n".join(f"{name}: {e}" for name, e in wrong.items())
        assert in_step and calls == 2, (in_step, calls)
