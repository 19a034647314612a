"""PcieAllReduce: the communicator a serving engine holds for its tensor-parallel group.

``all_reduce(t)`` runs the kernels when they admit ``t`` and the tuning table chooses them, the
group's own all-reduce otherwise: always the correct sum. Construction (``construction.py``)
and ``destroy()`` are collective."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import construction, policy
from .construction import Config, Table
from .errors import PcieAllReduceTimeout, TableMismatch
from .native import _C
from .tuning.passes import autotune_pass

logger = logging.getLogger("pcie_allreduce")


class PcieAllReduce:
    """All-reduce for one process group on PCIe-only hosts.

    Args:
        group: the process group (NCCL for CUDA tensors, gloo for CPU tensors).
        device: ``cpu`` (transport host_shm) or a CUDA device.
        max_numel: workspace capacity in elements; fixed for the communicator's life. Without
            it: PCIE_ALLREDUCE_MAX_NUMEL, else ``max_rows`` x ``hidden``, else a guess of 64
            rows (``policy.size_workspace``).
        table: tuning table as CSV text or a path. Without one: PCIE_ALLREDUCE_TABLE, else
            this host's tuning cache (written by ``tune()``), else the embedded seed table;
            ``stats()["table_source"]`` names the one in use.
        cpu_group: a gloo group over the same ranks for bootstrapping (made if needed; making
            one is an unbounded torch collective, so engines pass the one they have).
        islands: ranks grouped by socket, overriding the probe (CPU tensors: NUMA nodes).
        transport: CUDA tensors only: ``"auto"`` (cuda_ipc, moving to cuda_host when the P2P
            check fails on any pair), ``"cuda_ipc"`` (decline ``no_p2p`` instead) or
            ``"cuda_host"`` (always host memory), or an alias (``policy``). None:
            PCIE_ALLREDUCE_TRANSPORT. ``stats()["transport"]`` / ``["transport_detail"]``.

    What tools (the tuner) use besides the calls: :attr:`config` (what every rank agreed on),
    :attr:`table` (the table in use), :meth:`gather` (a bounded exchange over the group),
    :meth:`install_table` (collective) and :meth:`trial` (tables tried without counting).
    """

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
        )
        self.max_numel, self.timeout_s = int(local.opts.max_numel), float(local.opts.timeout_s)
        built = construction.build(
            self.group, cpu_group, self.device, local, topology=topology, islands=islands
        )
        self._comm, self._boot, self._id = built.comm, built.boot, built.id
        self.handle = built.handle
        self._config, self._table, self._transport_detail = built.config, built.table, built.detail
        # The op overloads, looked up once: torch.ops attribute lookups cost about a
        # microsecond per call, which is a third of a small CPU all-reduce.
        ops = torch.ops.pcie_allreduce
        self._op_out_of_place = ops.all_reduce.default
        self._op_in_place = ops.all_reduce_.default
        self._op_into = ops.all_reduce_into.default
        self._op_fused = ops.all_reduce_add_rms_norm.default
        self._op_fused_in_place = ops.all_reduce_add_rms_norm_.default
        self._op_fused_into = ops.all_reduce_add_rms_norm_into.default
        self._op_reduce_scatter = ops.reduce_scatter.default
        self._op_reduce_scatter_into = ops.reduce_scatter_into.default
        self._op_all_gather = ops.all_gather.default
        self._op_all_gather_into = ops.all_gather_into.default
        self._destroyed = False
        self._captures = 0
        if self.rank == 0:
            logger.info("pcie_allreduce: tuning table: %s", self._table.source)

    # ------------------------------------------------------------------ queries
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

    def decline_reason(self, t: torch.Tensor) -> str | None:
        """None when the kernels would run ``t``; else the reason code (see stats())."""
        return self._comm.decline_reason(t)

    def supports(self, t: torch.Tensor) -> str | None:
        """None when the kernels *can* run ``t`` (whatever the table prefers)."""
        return self._comm.supports(t)

    def should_use(self, t: torch.Tensor) -> bool:
        return self.decline_reason(t) is None

    def chosen_tactic(self, t: torch.Tensor) -> str:
        return str(self._comm.chosen_tactic(t))

    def stats(self) -> dict[str, Any]:
        s = dict(self._comm.stats())
        s["table_source"] = self._table.source
        s["transport"] = self._config.transport
        s["transport_detail"] = self._transport_detail
        s["captures"] = self._captures
        s["fingerprint"] = self._config.fingerprint
        s["workspace_bytes"] = self.workspace_bytes
        s["enabled"] = self.enabled
        s["disabled_reason"] = self.disabled_reason
        if self.device.type == "cpu":
            s["host_reduce"] = _C.host_reduce_isa()
        return s

    def failure(self) -> dict[str, Any] | None:
        return self._comm.failure()

    # ------------------------------------------------------------------ before capture
    def prepare(self, hidden: int | None = None, max_rows: int | None = None) -> dict[str, Any]:
        """Gets ready for graph capture: installs every program the table can pick for an
        admitted message, so nothing is installed inside a capture. With ``hidden`` and
        ``max_rows`` (decode batch x draft tokens), says once if the workspace (fixed at
        construction) is smaller than that, in which case the larger messages go to the
        fallback. Returns ``{"max_numel", "programs", "rows_covered"}``."""
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

    # ------------------------------------------------------------------ tuning
    def tune(
        self,
        *,
        dtypes: Sequence[str] | None = None,
        max_bytes: int | None = None,
        budget_s: float = 120.0,
        force: bool = False,
        progress: bool | None = None,
    ) -> dict[str, Any]:
        """Measures every runnable tactic and the fallback on this host and writes the cache
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
        )

    def gather(self, obj: Any, step: str) -> list[Any]:
        """Every rank's JSON-serialisable ``obj``, in rank order (collective, bounded by the
        timeout: a rank that does not arrive is named in a PcieAllReduceTimeout)."""
        return self._boot.gather(obj, step)

    def install_table(self, text: str, source: str) -> int:
        """Makes ``text`` the table in use from the next call (collective: every rank the same
        table between the same two calls). A table that does not parse raises ValueError and
        the old one stays; ranks whose tables differ turn the backend off everywhere and raise
        TableMismatch. Returns the table's hash."""
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
        without installing it (``use(None)``: the table in use again). Calls inside are left
        out of stats(); on exit the table in use decides again."""
        counts = self._comm.stats()
        keys = ("calls", "declines", "bytes_sent_per_peer", "staged")

        def use(text: str | None) -> None:
            if text is None:
                self._comm.set_table(self._table.text, self._table.source)
            else:
                self._comm.set_table(text, "trial table")

        try:
            yield use
        finally:
            use(None)
            self._comm.restore_stats(*(counts[k] for k in keys))

    # ------------------------------------------------------------------ the call
    def all_reduce(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of ``t`` over the group: kernels when admitted, the fallback otherwise.

        Raises PcieAllReduceTimeout (with the diagnostic) when a peer never arrived or
        disagreed about the call."""
        if out is None:
            return self._op_out_of_place(t, self.handle)
        self._op_into(t, self.handle, out)
        return out

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: no allocation (the lightest call; CPU tensors wait for peers without the
        GIL, like every torch op)."""
        self._op_in_place(t, self.handle)
        return t

    # ------------------------------------------------------------------ the fused call
    def fused_decline_reason(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> str | None:
        """None when the fused kernels would run ``all_reduce_add_rms_norm(x, residual,
        weight)``; else the reason code (``stats()["fused_declines"]``). A declined call still
        returns the same result, through the unfused path."""
        return self._comm.fused_decline_reason(x, residual, weight)

    def should_use_fused(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> bool:
        return self.fused_decline_reason(x, residual, weight) is None

    def all_reduce_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The end of a decoder layer, fused: ``residual_out = sum_ranks(x) + residual`` and
        ``y = rms_norm(residual_out) * weight``; returns ``(y, residual_out)``.

        ``x`` is ``[rows, hidden]`` (any leading shape; the last dimension is the row),
        ``residual`` has its shape and dtype, ``weight`` is ``[hidden]`` of the same dtype.
        Numerics (docs/design.md "The fused epilogue"): the sum as ``all_reduce`` forms it
        (fp32, fixed rank order, rounded once), ``residual_out`` rounded once from the fp32 sum
        with ``residual``, the mean of squares of ``residual_out`` in a fixed order that
        depends only on ``hidden``, ``y`` rounded once from fp32. Bitwise equal on every rank,
        and a row's result does not depend on the other rows of the batch.

        In place: ``out=x`` and/or ``residual_out=residual`` (the two must differ). Without
        them, new tensors. A call the kernels decline (``fused_decline_reason``) runs the
        group's all-reduce, then the same add and norm in torch."""
        eps = float(eps)
        if out is None and residual_out is None:
            return self._op_fused(x, residual, weight, eps, self.handle)
        if out is x and residual_out is residual:
            self._op_fused_in_place(x, residual, weight, eps, self.handle)
            return x, residual
        if out is x or residual_out is residual:
            # One in place, one not: the ops' schemas keep each written tensor apart from the
            # inputs, so form both results anew and copy the in-place one back.
            y, r = self._op_fused(x, residual, weight, eps, self.handle)
            out = y if out is None else out.copy_(y)
            residual_out = r if residual_out is None else residual_out.copy_(r)
            return out, residual_out
        if out is None:
            out = torch.empty_like(x)
        if residual_out is None:
            residual_out = torch.empty_like(residual)
        self._op_fused_into(x, residual, weight, eps, self.handle, out, residual_out)
        return out, residual_out

    # ------------------------------------------------------------------ reduce-scatter, all-gather
    COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")

    def _collective(self, collective: str) -> str:
        if collective not in self.COLLECTIVES:
            raise ValueError(
                f"collective must be one of {', '.join(self.COLLECTIVES)}; got {collective!r}"
            )
        return collective

    def collective_decline_reason(self, x: torch.Tensor, collective: str) -> str | None:
        """None when the kernels would run ``collective`` (``"all_reduce"``,
        ``"reduce_scatter"`` or ``"all_gather"``) with input ``x``; else the reason code
        (``stats()["collectives"][collective]["declines"]``). Depends only on what every rank
        agrees on (shape, dtype, the table): every rank declines together."""
        return self._comm.collective_decline_reason(self._collective(collective), x)

    def should_use_collective(self, x: torch.Tensor, collective: str) -> bool:
        return self.collective_decline_reason(x, collective) is None

    def chosen_collective_tactic(self, x: torch.Tensor, collective: str) -> str:
        """The tactic label that runs ``collective`` with input ``x``, or ``"fallback"``."""
        return self._comm.chosen_collective_tactic(self._collective(collective), x)

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """torch's ``reduce_scatter_tensor`` along dim 0, summing: ``x`` is ``[world * m, ...]``
        and the result ``[m, ...]`` is rows ``[rank * m, (rank + 1) * m)`` of the sum over ranks,
        formed as ``all_reduce`` forms it (fp32, rank order, rounded once). ``out`` (disjoint
        from ``x``) receives it when given. A call the kernels decline
        (``collective_decline_reason``) runs the group's own reduce-scatter."""
        if out is None:
            return self._op_reduce_scatter(x, self.world_size, self.handle)
        self._op_reduce_scatter_into(x, self.handle, out)
        return out

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """torch's ``all_gather_into_tensor`` along dim 0: ``x`` is ``[m, ...]`` and the result
        ``[world * m, ...]`` holds rank q's ``x`` at rows ``[q * m, (q + 1) * m)``, bit for bit.
        ``out`` (disjoint from ``x``) receives it when given. A call the kernels decline runs
        the group's own all-gather."""
        if out is None:
            return self._op_all_gather(x, self.world_size, self.handle)
        self._op_all_gather_into(x, self.handle, out)
        return out

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

    def __enter__(self) -> PcieAllReduce:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else f"disabled ({self.disabled_reason})"
        return (
            f"PcieAllReduce(rank={self.rank}, world={self.world_size}, device={self.device}, "
            f"max_numel={self.max_numel}, {state})"
        )
