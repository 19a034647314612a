"""The tuner: measures this host once and writes its tuning cache.

``tune()`` times, per operation (the all-reduce, whose rows the fused op uses too, the
reduce-scatter and the all-gather), dtype and size bucket, every runnable tactic against that
operation's own fallback, keeps the incumbent unless a challenger wins by more than the measured
noise (``decision``), and writes ``cache.cache_path(fingerprint)``; the next communicator on the
same host (same fingerprint) loads that file and measures nothing. It drives a
:class:`~pcie_allreduce.PcieAllReduce` through its public interface only: ``config``,
``table``, ``gather``, ``trial``, ``install_table``, ``supports``, ``tactic`` and the calls
(``all_reduce``, ``reduce_scatter``, ``all_gather``).

This module is the driver (refusals, the cache lock, the cached table or a measurement, the
table installed and written); ``sweep`` is what is measured (the candidates and the size
buckets), ``measurement`` how one bucket is measured, ``table`` the table a tune writes and
``progress`` its progress bar.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ... import policy
from ...env import read_env
from ...errors import TableMismatch, TuneError, TuneRefused
from ...testing import DTYPES
from .. import cache
from ..passes import current_pass
from .measurement import Measurement
from .progress import Progress
from .sweep import TUNED_OPS, Candidate, buckets, candidates, columns_of_label, message_size
from .table import tuned_rows, untuned_rows

__all__ = [
    "TUNED_OPS",
    "Candidate",
    "buckets",
    "candidates",
    "columns_of_label",
    "message_size",
    "synthetic_timer",
    "tune",
]

logger = logging.getLogger("pcie_allreduce")

# Tests replace how a block of calls is timed, to drive the decision logic with known costs
# and known noise: synthetic_timer(label, size_bytes, op) -> seconds per call. The calls still
# run.
# Read when a tune starts.
synthetic_timer: Any | None = None


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


def _check_ops(ops: Sequence[str] | None) -> list[str]:
    """The operations to tune, in TUNED_OPS order; anything else raises."""
    if ops is None:
        return list(TUNED_OPS)
    chosen = [ops] if isinstance(ops, str) else list(ops)
    if isinstance(ops, str) or not chosen or any(op not in TUNED_OPS for op in chosen):
        raise ValueError(
            f"tune(ops={ops!r}): expected a non-empty sequence of operations from "
            f"{list(TUNED_OPS)} (the fused all_reduce_add_rms_norm takes the all-reduce's rows)"
        )
    return [op for op in TUNED_OPS if op in chosen]


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


def tune(
    ar: Any,
    *,
    dtypes: Sequence[str] | None = None,
    max_bytes: int | None = None,
    budget_s: float = 120.0,
    force: bool = False,
    progress: bool | None = None,
    ops: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Measures this host and writes its cache (collective: call on every rank).

    ``dtypes`` defaults to every dtype the communicator admits: an admitted dtype left on the
    seed's guesses is how a tuner ends up tuning bf16 while serving fp16. ``ops`` defaults to
    every operation with rows of its own (:data:`TUNED_OPS`: the all-reduce, which decides the
    fused op too, the reduce-scatter and the all-gather); ``budget_s`` is the whole tune's,
    shared by every (op, dtype, bucket) measured.
    Without ``force``, a valid cache for this host is loaded and nothing is measured
    (``measured`` is 0 and ``status`` is ``cached``). Returns a report: ``measured`` (bucket,
    tactic pairs timed), ``path`` (the cache file), ``status``, ``choices`` (per op and bucket:
    ``op``, the winner, the incumbent and their times), ``excluded`` (wrong tactics, with their
    ``op``), ``table_hash``."""
    dtypes = _check_arguments(ar, dtypes, max_bytes, budget_s)
    tuned_ops = _check_ops(ops)
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
            measurement = Measurement(ar, budget_s, use, synthetic_timer)
            report = _measure(ar, measurement, tuned_ops, dtypes, max_bytes, progress, path)
    finally:
        if lock is not None:
            lock.release()
    report["seconds"] = time.perf_counter() - started
    return report


def _plan(
    ar: Any, ops: list[str], dtypes: list[str], max_bytes: int | None
) -> list[tuple[str, str, int, int, int]]:
    """(op, dtype, lo, measured size, hi) of every measurement: the buckets up to the workspace
    (or ``max_bytes``), each collective's size rounded down to whole 16-byte chunks per rank.
    Streamed sizes (above the workspace) run in rounds of at most the workspace, which the
    buckets below it measure: the last bucket's row reaches to no bound."""
    plan = []
    for op in ops:
        for dtype in dtypes:
            top = ar.max_numel * DTYPES[dtype].itemsize
            for lo, size, hi in buckets(min(top, max_bytes or top)):
                measured = message_size(op, size, ar.world_size)
                if measured > 0:
                    plan.append((op, dtype, lo, measured, hi))
    return plan


def _measure(
    ar: Any,
    measurement: Measurement,
    ops: list[str],
    dtypes: list[str],
    max_bytes: int | None,
    progress: bool | None,
    path: Path,
) -> dict[str, Any]:
    plan = _plan(ar, ops, dtypes, max_bytes)
    bar = Progress(len(plan), show=(ar.rank == 0) if progress is None else progress)
    choices = []
    try:
        for op, dtype, lo, size, hi in plan:
            choice = measurement.bucket(
                dtype, lo, size, hi, measurement.budget_s / max(len(plan), 1), op
            )
            if choice is not None:
                choices.append(choice)
            bar.step(f"{op} {dtype} {size} B")
    finally:
        measurement.restore()
    if measurement.measured == 0 or not choices:
        raise TuneError(
            "pcie_allreduce tune measured nothing (every size was declined); the "
            "table in use is unchanged"
        )
    key = ar.config.topology_key
    text = tuned_rows(choices, key, ar.world_size) + untuned_rows(
        ar.table.text, key, ar.world_size, dtypes, ops
    )
    text = ar.gather(text if ar.rank == 0 else None, "tune: decision")[0]
    try:
        table_hash = ar.install_table(text, policy.cache_source(path))
    except TableMismatch as error:
        raise TuneError(f"{error}; the tuned table is not kept") from error
    written, problem = _write_on_rank0(ar, path, text, measurement.measured)
    return {
        "status": "tuned",
        "ops": ops,
        "measured": measurement.measured,
        "path": str(path) if written else None,
        "problem": problem,
        "choices": choices,
        "excluded": measurement.excluded,
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
