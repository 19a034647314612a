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
* **The fused end of a layer** (all-reduce + residual add + RMSNorm): SGLang's layer boundary
  offers it where its FlashInfer fusion applies (``flashinfer_ar_fusion_applies``), and
  ``RMSNorm.forward_with_allreduce_fusion`` calls ``flashinfer_allreduce_residual_rmsnorm``,
  whose ``(None, None)`` means "not taken" (the caller then all-reduces, adds and normalises
  itself, into a fresh residual). Two AROUND hooks (SGLang's ``HookRegistry``): the gate also
  opens when this group's communicator is built and enabled and SGLang's own rules would allow a
  fusion (no DP attention, no deterministic inference, no
  ``--enforce-disable-flashinfer-allreduce-fusion``, no CuTe DSL fusion) for a batch that fits
  the workspace; the call goes to ``PcieAllReduce.all_reduce_add_rms_norm`` when the group it
  reduces over (SGLang's ``resolve_fusion_group``) holds our slot and the kernels take the
  tensors (``should_use_fused``), else to SGLang's own function. Fresh ``(norm_out,
  residual_out)``, ``residual`` untouched, as FlashInfer's kernel returns them.
* **Reduce-scatter and all-gather**: two AROUND hooks on ``GroupCoordinator
  ._reduce_scatter_tensor`` and ``._all_gather_into_tensor`` (SGLang's private methods beneath
  its ``reg_reduce_scatter_tensor`` / ``reg_all_gather_into_tensor`` custom ops; why those, at
  ``_reduce_scatter_hook``) run a tp call on ``PcieAllReduce.reduce_scatter`` / ``all_gather``
  when the communicator is built and ``should_use_collective`` admits the input; every other
  call, and every other group's, runs SGLang's method. Declines are counted per reason in
  ``stats()["collectives"]``.
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
from . import common

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pcie_allreduce")

HOOK_TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__"
# Where every dim-0 reduce-scatter and all-gather of a group meets (why: _reduce_scatter_hook).
REDUCE_SCATTER_TARGET = (
    "sglang.srt.distributed.parallel_state.GroupCoordinator._reduce_scatter_tensor"
)
ALL_GATHER_TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator._all_gather_into_tensor"
# SGLang's fused all-reduce + residual add + RMSNorm call site, and the gate that offers it.
FUSED_TARGET = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"
FUSION_GATE_TARGET = (
    "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies"
)
UPSTREAM_FLAG = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
NOT_PREPARED = "not_prepared"  # a capture reached the slot before the communicator was built

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
    HookRegistry.register(FUSED_TARGET, _fused_call, HookType.AROUND)
    HookRegistry.register(FUSION_GATE_TARGET, _fusion_gate, HookType.AROUND)
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
    if isinstance(coordinator.pcie_ipc_comm, SglangPcieAllReduce):
        return None
    from .. import env as env_mod

    env_mod.read_env()  # a malformed PCIE_ALLREDUCE_* flag fails here, on every rank alike
    theirs = coordinator.pcie_ipc_comm
    ours = SglangPcieAllReduce(coordinator)
    if theirs is not None or _upstream_flag_set():
        _take_over_from_upstream(coordinator, theirs)
    coordinator.pcie_ipc_comm = ours
    return None


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
    slot = getattr(coordinator, "pcie_ipc_comm", None)
    if isinstance(slot, SglangPcieAllReduce):
        tensors = _output_input(args, kwargs)
        if tensors is not None and slot.reduce_scatter_into(*tensors):
            return tensors[0]  # what SGLang's method returns
    return original(coordinator, *args, **kwargs)


def _all_gather_hook(
    original: Callable[..., Any], coordinator: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``GroupCoordinator._all_gather_into_tensor(output, input)``."""
    slot = getattr(coordinator, "pcie_ipc_comm", None)
    if isinstance(slot, SglangPcieAllReduce):
        tensors = _output_input(args, kwargs)
        if tensors is not None and slot.all_gather_into(*tensors):
            return None  # SGLang's method returns nothing
    return original(coordinator, *args, **kwargs)


# ---------------------------------------------------------------------------- the fused call
_FUSED_SIGNATURE: inspect.Signature | None = None
_ENGINE_GATE: Callable[..., bool] | None = None  # SGLang's own flashinfer_ar_fusion_applies


def _tp_slot() -> SglangPcieAllReduce | None:
    """Our slot in SGLang's ``tp`` coordinator, or None (no groups yet, or not ours)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        tp = get_parallel().tp_group
    except (RuntimeError, ValueError, AttributeError):
        return None
    slot = getattr(tp, "pcie_ipc_comm", None)
    return slot if isinstance(slot, SglangPcieAllReduce) else None


def _fusion_gate(original: Callable[..., bool], batch_size: Any, *args: Any, **kwargs: Any) -> bool:
    """AROUND ``flashinfer_ar_fusion_applies(batch_size)``: SGLang's answer, or True where our
    communicator can take the fused call instead (``SglangPcieAllReduce.offers_fusion``)."""
    global _ENGINE_GATE
    _ENGINE_GATE = original
    if original(batch_size, *args, **kwargs):
        return True
    slot = _tp_slot()
    return slot is not None and slot.offers_fusion(batch_size)


def _fused_call(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``flashinfer_allreduce_residual_rmsnorm``: our fused op when the group the call
    reduces over holds our slot and the kernels take it. Otherwise SGLang's own function where
    SGLang's own gate offered the call (FlashInfer's fusion), else ``(None, None)``, what that
    function returns when FlashInfer does not take a call: SGLang's caller then runs its unfused
    path (its all-reduce, then its add and norm into a fresh residual)."""
    global _FUSED_SIGNATURE
    if _FUSED_SIGNATURE is None:
        _FUSED_SIGNATURE = inspect.signature(original)
    try:
        bound = _FUSED_SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return original(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    try:
        _, _, coordinator = resolve_fusion_group(use_attn_tp_group=call["use_attn_tp_group"])
    except (RuntimeError, ValueError, AttributeError):  # no groups: SGLang decides
        return original(*args, **kwargs)
    slot = getattr(coordinator, "pcie_ipc_comm", None)
    if isinstance(slot, SglangPcieAllReduce):
        fused = slot.fused_add_rms_norm(
            call["input_tensor"], call["residual"], call["weight"], call["eps"]
        )
        if fused is not None:
            return fused
        rows = call["input_tensor"].shape[0] if call["input_tensor"].dim() else 0
        if _ENGINE_GATE is not None and not _ENGINE_GATE(rows):
            return None, None  # we opened the gate: SGLang's fallback, not FlashInfer's kernel
    return original(*args, **kwargs)


def _fusion_off_reason(deterministic: bool) -> str | None:
    """Why SGLang would not fuse the all-reduce into the norm in this server, whatever the
    hardware (its own rules for its FlashInfer fusion), or None."""
    from sglang.srt.runtime_context import get_exec

    if deterministic:
        return "deterministic inference (SGLang turns its all-reduce fusion off there too)"
    enforce_off, _ = _read_config(
        "get_exec().comm.enforce_disable_flashinfer_allreduce_fusion",
        lambda: get_exec().comm.enforce_disable_flashinfer_allreduce_fusion,
    )
    if enforce_off:
        return "--enforce-disable-flashinfer-allreduce-fusion"
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.flashinfer_comm_fusion import uses_cutedsl_ar_fusion

    try:
        if is_dp_attention_enabled():
            return "DP attention (the attention group is not the tp group)"
        if uses_cutedsl_ar_fusion():
            return "SGLang's CuTe DSL fusion owns the pattern"
    except (RuntimeError, ValueError, AttributeError) as error:
        return f"SGLang's config cannot be read ({error})"
    return None


# ---------------------------------------------------------------------------- SGLang's config
def _read_config(path: str, read: Callable[[], Any]) -> tuple[Any, str | None]:
    """(value, None), or (None, why not): SGLang's accessors raise ValueError until the server
    args are published; an AttributeError means this SGLang lays its config out differently
    from the one these paths were pinned against, which is said (a warning naming the path)."""
    try:
        return read(), None
    except ValueError as error:
        return None, f"SGLang's config is not published ({error})"
    except AttributeError as error:
        logger.warning(
            "pcie_allreduce: cannot read SGLang's %s (%s); going on without it", path, error
        )
        return None, f"SGLang's config has no {path}"


def _decode_width() -> tuple[int | None, int | None, str]:
    """(decode CUDA-graph max batch, draft tokens per request or None, where they came from)
    from SGLang's published config; (None, None, why) before it is published."""
    from sglang.srt.runtime_context import get_exec, get_spec

    graphs, problem = _read_config(
        "get_exec().graph.cuda_graph_config", lambda: get_exec().graph.cuda_graph_config
    )
    if problem:
        return None, None, problem
    max_bs, problem = _read_config(
        "cuda_graph_config.decode.max_bs",
        lambda: graphs.decode.max_bs if graphs is not None else None,
    )
    spec, spec_problem = _read_config("get_spec()", get_spec)
    draft = None
    if spec is not None and spec.speculative_algorithm:
        # Adaptive speculation may widen later: the launch-time capacity SGLang publishes
        # next to the active width bounds it.
        bounds = [spec.speculative_num_draft_tokens]
        if "max_speculative_num_draft_tokens" in spec:
            bounds.append(spec.max_speculative_num_draft_tokens)
        draft = max((b for b in bounds if b), default=None)
    if not max_bs:
        return None, draft, problem or "SGLang's config has no decode CUDA-graph max batch"
    return max_bs, draft, spec_problem or "SGLang's config"


def _deterministic(engine_rule_fn: Callable[[], bool]) -> tuple[bool, str]:
    """Whether this group's reductions must not depend on the batch, and why.
    ``engine_rule_fn`` is ``GroupCoordinator._deterministic_collectives_enabled``."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec

    engine_rule = bool(engine_rule_fn())
    if envs.SGLANG_USE_1STAGE_ALLREDUCE.is_set():
        return engine_rule, f"SGLANG_USE_1STAGE_ALLREDUCE={int(engine_rule)}"
    if engine_rule:
        return True, "SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1"
    published, _ = _read_config(
        "get_exec().deterministic.enable_deterministic_inference",
        lambda: get_exec().deterministic.enable_deterministic_inference,
    )
    return bool(published), "--enable-deterministic-inference" if published else "off"


def _engine_autotune_disabled() -> bool:
    from sglang.srt.runtime_context import get_exec

    disabled, _ = _read_config(
        "get_exec().kernel.disable_flashinfer_autotune",
        lambda: get_exec().kernel.disable_flashinfer_autotune,
    )
    return bool(disabled)


def _stream_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never for the CPU)."""
    if device.type != "cuda":
        return False
    import torch  # loaded long before (SGLang's own); not at plugin import, which may stay off

    return torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------- the slot
class SglangPcieAllReduce:
    """What SGLang's ``GroupCoordinator.pcie_ipc_comm`` holds: the API of SGLang's own
    ``PcieIpcCommunicator`` (``disabled``, ``should_pcie_ipc_ar``, ``pcie_ipc_all_reduce``,
    ``prepare``, ``destroy``) over one :class:`PcieAllReduce`, plus ``stats()``."""

    def __init__(self, coordinator: Any) -> None:
        import torch

        self.group_name = common.TP_GROUP_NAME
        self.rank = int(coordinator.rank_in_group)
        self.world_size = int(coordinator.world_size)
        self.device = torch.device(coordinator.device)
        # CPU tensors: the host transport over the gloo group. GPUs: the device (NCCL) group,
        # whose all-reduce is the fallback, and the gloo group for the bootstrap.
        cpu_group = coordinator.cpu_group
        self._group = cpu_group if self.device.type == "cpu" else coordinator.device_group
        self._cpu_group = cpu_group
        self._engine_deterministic = type(coordinator)._deterministic_collectives_enabled
        self.max_numel = 0
        self.sizing: policy.Sizing | None = None
        self.deterministic: str | None = None
        self.warm_up_outcome: dict[str, Any] | None = None
        self._ar: Any = None
        self._failed: str | None = None
        self._destroyed = False
        self._capture: contextlib.ExitStack | None = None
        self._declines: dict[str, int] = {}
        self.hidden: int | None = None
        self._fused_routed = 0
        self._fused_declines: dict[str, int] = {}
        self._collective_declines = common.CollectiveDeclines()
        self._fusion_off: tuple[str | None] | None = None  # (reason,) once decided

    # ------------------------------------------------------------------ SGLang's API
    @property
    def disabled(self) -> bool:
        """SGLang skips the slot when True. Before the communicator exists it is False, so
        the first reduction offered can build it."""
        if self._destroyed or self._failed is not None:
            return True
        return self._ar is not None and not self._ar.enabled

    def prepare(self, hidden: int | None = None, max_rows: int | None = None) -> dict[str, Any]:
        """Called by SGLang's runner on every rank before graph capture (collective): builds
        the communicator if needed, tunes once on a host without a cache, installs every
        program a captured call could need. Returns the warm-up outcome."""
        if self._destroyed:
            raise RuntimeError("prepare() on a destroyed pcie_allreduce slot")
        if self._failed is None and self._ar is None:
            self._build(hidden, max_rows)
        if self._ar is None:  # the build failed here or earlier (said once, when it did)
            return {"tuned": False, "why_not_tuned": f"not built ({self._failed})"}
        rows = max_rows or self._rows_from_config()
        ready = (hidden, rows) if hidden and rows else (None, None)
        self.warm_up_outcome = common.warm_up(
            self._ar,
            engine_autotune_disabled=_engine_autotune_disabled(),
            hidden=ready[0],
            max_rows=ready[1],
        )
        return self.warm_up_outcome

    def should_pcie_ipc_ar(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` goes to the kernels (else SGLang takes its own path)."""
        capturing = _stream_capturing(inp.device)
        if self._ar is None:
            if self.disabled:
                return False
            if capturing:
                self._declined(NOT_PREPARED, inp)
                return False
            if not self._build(int(inp.shape[-1]) if inp.dim() else None, None):
                return False
            ar: Any = self._ar  # _build made it; mypy keeps the None narrowed above
            ar.prepare()
        self._bracket_capture(capturing)
        reason = self._ar.decline_reason(inp)
        if reason is not None:
            self._declined(reason, inp)
            return False
        return True

    def pcie_ipc_all_reduce(self, inp: torch.Tensor) -> torch.Tensor:
        """The sum of ``inp`` over the group, in a new tensor."""
        return self._ar.all_reduce(inp)

    def destroy(self) -> None:
        """Before SGLang destroys the process groups (collective, idempotent): logs the
        summary line once and frees the workspace."""
        if self._destroyed:
            return
        self._destroyed = True
        self._bracket_capture(False)
        if self._ar is None:
            logger.info(
                "pcie_allreduce[%s rank %d/%d]: never built (%s)",
                self.group_name,
                self.rank,
                self.world_size,
                self._failed or "no prepare() and no reduction reached it",
            )
            return
        line = common.summary_line(self, self.group_name)
        (logger.info if self._ar.enabled else logger.warning)("%s", line)
        self._ar.destroy()

    # ------------------------------------------------------------------ the fused call
    def offers_fusion(self, batch_size: Any) -> bool:
        """Whether SGLang's layer boundary may offer the fused all-reduce + add + RMSNorm for a
        batch of ``batch_size`` rows: the communicator is built and enabled, SGLang's own rules
        allow a fusion (``_fusion_off_reason``) and the rows fit the workspace. The same answer
        on every rank (built and enabled are agreed; the rest is configuration)."""
        if self._ar is None or self.disabled:
            return False
        if self._fusion_off is None:
            reason = _fusion_off_reason(
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
        return self.hidden is None or batch_size * self.hidden <= self.max_numel

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FlashInfer's contract: ``(norm_out, residual_out)``, both new tensors, with
        ``residual_out = sum_ranks(x) + residual`` (``residual`` itself untouched); None when
        the kernels do not take it (counted under ``fused_declines``), so SGLang's own path
        runs."""
        if self._ar is None or self.disabled:
            return None
        self._bracket_capture(_stream_capturing(x.device))
        reason = self._ar.fused_decline_reason(x, residual, weight)
        if reason is not None:
            count = self._fused_declines.get(reason, 0)
            self._fused_declines[reason] = count + 1
            if count == 0 and self.rank == 0:
                logger.info(
                    "pcie_allreduce: %s declines fused all-reduce + RMSNorm calls "
                    "(%s; first: %s %s); they stay on SGLang's path",
                    self.group_name,
                    reason,
                    tuple(x.shape),
                    x.dtype,
                )
            return None
        self._fused_routed += 1
        return self._ar.all_reduce_add_rms_norm(x, residual, weight, eps)

    # ------------------------------------------------------------------ reduce-scatter, all-gather
    def reduce_scatter_into(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        """``GroupCoordinator._reduce_scatter_tensor(output, inp)`` on our kernels when they
        take it (True: ``output`` holds this rank's rows of the sum); False leaves the call to
        SGLang (counted under ``stats()["collectives"]["reduce_scatter"]["declines"]``)."""
        world = self.world_size
        if (
            inp.dim() == 0
            or inp.shape[0] % world
            or output.numel() * world != inp.numel()
            or output.dtype != inp.dtype
            or output.device != inp.device
        ):
            self._collective_declines.add("reduce_scatter", common.SHAPE)
            return False
        if not self._admits(inp, "reduce_scatter"):
            return False
        rows = (inp.shape[0] // world,) + tuple(inp.shape[1:])
        if output.is_contiguous() and not common.overlaps(output, inp):
            self._ar.reduce_scatter(inp, out=output.view(rows))
        else:  # SGLang's in-place form (output a slice of inp), or a strided output
            output.copy_(self._ar.reduce_scatter(inp).view(output.shape))
        return True

    def all_gather_into(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        """``GroupCoordinator._all_gather_into_tensor(output, inp)`` on our kernels when they
        take it (True: ``output`` holds every rank's ``inp``, rank-major); False leaves the
        call to SGLang (counted under ``stats()["collectives"]["all_gather"]["declines"]``)."""
        world = self.world_size
        if (
            inp.dim() == 0
            or output.numel() != world * inp.numel()
            or output.dtype != inp.dtype
            or output.device != inp.device
        ):
            self._collective_declines.add("all_gather", common.SHAPE)
            return False
        if not self._admits(inp, "all_gather"):
            return False
        rows = (world * inp.shape[0],) + tuple(inp.shape[1:])
        if output.is_contiguous() and not common.overlaps(output, inp):
            self._ar.all_gather(inp, out=output.view(rows))
        else:
            output.copy_(self._ar.all_gather(inp).view(output.shape))
        return True

    def _admits(self, inp: torch.Tensor, collective: str) -> bool:
        """Whether the kernels run ``collective`` on ``inp``; a decline is counted. Before the
        communicator is built (no prepare() yet, or a capture came first) the call stays on
        SGLang's path: only an all-reduce builds it (every rank offers the same all-reduces in
        the same order; prepare() comes before any graph capture)."""
        if self._destroyed or self._failed is not None:
            self._collective_declines.add(collective, "disabled")
            return False
        if self._ar is None:
            self._collective_declines.add(collective, common.NOT_BUILT)
            return False
        self._bracket_capture(_stream_capturing(inp.device))
        reason = self._ar.collective_decline_reason(inp, collective)
        if reason is not None:
            if self._collective_declines.add(collective, reason) == 0 and self.rank == 0:
                logger.info(
                    "pcie_allreduce: %s declines %s calls (%s; first: %s %s); they stay "
                    "on SGLang's path",
                    self.group_name,
                    collective,
                    reason,
                    tuple(inp.shape),
                    inp.dtype,
                )
            return False
        return True

    # ------------------------------------------------------------------ ours
    def stats(self) -> dict[str, Any]:
        """``PcieAllReduce.stats()`` with the slot's own declines added (reductions SGLang
        offered that stayed on its path), the fused calls SGLang's fused call site routed to
        the communicator (``fused_routed``) and declined (added to ``fused_declines``), the
        sizing line, the deterministic rule and the warm-up outcome."""
        if self._ar is not None:
            s = self._ar.stats()
        else:
            s = {
                "calls": {},
                "declines": {},
                "staged": 0,
                "captures": 0,
                "table_source": "none (not built)",
                "enabled": False,
                "disabled_reason": self._failed or "not built yet",
            }
        declines = dict(s.get("declines", {}))
        for reason, count in self._declines.items():
            declines[reason] = declines.get(reason, 0) + count
        s["declines"] = declines
        fused_declines = dict(s.get("fused_declines", {}) or {})
        for reason, count in self._fused_declines.items():
            fused_declines[reason] = fused_declines.get(reason, 0) + count
        s["fused_declines"] = fused_declines
        s["fused_routed"] = self._fused_routed
        self._collective_declines.merge_into(s)
        s["max_numel"] = self.max_numel
        s["sizing"] = self.sizing.how if self.sizing else None
        s["deterministic"] = self.deterministic
        s["warm_up"] = self.warm_up_outcome
        return s

    @property
    def communicator(self) -> Any:
        """The PcieAllReduce, once built."""
        return self._ar

    # ------------------------------------------------------------------ internals
    def _rows_from_config(self) -> int | None:
        max_bs, draft, _ = _decode_width()
        return max_bs * (draft or 1) if max_bs else None

    def _build(self, hidden: int | None, max_rows: int | None) -> bool:
        """Builds the communicator (collective: every rank gets here at the same call)."""
        from ..communicator import PcieAllReduce

        max_bs, draft, source = _decode_width()
        if not max_bs and max_rows:  # the runner's rows already count draft tokens
            max_bs, draft, source = max_rows, None, f"prepare(max_rows={max_rows}); {source}"
        sizing = common.size_workspace("sglang", max_bs=max_bs, draft_tokens=draft, hidden=hidden)
        deterministic, why = _deterministic(self._engine_deterministic)
        transport = policy.CUDA_IPC if self.device.type == "cuda" else policy.HOST_SHM
        table = common.deterministic_table(transport) if deterministic else None
        try:
            self._ar = PcieAllReduce(
                self._group,
                self.device,
                max_numel=sizing.max_numel,
                table=table,
                cpu_group=self._cpu_group,
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
        self.deterministic = (
            f"on ({why}): oneshot at every size" if deterministic else f"off ({why})"
        )
        if self.rank == 0 and not sizing.guessed:  # a guess was already announced
            logger.info(
                "pcie_allreduce: %s workspace %d elements: %s (%s)",
                self.group_name,
                sizing.max_numel,
                sizing.how,
                source,
            )
        if self.rank == 0 and deterministic:
            logger.info(
                "pcie_allreduce: deterministic inference (%s): one oneshot tactic at every size",
                why,
            )
        return True

    def _bracket_capture(self, capturing: bool) -> None:
        """Enters PcieAllReduce.capture() at the first decision inside a graph capture and
        leaves it at the first one outside (SGLang's graph_capture() has no hook for us)."""
        if capturing and self._capture is None and self._ar is not None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._ar.capture())
            self._capture = stack
        elif not capturing and self._capture is not None:
            stack, self._capture = self._capture, None
            stack.close()

    def _declined(self, reason: str, inp: torch.Tensor) -> None:
        count = self._declines.get(reason, 0)
        self._declines[reason] = count + 1
        if count == 0 and self.rank == 0:
            if reason == NOT_PREPARED:
                logger.warning(
                    "pcie_allreduce: a %s graph capture reached the slot before "
                    "prepare() built the communicator; captured reductions stay on "
                    "SGLang's path",
                    self.group_name,
                )
            else:
                logger.info(
                    "pcie_allreduce: %s declines %s reductions (first: %s %s); they "
                    "stay on SGLang's path",
                    self.group_name,
                    reason,
                    tuple(inp.shape),
                    inp.dtype,
                )

    def __repr__(self) -> str:
        state = (
            "destroyed"
            if self._destroyed
            else repr(self._ar)
            if self._ar
            else f"not built ({self._failed or 'waiting for prepare()'})"
        )
        return f"SglangPcieAllReduce({self.group_name} rank {self.rank}/{self.world_size}, {state})"
