"""A communicator's life, every step collective over its group: built (``construction.py``),
prepared for graph capture, given tuning tables (``tune``, ``install_table``, ``trial``),
synchronized, torn down. :class:`Lifecycle` holds the state those steps keep; the calls that run
on it, one op table for every operation, are :class:`~pcie_allreduce.PcieAllReduce`'s
(``communicator.py``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import construction, policy
from .construction import Config, Table
from .env import read_env
from .errors import PcieAllReduceTimeout, TableMismatch
from .native import _C
from .tuning.passes import autotune_pass

logger = logging.getLogger("pcie_allreduce")

Self = TypeVar("Self", bound="Lifecycle")


class Lifecycle:
    """The base of :class:`~pcie_allreduce.PcieAllReduce`, whose docstring gives the
    arguments."""

    def __init__(
        self,
        group: Any = None,
        device: str | torch.device | int = "cpu",
        *,
        max_numel: int | None = None,
        table: str | None = None,
        cpu_group: Any = None,
        hidden: int | None = None,
        max_rows: int | None = None,
        dtypes: Sequence[str] = ("bf16", "fp16", "fp32"),
        timeout_s: float | None = None,
        topology: Any | None = None,
        islands: Sequence[Sequence[int]] | None = None,
        initial_generation: int = 0,
        enabled: bool = True,
        transport: str | None = None,
        stream_max_numel: int | None = None,
        self_test: bool | None = None,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = construction.device_of(device)
        # Decided by this rank alone (a bad argument raises here, before any exchange), then
        # the collective steps.
        local = construction.decide_locally(
            self.group,
            self.device,
            max_numel=max_numel,
            hidden=hidden,
            max_rows=max_rows,
            table=table,
            dtypes=dtypes,
            timeout_s=timeout_s,
            initial_generation=initial_generation,
            enabled=enabled,
            transport=transport,
            stream_max_numel=stream_max_numel,
        )
        self.max_numel, self.timeout_s = int(local.opts.max_numel), float(local.opts.timeout_s)
        # Calls up to this many elements (every operation's message) run on the kernels
        # (streamed through the workspace above max_numel); agreed by every rank.
        self.stream_max_numel = int(local.opts.stream_max_numel)
        built = construction.build(
            self.group, cpu_group, self.device, local, topology=topology, islands=islands
        )
        self._comm, self._boot, self._id = built.comm, built.boot, built.id
        self.handle = built.handle
        self._config, self._table, self._transport_detail = built.config, built.table, built.detail
        self._destroyed = False
        self._captures = 0
        if self.rank == 0:
            logger.info("pcie_allreduce: tuning table: %s", self._table.source)
        self._self_test_on = read_env().self_test if self_test is None else bool(self_test)
        self._self_test: dict[str, Any] = {"cases": 0, "failed": [], "seconds": 0.0}
        if self._self_test_on:
            self.self_test()

    # ------------------------------------------------------------------ state
    @property
    def enabled(self) -> bool:
        return bool(self._comm.enabled())

    @property
    def disabled_reason(self) -> str | None:
        reason = self._comm.disabled_reason()
        if reason is None:
            return None
        return f"{reason}: {self._comm.disabled_detail()}"

    @property
    def workspace_bytes(self) -> int:
        return int(self._comm.workspace_bytes())

    @property
    def config(self) -> Config:
        """What every rank agreed on: transport, table key, islands, dtypes, the fingerprint."""
        return self._config

    @property
    def table(self) -> Table:
        """The tuning table deciding calls now (its text and ``stats()["table_source"]``)."""
        return self._table

    def failure(self) -> dict[str, Any] | None:
        return self._comm.failure()

    def synchronize(self) -> None:
        """Waits for the device; a kernel that timed out raises PcieAllReduceTimeout here."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as error:
                # A kernel that timed out traps, and CUDA reports only that it died: the
                # diagnostic it left in mapped host memory says why.
                diagnostic = self._comm.failure()
                if diagnostic is None:
                    raise
                raise PcieAllReduceTimeout(diagnostic["message"], diagnostic) from error
        self._comm.raise_if_failed()

    # ------------------------------------------------------------------ before capture
    def prepare(self, hidden: int | None = None, max_rows: int | None = None) -> dict[str, Any]:
        """Gets ready for graph capture: installs every program the table can pick for an
        admitted message of every operation, so nothing is installed inside a capture. With
        ``hidden`` and ``max_rows`` (decode batch x draft tokens), says once if the workspace
        (fixed at construction) is smaller than that, in which case the larger messages go to
        the fallback. Returns ``{"max_numel", "programs", "rows_covered"}``."""
        rows = policy.rows_covered(self.max_numel, hidden, max_rows)
        # rows_covered gives rows only when given both hidden and max_rows.
        if (
            rows is not None
            and max_rows is not None
            and rows < max_rows
            and self.rank == 0
            and self.enabled
        ):
            logger.warning(
                "pcie_allreduce: the workspace holds %d elements = %d rows of %d; batches of "
                "%d..%d rows go to the fallback (size it with max_numel or "
                "PCIE_ALLREDUCE_MAX_NUMEL)",
                self.max_numel,
                rows,
                hidden,
                rows + 1,
                max_rows,
            )
        programs = int(self._comm.prepare())
        if self._self_test_on:
            self.self_test()  # what a new table chose and nothing has tested yet
        return {"max_numel": self.max_numel, "programs": programs, "rows_covered": rows}

    # ------------------------------------------------------------------ before serving
    def self_test(self, *, again: bool = False) -> dict[str, Any]:
        """Runs every (op, dtype, tactic) the table can choose for this group and nothing has
        tested yet (``again``: every one) once on known data through the real transport, and
        compares every output with the host's reference, bit for bit, on every rank
        (collective). A tactic that gives wrong bits on any rank is withdrawn on every rank: its
        calls go to the fallback, counted under the decline reason ``self_test``, so wrong
        hardware behaviour costs speed, never a wrong answer; rank 0 logs it once. Returns what
        this run did: ``{"cases", "failed": [{"op", "dtype", "tactic", "ranks", "detail"}],
        "seconds"}``; ``stats()["self_test"]`` sums every run."""
        started = time.perf_counter()
        # Not inside a CUDA graph capture (its calls would be captured, not run): the cases wait
        # for the next prepare() outside one (capture() prepares before it captures).
        capturing = (
            self.device.type == "cuda"
            and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()
        )
        local = list(self._comm.self_test(again)) if self.enabled and not capturing else []
        # Cases that ran: a form no decided size fits (NVFP4 in fp32) has nothing to test.
        ran = [r for r in local if r["ran"]]
        report: dict[str, Any] = {"cases": len(ran), "failed": [], "seconds": 0.0}
        if local:  # every rank has the same cases (the table and the topology are agreed)
            mine = [[r["op"], r["dtype"], r["tactic"], r["detail"]] for r in ran if not r["ok"]]
            failed: dict[tuple[str, str, str], dict[str, Any]] = {}
            for rank, items in enumerate(self.gather(mine, "self-test")):
                for op, dtype, tactic, detail in items:
                    entry = failed.setdefault(
                        (op, dtype, tactic),
                        {"op": op, "dtype": dtype, "tactic": tactic, "ranks": [], "detail": ""},
                    )
                    entry["ranks"].append(rank)
                    entry["detail"] = entry["detail"] or f"rank {rank}: {detail}"
            for op, dtype, tactic in sorted(failed):
                self._comm.withdraw(op, dtype, tactic)
            report["failed"] = [failed[key] for key in sorted(failed)]
            if failed and self.rank == 0:
                logger.warning(
                    "pcie_allreduce: self-test: %d of %d tactics gave wrong bits and now go to "
                    "the fallback (decline reason self_test): %s",
                    len(failed),
                    len(ran),
                    "; ".join(
                        f"{e['op']} {e['dtype']} {e['tactic']} on rank(s) "
                        f"{','.join(map(str, e['ranks']))} ({e['detail']})"
                        for e in report["failed"]
                    ),
                )
        report["seconds"] = time.perf_counter() - started
        self._self_test["cases"] += report["cases"]
        self._self_test["failed"] += report["failed"]
        self._self_test["seconds"] += report["seconds"]
        return report

    def self_test_report(self) -> dict[str, Any]:
        """Every self-test run so far, summed (what ``stats()["self_test"]`` shows)."""
        return {
            "cases": self._self_test["cases"],
            "failed": list(self._self_test["failed"]),
            "seconds": self._self_test["seconds"],
        }

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Brackets an engine's CUDA-graph capture (vLLM's ``graph_capture()`` enters it):
        prepares first, refuses ``tune()`` inside, and counts captured calls apart
        (``stats()["captures"]``). Calls captured in a graph replay on the stream the graph is
        launched on; ordering that stream is the caller's, as for any captured kernel."""
        if getattr(self, "_destroyed", True):
            raise RuntimeError("capture() on a destroyed PcieAllReduce")
        self.prepare()
        self._captures += 1
        with autotune_pass("pcie_allreduce graph capture"):
            yield

    # ------------------------------------------------------------------ tables
    def tune(
        self,
        *,
        dtypes: Sequence[str] | None = None,
        max_bytes: int | None = None,
        budget_s: float = 120.0,
        force: bool = False,
        progress: bool | None = None,
        ops: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Measures every runnable tactic and the fallback of every op (``ops``: all_reduce,
        reduce_scatter, all_gather; all by default) on this host and writes the cache
        (collective). Without ``force`` a valid cache is loaded instead and nothing is
        measured. See :func:`pcie_allreduce.tuning.tuner.tune` for the report."""
        if getattr(self, "_destroyed", True):
            raise RuntimeError("tune() on a destroyed PcieAllReduce")
        from .tuning import tuner

        return tuner.tune(
            self,
            dtypes=dtypes,
            max_bytes=max_bytes,
            budget_s=budget_s,
            force=force,
            progress=progress,
            ops=ops,
        )

    def gather(self, obj: Any, step: str) -> list[Any]:
        """Every rank's JSON-serialisable ``obj``, in rank order (collective, bounded by the
        timeout: a rank that does not arrive is named in a PcieAllReduceTimeout)."""
        return self._boot.gather(obj, step)

    def install_table(self, text: str, source: str) -> int:
        """Makes ``text`` the table in use from the next call of every operation (collective:
        every rank the same table between the same two calls). A table that does not parse
        raises ValueError and the old one stays; ranks whose tables differ turn the backend off
        everywhere and raise TableMismatch. Returns the table's hash."""
        self._comm.set_table(text, source)
        hashes = self.gather(int(self._comm.table_hash()), "install table")
        changed = source != self._table.source
        self._table = Table(text, source)
        if len(set(hashes)) != 1:
            detail = f"ranks installed different tables from {source}: hashes {hashes}"
            self._comm.disable("disabled", detail)
            raise TableMismatch(f"pcie_allreduce: {detail}; the backend is off on every rank")
        if self.rank == 0 and changed:
            logger.info("pcie_allreduce: tuning table: %s", source)
        return hashes[0]

    @contextlib.contextmanager
    def trial(self) -> Iterator[Callable[[str | None], None]]:
        """For a tuner: yields ``use(text)``, which lets table ``text`` decide the next calls
        of every operation without installing it (``use(None)``: the table in use again). Calls
        inside are left out of every counter of stats(); on exit the table in use decides
        again."""
        counts = self._comm.stats()

        def use(text: str | None) -> None:
            if text is None:
                self._comm.set_table(self._table.text, self._table.source)
            else:
                self._comm.set_table(text, "trial table")

        try:
            yield use
        finally:
            use(None)
            self._comm.restore_stats(counts)

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Collective and idempotent: call on every rank before destroying the process group."""
        if getattr(self, "_destroyed", True):
            return
        self._destroyed = True
        _C.unregister_communicator(self.handle)
        if self._comm.forked():
            # A forked child owns none of this: its parent is the rank its peers know, and still
            # uses the workspace and the group. Nothing is said to the peers, nothing is freed.
            self._comm.release()
            return
        failed = self._comm.failure() is not None
        self._comm.close_peers()
        try:
            # No peer may still use our workspace when we free it, but a rank that failed
            # knows a peer did too (it may be gone): it tells the others and waits for nobody.
            self._boot.farewell(self._id, failed)
        except PcieAllReduceTimeout as error:
            logger.warning("pcie_allreduce: destroy() did not wait for every peer: %s", error)
        finally:
            self._comm.release()

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else f"disabled ({self.disabled_reason})"
        return (
            f"PcieAllReduce(rank={self.rank}, world={self.world_size}, device={self.device}, "
            f"max_numel={self.max_numel}, {state})"
        )
