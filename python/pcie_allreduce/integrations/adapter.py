"""The call path both engine adapters share: what an engine's slot does with one PcieAllReduce.

An engine hands the slot a call (an all-reduce through the slot it already has, the fused
all-reduce + residual add + RMSNorm, a reduce-scatter or all-gather into its own output) and
runs the call itself when the slot gives nothing back. :class:`EngineSlot` says that once:

* **one decision per call**: ``PcieAllReduce.try_run`` runs the call on the kernels or declines
  it; the engine's ask-then-run all-reduce slot asks ``PcieAllReduce.decline`` and then runs the
  torch op, one native call each;
* **declines counted per operation and reason**: calls the engine's own path ran, merged into
  ``stats()`` (``declines`` and their total ``engine_fallback``, ``fused_declines`` with
  ``fused_routed``, ``collectives[c]["declines"]``), the first of each said once on rank 0;
* **outputs the engine owns**: written in place where they are contiguous and disjoint from the
  input, else through a new tensor (an engine's in-place reduce-scatter passes a slice of its
  input as the output, as NCCL allows);
* **the build** (which group, which transport, the deterministic table) and **the close** (the
  summary line, then ``destroy``).

What differs per engine stays in ``vllm.py`` / ``sglang.py``: how it reads its configuration,
where it hooks in, the names of its slot's methods, and :meth:`EngineSlot.slot_decline` (why the
slot itself keeps a call off the kernels: disabled by the engine, not built yet). Nothing here
imports torch or an engine at import time.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from .. import env as env_mod
from .. import policy
from ..operations import (  # PcieAllReduce's operations (the extension's names)
    ALL_GATHER,
    ALL_REDUCE,
    FUSED_FORMS,
    OPS,
    REDUCE_SCATTER,
)
from . import common

logger = logging.getLogger("pcie_allreduce")

# Declines an adapter decides itself, before asking the communicator (the engine's path runs the
# call). Like the communicator's they depend only on what every rank agrees on (shapes, dtypes,
# the sizes list the engine passes), so every rank declines together.
SHAPE = "shape"  # no dim-0 split: the engine's tensors do not fit the collective's layout
VARIABLE_SIZES = "variable_sizes"  # an all_gatherv / reduce_scatterv with unequal sizes
NOT_BUILT = "not_built"  # SGLang: the communicator is not built yet (before prepare())


class EngineSlot:
    """The shared core of an engine's slot over one :class:`~pcie_allreduce.PcieAllReduce`
    (``self.ar``; None until built). Subclasses name the engine (``ENGINE``) and may refine
    :meth:`slot_decline` and :meth:`before_call`."""

    ENGINE = "the engine"  # in log lines: "... stay on <ENGINE>'s path"
    group_name = common.TP_GROUP_NAME

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.ar: Any = None
        self.transport: str | None = None
        # Calls the engine's own path ran, per operation and reason.
        self._declines = {op: collections.Counter[str]() for op in OPS}
        self._fused_routed = 0

    # ------------------------------------------------------------------ what engines refine
    def slot_decline(self) -> str | None:
        """Why the slot keeps every call off the kernels before asking the communicator, or
        None (ask it)."""
        return None if self.ar is not None else NOT_BUILT

    def before_call(self, x: Any) -> None:
        """Runs before each decision the communicator makes (SGLang: brackets a capture)."""

    # ------------------------------------------------------------------ the build and close
    def build(
        self, device: Any, device_group: Any, cpu_group: Any, *, max_numel: int, deterministic: bool
    ) -> Any:
        """Makes ``self.ar`` (collective over the group). CUDA tensors: transport cuda_ipc over
        the device (NCCL) group, whose collectives are the fallback. CPU tensors: host_shm over
        a gloo group (the device group when it is gloo, else the cpu group). The bootstrap uses
        the engine's gloo ``cpu_group``. Deterministic: one oneshot tactic at every size."""
        import torch
        import torch.distributed as dist

        from ..communicator import PcieAllReduce

        device = torch.device(device)
        cuda = device.type == "cuda"
        group = device_group
        if not cuda and dist.get_backend(group) != "gloo":
            group = cpu_group
        self.transport = policy.CUDA_IPC if cuda else policy.HOST_SHM
        table = common.deterministic_table(self.transport) if deterministic else None
        # An engine's slot streams past the workspace only when the operator says so
        # (PCIE_ALLREDUCE_STREAM_MAX_NUMEL), on every device: its larger messages stay on the
        # engine's own path, as on GPUs, where streamed sizes are not yet measured against NCCL.
        streamed = env_mod.read_env().stream_max_numel or 0
        self.ar = PcieAllReduce(
            group,
            device if cuda else "cpu",
            max_numel=max_numel,
            table=table,
            cpu_group=cpu_group,
            stream_max_numel=streamed,
        )
        return self.ar

    def close(self) -> None:
        """Logs the summary line once (a warning when the backend was off), then destroys the
        communicator while the engine's process groups still live (collective)."""
        try:
            line = common.summary_line(self, self.group_name)
            (logger.info if self.ar.enabled else logger.warning)("%s", line)
        finally:
            self.ar.destroy()

    # ------------------------------------------------------------------ decisions
    def admits(self, op: str, x: Any) -> bool:
        """For an engine that asks before it runs (its all-reduce slot): whether the kernels
        take ``op`` on ``x``; a decline is counted (the engine then runs the call)."""
        reason = self.slot_decline()
        if reason is None:
            self.before_call(x)
            reason = self.ar.decline(op, x)
        if reason is None:
            return True
        self.count(op, reason, x)
        return False

    def run(self, op: str, x: Any, **kwargs: Any) -> Any:
        """One decision (``PcieAllReduce.try_run``): the kernels' result, or None, counted,
        when the engine's path is to run the call."""
        reason = self.slot_decline()
        if reason is None:
            self.before_call(x)
            result, reason = self.ar.try_run(op, x, **kwargs)
            if reason is None:
                return result
        self.count(op, reason, x)
        return None

    def count(self, op: str, reason: str, x: Any, warning: str | None = None) -> None:
        """One call of ``op`` the engine's path runs. Rank 0 says the first of each reason:
        ``warning`` when given, else which calls and that they stay on the engine's path."""
        before = self._declines[op][reason]
        self._declines[op][reason] = before + 1
        if before or self.rank != 0:
            return
        if warning is not None:
            logger.warning("pcie_allreduce: %s", warning)
            return
        first = f"{tuple(x.shape)} {x.dtype}" if hasattr(x, "shape") else type(x).__name__
        logger.info(
            "pcie_allreduce: %s declines %s calls (%s; first: %s); they stay on %s's path",
            self.group_name,
            op,
            reason,
            first,
            self.ENGINE,
        )

    # ------------------------------------------------------------------ the calls
    def fused_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> Any:
        """``(y, residual_out)``, both new tensors (``residual`` untouched), from the fused
        kernels; None when they do not take the call (counted in ``fused_declines``): the
        engine then runs its unfused all-reduce, add and norm."""
        return self.all_reduce_rms_norm(x, weight, eps, residual=residual)

    def all_reduce_rms_norm(
        self,
        x: Any,
        weight: Any,
        eps: float,
        *,
        residual: Any = None,
        weight_offset: float = 0.0,
        quant: str | None = None,
        scale: Any = None,
    ) -> Any:
        """Any fused form (``PcieAllReduce.all_reduce_rms_norm``'s): ``(y or y_q,
        residual_out)`` and NVFP4's block scales third, all new tensors (the inputs untouched),
        from the fused kernels; None when they do not take the call (counted, every form, in
        ``fused_declines``): the engine then runs its unfused all-reduce, norm and quant."""
        op = FUSED_FORMS[(residual is not None, quant)]
        kwargs: dict[str, Any] = {"residual": residual, "weight": weight, "eps": eps}
        if weight_offset:
            kwargs["weight_offset"] = weight_offset
        if quant is not None:
            kwargs["scale"] = scale
        result = self.run(op, x, **kwargs)
        if result is not None:
            self._fused_routed += 1
        return result

    def reduce_scatter(self, x: Any, output: Any = None) -> Any:
        """Rows ``[rank * m, (rank + 1) * m)`` of the sum of ``x`` (``[world * m, ...]``) into
        ``output`` (the engine's tensor of that many elements, any layout) or a new tensor;
        None when the kernels decline (counted)."""
        rows = (x.shape[0] // self.world_size,) + tuple(x.shape[1:])
        return self._written(REDUCE_SCATTER, x, output, rows)

    def all_gather(self, x: Any, output: Any = None) -> Any:
        """Every rank's ``x`` (``[m, ...]``), rank-major along dim 0, into ``output`` or a new
        tensor; None when the kernels decline (counted)."""
        rows = (self.world_size * x.shape[0],) + tuple(x.shape[1:])
        return self._written(ALL_GATHER, x, output, rows)

    def _written(self, op: str, x: Any, output: Any, rows: tuple[int, ...]) -> Any:
        if output is None:
            return self.run(op, x)
        direct = output.is_contiguous() and not overlaps(output, x)
        result = self.run(op, x, out=output.view(rows) if direct else None)
        if result is None:
            return None
        if not direct:
            output.copy_(result.view(output.shape))
        return output

    # ------------------------------------------------------------------ counts
    def communicator_stats(self) -> dict[str, Any]:
        """The communicator's ``stats()``; an engine whose slot may stay unbuilt says what
        stands in for them."""
        return self.ar.stats()

    def stats(self) -> dict[str, Any]:
        """The communicator's ``stats()`` with the calls the engine's path ran added: to
        ``declines`` (their total in ``engine_fallback``), ``fused_declines`` (beside
        ``fused_routed``, the fused calls the kernels ran) and ``collectives[c]["declines"]``."""
        s = self.communicator_stats()
        ours = self._declines
        s["declines"] = _added(s.get("declines"), ours[ALL_REDUCE])
        s["engine_fallback"] = sum(ours[ALL_REDUCE].values())
        fused = collections.Counter[str]()
        for form in FUSED_FORMS.values():
            fused.update(ours[form])
        s["fused_declines"] = _added(s.get("fused_declines"), fused)
        s["fused_routed"] = self._fused_routed
        merged = {
            c: {k: dict(v) for k, v in (entry or {}).items()}
            for c, entry in (s.get("collectives") or {}).items()
        }
        for c in common.COLLECTIVES:
            if ours[c]:  # the communicator's layout: only collectives that saw something
                entry = merged.setdefault(c, {})
                entry["declines"] = _added(entry.get("declines"), ours[c])
        s["collectives"] = merged
        return s


def _added(counts: dict[str, int] | None, more: collections.Counter[str]) -> dict[str, int]:
    total = collections.Counter(counts or {})
    total.update(more)
    return dict(total)


def overlaps(a: Any, b: Any) -> bool:
    """Whether two tensors share any byte."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: Any) -> tuple[int, int]:
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        start = t.data_ptr()
        return start, start + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def gathered_along(gathered: Any, world: int, size: Any, dim: int) -> Any:
    """``[world * size[0], ...]`` (rank-major along dim 0, what PcieAllReduce.all_gather
    returns) as the engines' concat-style all-gather along ``dim`` (the layout both vLLM's and
    SGLang's ``all_gather(x, dim)`` build from their dim-0 collective)."""
    if dim == 0:
        return gathered
    out = gathered.reshape((world,) + tuple(size)).movedim(0, dim)
    return out.reshape(tuple(size[:dim]) + (world * size[dim],) + tuple(size[dim + 1 :]))
