"""The fused forms beside all_reduce_add_rms_norm, on the host shared-memory transport with real
processes, shared memory and gloo groups: without the residual (a model's first layer), with
Gemma's weight offset, and with y quantised to FP8 at a static scale (vLLM's
static_scaled_fp8_quant of the rounded y). Every form equals, bit for bit, our plain all-reduce
followed by plan/epilogue.h's arithmetic and vLLM's quantisation written in torch
(pcie_allreduce.testing), on every rank, at worlds 3 and 4 (two islands), for every tactic shape
and dtype, in every batch whatever path it takes (the kernels or the unfused path)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

from pcie_allreduce.testing import (
    DTYPES,
    fp8_static_quant,
    fused_in_order,
    nvfp4_quant,
    rank_input,
)

EPS = 1e-6
# Every form: (with a residual, weight offset, quantised). NVFP4 takes bf16 and fp16 only.
FORMS = [
    (res, off, q) for res in (True, False) for off in (0.0, 1.0) for q in (None, "fp8", "nvfp4")
]
# The scales tried: FP8's static scale (0.02 saturates some rows, 50 makes e4m3 subnormals);
# NVFP4's global scale G (1: small block scales; 672 = 448 * 6 / 4, as for a tensor whose amax
# is 4; 1e5: block scales saturate at 448).
SCALES = {None: (1.0,), "fp8": (0.02, 50.0), "nvfp4": (1.0, 672.0, 1e5)}


def forms_for(dtype):
    return [f for f in FORMS if f[2] != "nvfp4" or dtype != torch.float32]


# One tactic of each protocol and direction, staged and not; the island algorithms at world 4.
SHAPES = [
    ("push", False, "flag"),
    ("pull", True, "flag"),
    ("push", False, "ll"),
    ("push", False, "lamport"),
]


def one_row(algorithm, direction, staged, blocks, protocol):
    return f"*,*,*,0,*,{algorithm},{direction},{int(staged)},{blocks},64,{protocol}\n"


def replicated(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same_bits_everywhere(t: torch.Tensor) -> bool:
    mine = bits(t).clone()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], e) for e in everyone)


def expected(total, residual, weight, offset, quant, scale):
    """What the form must return: plan/epilogue.h on the plain all-reduce's result, then vLLM's
    quantisation of the rounded y (FP8: static_scaled_fp8_quant; NVFP4: scaled_fp4_quant with
    IEEE reciprocals, the block scales third)."""
    y, r = fused_in_order(total, residual, weight, EPS, offset)
    if quant == "fp8":
        return fp8_static_quant(y, scale), r
    if quant == "nvfp4":
        y_q, block_scale = nvfp4_quant(y, scale)
        return y_q, r, block_scale
    return y, r


def same_outputs(got, want) -> bool:
    return len(got) == len(want) and all(
        torch.equal(bits(g), bits(w)) for g, w in zip(got, want, strict=True)
    )


def scale_rows(block_scale, rows, hidden):
    """NVFP4's block scales of rows [0, rows) as a [rows, hidden / 16] matrix (undoing the
    swizzled 128x4 layout: [tiles][k tiles][32][4][4] -> [tiles][4][32][k tiles][4])."""
    blocks = hidden // 16
    k_tiles = (blocks + 3) // 4
    padded = block_scale.shape[0]
    tiles = bits(block_scale).reshape(padded // 128, k_tiles, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(padded, 4 * k_tiles)[:rows, :blocks]


def call(ar, x, residual, weight, offset, quant, scale, **outs):
    return ar.all_reduce_rms_norm(
        x,
        weight,
        EPS,
        residual=residual,
        weight_offset=offset,
        quant=quant,
        scale=scale if quant else None,
        **outs,
    )


def _every_tactic(rank, world, algorithms, islands, hidden, rows):
    from pcie_allreduce import PcieAllReduce

    numel = hidden * rows
    checked = []
    for algorithm in algorithms:
        for direction, staged, protocol in SHAPES:
            table = one_row(algorithm, direction, staged, 1 if staged else 2, protocol)
            with PcieAllReduce(None, "cpu", max_numel=numel, table=table, islands=islands) as ar:
                for dtype_name, dtype in DTYPES.items():
                    x = rank_input(rank, numel, dtype, seed=5).view(rows, hidden)
                    residual = replicated((rows, hidden), dtype, 11)
                    # Gemma's weights are small around 0 (1 + w); 0.02 saturates FP8 in some rows
                    # and 50 makes e4m3 subnormals.
                    weight = replicated((hidden,), dtype, 13) * 0.5
                    total = ar.all_reduce(x)
                    for has_residual, offset, quant in forms_for(dtype):
                        res = residual if has_residual else None
                        for scale_value in SCALES[quant]:
                            scale = torch.tensor([scale_value], dtype=torch.float32)
                            before = (x.clone(), residual.clone(), weight.clone())
                            assert ar.decline(_op(has_residual, quant), x, weight) is None
                            got = call(ar, x, res, weight, offset, quant, scale)
                            assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
                            want = expected(total, res, weight, offset, quant, scale)
                            label = (
                                f"{algorithm}/{direction}/{protocol} {dtype_name} residual="
                                f"{has_residual} offset={offset} quant={quant} scale={scale_value}"
                            )
                            assert got[0].dtype == want[0].dtype or quant == "nvfp4", label
                            assert same_outputs(got, want), label
                            assert all(same_bits_everywhere(t) for t in got), label
                            checked.append(label)
                stats = ar.stats()
                assert "unfused" not in str(stats["collectives"]), stats
    return len(checked)


def _op(has_residual, quant):
    from pcie_allreduce.operations import FUSED_FORMS

    return FUSED_FORMS[(has_residual, quant)]


@pytest.mark.parametrize(
    "world,algorithms,islands,hidden,rows",
    [
        (3, ("oneshot", "twoshot"), None, 2064, 2),
        (4, ("island_oneshot", "island_twoshot"), [[0, 1], [2, 3]], 1024, 3),
    ],
    ids=["w3", "w4_islands"],
)
def test_every_form_is_the_epilogue_of_its_all_reduce_bit_for_bit(
    world, algorithms, islands, hidden, rows, clean_shm
):
    counts = run_ranks(
        _every_tactic, world, algorithms, islands, hidden, rows, timeout=600
    ).values()
    assert counts[0] > 0 and len(set(counts)) == 1


def _specials(rank, world):
    """NaN, infinities and saturation: a NaN y quantises to 448 (0x7E) as vLLM's CUDA op gives
    it, never to the NaN byte; values beyond ±448 * scale saturate; the zero weight gives signed
    zeros."""
    from pcie_allreduce import PcieAllReduce

    hidden, rows = 512, 4
    with PcieAllReduce(None, "cpu", max_numel=hidden * rows) as ar:
        x = rank_input(rank, hidden * rows, torch.bfloat16, seed=3).view(rows, hidden)
        if rank == 1:
            x[0, 7] = float("nan")  # row 0's y: all NaN
            x[1, 9] = float("inf")  # row 1: inf / inf
        weight = replicated((hidden,), torch.bfloat16, 4)
        weight[:16] = 0.0
        weight[16:32] = -0.0
        scale = torch.tensor([0.001])
        out = {}
        for has_residual in (True, False):
            res = replicated((rows, hidden), torch.bfloat16, 5) if has_residual else None
            got, _ = call(ar, x, res, weight, 0.0, "fp8", scale)
            want, _ = expected(ar.all_reduce(x), res, weight, 0.0, "fp8", scale)
            assert torch.equal(bits(got), bits(want)), has_residual
            b = bits(got)
            out[has_residual] = (
                bool((b[0] == 0x7E).all()),
                int((b == 0x7F).sum() + (b == 0xFF).sum()),
                int((b[2:] == 0x7E).sum() + (b[2:] == 0xFE).sum()),
            )
        return out


def test_nan_quantises_to_448_and_large_values_saturate(clean_shm):
    results = run_ranks(_specials, 3).values()
    assert len({repr(r) for r in results}) == 1
    for all_448, nan_bytes, saturated in results[0].values():
        assert all_448 and nan_bytes == 0 and saturated > 0


# The seed's tactics for small messages, then at 16 KiB another family and protocol; the
# workspace holds 48 rows of 1,024, so larger batches stream through it in rounds of whole rows.
TABLE = "*,*,*,0,16384,oneshot,push,0,2,64,lamport\n*,*,*,16384,*,twoshot,pull,1,1,64,flag\n"


def _batches(rank, world):
    """Every form, every batch of 1..96 rows cut from a 96-row batch: the table changes tactic
    by size, and batches above 48 rows stream in rounds. A row's bits must not depend on the
    batch, the tactic or the rounds."""
    from pcie_allreduce import PcieAllReduce

    hidden, most = 1024, 96
    dtype = torch.bfloat16
    with PcieAllReduce(None, "cpu", max_numel=48 * hidden, table=TABLE) as ar:
        x = rank_input(rank, most * hidden, dtype, seed=9).view(most, hidden)
        residual = replicated((most, hidden), dtype, 21)
        weight = replicated((hidden,), dtype, 22)
        scale = torch.tensor([0.05])
        tactics = set()
        total = ar.all_reduce(x)
        for has_residual, offset, quant in FORMS:
            res = residual if has_residual else None
            g = torch.tensor([672.0]) if quant == "nvfp4" else scale
            whole = call(ar, x, res, weight, offset, quant, g)
            assert same_outputs(whole, expected(total, res, weight, offset, quant, g))
            for rows in (1, 2, 5, 16, 47, 48, 49, 95):
                for start in (0, most - rows):
                    part = slice(start, start + rows)
                    op = _op(has_residual, quant)
                    assert ar.decline(op, x[part], weight) is None
                    tactics.add(ar.tactic(op, x[part], weight))
                    got = call(
                        ar, x[part], None if res is None else res[part], weight, offset, quant, g
                    )
                    label = f"rows {part} residual={has_residual} offset={offset} quant={quant}"
                    assert torch.equal(bits(got[0]), bits(whole[0][part])), label
                    assert torch.equal(bits(got[1]), bits(whole[1][part])), label
                    if quant == "nvfp4":  # a row's block scales, wherever the layout puts them
                        mine = scale_rows(got[2], rows, hidden)
                        assert torch.equal(mine, scale_rows(whole[2], most, hidden)[part]), label
        return sorted(tactics)


def test_a_rows_bits_do_not_depend_on_its_batch_tactic_or_rounds(clean_shm):
    tactics = run_ranks(_batches, 3, timeout=600)[0]["value"]
    assert len(tactics) == 2, tactics


def _unfused(rank, world, islands):
    """A table that sends every call to the fallback: each form runs the group's all-reduce
    (gloo), then the epilogue in torch (comm/fallback.cc), which must give plan/epilogue.h's
    bits on that sum, the quantisation included."""
    from pcie_allreduce import PcieAllReduce

    hidden, rows = 512, 5
    table = "*,*,*,0,*,fallback\n"
    with PcieAllReduce(None, "cpu", max_numel=hidden * rows, table=table, islands=islands) as ar:
        for dtype in DTYPES.values():
            x = rank_input(rank, hidden * rows, dtype, seed=7).view(rows, hidden)
            residual = replicated((rows, hidden), dtype, 8)
            weight = replicated((hidden,), dtype, 9)
            total = ar.all_reduce(x)
            for has_residual, offset, quant in forms_for(dtype):
                for scale_value in (SCALES[quant] * 2)[:2]:
                    scale = torch.tensor([scale_value])
                    res = residual if has_residual else None
                    assert ar.decline(_op(has_residual, quant), x, weight) == "table"
                    got = call(ar, x, res, weight, offset, quant, scale)
                    want = expected(total, res, weight, offset, quant, scale)
                    label = f"{dtype} residual={has_residual} offset={offset} quant={quant}"
                    assert same_outputs(got, want), label
        return {k: v for k, v in ar.stats()["collectives"].items()}


def test_a_declined_form_runs_the_same_epilogue_unfused(clean_shm):
    stats = run_ranks(_unfused, 4, [[0, 1], [2, 3]], timeout=600)[0]["value"]
    for op, calls in (
        ("all_reduce_rms_norm", 12),  # 3 dtypes x 2 offsets x 2 scales
        ("all_reduce_add_rms_norm_fp8", 12),
        ("all_reduce_rms_norm_fp8", 12),
        ("all_reduce_add_rms_norm_nvfp4", 8),  # bf16 and fp16
        ("all_reduce_rms_norm_nvfp4", 8),
    ):
        assert stats[op]["declines"] == {"table": calls}, stats
        assert set(stats[op]["calls"]) == {"unfused"}, stats


def _into_and_checks(rank, world):
    from pcie_allreduce import PcieAllReduce

    hidden, rows = 256, 2
    dtype = torch.float16
    out = {}
    with PcieAllReduce(None, "cpu", max_numel=hidden * rows) as ar:
        x = rank_input(rank, hidden * rows, dtype, seed=1).view(rows, hidden)
        residual = replicated((rows, hidden), dtype, 2)
        weight = replicated((hidden,), dtype, 3)
        scale = torch.tensor([0.1])
        # Into given tensors: the same bits as the functional form; residual in place.
        want, r_want = call(ar, x, residual, weight, 1.0, "fp8", scale)
        y_q = torch.full((rows, hidden), 0.5).to(torch.float8_e4m3fn)
        res = residual.clone()
        got, r = call(ar, x, res, weight, 1.0, "fp8", scale, out=y_q, residual_out=res)
        out["into"] = got is y_q and r is res and torch.equal(bits(y_q), bits(want))
        out["in_place_residual"] = torch.equal(res, r_want)
        # The unquantised no-residual form never writes x.
        y, s = call(ar, x, None, weight, 0.0, None, scale)
        out["sum"] = torch.equal(s, ar.all_reduce(x))
        # NVFP4 into given tensors: the functional form's bytes.
        g = torch.tensor([672.0])
        want4 = call(ar, x, None, weight, 0.0, "nvfp4", g)
        y_q4 = torch.zeros(rows, hidden // 2, dtype=torch.uint8)
        scales4 = torch.zeros_like(want4[2])
        got4 = call(
            ar, x, None, weight, 0.0, "nvfp4", g, out=y_q4, residual_out=None, block_scale=scales4
        )
        out["nvfp4_into"] = got4[0] is y_q4 and got4[2] is scales4 and same_outputs(got4, want4)
        errors = {}
        cases = {
            "scale_dtype": lambda: call(ar, x, residual, weight, 0.0, "fp8", scale.double()),
            "scale_numel": lambda: call(ar, x, residual, weight, 0.0, "fp8", torch.ones(2)),
            "no_scale": lambda: ar.all_reduce_rms_norm(x, weight, EPS, quant="fp8"),
            "quant_name": lambda: ar.all_reduce_rms_norm(x, weight, EPS, quant="nvfp8"),
            "y_q_dtype": lambda: call(
                ar, x, None, weight, 0.0, "fp8", scale, out=torch.empty_like(x)
            ),
            "y_is_x": lambda: call(ar, x, None, weight, 0.0, None, scale, out=x),
            "offset": lambda: call(ar, x, None, weight, float("nan"), None, scale),
            "nvfp4_fp32": lambda: call(ar, x.float(), None, weight.float(), 0.0, "nvfp4", g),
            "nvfp4_hidden": lambda: call(ar, x[:, :8], None, weight[:8], 0.0, "nvfp4", g),
            "nvfp4_scales": lambda: call(
                ar, x, None, weight, 0.0, "nvfp4", g, block_scale=torch.empty(rows, 16)
            ),
            "try_run_residual": lambda: ar.try_run(
                "all_reduce_rms_norm", x, residual=residual, weight=weight, eps=EPS
            ),
            "try_run_scale": lambda: ar.try_run(
                "all_reduce_add_rms_norm", x, residual=residual, weight=weight, scale=scale
            ),
        }
        for name, fn in cases.items():
            try:
                fn()
                errors[name] = "no error"
            except (ValueError, TypeError, RuntimeError) as e:
                errors[name] = f"{type(e).__name__}: {e}"
        out["errors"] = errors
        # The ops pass opcheck (schemas, fakes, aliasing) and trace under torch.compile. An op
        # with a float8 output skips opcheck's test_schema, which multiplies every output and
        # torch has no float8 multiply on the CPU; its aliasing is checked by the others.
        ops = torch.ops.pcie_allreduce
        h = ar.handle
        fp8_checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
        torch.library.opcheck(ops.all_reduce_rms_norm.default, (x, weight, EPS, h, 1.0))
        torch.library.opcheck(
            ops.all_reduce_rms_norm_into.default,
            (x, weight, EPS, h, torch.empty_like(x), torch.empty_like(x)),
        )
        torch.library.opcheck(
            ops.all_reduce_add_rms_norm_fp8.default,
            (x, residual, weight, scale, EPS, h),
            test_utils=fp8_checks,
        )
        torch.library.opcheck(
            ops.all_reduce_rms_norm_fp8.default, (x, weight, scale, EPS, h), test_utils=fp8_checks
        )
        torch.library.opcheck(
            ops.all_reduce_rms_norm_fp8_into.default,
            (x, weight, scale, EPS, h, torch.empty_like(y_q), torch.empty_like(x)),
            test_utils=fp8_checks,
        )
        torch.library.opcheck(
            ops.all_reduce_add_rms_norm_fp8_into.default,
            (x, residual, weight, scale, EPS, h, torch.empty_like(y_q), torch.empty_like(x)),
            test_utils=fp8_checks,
        )
        torch.library.opcheck(
            ops.all_reduce_add_rms_norm_nvfp4.default,
            (x, residual, weight, g, EPS, h),
            test_utils=fp8_checks,
        )
        torch.library.opcheck(
            ops.all_reduce_rms_norm_nvfp4_into.default,
            (x, weight, g, EPS, h, torch.empty_like(y_q4), torch.empty_like(x), scales4.clone()),
            test_utils=fp8_checks,
        )

        @torch.compile(fullgraph=True, backend="aot_eager")
        def layer(h_in, res_in):
            q, r2 = ops.all_reduce_add_rms_norm_fp8(h_in * 2, res_in, weight, scale, EPS, h)
            return q.float() + 1, r2

        q, r2 = layer(x, residual)
        q_want, r2_want = call(ar, x * 2, residual, weight, 0.0, "fp8", scale)
        out["compiled"] = torch.equal(q, q_want.float() + 1) and torch.equal(r2, r2_want)
    return out


def test_into_forms_argument_errors_opcheck_and_torch_compile(clean_shm):
    out = run_ranks(_into_and_checks, 2, timeout=400)[0]["value"]
    assert out["into"] and out["in_place_residual"] and out["sum"] and out["compiled"], out
    e = out["errors"]
    assert "scale must be one torch.float32" in e["scale_dtype"], e
    assert "scale must be one torch.float32" in e["scale_numel"], e
    assert "needs scale" in e["no_scale"], e
    assert "quant must be None, 'fp8' or 'nvfp4'" in e["quant_name"], e
    assert "out must be torch.float8_e4m3fn" in e["y_q_dtype"], e
    assert "out overlaps x" in e["y_is_x"] and "may not overlap" in e["y_is_x"], e
    assert "weight_offset must be finite" in e["offset"], e
    assert "takes no residual" in e["try_run_residual"], e
    assert "takes no scale" in e["try_run_scale"], e
    assert out["nvfp4_into"], out
    assert "quantises bf16 or fp16 x to NVFP4" in e["nvfp4_fp32"], e
    assert "a multiple of 16" in e["nvfp4_hidden"], e
    assert "block_scale must be torch.float8_e4m3fn [128, 16]" in e["nvfp4_scales"], e
