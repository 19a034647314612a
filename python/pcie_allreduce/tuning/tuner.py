"""The tuner: measures this host once and writes its tuning cache.

``tune()`` times every runnable tactic (and the fallback) per size bucket, keeps the incumbent
unless a challenger wins by more than the measured noise (``decision``), and writes
``cache.cache_path(fingerprint)``; the next communicator on the same host (same fingerprint)
loads that file and measures nothing. It drives a :class:`~pcie_allreduce.PcieAllReduce`
through its public interface only: ``config``, ``table``, ``gather``, ``trial``,
``install_table``, ``supports``, ``chosen_tactic`` and ``all_reduce``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import policy
from ..env import read_env
from ..errors import TableMismatch, TuneError, TuneRefused
from ..native import _C
from ..plan import ALGORITHMS, PROTOCOLS
from ..testing import DTYPES
from . import cache
from .decision import (
    MIN_MARGIN,
    MIN_MARGIN_MEASURED,
    keep_or_replace,
    median,
    median_and_error,
    ratio_and_error,
)
from .passes import current_pass

logger = logging.getLogger("pcie_allreduce")

_HOST_SHAPES = ((1, 32), (2, 32))  # (blocks, threads): the host executor ignores threads
_CUDA_SHAPES = tuple((b, t) for b in (4, 8, 16, 32) for t in (256, 512))
_MIN_ROUNDS = 10
_FLOOR_ROUNDS = 3  # a bucket whose budget is spent stops here, short of _MIN_ROUNDS
_MAX_ROUNDS = 60
_PRECISION = 0.01  # stop once every finalist's ratio to the incumbent is known to 1 %
_FINALIST = 1.25  # after the minimum rounds only contenders this close to the best are timed
_BLOCK_SECONDS = 0.001  # one timed block of calls per contender per round
_FALLBACK_ROW = "fallback,,,,,"

# Tests replace how a block of calls is timed, to drive the decision logic with known costs
# and known noise: synthetic_timer(label, size_bytes) -> seconds per call. The calls still run.
synthetic_timer: Any | None = None


@dataclass(frozen=True)
class Candidate:
    """One contender: a tactic label (or ``fallback``) and its table columns 6..11."""

    label: str
    columns: str


def candidates(
    transport: str, world: int, island_of: Sequence[int], max_blocks: int
) -> list[Candidate]:
    """Every tactic the plan layer supports here, in every (blocks, threads) shape worth
    trying on this transport, then the fallback."""
    shapes = _HOST_SHAPES if transport == policy.HOST_SHM else _CUDA_SHAPES
    out: list[Candidate] = []
    for algorithm in ALGORITHMS:
        for direction in ("push", "pull"):
            for staged in (False, True):
                for protocol in PROTOCOLS:
                    if (
                        _C.why_unsupported(
                            algorithm, world, list(island_of), direction, staged, protocol
                        )
                        is not None
                    ):
                        continue
                    for blocks, threads in shapes:
                        if blocks > max_blocks:
                            continue
                        label = (
                            f"{algorithm}/{direction}/{'staged' if staged else 'unstaged'}"
                            f"/{protocol}/b{blocks}/t{threads}"
                        )
                        columns = (
                            f"{algorithm},{direction},{int(staged)},{blocks},{threads},{protocol}"
                        )
                        out.append(Candidate(label, columns))
    out.append(Candidate("fallback", _FALLBACK_ROW))
    return out


def columns_of_label(label: str) -> str:
    """Table columns 6..11 for a tactic label ``alg/dir/staged|unstaged/proto/bN/tM``."""
    if label == "fallback":
        return _FALLBACK_ROW
    algorithm, direction, staged, protocol, blocks, threads = label.split("/")
    staged_flag = int(staged == "staged")
    return f"{algorithm},{direction},{staged_flag},{blocks[1:]},{threads[1:]},{protocol}"


def buckets(max_bytes: int, min_bytes: int = 1024) -> list[tuple[int, int, int]]:
    """(lo, measured size, hi) per bucket: sizes 1 KiB, 2 KiB, ... up to ``max_bytes``; each
    bucket reaches halfway (geometrically) to its neighbours, the first from 0 and the last to
    no bound (hi = -1), boundaries on 16 bytes."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    if not sizes:
        sizes = [max(16, max_bytes // 16 * 16)]
    edges = [0] + [int(s * 1.4142135623730951) // 16 * 16 for s in sizes[:-1]] + [-1]
    return [(edges[i], s, edges[i + 1]) for i, s in enumerate(sizes)]


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


class _Progress:
    """A bar on a terminal, log lines otherwise (rank 0 only)."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.done, self.show = total, 0, show
        self.tty = show and sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.show:
            return
        if self.tty:
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r[pcie_allreduce tune] [{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done}/{self.total} {what:<40}"
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            logger.info("pcie_allreduce tune: %d/%d %s", self.done, self.total, what)


class _Tuner:
    """One tune of one communicator: every rank runs the same candidates in the same order;
    every decision is computed from gathered numbers, and rank 0's table is the one kept."""

    def __init__(self, ar: Any, budget_s: float, use: Callable[[str | None], None]) -> None:
        self.ar, self.use, self.budget_s = ar, use, budget_s
        self.cuda = ar.device.type == "cuda"
        # CUDA-graph replay is how engines run decode, so that is what is timed; the fallback
        # only when its backend can be captured (NCCL can, gloo cannot).
        self.graph_fallback = self.cuda and dist.get_backend(ar.group) == "nccl"
        self.sync = (lambda: torch.cuda.synchronize(ar.device)) if self.cuda else (lambda: None)
        measured = ar.table.source.startswith(policy.cache_source(""))
        self.min_margin = MIN_MARGIN_MEASURED if measured else MIN_MARGIN
        config = ar.config
        self.candidates = candidates(
            config.transport, ar.world_size, config.island_of, config.max_blocks
        )
        self.measured = 0
        self.excluded: list[dict[str, Any]] = []

    def install(self, columns: str, dtype: str) -> None:
        self.use(f"*,*,{dtype},0,*,{columns}\n")

    def restore(self) -> None:
        self.use(None)

    def _timed(self, fn: Any, calls: int, label: str = "", size: int = 0) -> float:
        """Seconds per call of ``calls`` calls of ``fn`` (CUDA-graph replay on GPUs)."""
        if synthetic_timer is not None:
            fn()
            return float(synthetic_timer(label, size))

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
        self, dtype: str, lo: int, size: int, hi: int, budget_s: float
    ) -> dict[str, Any] | None:
        """Measures one size bucket; None when the communicator declines that size."""
        numel = size // DTYPES[dtype].itemsize
        x = _exact_input(self.ar.rank, numel, DTYPES[dtype]).to(self.ar.device)
        if self.ar.supports(x) is not None:
            return None
        expected = _exact_sum(self.ar.world_size, numel, DTYPES[dtype])
        y = torch.empty_like(x)
        self.restore()
        incumbent = self.ar.chosen_tactic(x)
        contenders = self._runnable(x, dtype, incumbent)

        def call() -> None:
            self.ar.all_reduce(x, out=y)

        contenders = self._correct(contenders, dtype, call, y, expected, size)
        if not contenders:
            raise TuneError(
                f"no tactic and not even the fallback gave the exact sum at {size} "
                f"bytes {dtype}: nothing to choose from"
            )
        samples = self._rounds(contenders, dtype, call, budget_s, incumbent, size)
        stats = {label: median_and_error(times) for label, times in samples.items()}
        winner, ratio, margin = keep_or_replace(incumbent, samples, self.min_margin)
        self.measured += len(samples)
        return {
            "dtype": dtype,
            "bytes": size,
            "min_bytes": lo,
            "max_bytes": hi,
            "winner": winner,
            "columns": contenders[winner],
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

    def _runnable(self, x: Any, dtype: str, incumbent: str) -> dict[str, str]:
        """label -> columns of every candidate the communicator can run at this size; the
        incumbent is always among them (it may use a shape the sweep does not try)."""
        out: dict[str, str] = {}
        for c in self.candidates:
            self.install(c.columns, dtype)
            if self.ar.chosen_tactic(x) == c.label:
                out[c.label] = c.columns
        out.setdefault(incumbent, columns_of_label(incumbent))
        return out

    def _correct(
        self, contenders: dict[str, str], dtype: str, call: Any, y: Any, expected: Any, size: int
    ) -> dict[str, str]:
        """Correctness first: a contender that gives a wrong sum on any rank is excluded, with
        a warning that names it."""
        mine = []
        for columns in contenders.values():
            self.install(columns, dtype)
            y.fill_(0)
            call()
            self.sync()
            mine.append(bool(torch.equal(y.cpu(), expected)))
        everyone = self.ar.gather(mine, "tune: correctness")
        ok: dict[str, str] = {}
        for i, (label, columns) in enumerate(contenders.items()):
            wrong = [r for r, flags in enumerate(everyone) if not flags[i]]
            if wrong:
                self.excluded.append(
                    {"tactic": label, "dtype": dtype, "bytes": size, "ranks": wrong}
                )
                logger.warning(
                    "pcie_allreduce tune: %s gave a wrong sum at %d bytes %s on ranks %s: excluded",
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
    ) -> dict[str, list[float]]:
        """Interleaved rounds (each contender timed once per round, in a rotating order). After
        the minimum rounds only the finalists (within 25 % of the best, and the incumbent) are
        timed, until each one's ratio to the incumbent is known to 1 % or the bucket's budget
        is spent (then after _FLOOR_ROUNDS at least, even short of the minimum). Every rank
        computes the same stop from the same gathered numbers."""
        labels = list(contenders)
        probe = []
        for label in labels:
            self.install(contenders[label], dtype)
            call()
            probe.append(self._timed(call, 3, label, size))
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
                self.install(contenders[label], dtype)
                call()
                mine[label] = self._timed(call, calls[label], label, size)
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


def _refusal(ar: Any) -> str | None:
    """Why this rank must not tune now, or None."""
    if read_env().disable_autotune:
        return "PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1"
    outer = current_pass()
    if outer is not None:
        return (
            f"inside another autotune pass ({outer}): its timings would measure that pass; "
            "tune before or after it"
        )
    if ar.device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return "during CUDA graph capture: nothing can be timed while a graph is recorded"
    if not ar.enabled:
        return f"the communicator is disabled ({ar.disabled_reason}): there is nothing to tune"
    return None


def _check_arguments(
    ar: Any, dtypes: Sequence[str] | None, max_bytes: int | None, budget_s: float
) -> list[str]:
    """The dtypes to tune; a bad argument raises on this rank before any exchange."""
    admitted = list(ar.config.dtypes)
    chosen = list(dtypes) if dtypes is not None else admitted
    unknown = [d for d in chosen if d not in admitted]
    if not chosen or unknown:
        raise ValueError(
            f"tune(dtypes={dtypes!r}): expected a non-empty subset of the "
            f"communicator's dtypes {admitted}"
        )
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 16
    ):
        raise ValueError(f"tune(max_bytes={max_bytes!r}): expected a whole number of bytes >= 16")
    if (
        isinstance(budget_s, bool)
        or not isinstance(budget_s, (int, float))
        or not (0 < budget_s < float("inf"))
    ):
        raise ValueError(f"tune(budget_s={budget_s!r}): expected a positive number of seconds")
    return chosen


def _agree_to_tune(ar: Any) -> None:
    """Every rank says whether it may tune; any refusal is raised on every rank, named."""
    everyone = ar.gather(_refusal(ar), "tune: start")
    refused = [(r, why) for r, why in enumerate(everyone) if why is not None]
    if refused:
        rank, why = refused[0]
        raise TuneRefused(f"pcie_allreduce tune refused on rank {rank}: {why}; measured nothing")


def _lock_cache(ar: Any, path: Path, wait_s: float) -> cache.CacheLock | None:
    """Rank 0 takes the cache lock; every rank waits (bounded, in small steps, so no
    exchange outlives the timeout) while another tune of this host holds it."""
    lock = cache.CacheLock(path) if ar.rank == 0 else None
    deadline = time.monotonic() + wait_s
    while True:
        state = None
        if lock is not None:
            try:
                state = "held" if lock.try_acquire() else f"busy (pid {lock.holder()})"
            except OSError as error:  # an unwritable or untrusted folder (files.Refused)
                # Said to every rank, which all raise it now: rank 0 alone raising would leave
                # the others waiting out the timeout for a gather it never joins.
                state = f"error: {error}"
        state = ar.gather(state, "tune: cache lock")[0]
        if state == "held":
            return lock
        if state.startswith("error: "):
            raise TuneError(
                f"rank 0 cannot lock the cache {path}.lock ({state[7:]}); measured nothing"
            )
        if time.monotonic() > deadline:
            raise TuneError(
                f"another tune of this host holds {path}.lock ({state}) for more "
                f"than {wait_s:.0f} s; measured nothing"
            )
        time.sleep(0.2)


def _rows(choices: list[dict[str, Any]], key: str, world: int) -> str:
    lines = [
        "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,"
        "threads,protocol,time_us,fallback_us,incumbent,incumbent_us,noise_pct"
    ]
    for c in choices:
        hi = "*" if c["max_bytes"] < 0 else str(c["max_bytes"])
        lines.append(
            f"{key},{world},{c['dtype']},{c['min_bytes']},{hi},{c['columns']},"
            f"{c['time_us']:.2f},{c['fallback_us']:.2f},{c['incumbent']},"
            f"{c['incumbent_us']:.2f},{c['noise_pct']:.2f}"
        )
    return "\n".join(lines) + "\n"


def _tail(original_text: str, key: str, world: int, dtypes: Sequence[str]) -> str:
    """The table in use before, minus the rows the tuned ones replace: every size of the
    tuned dtypes outside the tuned range still gets a decision."""
    kept = []
    for line in _C.TuningTable.parse(original_text, "table").canonical_text().splitlines():
        topology, w, dtype = line.split(",")[:3]
        if topology == key and w == str(world) and dtype in dtypes:
            continue
        kept.append(line)
    return (
        "# the table in use before this tune, for everything it did not measure\n"
        + "\n".join(kept)
        + "\n"
    )


def tune(
    ar: Any,
    *,
    dtypes: Sequence[str] | None = None,
    max_bytes: int | None = None,
    budget_s: float = 120.0,
    force: bool = False,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Measures this host and writes its cache (collective: call on every rank).

    ``dtypes`` defaults to every dtype the communicator admits: an admitted dtype left on the
    seed's guesses is how a tuner ends up tuning bf16 while serving fp16.
    Without ``force``, a valid cache for this host is loaded and nothing is measured
    (``measured`` is 0 and ``status`` is ``cached``). Returns a report: ``measured`` (bucket,
    tactic pairs timed), ``path`` (the cache file), ``status``, ``choices`` (per bucket: the
    winner, the incumbent and their times), ``excluded`` (wrong tactics), ``table_hash``."""
    dtypes = _check_arguments(ar, dtypes, max_bytes, budget_s)
    _agree_to_tune(ar)
    started = time.perf_counter()
    path = cache.cache_path(ar.config.fingerprint)
    lock = _lock_cache(ar, path, wait_s=max(budget_s * 2, ar.timeout_s))
    try:
        if not force:
            found = (
                cache.read_cache(path, ar.config.fingerprint)
                if ar.rank == 0
                else cache.CacheRead(path)
            )
            text = ar.gather(found.text, "tune: cache")[0]
            if text is not None:
                table_hash = ar.install_table(text, policy.cache_source(path))
                return {
                    "status": "cached",
                    "measured": 0,
                    "path": str(path),
                    "choices": [],
                    "excluded": [],
                    "seconds": time.perf_counter() - started,
                    "table_hash": table_hash,
                }
        # The measurement calls are not service: stats() shows only the engine's calls.
        with ar.trial() as use:
            report = _measure(ar, _Tuner(ar, budget_s, use), dtypes, max_bytes, progress, path)
    finally:
        if lock is not None:
            lock.release()
    report["seconds"] = time.perf_counter() - started
    return report


def _measure(
    ar: Any,
    tuner: _Tuner,
    dtypes: list[str],
    max_bytes: int | None,
    progress: bool | None,
    path: Path,
) -> dict[str, Any]:
    plan = []
    for dtype in dtypes:
        top = ar.max_numel * DTYPES[dtype].itemsize
        plan += [(dtype, *b) for b in buckets(min(top, max_bytes or top))]
    bar = _Progress(len(plan), show=(ar.rank == 0) if progress is None else progress)
    choices = []
    try:
        for dtype, lo, size, hi in plan:
            choice = tuner.bucket(dtype, lo, size, hi, tuner.budget_s / max(len(plan), 1))
            if choice is not None:
                choices.append(choice)
            bar.step(f"{dtype} {size} B")
    finally:
        tuner.restore()
    if tuner.measured == 0 or not choices:
        raise TuneError(
            "pcie_allreduce tune measured nothing (every size was declined); the "
            "table in use is unchanged"
        )
    key = ar.config.topology_key
    text = _rows(choices, key, ar.world_size) + _tail(ar.table.text, key, ar.world_size, dtypes)
    text = ar.gather(text if ar.rank == 0 else None, "tune: decision")[0]
    try:
        table_hash = ar.install_table(text, policy.cache_source(path))
    except TableMismatch as error:
        raise TuneError(f"{error}; the tuned table is not kept") from error
    written, problem = _write_on_rank0(ar, path, text, tuner.measured)
    return {
        "status": "tuned",
        "measured": tuner.measured,
        "path": str(path) if written else None,
        "problem": problem,
        "choices": choices,
        "excluded": tuner.excluded,
        "table_hash": table_hash,
    }


def _write_on_rank0(ar: Any, path: Path, text: str, measured: int) -> tuple[bool, str | None]:
    problem = None
    if ar.rank == 0:
        try:
            cache.write_cache(
                path, ar.config.fingerprint, ar.config.fingerprint_fields, text, measured
            )
        except OSError as error:
            problem = f"could not write {path}: {error}"
            logger.warning("pcie_allreduce tune: %s; the tuned table is used but not kept", problem)
    problem = ar.gather(problem, "tune: written")[0]
    return problem is None, problem
