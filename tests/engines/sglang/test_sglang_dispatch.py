"""SGLang's own dispatch, capture handling and teardown reaching our slot."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang: run .ci/engine-sglang")

from sglang_ranks import lines, load_sglang_plugins, make_group, run_ranks  # noqa: E402

# No warm-up tune here: these tests count calls, and a tune's measurements are calls too.
ENV = {"PCIE_ALLREDUCE_ENABLE": "1", "PCIE_ALLREDUCE_DISABLE_AUTOTUNE": "1"}
HIDDEN, ROWS = 256, 8


def _total_calls(slot: Any) -> int:
    return sum(slot.stats()["calls"].values())


def _dispatch(rank: int, world: int) -> dict[str, Any]:
    import torch

    from pcie_allreduce.testing import count_wrong, rank_input

    load_sglang_plugins()
    tp = make_group(rank, "tp")
    slot = tp.pcie_ipc_comm
    slot.prepare(hidden=HIDDEN, max_rows=ROWS)  # as SGLang's runner calls it
    out: dict[str, Any] = {"max_numel": slot.max_numel}
    resolve = tp._resolve_outplace_all_reduce_method
    admitted = {
        "bf16 1 row": torch.empty(1, HIDDEN, dtype=torch.bfloat16),
        "bf16 all rows": torch.empty(ROWS, HIDDEN, dtype=torch.bfloat16),
        "fp16": torch.empty(2, HIDDEN, dtype=torch.float16),
        "fp32": torch.empty(ROWS, HIDDEN, dtype=torch.float32),
    }
    declined = {
        "too large": torch.empty(ROWS + 1, HIDDEN, dtype=torch.bfloat16),
        "float64": torch.empty(2, HIDDEN, dtype=torch.float64),
        "int32": torch.empty(2, HIDDEN, dtype=torch.int32),
    }
    out["admitted"] = {k: resolve(t) for k, t in admitted.items()}
    out["declined"] = {k: resolve(t) for k, t in declined.items()}
    out["declines"] = slot.stats()["declines"]

    calls_before = _total_calls(slot)
    wrong, fresh, untouched = {}, {}, {}
    for name, dtype, rows in (("bf16", torch.bfloat16, ROWS), ("fp32", torch.float32, 3)):
        x = rank_input(rank, rows * HIDDEN, dtype, seed=5).view(rows, HIDDEN)
        before = x.clone()
        y = tp._all_reduce_out_place(x, "auto")  # SGLang resolves "pcie_ipc" and calls us
        wrong[name] = count_wrong(y.flatten(), world, rows * HIDDEN, name, seed=5)
        fresh[name] = y is not x and y.data_ptr() != x.data_ptr()
        untouched[name] = torch.equal(x, before)
    z = tp._all_reduce_out_place(
        rank_input(rank, HIDDEN, torch.bfloat16, 6).view(1, HIDDEN), "pcie_ipc"
    )
    wrong["explicit"] = count_wrong(z.flatten(), world, HIDDEN, "bf16", seed=6)
    out.update(
        wrong=wrong, fresh=fresh, untouched=untouched, calls=_total_calls(slot) - calls_before
    )

    # SGLang's destroy: ours first, while both groups live; then the process groups.
    import torch.distributed as dist

    events = []
    real_destroy_pg = dist.destroy_process_group

    def destroy_pg(group=None):
        events.append("destroy_process_group")
        return real_destroy_pg(group)

    real_slot_destroy = slot.destroy

    def slot_destroy():
        events.append(("pcie_allreduce", tp.device_group is not None, tp.cpu_group is not None))
        real_slot_destroy()

    dist.destroy_process_group = destroy_pg
    slot.destroy = slot_destroy
    try:
        tp.destroy()
    finally:
        dist.destroy_process_group = real_destroy_pg
        del slot.destroy
    out["events"] = events
    out["slot_after"] = tp.pcie_ipc_comm
    out["disabled_after"] = slot.disabled
    slot.destroy()  # idempotent: no second summary line
    return out


def test_sglang_dispatch_picks_our_slot_for_admitted_sizes_and_sums_correctly():
    results = run_ranks(_dispatch, env=ENV)
    for rank, r in enumerate(results):
        value = r["value"]
        assert value["max_numel"] == HIDDEN * ROWS
        assert set(value["admitted"].values()) == {"pcie_ipc"}
        assert set(value["declined"].values()) == {None}
        assert value["declines"] == {"too_large": 1, "dtype": 2}
        assert value["wrong"] == {"bf16": 0, "fp32": 0, "explicit": 0}
        assert all(value["fresh"].values()) and all(value["untouched"].values())
        assert value["calls"] == 3
        assert value["events"] == [
            ("pcie_allreduce", True, True),
            "destroy_process_group",
            "destroy_process_group",
        ]
        assert value["slot_after"] is None and value["disabled_after"] is True
        summary = lines([r], f"pcie_allreduce[tp rank {rank}/2]: enabled; calls: ")
        assert len(summary) == 1, r["logs"]
        assert "declines: dtype 2, too_large 1" in summary[0][2]
        assert not lines([r], "did not wait for every peer")  # the farewell found its peer


def _capture(rank: int, world: int) -> dict[str, Any]:
    import torch

    import pcie_allreduce.integrations.sglang as ours

    capturing = {"on": False}
    ours._stream_capturing = lambda device: capturing["on"]  # what a CUDA capture reports
    load_sglang_plugins()
    tp = make_group(rank, "tp")
    slot = tp.pcie_ipc_comm
    x = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    out: dict[str, Any] = {}
    capturing["on"] = True  # a capture before prepare(): decline, build nothing inside it
    out["before_prepare"] = tp._resolve_outplace_all_reduce_method(x)
    out["built_in_capture"] = slot.communicator is not None
    capturing["on"] = False
    slot.prepare(hidden=HIDDEN, max_rows=ROWS)
    capturing["on"] = True
    out["in_capture"] = [tp._resolve_outplace_all_reduce_method(x) for _ in range(3)]
    out["sum_in_capture"] = tp._all_reduce_out_place(x, "auto")[0, 0].item()
    import os

    os.environ.pop("PCIE_ALLREDUCE_DISABLE_AUTOTUNE")  # only the capture may refuse it now
    try:
        slot.communicator.tune(max_bytes=1024, budget_s=1.0)
        out["tune_in_capture"] = "ran"
    except RuntimeError as error:
        out["tune_in_capture"] = str(error)
    out["captures_during"] = slot.stats()["captures"]
    capturing["on"] = False
    out["eager"] = tp._resolve_outplace_all_reduce_method(x)
    capturing["on"] = True
    out["second_capture"] = tp._resolve_outplace_all_reduce_method(x)
    out["captures"] = slot.stats()["captures"]
    out["declines"] = slot.stats()["declines"]
    capturing["on"] = False
    tp.destroy()
    return out


def test_capture_before_prepare_declines_and_after_prepare_is_bracketed():
    """SGLang's graph_capture() has no hook for the slot: the slot watches the capture state
    itself (simulated here: the CPU has no CUDA capture)."""
    results = run_ranks(_capture, env=ENV)
    for r in results:
        value = r["value"]
        assert value["before_prepare"] is None and not value["built_in_capture"]
        assert value["in_capture"] == ["pcie_ipc"] * 3
        assert value["sum_in_capture"] == 2.0
        assert "inside another autotune pass" in value["tune_in_capture"]
        assert value["captures_during"] == 1
        assert value["eager"] == "pcie_ipc" and value["second_capture"] == "pcie_ipc"
        assert value["captures"] == 2
        assert value["declines"] == {"not_prepared": 1}
    assert len(lines(results, "reached the slot before prepare()")) == 1  # rank 0, once


def _lazy(rank: int, world: int) -> dict[str, Any]:
    import torch

    load_sglang_plugins()
    tp = make_group(rank, "tp")
    slot = tp.pcie_ipc_comm
    x = torch.full((3, 96), float(rank + 1), dtype=torch.float32)
    method = tp._resolve_outplace_all_reduce_method(x)  # no prepare(): built here
    y = tp._all_reduce_out_place(x, "auto")
    out = {
        "method": method,
        "max_numel": slot.max_numel,
        "sum": y.unique().tolist(),
        "sizing": slot.stats()["sizing"],
    }
    tp.destroy()
    return out


def test_without_prepare_the_first_offered_reduction_builds_the_communicator():
    results = run_ranks(_lazy, env=ENV)
    for r in results:
        value = r["value"]
        # Nothing published and no prepare(): the announced guess of 64 rows of this hidden.
        assert value["method"] == "pcie_ipc" and value["sum"] == [3.0]
        assert value["max_numel"] == 64 * 96 and "guessing" in value["sizing"]
    assert len(lines(results, "guessing 64 rows x 96 hidden")) == 2  # size_workspace's warning
