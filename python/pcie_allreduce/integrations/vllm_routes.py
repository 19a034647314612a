"""vLLM's reduce-scatter and all-gather on the tp group's slot.

vLLM 0.33's CudaCommunicator keeps a slot for a PCIe all-reduce backend (fi_pcie_ipc_ar_comm)
but none for reduce-scatter or all-gather: those run pynccl, NCCL symmetric memory or AITER
inline in its public methods. So the tp group's communicator *instance* gets its own copy of
these public methods, the ones vLLM's GroupCoordinator (and so its vllm.reduce_scatter /
vllm.all_gather custom ops) calls: each asks the slot, and calls vLLM's own method, taken
from the class, for every call the slot declines. Nothing private is touched, the class stays
as vLLM ships it, and no other group's communicator changes. When vLLM's destroy() empties
the slot, every call goes to vLLM's methods again.

Each routed method makes one decision through a function below: vLLM's layout (its ``dim``,
its ``sizes``, its output tensor) over the shared core's dim-0 collectives
(``adapter.EngineSlot.reduce_scatter`` / ``all_gather``). Each returns vLLM's result, or None
when the kernels do not take the call (counted in the slot's stats): vLLM's own method then
runs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .adapter import (
    ALL_GATHER,
    REDUCE_SCATTER,
    SHAPE,
    VARIABLE_SIZES,
    EngineSlot,
    gathered_along,
)

logger = logging.getLogger("pcie_allreduce.vllm")

COLLECTIVE_ROUTES = (
    "reduce_scatter",
    "all_gather",
    "reduce_scatterv",
    "reduce_scatterv_into_output",
    "all_gatherv",
)
_ROUTED = "_pcie_allreduce_routed"  # set on a communicator instance once routed


def route_collectives(communicator: Any) -> list[str]:
    """Gives the tp communicator instance the routed versions of :data:`COLLECTIVE_ROUTES`
    (those its class has); returns their names. Idempotent."""
    import weakref

    from .vllm import slot_of  # vllm.py imports this module: not at import time

    cls = type(communicator)
    present = [n for n in COLLECTIVE_ROUTES if callable(getattr(cls, n, None))]
    if _ROUTED in communicator.__dict__:
        return list(communicator.__dict__[_ROUTED])
    absent = sorted(set(COLLECTIVE_ROUTES) - set(present))
    if absent and communicator.rank_in_group == 0:
        logger.warning(
            "pcie_allreduce: vLLM's %s has no %s (renamed upstream?); those stay on vLLM's path",
            cls.__name__,
            ", ".join(absent),
        )
    ref = weakref.ref(communicator)  # no cycle: the methods live on the instance

    def reduce_scatter(input_: Any, dim: int = -1) -> Any:
        comm = ref()
        slot = slot_of(comm)
        out = try_reduce_scatter(slot, input_, dim) if slot is not None else None
        return cls.reduce_scatter(comm, input_, dim) if out is None else out

    def all_gather(input_: Any, dim: int = -1) -> Any:
        comm = ref()
        slot = slot_of(comm)
        out = try_all_gather(slot, input_, dim) if slot is not None else None
        return cls.all_gather(comm, input_, dim) if out is None else out

    def reduce_scatterv(input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
        comm = ref()
        slot = slot_of(comm)
        out = try_reduce_scatterv(slot, input_, dim, sizes) if slot is not None else None
        return cls.reduce_scatterv(comm, input_, dim, sizes) if out is None else out

    def reduce_scatterv_into_output(
        input_: Any, output: Any, dim: int = -1, sizes: list[int] | None = None
    ) -> Any:
        comm = ref()
        slot = slot_of(comm)
        out = (
            try_reduce_scatterv(slot, input_, dim, sizes, output=output)
            if slot is not None
            else None
        )
        return (
            cls.reduce_scatterv_into_output(comm, input_, output, dim, sizes)
            if out is None
            else out
        )

    def all_gatherv(input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
        comm = ref()
        slot = slot_of(comm)

        def theirs(rest: Any) -> Any:
            return cls.all_gatherv(comm, rest, dim, sizes)

        out = try_all_gatherv(slot, input_, dim, sizes, theirs) if slot is not None else None
        return theirs(input_) if out is None else out

    routes = {
        "reduce_scatter": reduce_scatter,
        "all_gather": all_gather,
        "reduce_scatterv": reduce_scatterv,
        "reduce_scatterv_into_output": reduce_scatterv_into_output,
        "all_gatherv": all_gatherv,
    }
    for name in present:
        route = routes[name]
        route.__doc__ = (
            f"vLLM's {cls.__name__}.{name}, routed: pcie_allreduce's kernels "
            "where the tp slot admits the call, vLLM's own method otherwise."
        )
        setattr(communicator, name, route)
    setattr(communicator, _ROUTED, tuple(present))
    return present


def try_reduce_scatter(slot: EngineSlot, input_: Any, dim: int = -1) -> Any:
    """``CudaCommunicator.reduce_scatter(input_, dim)``: vLLM's layout (it moves dim 0 to
    ``dim``, scatters rows, moves them back), the sum from our kernels."""
    if input_.dim() == 0:
        return None
    if dim < 0:
        dim += input_.dim()
    x = input_.movedim(0, dim)  # exactly vLLM's (and its base class's) transform
    if x.shape[0] % slot.world_size:
        slot.count(REDUCE_SCATTER, SHAPE, x)
        return None  # vLLM's own path asserts on it
    out = slot.reduce_scatter(x)
    return None if out is None else out.movedim(0, dim).contiguous()


def try_all_gather(slot: EngineSlot, input_: Any, dim: int = -1) -> Any:
    """``CudaCommunicator.all_gather(input_, dim)``: concatenated along ``dim``."""
    if input_.dim() == 0:
        return None
    if dim < 0:
        dim += input_.dim()
    out = slot.all_gather(input_)
    return None if out is None else gathered_along(out, slot.world_size, input_.size(), dim)


def try_all_gatherv(
    slot: EngineSlot,
    input_: Any,
    dim: int,
    sizes: Sequence[int] | None,
    theirs: Callable[[list[Any]], list[Any]],
) -> Any:
    """``CudaCommunicator.all_gatherv``: equal sizes (or none) only, one tensor or a list.
    A list: one decision per tensor, in order; from the first one the kernels decline on,
    the rest go to vLLM's method (``theirs``) as one list."""
    if dim != 0:
        return None  # vLLM raises NotImplementedError
    if sizes is not None and any(s != sizes[0] for s in sizes):
        slot.count(ALL_GATHER, VARIABLE_SIZES, input_)
        return None
    single = not isinstance(input_, (list, tuple))
    tensors = [input_] if single else list(input_)
    outs: list[Any] = []
    for t in tensors:
        if t.dim() == 0:
            slot.count(ALL_GATHER, SHAPE, t)
            break
        out = slot.all_gather(t)
        if out is None:
            break
        outs.append(out)
    if not outs:
        return None
    if len(outs) < len(tensors):
        outs += theirs(tensors[len(outs) :])
    return outs[0] if single else outs


def try_reduce_scatterv(
    slot: EngineSlot,
    input_: Any,
    dim: int = -1,
    sizes: Sequence[int] | None = None,
    output: Any = None,
) -> Any:
    """``CudaCommunicator.reduce_scatterv`` and ``reduce_scatterv_into_output``
    (``output`` given): equal sizes (or none) only."""
    if sizes is not None and any(s != sizes[0] for s in sizes):
        slot.count(REDUCE_SCATTER, VARIABLE_SIZES, input_)
        return None
    if output is None:
        return try_reduce_scatter(slot, input_, dim)
    if input_.dim() == 0:
        return None
    if dim < 0:
        dim += input_.dim()
    world = slot.world_size
    if dim != 0 or input_.shape[0] % world:
        return None  # vLLM's own path asserts on these
    expected = (input_.shape[0] // world,) + tuple(input_.shape[1:])
    if (
        tuple(output.shape) != expected
        or output.dtype != input_.dtype
        or output.device != input_.device
        or not output.is_contiguous()
    ):
        return None  # likewise
    return slot.reduce_scatter(input_, output)
