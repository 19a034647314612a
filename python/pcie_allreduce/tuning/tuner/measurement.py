"""How a tune measures one operation at one size bucket: every rank runs the same contenders in
the same order on small-integer inputs whose sums are exact, excludes a contender that gives a
wrong result on any rank, then times the rest in interleaved rounds until each finalist's ratio
to the incumbent is known, or the bucket's budget is spent; the incumbent stays unless beaten by
more than the noise (``decision``). The operations: the all-reduce, the reduce-scatter and the
all-gather, each against its own fallback."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import policy
from ...errors import TuneError
from ...testing import DTYPES
from ..decision import (
    MIN_MARGIN,
    MIN_MARGIN_MEASURED,
    keep_or_replace,
    median,
    median_and_error,
    ratio_and_error,
)
from ..model import row_prefix
from .sweep import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    Candidate,
    candidates,
    columns_of_label,
)

logger = logging.getLogger("pcie_allreduce")

_MIN_ROUNDS = 10
_FLOOR_ROUNDS = 3  # a bucket whose budget is spent stops here, short of _MIN_ROUNDS
_MAX_ROUNDS = 60
_PRECISION = 0.01  # stop once every finalist's ratio to the incumbent is known to 1 %
_FINALIST = 1.25  # after the minimum rounds only contenders this close to the best are timed
_BLOCK_SECONDS = 0.001  # one timed block of calls per contender per round


def _exact_input(rank: int, numel: int, dtype: Any) -> Any:
    """Small integers (-4..4): their sum over 8 ranks is exact in every dtype, so a tactic's
    result must equal the reference bit for bit."""
    idx = torch.arange(numel, dtype=torch.int64)
    return ((idx * 7 + rank * 13) % 9 - 4).to(dtype)


def _exact_sum(world: int, numel: int, dtype: Any) -> Any:
    total = _exact_input(0, numel, dtype).double()
    for r in range(1, world):
        total += _exact_input(r, numel, dtype).double()
    return total.to(dtype)


@dataclass
class _Case:
    """One operation at one message size on this rank: its input, the output a call writes,
    the exact result that output must hold, and the call."""

    x: Any
    y: Any
    expected: Any
    call: Callable[[], None]


def _case(ar: Any, op: str, numel: int, dtype: Any) -> _Case:
    """``op`` on a message of ``numel`` elements (a collective's message is the whole tensor:
    reduce-scatter's input, all-gather's output). The reference: the exact sum (all-reduce),
    this rank's chunk of it (reduce-scatter), every rank's input in rank order (all-gather)."""
    rank, world = ar.rank, ar.world_size
    if op == ALL_REDUCE:
        x = _exact_input(rank, numel, dtype).to(ar.device)
        y = torch.empty_like(x)
        return _Case(x, y, _exact_sum(world, numel, dtype), lambda: ar.all_reduce(x, out=y))
    chunk = numel // world
    if op == REDUCE_SCATTER:
        x = _exact_input(rank, numel, dtype).to(ar.device)
        y = torch.empty(chunk, dtype=dtype, device=ar.device)
        expected = _exact_sum(world, numel, dtype)[rank * chunk : (rank + 1) * chunk]
        return _Case(x, y, expected, lambda: ar.reduce_scatter(x, out=y))
    if op == ALL_GATHER:
        x = _exact_input(rank, chunk, dtype).to(ar.device)
        y = torch.empty(numel, dtype=dtype, device=ar.device)
        expected = torch.cat([_exact_input(r, chunk, dtype) for r in range(world)])
        return _Case(x, y, expected, lambda: ar.all_gather(x, out=y))
    raise ValueError(f"no tuned operation {op!r}")


class Measurement:
    """One tune's measurements of one communicator: every rank runs the same candidates in the
    same order; every decision is computed from gathered numbers. ``synthetic_timer(label,
    size_bytes, op) -> seconds per call``, when given, replaces how a block of calls is timed
    (the calls still run)."""

    def __init__(
        self,
        ar: Any,
        budget_s: float,
        use: Callable[[str | None], None],
        synthetic_timer: Callable[[str, int, str], float] | None = None,
    ) -> None:
        self.ar, self.use, self.budget_s = ar, use, budget_s
        self.synthetic_timer = synthetic_timer
        self.cuda = ar.device.type == "cuda"
        # CUDA-graph replay is how engines run decode, so that is what is timed; the fallback
        # only when its backend can be captured (NCCL can, gloo cannot).
        self.graph_fallback = self.cuda and dist.get_backend(ar.group) == "nccl"
        self.sync = (lambda: torch.cuda.synchronize(ar.device)) if self.cuda else (lambda: None)
        measured = ar.table.source.startswith(policy.cache_source(""))
        self.min_margin = MIN_MARGIN_MEASURED if measured else MIN_MARGIN
        self._candidates: dict[str, list[Candidate]] = {}
        self.measured = 0
        self.excluded: list[dict[str, Any]] = []

    def candidates(self, op: str) -> list[Candidate]:
        """Every tactic the plan layer builds for ``op`` here, then the fallback."""
        if op not in self._candidates:
            config = self.ar.config
            self._candidates[op] = candidates(
                config.transport, self.ar.world_size, config.island_of, config.max_blocks, op
            )
        return self._candidates[op]

    def install(self, columns: str, dtype: str, op: str = ALL_REDUCE) -> None:
        """A trial table whose one row sends every ``op`` call of ``dtype`` to ``columns``."""
        self.use(f"*,*,{dtype},0,*,{row_prefix(op)}{columns}\n")

    def restore(self) -> None:
        self.use(None)

    def _timed(
        self, fn: Any, calls: int, label: str = "", size: int = 0, op: str = ALL_REDUCE
    ) -> float:
        """Seconds per call of ``calls`` calls of ``fn`` (CUDA-graph replay on GPUs)."""
        if self.synthetic_timer is not None:
            fn()
            return float(self.synthetic_timer(label, size, op))

        if self.cuda and (label != "fallback" or self.graph_fallback):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
            self.sync()
            start = time.perf_counter()
            graph.replay()
            self.sync()
            return (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        self.sync()
        return (time.perf_counter() - start) / calls

    def bucket(
        self,
        dtype: str,
        lo: int,
        size: int,
        hi: int,
        budget_s: float,
        op: str = ALL_REDUCE,
    ) -> dict[str, Any] | None:
        """Measures ``op`` on a message of ``size`` bytes (a collective's: a multiple of world
        x 16 bytes, ``sweep.message_size``) for the bucket [lo, hi); None when the kernels cannot
        run that size (then only the fallback could)."""
        numel = size // DTYPES[dtype].itemsize
        case = _case(self.ar, op, numel, DTYPES[dtype])
        if op == ALL_REDUCE and self.ar.supports(case.x) is not None:
            return None
        self.restore()
        incumbent = self.ar.tactic(op, case.x)
        contenders = self._runnable(case.x, dtype, incumbent, op)
        if set(contenders) <= {"fallback"}:
            return None
        contenders = self._correct(contenders, dtype, case, size, op)
        if not contenders:
            raise TuneError(
                f"no tactic and not even the fallback gave the exact {op} at {size} "
                f"bytes {dtype}: nothing to choose from"
            )
        samples = self._rounds(contenders, dtype, case.call, budget_s, incumbent, size, op)
        stats = {label: median_and_error(times) for label, times in samples.items()}
        winner, ratio, margin = keep_or_replace(incumbent, samples, self.min_margin)
        self.measured += len(samples)
        return {
            "op": op,
            "dtype": dtype,
            "bytes": size,
            "min_bytes": lo,
            "max_bytes": hi,
            "winner": winner,
            "columns": row_prefix(op) + contenders[winner],
            "time_us": stats[winner][0] * 1e6,
            "noise_pct": stats[winner][1] * 100,
            "fallback_us": stats["fallback"][0] * 1e6 if "fallback" in stats else float("nan"),
            "incumbent": incumbent,
            "incumbent_us": stats[incumbent][0] * 1e6 if incumbent in stats else float("nan"),
            "ratio": ratio,
            "margin_pct": margin * 100,
            "changed": winner != incumbent,
            "rounds": len(samples[incumbent]),
            "measured": {label: stats[label][0] * 1e6 for label in stats},
        }

    def _runnable(self, x: Any, dtype: str, incumbent: str, op: str) -> dict[str, str]:
        """label -> columns of every candidate the communicator can run for ``op`` at this
        size; the incumbent is always among them (it may use a shape the sweep does not try)."""
        out: dict[str, str] = {}
        for c in self.candidates(op):
            self.install(c.columns, dtype, op)
            if self.ar.tactic(op, x) == c.label:
                out[c.label] = c.columns
        out.setdefault(incumbent, columns_of_label(incumbent))
        return out

    def _correct(
        self, contenders: dict[str, str], dtype: str, case: _Case, size: int, op: str
    ) -> dict[str, str]:
        """Correctness first: a contender that gives a wrong result on any rank (one bit off
        the exact reference) is excluded, with a warning that names it and its operation."""
        mine = []
        for columns in contenders.values():
            self.install(columns, dtype, op)
            case.y.fill_(0)
            case.call()
            self.sync()
            mine.append(bool(torch.equal(case.y.cpu(), case.expected)))
        everyone = self.ar.gather(mine, "tune: correctness")
        ok: dict[str, str] = {}
        for i, (label, columns) in enumerate(contenders.items()):
            wrong = [r for r, flags in enumerate(everyone) if not flags[i]]
            if wrong:
                self.excluded.append(
                    {"op": op, "tactic": label, "dtype": dtype, "bytes": size, "ranks": wrong}
                )
                logger.warning(
                    "pcie_allreduce tune: %s %s gave a wrong result at %d bytes %s on ranks %s: "
                    "excluded",
                    op,
                    label,
                    size,
                    dtype,
                    wrong,
                )
            else:
                ok[label] = columns
        return ok

    def _rounds(
        self,
        contenders: dict[str, str],
        dtype: str,
        call: Any,
        budget_s: float,
        incumbent: str,
        size: int,
        op: str = ALL_REDUCE,
    ) -> dict[str, list[float]]:
        """Interleaved rounds (each contender timed once per round, in a rotating order). After
        the minimum rounds only the finalists (within 25 % of the best, and the incumbent) are
        timed, until each one's ratio to the incumbent is known to 1 % or the bucket's budget
        is spent (then after _FLOOR_ROUNDS at least, even short of the minimum). Every rank
        computes the same stop from the same gathered numbers."""
        labels = list(contenders)
        probe = []
        for label in labels:
            self.install(contenders[label], dtype, op)
            call()
            probe.append(self._timed(call, 3, label, size, op))
        slowest = [max(col) for col in zip(*self.ar.gather(probe, "tune: probe"))]
        # Blocks short enough that the minimum rounds fit in half the bucket's budget.
        block = min(_BLOCK_SECONDS, budget_s / (2 * _MIN_ROUNDS * len(labels)))
        calls = {
            label: int(min(500, max(3, block / max(t, 1e-7)))) for label, t in zip(labels, slowest)
        }
        samples: dict[str, list[float]] = {label: [] for label in labels}
        active = list(labels)
        start = time.perf_counter()
        for round_no in range(_MAX_ROUNDS):
            order = active[round_no % len(active) :] + active[: round_no % len(active)]
            mine = {}
            for label in order:
                self.install(contenders[label], dtype, op)
                call()
                mine[label] = self._timed(call, calls[label], label, size, op)
            everyone = self.ar.gather(
                {"t": mine, "elapsed": time.perf_counter() - start}, "tune: round"
            )
            for label in active:
                samples[label].append(max(e["t"][label] for e in everyone))
            elapsed = max(e["elapsed"] for e in everyone)
            if round_no + 1 >= _FLOOR_ROUNDS and elapsed > budget_s:
                break  # the budget is the operator's: a few rounds' median rather than overrun
            if round_no + 1 < _MIN_ROUNDS:
                continue
            ratios = {
                label: median([t / i for t, i in zip(samples[label], samples[incumbent])])
                for label in active
            }
            best = min(ratios.values())
            active = [
                label for label in active if ratios[label] <= _FINALIST * best or label == incumbent
            ]
            errors = [
                ratio_and_error(samples[label], samples[incumbent])[1]
                for label in active
                if label != incumbent
            ]
            if all(e <= _PRECISION for e in errors) or elapsed > budget_s:
                break
        return samples
