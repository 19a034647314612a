"""vLLM's eight all-reduce fusion patterns (vLLM 0.33.0 ``AllReduceFusionPass``:
compilation/passes/fusion/allreduce_rms_fusion.py) through our post-grad pass, on real vLLM
groups (spawned ranks, gloo, our host transport).

Each graph is the pattern vLLM's own matcher holds: its pattern class's ``pattern`` function
(captured where the class hands it to Inductor's ``register_replacement``), traced the way vLLM
traces it (``pattern_matcher.fwd_only``) at this test's shapes, FP8 both with vLLM's custom
quant op and with QuantFP8's native torch ops, and the FP8 ones also after vLLM's own
RMSNormQuantFusionPass patterns (``fuse_norm_quant``) have turned the norm + quantisation into
``_C.rms_norm_static_fp8_quant`` / ``_C.fused_add_rms_norm_static_fp8_quant``. vLLM's compiled
``_C`` ops do not exist on a CPU: ``vllm_c_ops`` defines them with vLLM's schemas and, for the
quantisations and the norm + quantisation ops, vLLM's CUDA arithmetic in torch
(``pcie_allreduce.testing``: ``fp8_static_quant``; ``nvfp4_quant`` with IEEE reciprocals where
vLLM's GPU kernel uses approximate ones).

After our pass, a graph holds one of our ops and none of the pattern's nodes, and running it
gives, bit for bit, our plain all-reduce followed by the epilogue reference
(``fused_in_order``, then the quantisation): what every form of PcieAllReduce promises. The
unfused graph (vLLM's native IR norm then the quant, or its ``_C`` norm + FP8 op, each rounding
differently from ours) is close, not bitwise. A batch our kernels decline runs vLLM's own ops
and gives the unfused graph's values bit for bit. Two layer ends as a model writes them also go
through Inductor's compile (the pass in its post-grad custom pass slot, the batch dimension
dynamic), and what the pass must leave alone is checked on traced graphs in this process."""

from __future__ import annotations

import inspect
import operator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run .ci/engine-vllm")

import vllm_harness as h  # noqa: E402

HIDDEN, ROWS, EPS = 272, 5, 1e-6  # 17 NVFP4 blocks a row: the swizzled scales have padding
FP8_SCALE, NVFP4_SCALE = 0.005, 700.0  # FP8: |y| > 2.24 saturates
DECLINED_ROWS = 16  # 16 x 272 elements > the slot's workspace (8 decode rows x 256)

# vLLM's pattern classes; the FP8 ones traced with the custom quant op and with native torch ops.
PATTERNS = [
    ("AllReduceRMSNormPattern", None),
    ("AllReduceFusedAddRMSNormPattern", None),
    ("AllReduceGemmaRMSNormPattern", None),
    ("AllReduceFusedAddGemmaRMSNormPattern", None),
    ("AllReduceFusedRMSNormStaticQuantFP8Pattern", True),
    ("AllReduceFusedRMSNormStaticQuantFP8Pattern", False),
    ("AllReduceFusedAddRMSNormStaticQuantFP8Pattern", True),
    ("AllReduceFusedAddRMSNormStaticQuantFP8Pattern", False),
    ("AllReduceFusedRMSNormStaticQuantNVFP4Pattern", None),
    ("AllReduceFusedAddRMSNormStaticQuantNVFP4Pattern", None),
]


def _norm_quant_pass(config: Any) -> Any:
    """vLLM's RMSNormQuantFusionPass's static FP8 patterns (``fuse_norm_quant``: the IR norm +
    static per-tensor FP8, with the residual add or without, the quantisation as vLLM's custom
    op or its native torch ops), registered as the pass registers them: a function that
    rewrites a graph's norm + quantisation into ``_C.rms_norm_static_fp8_quant`` /
    ``_C.fused_add_rms_norm_static_fp8_quant``, as vLLM does before our pass runs."""
    import torch
    from torch._inductor.pattern_matcher import PatternMatcherPass
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        import vllm.compilation.passes.fusion.rms_quant_fusion as rqf
        from vllm.compilation.passes.fusion.matcher_utils import MatcherQuantFP8

        patterns = PatternMatcherPass(pass_name="rmsnorm_quant_fusion_pass")
        for cls in (rqf.FusedAddRMSNormStaticQuantPattern, rqf.RMSNormStaticQuantPattern):
            for custom_quant in (True, False):
                p = cls(EPS, torch.float8_e4m3fn)
                p.quant_matcher = MatcherQuantFP8(p.quant_matcher.quant_key, enabled=custom_quant)
                p.register(patterns)
    return patterns.apply


def _capture(config: Any) -> dict[str, tuple[Any, list[str], Any, Any]]:
    """label -> (vLLM's pattern function, its parameter names, the class, what vLLM runs on its
    graph before our pass or None) for every pattern the classes register (the fused-add ones
    also register a "first output only" variant), and the FP8 ones once more after vLLM's
    RMSNormQuantFusionPass ("[fuse_norm_quant]")."""
    import torch
    import torch._inductor.pattern_matcher as pm
    import vllm_c_ops
    from vllm.config import set_current_vllm_config

    vllm_c_ops.install()
    norm_quant = _norm_quant_pass(config)
    with set_current_vllm_config(config):
        import vllm.compilation.passes.fusion.allreduce_rms_fusion as arf
        from vllm.compilation.passes.fusion.matcher_utils import MatcherQuantFP8
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8StaticTensorSym,
        )

        # Bound at vLLM's import only where _C.scaled_fp4_quant existed then.
        arf.STATIC_FP4_QUANT_OP = torch.ops._C.scaled_fp4_quant.out
        captured: dict[str, tuple[Any, list[str], Any, Any]] = {}
        params = arf.FlashInferFusedAllReduceParams(world_size=2)
        original = pm.register_replacement
        found: list[Any] = []
        pm.register_replacement = lambda pattern, *args, **kwargs: found.append(pattern)
        try:
            for name, custom_quant in PATTERNS:
                cls = getattr(arf, name)
                p = cls(EPS, torch.bfloat16, "cpu", params)
                if custom_quant is not None:
                    p.quant_matcher = MatcherQuantFP8(kFp8StaticTensorSym, enabled=custom_quant)
                found.clear()
                p.register(None)
                label = (
                    name
                    if custom_quant is None
                    else f"{name}[{'_C' if custom_quant else 'native'}]"
                )
                names: list[str] = []
                for i, pattern in enumerate(found):
                    own = list(inspect.signature(pattern).parameters)
                    names = names if own == ["a", "b", "c"] else own  # first-only: as its parent
                    entry = (pattern, names, cls)
                    captured[label if i == 0 else f"{label}[first only]"] = (*entry, None)
                    if custom_quant is not None and i == 0:
                        captured[f"{label}[fuse_norm_quant]"] = (*entry, norm_quant)
        finally:
            pm.register_replacement = original
    return captured


def _inputs(rank: int, rows: int, gemma: bool) -> dict[str, Any]:
    """Every pattern parameter by name: x (this rank's), residual, weight, the scales and
    vLLM's NVFP4 output buffers."""
    import torch

    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(4)]
    residual = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
    # Gemma's raw weights sit around 0 (the norm scales by 1 + w).
    w = 0.5 * torch.randn(HIDDEN, generator=g) + (0.0 if gemma else 1.0)
    blocks = HIDDEN // 16
    return {
        "input": xs[rank],
        "xs": xs,
        "residual": residual,
        "weight": w.to(torch.bfloat16),
        "scale": torch.tensor([[FP8_SCALE]]),
        "input_global_scale": torch.tensor([[NVFP4_SCALE]]),
        "quant_result": torch.empty(rows, HIDDEN // 2, dtype=torch.uint8),
        "output_scale": torch.empty(
            (rows + 127) // 128 * 128, (blocks + 3) // 4, dtype=torch.int32
        ),
    }


def _trace(pattern: Any, args: list, vllm_pass: Any = None) -> Any:
    """vLLM's trace of a pattern (Inductor's fwd_only), on fake copies of the arguments, then
    ``vllm_pass`` (vLLM's own pass before ours) where given."""
    from torch._inductor.pattern_matcher import fwd_only
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        gm = fwd_only(pattern, [mode.from_tensor(a) for a in args])
        if vllm_pass is not None:
            vllm_pass(gm.graph)
            gm.recompile()
    return gm


def _targets(gm: Any) -> list[str]:
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.append(str(n.target))
            if n.args and hasattr(n.args[0], "_schema"):  # auto_functionalized(op)
                out.append(str(n.args[0]))
    return out


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().view(-1).view(torch.uint8)


def _expected(name: str, ins: dict[str, Any], ar: Any, first_only: bool) -> tuple:
    """Our plain all-reduce, then the epilogue reference and vLLM's quantisation arithmetic,
    in the order the pattern returns its values."""
    import torch

    from pcie_allreduce import testing

    total = ar.all_reduce(ins["input"])
    add = "FusedAdd" in name
    y, r = testing.fused_in_order(
        total, ins["residual"] if add else None, ins["weight"], EPS, 1.0 if "Gemma" in name else 0.0
    )
    if "FP8" in name:
        return (testing.fp8_static_quant(y, ins["scale"]), r)
    if "NVFP4" in name:
        y_q, scales = testing.nvfp4_quant(y, ins["input_global_scale"])
        return (y_q, r, scales.view(torch.int32))
    return (y,) if first_only else (y, r)


def _distance(ours: Any, theirs: Any) -> float:
    """How far vLLM's unfused value is from ours: FP8 in e4m3 steps (one step is at most 2^-3
    of the larger value); others relative to the largest |value|."""
    import torch

    if ours.dtype == torch.float8_e4m3fn:
        a, b = ours.float(), theirs.float()
        step = torch.maximum(a.abs(), b.abs()).clamp(min=2.0**-6) * 2.0**-3
        return ((a - b).abs() / step).max().item()
    return ((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max()).item()


def _nvfp4_distance(ours: tuple, theirs: tuple, rows: int) -> float:
    """The dequantised rows' largest difference, in units of the larger block scale / G (one
    e2m1 step at the top of a block is 2 such units)."""
    import torch

    from pcie_allreduce import testing

    a = testing.nvfp4_dequant(ours[0], ours[2], NVFP4_SCALE, rows, HIDDEN)
    b = testing.nvfp4_dequant(theirs[0], theirs[2], NVFP4_SCALE, rows, HIDDEN)
    unit = torch.maximum(a.abs(), b.abs()).reshape(rows, -1, 16).amax(-1, keepdim=True) / 6
    diff = (a - b).abs().reshape(rows, -1, 16) / unit.clamp(min=1e-30)
    return diff.max().item()


def _two_layers(x0: Any, x1: Any, w: Any, scale: Any, g: Any) -> tuple:
    """A model's first two layer ends as its code writes them: the all-reduce, the first
    layer's norm quantised to FP8 (QuantFP8's native ops), the next one's add + norm quantised
    to NVFP4 (vLLM's scaled_fp4_quant, which views its scales as float8_e4m3fn)."""
    import torch
    import vllm.ir.ops
    from vllm import _custom_ops
    from vllm.distributed import tensor_model_parallel_all_reduce

    s = tensor_model_parallel_all_reduce(x0)
    q0 = (
        (vllm.ir.ops.rms_norm(s, w, EPS).to(torch.float32) * scale.reciprocal())
        .clamp(-448.0, 448.0)
        .to(torch.float8_e4m3fn)
    )
    y1, r1 = vllm.ir.ops.fused_add_rms_norm(tensor_model_parallel_all_reduce(x1), s, w, EPS)
    q1, scales1 = _custom_ops.scaled_fp4_quant(y1, g)
    return q0, s, q1, scales1, r1


def _compiled(rank: int, held: Any, ar: Any) -> dict[str, Any]:
    """``_two_layers`` through torch.compile (Inductor, the batch dimension dynamic as vLLM
    marks it) with our pass in Inductor's post-grad custom pass slot: the graph Inductor
    lowers holds our two ops, and the compiled code returns the reference's bits."""
    import torch

    from pcie_allreduce import testing

    ins = _inputs(rank, ROWS, False)
    x0, x1 = ins["xs"][rank], ins["xs"][rank + 1]
    args = (x0, x1, ins["weight"], ins["scale"], ins["input_global_scale"])
    for t in (x0, x1):
        torch._dynamo.mark_dynamic(t, 0)
    # vLLM's inductor settings: auto_functionalized v1 (its fusion passes match only that).
    settings = {"enable_auto_functionalized_v2": False, "fx_graph_cache": False}
    with torch._inductor.config.patch(post_grad_custom_post_pass=held, **settings):
        got = torch.compile(_two_layers, backend="inductor", fullgraph=True)(*args)
    forms = dict(held.matched_forms)
    s = ar.all_reduce(x0)
    y0, _ = testing.fused_in_order(s, None, ins["weight"], EPS)
    y1, r1 = testing.fused_in_order(ar.all_reduce(x1), s, ins["weight"], EPS)
    q1, scales1 = testing.nvfp4_quant(y1, ins["input_global_scale"])
    want = (testing.fp8_static_quant(y0, ins["scale"]), s, q1, scales1, r1)
    return {
        "forms": forms,
        "bitwise": [
            g.shape == w.shape and torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want)
        ],
    }


def _forms_rank(
    rank: int, world: int, init_file: str, model_dir: str, compiled: bool
) -> dict[str, Any]:
    import torch
    from vllm.platforms import current_platform

    config = h.make_config(model_dir)
    tp = h.init_vllm_groups(rank, world, init_file, tp=world, config=config)
    slot = h.slot_of(tp)
    # As on CUDA (use_custom_op_collectives): the all-reduce is the vllm.all_reduce op in graphs.
    tp.use_custom_op_call = True
    held = config.compilation_config.inductor_compile_config[current_platform.pass_key]
    patterns = _capture(config)
    results: dict[str, Any] = {}
    ours_by_label: dict[str, tuple] = {}
    for label, (pattern, names, cls, vllm_pass) in patterns.items():
        name, first_only = cls.__name__, label.endswith("[first only]")
        ins = _inputs(rank, ROWS, "Gemma" in name)
        args = [ins[n] for n in names]
        before_args = [a.clone() for a in args]
        fused, unfused = _trace(pattern, args, vllm_pass), _trace(pattern, args, vllm_pass)
        before = _targets(fused)
        held(fused.graph)
        fused.recompile()
        after = _targets(fused)
        ours = [n for n in fused.graph.nodes if str(n.target).startswith("pcie_allreduce_vllm")]
        got = fused(*args)
        got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
        theirs = unfused(*args)
        theirs = tuple(theirs) if isinstance(theirs, (tuple, list)) else (theirs,)
        want = _expected(name, ins, slot.ar, first_only)
        ours_by_label[label] = got
        entry: dict[str, Any] = {
            "before": before,
            "after": after,
            "forms": dict(held.matched_forms),
            "last_arg": [n.args[-1] for n in ours],
            "dtypes": [str(t.dtype) for t in got],
            "bitwise": [
                g.shape == w.shape and torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want)
            ],
            "count": (len(got), len(want)),
            "inputs_untouched": all(torch.equal(a, b) for a, b in zip(args, before_args)),
        }
        if "NVFP4" in name:  # y_q and its scales together: the values they stand for
            entry["distance"] = [_nvfp4_distance(got, theirs, ROWS), _distance(got[1], theirs[1])]
        else:
            entry["distance"] = [_distance(g, t) for g, t in zip(got, theirs)]
        # Declined (a batch past the workspace): vLLM's own ops, the unfused graph's values.
        big = _inputs(rank, DECLINED_ROWS, "Gemma" in name)
        big_args = [big[n] for n in names]
        fused_big = _trace(pattern, big_args, vllm_pass)
        unfused_big = _trace(pattern, big_args, vllm_pass)
        held(fused_big.graph)
        fused_big.recompile()
        a = fused_big(*big_args)
        b = unfused_big(*big_args)
        a = tuple(a) if isinstance(a, (tuple, list)) else (a,)
        b = tuple(b) if isinstance(b, (tuple, list)) else (b,)
        entry["declined_forms"] = dict(held.matched_forms)
        entry["declined_bitwise"] = [torch.equal(_bits(p), _bits(q)) for p, q in zip(a, b)]
        results[label] = entry

    # vLLM's native QuantFP8 (static, per tensor) of our y is our y_q, byte for byte.
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(config):
        quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False)
    scale = _inputs(rank, ROWS, False)["scale"]
    native = {}
    for plain, fp8 in (
        ("AllReduceRMSNormPattern", "AllReduceFusedRMSNormStaticQuantFP8Pattern"),
        ("AllReduceFusedAddRMSNormPattern", "AllReduceFusedAddRMSNormStaticQuantFP8Pattern"),
    ):
        y = ours_by_label[plain][0]
        q, _ = quant.forward_native(y, scale)
        native[plain] = [
            torch.equal(_bits(q), _bits(ours_by_label[f"{fp8}[{impl}]"][0]))
            for impl in ("_C", "native")
        ]
    inductor = _compiled(rank, held, slot.ar) if compiled else None
    stats = slot.stats()
    h.teardown_vllm_groups()
    return {
        "results": results,
        "inductor": inductor,
        "native_quant_of_our_y": native,
        "fused_declines": stats["fused_declines"],
        "routed": stats["fused_routed"],
    }


FORM_OF = {
    "AllReduceRMSNormPattern": "rms_norm",
    "AllReduceFusedAddRMSNormPattern": "fused_add_rms_norm",
    "AllReduceGemmaRMSNormPattern": "rms_norm",
    "AllReduceFusedAddGemmaRMSNormPattern": "fused_add_rms_norm",
    "AllReduceFusedRMSNormStaticQuantFP8Pattern": "rms_norm_fp8",
    "AllReduceFusedAddRMSNormStaticQuantFP8Pattern": "fused_add_rms_norm_fp8",
    "AllReduceFusedRMSNormStaticQuantNVFP4Pattern": "rms_norm_nvfp4",
    "AllReduceFusedAddRMSNormStaticQuantNVFP4Pattern": "fused_add_rms_norm_nvfp4",
}


@pytest.mark.parametrize("world", [2, 3])
def test_every_vllm_all_reduce_fusion_pattern_becomes_our_fused_op(world, tmp_path, clean_shm):
    model_dir = h.tiny_model_dir(str(tmp_path))
    compiled = world == 2  # Inductor's compile once: the lowering does not depend on the world
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for v in h.run_ranks(_forms_rank, world, model_dir, compiled, env=env).values():
        if compiled:
            assert v["inductor"]["forms"] == {"rms_norm_fp8": 1, "fused_add_rms_norm_nvfp4": 1}
            assert all(v["inductor"]["bitwise"]), v["inductor"]
        results = v["results"]
        # 10 traced, 2 of them "first only" too, the 4 FP8 ones also after fuse_norm_quant
        assert len(results) == 16, sorted(results)
        for label, r in results.items():
            form = FORM_OF[label.split("[")[0]]
            assert "vllm.all_reduce.default" in r["before"], label
            if label.endswith("[fuse_norm_quant]"):  # vLLM's own pass ran on the graph first
                assert f"_C.{form[:-4]}_static_fp8_quant.default" in r["before"], r["before"]
                assert r["last_arg"] == ["_C_fused"], (label, r["last_arg"])
            elif "FP8" in label:  # the decline path runs the quantisation the graph held
                assert r["last_arg"] == [label.split("[")[1][:-1]], (label, r["last_arg"])
            assert r["forms"] == {form: 1} and r["declined_forms"] == {form: 1}, (label, r)
            after = r["after"]
            assert f"pcie_allreduce_vllm.{form}.default" in after, (label, after)
            gone = ("vllm.all_reduce", "vllm_ir.", "_C.", "auto_functionalized", "reciprocal")
            assert not any(t.startswith(gone) or "clamp" in t for t in after), (label, after)
            assert r["count"][0] == r["count"][1], (label, r["count"])
            assert all(r["bitwise"]), (label, r["bitwise"], r["dtypes"])
            assert r["inputs_untouched"], label
            assert all(r["declined_bitwise"]), (label, r["declined_bitwise"])
            # vLLM's unfused graph: the same sum and residual out (our all-reduce through
            # vLLM's dispatch, the same add), a y its native norm rounds differently from ours
            # (the normalised row rounded to bf16 before the weight multiply): a few bf16 ulps
            # of the row's largest value, at most one step of FP8 or of NVFP4 (an e2m1 step is
            # at most 2 units of block max / 6) where the two roundings straddle a boundary.
            y_distance, *sum_distance = r["distance"]  # "first only": no second output
            assert sum_distance in ([], [0.0]), (label, r["distance"])
            limit = 2.0 if "NVFP4" in label else 1.0 if "FP8" in label else 2.0**-6
            assert y_distance <= limit, (label, r["distance"])
        assert v["native_quant_of_our_y"] == {
            "AllReduceRMSNormPattern": [True, True],
            "AllReduceFusedAddRMSNormPattern": [True, True],
        }
        assert v["routed"] == 16 + 2 * compiled
        assert v["fused_declines"] == {"too_large": 16}, v["fused_declines"]


# ---------------------------------------------------------------------- what the pass leaves
def _graph(fn: Any, *tensors: Any) -> Any:
    """``fn`` traced as vLLM traces its patterns (Inductor's decompositions), fake tensors."""
    import vllm.distributed.parallel_state  # noqa: F401 - defines the vllm.all_reduce op

    return _trace(fn, list(tensors))


def _rewritten(gm: Any, group: str = "tp:0") -> tuple[dict[str, int], list[str]]:
    from pcie_allreduce.integrations.vllm_fusion import FusedAddRmsNormRewrite

    rewrite = FusedAddRmsNormRewrite(group)
    rewrite(gm.graph)
    return rewrite.matched_forms, _targets(gm)


def _native_fp8(y: Any, scale: Any, bound: float = 448.0) -> Any:
    """QuantFP8.forward_native, static per tensor (``bound``: its clamp)."""
    import torch

    out = y.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return out.clamp(-bound, bound).to(torch.float8_e4m3fn)


def _norm_fp8(s: Any, w: Any, scale: Any, residual: Any = None) -> tuple:
    """vLLM's ``_C`` norm + static FP8 op on ``s`` as RMSNormQuantFusionPass's replacement
    writes it: (y_q, the updated residual) with a residual, else (y_q,)."""
    import torch
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    result = torch.empty(s.shape, dtype=torch.float8_e4m3fn)
    if residual is None:
        op, kwargs = torch.ops._C.rms_norm_static_fp8_quant.default, {}
    else:
        op, kwargs = (
            torch.ops._C.fused_add_rms_norm_static_fp8_quant.default,
            {"residual": residual},
        )
    at = auto_functionalized(
        op, result=result, input=s, weight=w, scale=scale, epsilon=EPS, **kwargs
    )
    return tuple(at[1:])


def test_the_pass_leaves_patterns_our_ops_do_not_compute():
    """Another group, a weight of another dtype (Gemma's offset only from a weight of x's dtype;
    none into vLLM's ``_C`` norm + FP8 ops), variance_size, a sum the op cannot return: the
    graph stays as it was."""
    import torch
    import vllm.ir.ops
    import vllm_c_ops

    vllm_c_ops.install()

    bf16 = torch.bfloat16
    x, res = torch.empty(ROWS, HIDDEN, dtype=bf16), torch.empty(ROWS, HIDDEN, dtype=bf16)
    w, w32 = torch.empty(HIDDEN, dtype=bf16), torch.empty(HIDDEN)

    def ar(t, group="tp:0"):  # noqa: ANN001, ANN202
        return torch.ops.vllm.all_reduce(t, group_name=group)

    def sum_used_elsewhere(r, x, w):  # noqa: ANN001, ANN202
        s = ar(x)
        return vllm.ir.ops.fused_add_rms_norm(s, r, w, EPS), s

    def sum_used_beside_c_add(r, x, w, scale):  # noqa: ANN001, ANN202
        s = ar(x)
        return _norm_fp8(s, w, scale, r), s

    scale = torch.empty(1, 1)
    cases = {
        "another group": (lambda x, w: vllm.ir.ops.rms_norm(ar(x, "pp:0"), w, EPS), [x, w]),
        "fp32 weight": (lambda x, w: vllm.ir.ops.rms_norm(ar(x), w, EPS), [x, w32]),
        "Gemma's offset on an fp32 weight": (
            lambda x, w: vllm.ir.ops.rms_norm(ar(x), w.float() + 1.0, EPS),
            [x, w32],
        ),
        "variance_size": (
            lambda x, w: vllm.ir.ops.rms_norm(ar(x), w, EPS, variance_size=HIDDEN // 2),
            [x, w],
        ),
        "sum used beside the add": (sum_used_elsewhere, [res, x, w]),
        "_C norm + FP8, another group": (
            lambda x, w, c: _norm_fp8(ar(x, "pp:0"), w, c),
            [x, w, scale],
        ),
        "_C norm + FP8, fp32 weight": (lambda x, w, c: _norm_fp8(ar(x), w, c), [x, w32, scale]),
        "_C norm + FP8, Gemma's fp32 weight": (
            lambda x, w, c: _norm_fp8(ar(x), w.float() + 1.0, c),
            [x, w, scale],
        ),
        "_C add + norm + FP8, sum used beside": (sum_used_beside_c_add, [res, x, w, scale]),
    }
    for label, (fn, args) in cases.items():
        gm = _graph(fn, *args)
        before = _targets(gm)
        forms, after = _rewritten(gm)
        assert forms == {} and after == before, (label, after)


def test_a_quantisation_our_ops_do_not_compute_stays_after_our_norm():
    """y used beside its quantisation, or clamped to another format's range: the all-reduce and
    norm become our plain form, the quantisation stays vLLM's. Gemma's weight with a
    quantisation (no vLLM pattern, the same arithmetic) becomes the quantised form; a sum read
    before the norm (IR or vLLM's ``_C`` norm + FP8) is the op's second output (the op goes
    before that reader)."""
    import torch
    import vllm.ir.ops
    import vllm_c_ops

    vllm_c_ops.install()

    bf16 = torch.bfloat16
    x, w = torch.empty(ROWS, HIDDEN, dtype=bf16), torch.empty(HIDDEN, dtype=bf16)
    scale = torch.empty(1, 1)

    def ar(t):  # noqa: ANN001, ANN202
        return torch.ops.vllm.all_reduce(t, group_name="tp:0")

    def y_used_twice(x, w, s):  # noqa: ANN001, ANN202
        y = vllm.ir.ops.rms_norm(ar(x), w, EPS)
        return _native_fp8(y, s), y

    def fnuz_range(x, w, s):  # noqa: ANN001, ANN202
        return _native_fp8(vllm.ir.ops.rms_norm(ar(x), w, EPS), s, 224.0)

    def gemma_fp8(x, w, s):  # noqa: ANN001, ANN202
        return _native_fp8(vllm.ir.ops.rms_norm(ar(x), w.float() + 1.0, EPS), s)

    def sum_read_before_the_norm(x, w, s):  # noqa: ANN001, ANN202
        total = ar(x)
        twice = total * 2  # the op goes before this reader and hands it the sum
        return vllm.ir.ops.rms_norm(total, w, EPS), twice

    def sum_read_before_c_norm_fp8(x, w, s):  # noqa: ANN001, ANN202
        total = ar(x)
        twice = total * 2
        return _norm_fp8(total, w, s)[0], twice

    for label, fn, form, quant_kept in (
        ("sum read before the norm", sum_read_before_the_norm, "rms_norm", False),
        ("sum read before _C's norm + FP8", sum_read_before_c_norm_fp8, "rms_norm_fp8", False),
        ("y used twice", y_used_twice, "rms_norm", True),
        ("another range", fnuz_range, "rms_norm", True),
        ("Gemma + FP8", gemma_fp8, "rms_norm_fp8", False),
    ):
        gm = _graph(fn, x, w, scale)
        forms, after = _rewritten(gm)
        assert forms == {form: 1}, (label, forms)
        assert not any(t.startswith(("vllm.all_reduce", "vllm_ir.", "_C.")) for t in after), after
        assert ("aten.reciprocal.default" in after) == quant_kept, (label, after)
        (op,) = [n for n in gm.graph.nodes if str(n.target).startswith("pcie_allreduce_vllm")]
        # y's readers (and the sum's, where the graph reads it) read the op's outputs.
        readers = {n.args for n in gm.graph.nodes if n.target is operator.getitem}
        want = {(op, 0), (op, 1)} if "sum" in label else {(op, 0)}
        assert readers == want, (label, after)
        assert op.args[-2 if form == "rms_norm_fp8" else -1] == (
            1.0 if "Gemma" in label else 0.0
        ), op.args
