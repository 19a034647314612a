"""PcieAllReduce: the communicator a serving engine holds for its tensor-parallel group.

Every operation (:data:`OPS`: the all-reduce, the fused all-reduce + residual add + RMSNorm,
reduce-scatter, all-gather) takes the extension's one path: checked, decided, run on the kernels
or the fallback, counted. Here an operation is a row of the op table (:data:`TORCH_OPS`), and the
public methods are thin calls of the same three entries: :meth:`PcieAllReduce.decline` /
:meth:`~PcieAllReduce.tactic` (what would run), the torch ops (always the group's result: the
kernels', or the group's own collective's where they decline) and :meth:`~PcieAllReduce.try_run`
(one decision, for callers with a path of their own). The communicator's life (construction,
``prepare``, tables, ``destroy``: each collective) is :class:`~pcie_allreduce.lifecycle.Lifecycle`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .lifecycle import Lifecycle
from .native import _C, _nvfp4_outputs
from .operations import (  # noqa: F401 - the names, exported here as before
    ALL_GATHER,
    ALL_REDUCE,
    FUSED,
    FUSED_FORMS,
    FUSED_FP4,
    FUSED_FP8,
    NORM,
    NORM_FP4,
    NORM_FP8,
    OPS,
    QUANTS,
    REDUCE_SCATTER,
)


class TorchOps(NamedTuple):
    """An operation's torch ops, looked up once: a torch.ops attribute lookup costs about a
    microsecond per call, which is a third of a small CPU all-reduce."""

    new: Any  # -> a new result
    into: Any  # writes the caller's ``out`` (the fused op: and ``residual_out``)
    in_place: Any  # writes the input (the fused op: and the residual); None: no such op
    sized: bool  # ``new`` takes the world size: the result's dim 0 is not the input's


def _op(name: str) -> Any:
    return getattr(torch.ops.pcie_allreduce, name).default


# The op table (importing the extension above registered these ops).
TORCH_OPS = {
    ALL_REDUCE: TorchOps(_op("all_reduce"), _op("all_reduce_into"), _op("all_reduce_"), False),
    FUSED: TorchOps(_op(FUSED), _op(f"{FUSED}_into"), _op(f"{FUSED}_"), False),
    REDUCE_SCATTER: TorchOps(_op("reduce_scatter"), _op("reduce_scatter_into"), None, True),
    ALL_GATHER: TorchOps(_op("all_gather"), _op("all_gather_into"), None, True),
    NORM: TorchOps(_op(NORM), _op(f"{NORM}_into"), None, False),
    FUSED_FP8: TorchOps(_op(FUSED_FP8), _op(f"{FUSED_FP8}_into"), None, False),
    NORM_FP8: TorchOps(_op(NORM_FP8), _op(f"{NORM_FP8}_into"), None, False),
    FUSED_FP4: TorchOps(_op(FUSED_FP4), _op(f"{FUSED_FP4}_into"), None, False),
    NORM_FP4: TorchOps(_op(NORM_FP4), _op(f"{NORM_FP4}_into"), None, False),
}
_ALL_REDUCE = TORCH_OPS[ALL_REDUCE]


class PcieAllReduce(Lifecycle):
    """All-reduce (and the fused add + RMSNorm, reduce-scatter, all-gather) for one process
    group on PCIe-only hosts.

    Args:
        group: the process group (NCCL for CUDA tensors, gloo for CPU tensors).
        device: ``cpu`` (transport host_shm) or a CUDA device.
        max_numel: workspace capacity in elements; fixed for the communicator's life. Without
            it: PCIE_ALLREDUCE_MAX_NUMEL, else ``max_rows`` x ``hidden``, else a guess of 64
            rows (``policy.size_workspace``).
        stream_max_numel: calls larger than the workspace (all-reduce, fused, reduce-scatter,
            all-gather; the collectives' message is the whole tensor), up to this many
            elements, run on the kernels as rounds through it (every element the same tree, so a
            row's bits never depend on its batch); larger ones decline ``too_large``. Without
            it: PCIE_ALLREDUCE_STREAM_MAX_NUMEL, else 2^31 on CPU tensors and 0 (off) on CUDA
            tensors, where streamed sizes are not yet measured against NCCL.
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
        self_test: run :meth:`self_test` at construction and whenever :meth:`prepare` finds a
            tactic not yet tested (a new table). None: PCIE_ALLREDUCE_SELF_TEST (on unless 0).

    What tools (the tuner) use besides the calls: :attr:`config` (what every rank agreed on),
    :attr:`table` (the table in use), :meth:`gather` (a bounded exchange over the group),
    :meth:`install_table` (collective) and :meth:`trial` (tables tried without counting).
    """

    COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)

    def stats(self) -> dict[str, Any]:
        """Every operation's counters (``calls``/``declines`` of the all-reduce, ``fused_*``,
        ``collectives``), then the communicator's state."""
        s = dict(self._comm.stats())
        s["table_source"] = self._table.source
        s["transport"] = self._config.transport
        s["transport_detail"] = self._transport_detail
        s["captures"] = self._captures
        s["fingerprint"] = self._config.fingerprint
        s["workspace_bytes"] = self.workspace_bytes
        s["enabled"] = self.enabled
        s["disabled_reason"] = self.disabled_reason
        s["self_test"] = self.self_test_report()
        if self.device.type == "cpu":
            s["host_reduce"] = _C.host_reduce_isa()
        return s

    # ------------------------------------------------------------------ what would run
    def decline(self, op: str, x: torch.Tensor, weight: torch.Tensor | None = None) -> str | None:
        """None when the kernels would run ``op`` (:data:`OPS`) with input ``x`` (the fused op:
        and ``weight``); else the reason code, as ``stats()`` counts it (``declines``,
        ``fused_declines``, ``collectives[op]["declines"]``). It depends only on what every
        rank agrees on (shape, dtype, the table): every rank declines together."""
        return self._comm.decline_reason(op, x, weight)

    def tactic(self, op: str, x: torch.Tensor, weight: torch.Tensor | None = None) -> str:
        """The tactic label that would run ``op`` with input ``x``, else the op's fallback
        label: ``"fallback"`` (the fused op: ``"unfused"``)."""
        return str(self._comm.chosen_tactic(op, x, weight))

    def decline_reason(self, t: torch.Tensor) -> str | None:
        """:meth:`decline` of the all-reduce of ``t``."""
        return self.decline(ALL_REDUCE, t)

    def supports(self, t: torch.Tensor) -> str | None:
        """None when the kernels *can* run ``t`` (whatever the table prefers)."""
        return self._comm.supports(t)

    def should_use(self, t: torch.Tensor) -> bool:
        return self.decline(ALL_REDUCE, t) is None

    def chosen_tactic(self, t: torch.Tensor) -> str:
        return self.tactic(ALL_REDUCE, t)

    def fused_decline_reason(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> str | None:
        """:meth:`decline` of ``all_reduce_add_rms_norm(x, residual, weight)``. A declined call
        still returns the same result, through the unfused path."""
        return self.decline(FUSED, x, weight)

    def should_use_fused(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> bool:
        return self.decline(FUSED, x, weight) is None

    def _collective(self, collective: str) -> str:
        if collective not in self.COLLECTIVES:
            raise ValueError(
                f"collective must be one of {', '.join(self.COLLECTIVES)}; got {collective!r}"
            )
        return collective

    def collective_decline_reason(self, x: torch.Tensor, collective: str) -> str | None:
        """:meth:`decline` of ``collective`` (one of :attr:`COLLECTIVES`) with input ``x``."""
        return self.decline(self._collective(collective), x)

    def should_use_collective(self, x: torch.Tensor, collective: str) -> bool:
        return self.collective_decline_reason(x, collective) is None

    def chosen_collective_tactic(self, x: torch.Tensor, collective: str) -> str:
        return self.tactic(self._collective(collective), x)

    # ------------------------------------------------------------------ the calls
    def try_run(
        self,
        op: str,
        x: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        eps: float = 0.0,
        residual_out: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        weight_offset: float = 0.0,
        block_scale: torch.Tensor | None = None,
    ) -> tuple[Any, str | None]:
        """One decision, for a caller with a path of its own (the engine adapters): a single
        call into the extension (without the GIL) runs ``op`` (:data:`OPS`) with input ``x``
        on the kernels if they take it, and otherwise does nothing.

        Returns ``(result, None)`` when the kernels ran it: ``out``, or a new tensor where
        ``out`` is None (the fused op: ``(y, residual_out)``, see
        :meth:`all_reduce_add_rms_norm`). Else ``(None, reason)``, having written nothing and
        counted nothing: the caller runs its own path and counts that call itself. Arguments
        the op's torch op refuses raise ValueError here too, except one: with grad mode on, an
        operand the call reads that requires grad (an engine's ``nn.Parameter`` weight outside
        its inference mode) declines ``autograd`` where the torch op raises, since the caller's
        path keeps the graph."""
        got = self._comm.try_run(
            op,
            x,
            out,
            residual,
            weight,
            float(eps),
            residual_out,
            scale,
            float(weight_offset),
            block_scale,
        )
        return (None, got) if isinstance(got, str) else (got, None)

    def _run(self, op: str, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``op``'s torch op: into ``out``, or a new result."""
        ops = TORCH_OPS[op]
        if out is not None:
            ops.into(x, self.handle, out)
            return out
        return ops.new(x, self.world_size, self.handle) if ops.sized else ops.new(x, self.handle)

    def all_reduce(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of ``t`` over the group: kernels when admitted, the fallback otherwise.

        Raises PcieAllReduceTimeout (with the diagnostic) when a peer never arrived or
        disagreed about the call."""
        if out is None:  # the decode path's call: no frame of _run (40 ns of a 2.5 us CPU call)
            return _ALL_REDUCE.new(t, self.handle)
        return self._run(ALL_REDUCE, t, out)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: no allocation (the lightest call; CPU tensors wait for peers without the
        GIL, like every torch op)."""
        _ALL_REDUCE.in_place(t, self.handle)
        return t

    def all_reduce_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        weight_offset: float = 0.0,
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
        them, new tensors. Outputs of another dtype, shape or device, or overlapping any other
        operand (the weight included), raise ValueError on every rank before any rank talks.
        A call the kernels decline (``fused_decline_reason``) runs the group's all-reduce, then
        the same add and norm in torch."""
        ops, args = TORCH_OPS[FUSED], (x, residual, weight, float(eps), self.handle)
        offset = float(weight_offset)
        if out is None and residual_out is None:
            return ops.new(*args, offset)
        if out is x and residual_out is residual:
            ops.in_place(*args, offset)
            return x, residual
        if out is x or residual_out is residual:
            # One in place, one not: the ops' schemas keep each written tensor apart from the
            # inputs, so form both results anew and copy them back, after the check the op
            # would make of the caller's outputs (before any rank talks).
            self._comm.check(FUSED, x, out, residual, weight, residual_out, None, offset)
            y, r = ops.new(*args, offset)
            out = y if out is None else out.copy_(y)
            return out, (r if residual_out is None else residual_out.copy_(r))
        out = torch.empty_like(x) if out is None else out
        residual_out = torch.empty_like(residual) if residual_out is None else residual_out
        ops.into(*args, out, residual_out, offset)
        return out, residual_out

    def all_reduce_rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        residual: torch.Tensor | None = None,
        weight_offset: float = 0.0,
        quant: str | None = None,
        scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        block_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Every fused form of the end of a decoder layer (the forms vLLM's all-reduce fusion
        matches), one call: ``r = sum_ranks(x) + residual`` (without ``residual``: ``r`` is the
        sum itself, a model's first layer), ``y = rms_norm(r) * (weight + weight_offset)``
        (``weight_offset=1``: Gemma's convention, the offset added in fp32), and ``y`` rounded
        to ``x``'s dtype, then optionally quantised:

        - ``quant="fp8"``: ``torch.float8_e4m3fn`` at the static per-tensor ``scale`` (one
          ``torch.float32``), as vLLM's ``static_scaled_fp8_quant``:
          ``clamp(float(y) * (1 / scale), -448, 448)`` rounded to nearest even, a NaN giving 448.
        - ``quant="nvfp4"`` (bf16 or fp16 ``x``, ``hidden`` a multiple of 16): e2m1 codes in
          blocks of 16, two a byte (``uint8 [..., hidden / 2]``, the even element in the low
          nibble), and one float8_e4m3fn scale a block in vLLM's swizzled 128x4 layout
          (``block_scale``, ``[round_up(rows, 128), round_up(hidden / 16, 4)]``), at the global
          ``scale`` (vLLM's ``input_global_scale``), as vLLM's ``scaled_fp4_quant`` lays it out
          (plan/quant.h: its reciprocals are IEEE here, approximate on vLLM's GPU).

        Returns ``(y or y_q, r)``, and NVFP4's ``block_scale`` third. A quantised form never
        stores ``y``. Numerics as :meth:`all_reduce_add_rms_norm`: bitwise equal on every rank,
        and a row's result does not depend on the other rows of the batch. ``out``,
        ``residual_out`` and ``block_scale`` (new tensors where None) receive the results; with a
        residual and no ``quant``, the in-place forms of :meth:`all_reduce_add_rms_norm` apply.
        A call the kernels decline runs the group's all-reduce, then the same epilogue in
        torch."""
        if quant is not None and quant not in QUANTS:
            raise ValueError(f"quant must be None, 'fp8' or 'nvfp4'; got {quant!r}")
        op = FUSED_FORMS[(residual is not None, quant)]
        if residual is not None and quant is None:
            return self.all_reduce_add_rms_norm(
                x, residual, weight, eps, out=out, residual_out=residual_out,
                weight_offset=weight_offset,
            )  # fmt: skip
        head: tuple = (x,) if residual is None else (x, residual)
        head += (weight,) if quant is None else (weight, scale)
        args = (*head, float(eps), self.handle)
        ops, offset = TORCH_OPS[op], float(weight_offset)
        if out is None and residual_out is None and block_scale is None:
            return tuple(ops.new(*args, offset))
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        if quant == "nvfp4":
            y_q, scales = _nvfp4_outputs(x)
            out = y_q if out is None else out
            scales = scales if block_scale is None else block_scale
            ops.into(*args, out, residual_out, scales, offset)
            return out, residual_out, scales
        if out is None:
            out = torch.empty_like(x, dtype=torch.float8_e4m3fn if quant else x.dtype)
        ops.into(*args, out, residual_out, offset)
        return out, residual_out

    def reduce_scatter(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """torch's ``reduce_scatter_tensor`` along dim 0, summing: ``x`` is ``[world * m, ...]``
        and the result ``[m, ...]`` is rows ``[rank * m, (rank + 1) * m)`` of the sum over ranks,
        formed as ``all_reduce`` forms it (fp32, rank order, rounded once). ``out`` (disjoint
        from ``x``) receives it when given. A call the kernels decline
        (``collective_decline_reason``) runs the group's own reduce-scatter."""
        return self._run(REDUCE_SCATTER, x, out)

    def all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """torch's ``all_gather_into_tensor`` along dim 0: ``x`` is ``[m, ...]`` and the result
        ``[world * m, ...]`` holds rank q's ``x`` at rows ``[q * m, (q + 1) * m)``, bit for bit.
        ``out`` (disjoint from ``x``) receives it when given. A call the kernels decline runs
        the group's own all-gather."""
        return self._run(ALL_GATHER, x, out)
