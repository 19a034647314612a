"""A communicator's life, every step collective over its group: built (``construction.py``),
prepared for graph capture, given tuning tables (``tune``, ``install_table``, ``trial``),
synchronized, torn down. :class:`Lifecycle` holds the state those steps keep; the calls that run
on it, one op table for every operation, are :class:`~pcie_allreduce.PcieAllReduce`'s
(``communicator.py``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import construction, policy
from .construction import Config, Table
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
        return {
            "max_numel": self.max_numel,
            "programs": int(self._comm.prepare()),
            "rows_covered": rows,
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
