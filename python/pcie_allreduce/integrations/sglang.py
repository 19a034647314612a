"""SGLang integration: a :class:`PcieAllReduce` in the tensor-parallel group's PCIe-IPC slot.

SGLang (>= 0.5.23) already dispatches to a PCIe-IPC all-reduce: ``GroupCoordinator`` holds
``pcie_ipc_comm``, ``_resolve_outplace_all_reduce_method`` asks it (after the custom
all-reduce, which wins on NVLink hosts) with ``should_pcie_ipc_ar(t)``, ``_all_reduce_out_place``
calls ``pcie_ipc_all_reduce(t)`` for a new tensor, the model runner calls
``prepare(hidden=, max_rows=)`` before graph capture and ``destroy()`` runs before the process
groups are destroyed. This module fills that slot and patches nothing else:

* **Installed by** SGLang's plugin loader (entry point ``sglang.srt.plugins`` ->
  :func:`register`), which does nothing unless ``PCIE_ALLREDUCE_ENABLE=1``. Enabled, it
  registers an AFTER hook on ``GroupCoordinator.__init__`` with SGLang's ``HookRegistry``.
* **Which group**: only the one named exactly ``tp`` with world size > 1
  (``common.ineligible``); ``attention_tp``, ``moe_tp``, ``pdmux_prefill_tp`` get nothing. The
  communicator turns itself off on NVLink hosts and across hosts.
* **Both flags**: with SGLang's own ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE`` also set, the explicit
  ``PCIE_ALLREDUCE_ENABLE=1`` wins: SGLang's communicator (its workspace is still unbuilt then)
  is destroyed and one line on group rank 0 says so.
* **When it is built**: the workspace needs the hidden size, which the group does not know when
  it is made, so the communicator is built (collectively) in ``prepare(hidden, max_rows)``,
  which SGLang's runner calls on every rank before graph capture; without a ``prepare``, on the
  first reduction SGLang offers (every rank offers the same reductions in the same order) with
  that tensor's last dimension as the hidden size, never inside a graph capture.
* **Sizing**: ``PCIE_ALLREDUCE_MAX_NUMEL`` > decode CUDA-graph ``max_bs`` x draft tokens (when
  a speculative algorithm is set) x hidden from SGLang's published config > ``max_rows`` from
  ``prepare`` x hidden > the announced guess (``common.size_workspace``). One line says which.
* **Warm-up**: ``prepare`` runs ``common.warm_up``: one tune when this host has no cache (unless
  ``--disable-flashinfer-autotune`` or ``PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1``), then installs every
  program a captured call could need.
* **Graph capture**: SGLang's ``graph_capture()`` has no PCIe-IPC hook, so every decision checks
  whether the current CUDA stream is capturing (a no-op for CPU tensors): before the
  communicator exists it declines (``not_prepared``, warned once) rather than build inside a
  capture; after, it brackets the capture in ``PcieAllReduce.capture()`` (programs already
  installed, no tuning inside, ``stats()["captures"]`` counts it), left at the first decision
  made outside a capture. Calls on the capture stream and the replay stream are ordered by the
  communicator itself.
* **Deterministic inference**: SGLang's own rule for deterministic collectives
  (``GroupCoordinator._deterministic_collectives_enabled()``: ``SGLANG_USE_1STAGE_ALLREDUCE``
  when set, else ``SGLANG_ENABLE_DETERMINISTIC_INFERENCE``), and when the former is unset also
  the published ``exec.deterministic.enable_deterministic_inference``. Then the table is
  ``common.deterministic_table``: oneshot at every admitted size.
* **The fused end of a layer** (all-reduce + residual add + RMSNorm): two AROUND hooks on
  SGLang's FlashInfer fusion gate and call (``sglang_fusion.py``) send it to the slot's
  ``fused_add_rms_norm`` where the kernels take it.
* **Reduce-scatter and all-gather**: two AROUND hooks on ``GroupCoordinator
  ._reduce_scatter_tensor`` and ``._all_gather_into_tensor`` (SGLang's private methods beneath
  its ``reg_reduce_scatter_tensor`` / ``reg_all_gather_into_tensor`` custom ops; why those, at
  ``_reduce_scatter_hook``) run a tp call on our kernels when the communicator is built and
  takes it (one decision: ``PcieAllReduce.try_run``); every other call, and every other group's,
  runs SGLang's method. Declines are counted per reason in ``stats()["collectives"]``.
* **One call path**: every call the slot gets is decided once through the shared core
  (``adapter.EngineSlot``), and the calls SGLang's own path then ran are counted per reason.
* **SGLang's configuration** is read in ``sglang_config.py``.
* **Shutdown**: ``destroy()`` logs ``common.summary_line`` once (its declines include the
  slot's: reductions SGLang offered that stayed on its own path) and destroys the communicator
  while the process groups still live (SGLang calls it first in ``GroupCoordinator.destroy``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import policy
from . import common, sglang_fusion
from .adapter import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, SHAPE, EngineSlot
from .sglang_config import decode_width, deterministic_rule, engine_autotune_disabled

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pcie_allreduce")

HOOK_TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__"
# Where every dim-0 reduce-scatter and all-gather of a group meets (why: _reduce_scatter_hook).
REDUCE_SCATTER_TARGET = (
    "sglang.srt.distributed.parallel_state.GroupCoordinator._reduce_scatter_tensor"
)
ALL_GATHER_TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator._all_gather_into_tensor"
UPSTREAM_FLAG = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
NOT_PREPARED = "not_prepared"  # a capture reached the slot before the communicator was built
_NOT_PREPARED = (
    "a %s graph capture reached the slot before prepare() built the communicator; captured "
    "reductions stay on SGLang's path"
)

_registered = False


def register() -> None:
    """SGLang's ``sglang.srt.plugins`` entry point (``load_plugins()`` calls it in every
    process, then applies the registered hooks). Does nothing unless PCIE_ALLREDUCE_ENABLE=1."""
    global _registered
    if _registered or not common.enabled():
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as error:  # noqa: BLE001 - any import failure means: not on this SGLang
        # As vLLM's register() does: a plugin the operator enabled says why it does nothing,
        # and the server it was loaded into keeps running.
        logger.warning(
            "pcie_allreduce: PCIE_ALLREDUCE_ENABLE=1 but SGLang's plugin hooks "
            "cannot be imported (%s: %s); SGLang keeps its own all-reduce",
            type(error).__name__,
            error,
        )
        return

    HookRegistry.register(HOOK_TARGET, _after_group_init, HookType.AFTER)
    HookRegistry.register(sglang_fusion.FUSED_TARGET, sglang_fusion.fused_call, HookType.AROUND)
    HookRegistry.register(
        sglang_fusion.FUSION_GATE_TARGET, sglang_fusion.fusion_gate, HookType.AROUND
    )
    HookRegistry.register(REDUCE_SCATTER_TARGET, _reduce_scatter_hook, HookType.AROUND)
    HookRegistry.register(ALL_GATHER_TARGET, _all_gather_hook, HookType.AROUND)
    _registered = True


def _after_group_init(result: Any, coordinator: Any, *args: Any, **kwargs: Any) -> None:
    """Runs after every ``GroupCoordinator.__init__``: fills ``pcie_ipc_comm`` of ``tp``."""
    name = _group_name(coordinator, args, kwargs)
    why_not = common.ineligible(name, int(coordinator.world_size))
    if why_not is not None:
        logger.debug("pcie_allreduce: no communicator for %s: %s", coordinator.unique_name, why_not)
        return None
    if slot_of(coordinator) is not None:
        return None
    from .. import env as env_mod

    env_mod.read_env()  # a malformed PCIE_ALLREDUCE_* flag fails here, on every rank alike
    theirs = coordinator.pcie_ipc_comm
    ours = SglangPcieAllReduce(coordinator)
    if theirs is not None or _upstream_flag_set():
        _take_over_from_upstream(coordinator, theirs)
    coordinator.pcie_ipc_comm = ours
    return None


def slot_of(coordinator: Any) -> SglangPcieAllReduce | None:
    """Our slot in SGLang's ``coordinator`` (None: none, or SGLang's own)."""
    slot = getattr(coordinator, "pcie_ipc_comm", None)
    return slot if isinstance(slot, SglangPcieAllReduce) else None


def _group_name(coordinator: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The ``group_name`` the coordinator was built with (keyword or positional)."""
    init = type(coordinator).__init__
    try:
        bound = inspect.signature(init).bind(coordinator, *args, **kwargs)
    except TypeError:
        return kwargs.get("group_name")
    return bound.arguments.get("group_name")


def _upstream_flag_set() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get())


def _take_over_from_upstream(coordinator: Any, theirs: Any) -> None:
    """Both backends were asked for: ours owns the slot; theirs, if SGLang built it (its
    workspace is built lazily, so nothing collective has happened yet), is destroyed."""
    if theirs is not None:
        theirs.destroy()
        fate = f"SGLang's {type(theirs).__name__} was destroyed"
    elif coordinator._deterministic_collectives_enabled():
        fate = "SGLang did not build its own (deterministic inference keeps it off)"
    else:
        fate = "SGLang did not build its own"
    if coordinator.rank_in_group == 0:
        logger.warning(
            "pcie_allreduce: PCIE_ALLREDUCE_ENABLE=1 and %s=1 both ask for the %s PCIe-IPC "
            "all-reduce slot; pcie_allreduce owns it (the explicit PCIE_ALLREDUCE_ENABLE=1 "
            "wins); %s",
            UPSTREAM_FLAG,
            coordinator.unique_name,
            fate,
        )


# ------------------------------------------------------------------ reduce-scatter, all-gather
# SGLang has no slot for a reduce-scatter or all-gather backend. Its public
# ``reduce_scatter_tensor(output, input)`` and ``all_gather_into_tensor(output, input)`` (in
# which ``reduce_scatter_along_dim``, ``all_gather(x, dim)`` of GPU tensors, the layer
# boundary's tp / attention-tp scatters and gathers, and DP attention's padded gather and
# ``dp_reduce_scatter_tensor`` all end) first take SGLang's own special routes (deterministic
# inference: an all-reduce and a slice; ROCm's AITER), then call the custom ops
# ``reg_reduce_scatter_tensor`` / ``reg_all_gather_into_tensor`` (opaque to Dynamo, CUDA-graph
# safe), whose bodies call the private ``GroupCoordinator._reduce_scatter_tensor`` /
# ``_all_gather_into_tensor``, where SGLang picks pynccl or torch.distributed.
#
# We hook those two private methods (AROUND, through SGLang's own HookRegistry) on purpose:
# they are the one place beneath the custom ops where every such call of a group arrives, the
# analogue of ``_all_reduce_out_place``, where SGLang consults ``pcie_ipc_comm``. Hooking the
# public methods instead would put our Python in front of Dynamo (what the custom ops exist to
# avoid) and would have to copy SGLang's deterministic and AITER routes. The hooks act only
# for a coordinator whose ``pcie_ipc_comm`` is ours (the tp group) and only for a call the
# slot admits; every other call runs SGLang's method as it is. ``test_sglang_collectives.py``
# pins the names and the call path against SGLang 0.5.23, so a rename fails a test.
def _output_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """(output, input) of a ``(output, input)`` call, positional or keyword, else None."""
    names = ("output", "input")
    if len(args) + len(kwargs) != 2 or any(k not in names for k in kwargs):
        return None
    values = dict(zip(names, args))
    if any(k in values for k in kwargs):
        return None
    values.update(kwargs)
    return values["output"], values["input"]


def _reduce_scatter_hook(
    original: Callable[..., Any], coordinator: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``GroupCoordinator._reduce_scatter_tensor(output, input)``."""
    slot = slot_of(coordinator)
    if slot is not None:
        tensors = _output_input(args, kwargs)
        if tensors is not None and slot.reduce_scatter_into(*tensors):
            return tensors[0]  # what SGLang's method returns
    return original(coordinator, *args, **kwargs)


def _all_gather_hook(
    original: Callable[..., Any], coordinator: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``GroupCoordinator._all_gather_into_tensor(output, input)``."""
    slot = slot_of(coordinator)
    if slot is not None:
        tensors = _output_input(args, kwargs)
        if tensors is not None and slot.all_gather_into(*tensors):
            return None  # SGLang's method returns nothing
    return original(coordinator, *args, **kwargs)


def _stream_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never for the CPU)."""
    if device.type != "cuda":
        return False
    import torch  # loaded long before (SGLang's own); not at plugin import, which may stay off

    return torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------- the slot
class SglangPcieAllReduce(EngineSlot):
    """What SGLang's ``GroupCoordinator.pcie_ipc_comm`` holds: the API of SGLang's own
    ``PcieIpcCommunicator`` (``disabled``, ``should_pcie_ipc_ar``, ``pcie_ipc_all_reduce``,
    ``prepare``, ``destroy``) over one :class:`PcieAllReduce`, plus ``stats()``, the fused call
    and the hooked collectives (the shared core: ``EngineSlot``)."""

    ENGINE = "SGLang"

    def __init__(self, coordinator: Any) -> None:
        import torch

        super().__init__(int(coordinator.rank_in_group), int(coordinator.world_size))
        self.device = torch.device(coordinator.device)
        self._device_group = coordinator.device_group
        self._cpu_group = coordinator.cpu_group
        self._engine_deterministic = type(coordinator)._deterministic_collectives_enabled
        self.max_numel = 0
        self.sizing: policy.Sizing | None = None
        self.deterministic: str | None = None
        self.warm_up_outcome: dict[str, Any] | None = None
        self._failed: str | None = None
        self._destroyed = False
        self._capture: contextlib.ExitStack | None = None
        self.hidden: int | None = None
        self._fusion_off: tuple[str | None] | None = None  # (reason,) once decided

    # ------------------------------------------------------------------ the core's refinements
    def slot_decline(self) -> str | None:
        """Destroyed or failed to build: ``disabled``; not built yet: ``not_built``."""
        if self._destroyed or self._failed is not None:
            return "disabled"
        return super().slot_decline()

    def before_call(self, x: Any) -> None:
        self._bracket_capture(_stream_capturing(x.device))

    # ------------------------------------------------------------------ SGLang's API
    @property
    def disabled(self) -> bool:
        """SGLang skips the slot when True. Before the communicator exists it is False, so
        the first reduction offered can build it."""
        if self._destroyed or self._failed is not None:
            return True
        return self.ar is not None and not self.ar.enabled

    def prepare(self, hidden: int | None = None, max_rows: int | None = None) -> dict[str, Any]:
        """Called by SGLang's runner on every rank before graph capture (collective): builds
        the communicator if needed, tunes once on a host without a cache, installs every
        program a captured call could need. Returns the warm-up outcome."""
        if self._destroyed:
            raise RuntimeError("prepare() on a destroyed pcie_allreduce slot")
        if self._failed is None and self.ar is None:
            self._build(hidden, max_rows)
        if self.ar is None:  # the build failed here or earlier (said once, when it did)
            return {"tuned": False, "why_not_tuned": f"not built ({self._failed})"}
        rows = max_rows or self._rows_from_config()
        ready = (hidden, rows) if hidden and rows else (None, None)
        self.warm_up_outcome = common.warm_up(
            self.ar,
            engine_autotune_disabled=engine_autotune_disabled(),
            hidden=ready[0],
            max_rows=ready[1],
        )
        return self.warm_up_outcome

    def should_pcie_ipc_ar(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` goes to the kernels (else SGLang takes its own path). Before
        ``prepare()``, the first reduction offered outside a graph capture builds the
        communicator; one inside a capture never does (``not_prepared``: SGLang's path)."""
        if self.ar is None:
            if self.disabled:
                return False
            if _stream_capturing(inp.device):
                self.count(ALL_REDUCE, NOT_PREPARED, inp, warning=_NOT_PREPARED % self.group_name)
                return False
            if not self._build(int(inp.shape[-1]) if inp.dim() else None, None):
                return False
            self.communicator.prepare()  # built just now
        return self.admits(ALL_REDUCE, inp)

    def pcie_ipc_all_reduce(self, inp: torch.Tensor) -> torch.Tensor:
        """The sum of ``inp`` over the group, in a new tensor."""
        return self.ar.all_reduce(inp)

    def destroy(self) -> None:
        """Before SGLang destroys the process groups (collective, idempotent): logs the
        summary line once and frees the workspace."""
        if self._destroyed:
            return
        self._destroyed = True
        self._bracket_capture(False)
        if self.ar is not None:
            self.close()
            return
        logger.info(
            "pcie_allreduce[%s rank %d/%d]: never built (%s)",
            self.group_name,
            self.rank,
            self.world_size,
            self._failed or "no prepare() and no reduction reached it",
        )

    # ------------------------------------------------------------------ the fused call
    def offers_fusion(self, batch_size: Any) -> bool:
        """Whether SGLang's layer boundary may offer the fused all-reduce + add + RMSNorm for a
        batch of ``batch_size`` rows: the communicator is built and enabled, SGLang's own rules
        allow a fusion (``_fusion_off_reason``) and the rows fit the workspace. The same answer
        on every rank (built and enabled are agreed; the rest is configuration)."""
        if self.ar is None or self.disabled:
            return False
        if self._fusion_off is None:
            reason = sglang_fusion.fusion_off_reason(
                bool(self.deterministic and self.deterministic.startswith("on"))
            )
            self._fusion_off = (reason,)
            if reason is not None and self.rank == 0:
                logger.info(
                    "pcie_allreduce: %s keeps SGLang's unfused all-reduce + RMSNorm: %s",
                    self.group_name,
                    reason,
                )
        if self._fusion_off[0] is not None:
            return False
        if not batch_size > 0:
            return False
        # The communicator admits what its workspace holds and what it streams through it.
        limit = max(self.max_numel, self.ar.stream_max_numel if self.ar is not None else 0)
        return self.hidden is None or batch_size * self.hidden <= limit

    # ------------------------------------------------------------------ reduce-scatter, all-gather
    def reduce_scatter_into(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        """``GroupCoordinator._reduce_scatter_tensor(output, inp)`` on our kernels when they
        take it (True: ``output`` holds this rank's rows of the sum); False leaves the call to
        SGLang (counted under ``stats()["collectives"]["reduce_scatter"]["declines"]``)."""
        fits = inp.dim() and not inp.shape[0] % self.world_size
        if not (fits and output.numel() * self.world_size == inp.numel() and _alike(output, inp)):
            self.count(REDUCE_SCATTER, SHAPE, inp)
            return False
        return self.reduce_scatter(inp, output) is not None

    def all_gather_into(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        """``GroupCoordinator._all_gather_into_tensor(output, inp)`` on our kernels when they
        take it (True: ``output`` holds every rank's ``inp``, rank-major); False leaves the
        call to SGLang (counted under ``stats()["collectives"]["all_gather"]["declines"]``)."""
        fits = inp.dim() and output.numel() == self.world_size * inp.numel()
        if not (fits and _alike(output, inp)):
            self.count(ALL_GATHER, SHAPE, inp)
            return False
        return self.all_gather(inp, output) is not None

    # ------------------------------------------------------------------ ours
    def communicator_stats(self) -> dict[str, Any]:
        if self.ar is not None:
            return super().communicator_stats()
        return {
            "calls": {},
            "declines": {},
            "staged": 0,
            "captures": 0,
            "table_source": "none (not built)",
            "enabled": False,
            "disabled_reason": self._failed or "not built yet",
        }

    def stats(self) -> dict[str, Any]:
        """The core's stats (``EngineSlot.stats``: what SGLang's own path ran, added), plus the
        sizing line, the deterministic rule and the warm-up outcome."""
        s = super().stats()
        s["max_numel"] = self.max_numel
        s["sizing"] = self.sizing.how if self.sizing else None
        s["deterministic"] = self.deterministic
        s["warm_up"] = self.warm_up_outcome
        return s

    @property
    def communicator(self) -> Any:
        """The PcieAllReduce, once built."""
        return self.ar

    # ------------------------------------------------------------------ internals
    def _rows_from_config(self) -> int | None:
        max_bs, draft, _ = decode_width()
        return max_bs * (draft or 1) if max_bs else None

    def _build(self, hidden: int | None, max_rows: int | None) -> bool:
        """Builds the communicator (collective: every rank gets here at the same call)."""
        max_bs, draft, source = decode_width()
        if not max_bs and max_rows:  # the runner's rows already count draft tokens
            max_bs, draft, source = max_rows, None, f"prepare(max_rows={max_rows}); {source}"
        sizing = common.size_workspace("sglang", max_bs=max_bs, draft_tokens=draft, hidden=hidden)
        on, why = deterministic_rule(self._engine_deterministic)
        try:
            self.build(
                self.device,
                self._device_group,
                self._cpu_group,
                max_numel=sizing.max_numel,
                deterministic=on,
            )
        except Exception as error:  # the group keeps SGLang's own path; say why, once
            self._failed = f"{type(error).__name__}: {error}"
            logger.warning(
                "pcie_allreduce: the %s communicator could not be built, so its "
                "reductions stay on SGLang's path: %s",
                self.group_name,
                self._failed,
            )
            return False
        self.sizing, self.max_numel = sizing, sizing.max_numel
        self.hidden = hidden if hidden and hidden > 0 else None
        self.deterministic = f"on ({why}): oneshot at every size" if on else f"off ({why})"
        if self.rank == 0 and not sizing.guessed:  # a guess was already announced
            logger.info(
                "pcie_allreduce: %s workspace %d elements: %s (%s)",
                self.group_name,
                sizing.max_numel,
                sizing.how,
                source,
            )
        if self.rank == 0 and on:
            logger.info(
                "pcie_allreduce: deterministic inference (%s): one oneshot tactic at every size",
                why,
            )
        return True

    def _bracket_capture(self, capturing: bool) -> None:
        """Enters PcieAllReduce.capture() at the first decision inside a graph capture and
        leaves it at the first one outside (SGLang's graph_capture() has no hook for us)."""
        if capturing and self._capture is None and self.ar is not None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.ar.capture())
            self._capture = stack
        elif not capturing and self._capture is not None:
            stack, self._capture = self._capture, None
            stack.close()

    def __repr__(self) -> str:
        state = (
            "destroyed"
            if self._destroyed
            else repr(self.ar)
            if self.ar
            else f"not built ({self._failed or 'waiting for prepare()'})"
        )
        return f"SglangPcieAllReduce({self.group_name} rank {self.rank}/{self.world_size}, {state})"


def _alike(output: torch.Tensor, inp: torch.Tensor) -> bool:
    return output.dtype == inp.dtype and output.device == inp.device
