"""PcieAllReduce.try_run, the one decision a caller with a path of its own makes per call: what
the kernels take runs and returns what it wrote (the torch op's result, bit for bit); what they
decline returns the reason having written and counted nothing. decline()/tactic() answer for
every operation. Real processes, real shared memory, a real gloo group."""

from __future__ import annotations

import pytest
import torch
from conftest import run_ranks

from pcie_allreduce.testing import rank_input

ROWS, HIDDEN = 4, 64


def _try_run(rank, world):
    from pcie_allreduce import PcieAllReduce

    numel = world * ROWS * HIDDEN
    x = rank_input(rank, numel, torch.float32, seed=21).view(world * ROWS, HIDDEN)
    residual = rank_input(0, numel, torch.float32, seed=22).view(world * ROWS, HIDDEN)
    weight = rank_input(0, HIDDEN, torch.float32, seed=23)
    with PcieAllReduce(None, "cpu", max_numel=numel, timeout_s=10, stream_max_numel=0) as ar:
        total, reason = ar.try_run("all_reduce", x)
        assert reason is None and torch.equal(total, ar.all_reduce(x))
        mine = total[rank * ROWS : (rank + 1) * ROWS]
        out = torch.empty(ROWS, HIDDEN)
        got, reason = ar.try_run("reduce_scatter", x, out=out)
        assert reason is None and got is out and torch.equal(out, mine)
        gathered, reason = ar.try_run("all_gather", mine.clone())
        assert reason is None and torch.equal(gathered[rank * ROWS : (rank + 1) * ROWS], mine)
        fused, reason = ar.try_run(
            "all_reduce_add_rms_norm", x, residual=residual, weight=weight, eps=1e-6
        )
        expected = ar.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
        assert reason is None and all(torch.equal(a, b) for a, b in zip(fused, expected))

        counted = ar.stats()
        big = torch.ones(numel + 8 * world)
        untouched = torch.full((big.numel() // world,), -1.0)
        declined = {
            "all_reduce": ar.try_run("all_reduce", big),
            "reduce_scatter": ar.try_run("reduce_scatter", big, out=untouched),
            "all_gather": ar.try_run("all_gather", torch.ones(numel // world + 8)),
            "fused": ar.try_run(
                "all_reduce_add_rms_norm", x, residual=residual, weight=weight.double(), eps=1e-6
            ),
        }
        assert {
            k: declined[k] for k in ("all_reduce", "reduce_scatter", "all_gather", "fused")
        } == {
            "all_reduce": (None, "too_large"),
            "reduce_scatter": (None, "too_large"),
            "all_gather": (None, "too_large"),
            "fused": (None, "dtype"),
        }
        # Grad mode on and an operand it reads tracked (an engine's nn.Parameter outside its
        # inference mode): the caller's differentiable path runs the call.
        tracked = weight.clone().requires_grad_()
        declined["fused_tracked"] = ar.try_run(
            "all_reduce_add_rms_norm", x, residual=residual, weight=tracked, eps=1e-6
        )
        declined["all_reduce_tracked"] = ar.try_run("all_reduce", x.clone().requires_grad_())
        assert declined["fused_tracked"] == declined["all_reduce_tracked"] == (None, "autograd")
        with pytest.raises(ValueError, match="weight"):  # other argument errors still raise
            ar.try_run("all_reduce_add_rms_norm", x, residual=residual, weight=tracked[:-4])
        assert ar.stats() == counted  # a decline counts nothing: the caller's path runs it
        with torch.no_grad():  # the engine's inference mode: nothing is tracked, the kernels run
            fused, reason = ar.try_run(
                "all_reduce_add_rms_norm", x, residual=residual, weight=tracked, eps=1e-6
            )
        assert reason is None and all(torch.equal(a, b) for a, b in zip(fused, expected))
        assert bool((untouched == -1.0).all())
        assert ar.decline("all_reduce", big) == "too_large" == ar.decline_reason(big)
        assert ar.decline("all_reduce_add_rms_norm", x, weight.double()) == "dtype"
        assert ar.tactic("all_reduce_add_rms_norm", x, weight.double()) == "unfused"
        assert ar.tactic("reduce_scatter", big) == "fallback"
        assert ar.tactic("all_reduce", x) == ar.chosen_tactic(x)
    return True


def test_try_run_runs_what_the_kernels_take_and_leaves_the_rest_untouched(clean_shm):
    assert run_ranks(_try_run, 2).values() == [True, True]
