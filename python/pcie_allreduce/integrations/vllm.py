"""pcie_allreduce in vLLM: fills the PCIe all-reduce slot of vLLM's CUDA communicator.

vLLM loads this module through its ``vllm.general_plugins`` entry point in every process, and
:func:`register` does nothing unless ``PCIE_ALLREDUCE_ENABLE=1``. Enabled, it wraps
``CudaCommunicator.__init__``: after vLLM's own constructor, the communicator of the group named
exactly ``tp`` (world size > 1) gets a :class:`VllmPcieAllReduce` in
``CudaCommunicator.fi_pcie_ipc_ar_comm``, the slot vLLM already dispatches to
(``should_use``/``all_reduce``), enters around graph capture (``capture``) and destroys before
its process groups (``destroy``). vLLM's dispatch itself is not touched: a tensor the slot
declines goes on down vLLM's chain (custom all-reduce, pynccl, torch.distributed).

Reduce-scatter and all-gather: vLLM has no slot for them, so the same communicator instance
(only the tp group's) gets routed copies of its public ``reduce_scatter``, ``all_gather``,
``reduce_scatterv``, ``reduce_scatterv_into_output`` and ``all_gatherv``
(:func:`route_collectives`): a call the slot admits (``PcieAllReduce.should_use_collective``)
runs on our kernels, every other call runs vLLM's own method from the class, untouched.

The fused end of a layer (all-reduce + residual add + RMSNorm): vLLM fuses it in a torch.compile
post-grad pass (``AllReduceFusionPass``, FlashInfer's kernel, NVLink-class hosts only). Where
our slot is filled, ``PcieFusedAddRmsNormPass`` (``fusion_pass_class()``) goes into the slot
vLLM keeps for one custom post-grad pass,
``compilation_config.inductor_compile_config[current_platform.pass_key]``
(``"post_grad_custom_post_pass"``), unless something else already holds it; vLLM's
``PostGradPassManager`` runs it after its own fusion passes and before lowering its IR. It
rewrites ``vllm.all_reduce`` over the tp group followed by ``vllm_ir.fused_add_rms_norm`` (or
``vllm_ir.rms_norm``) into :data:`FUSED_OP`, which runs
``PcieAllReduce.all_reduce_add_rms_norm`` when the kernels take the tensors
(``should_use_fused``) and otherwise vLLM's own ``vllm.all_reduce`` then
``vllm.ir.ops.fused_add_rms_norm``: the graph's values either way.

What it reads from vLLM (each path is pinned by tests/engines/vllm against the real vLLM):
:data:`CONFIG_PATHS` from ``vllm.config.get_current_vllm_config_or_none()`` (set while vLLM's
worker builds its groups), ``vllm.envs.VLLM_BATCH_INVARIANT`` and
``vllm.envs.VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import policy
from . import common

logger = logging.getLogger("pcie_allreduce.vllm")

UPSTREAM_FLAG = "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC"
SLOT = "fi_pcie_ipc_ar_comm"  # CudaCommunicator's attribute that vLLM dispatches to
FUSED_OP = "pcie_allreduce_vllm::fused_add_rms_norm"  # what the fusion pass puts in the graph
_ORIGINAL_INIT = "_pcie_allreduce_original_init"  # set on CudaCommunicator once wrapped

# The vLLM configuration this adapter reads, as attribute paths from VllmConfig.
CONFIG_PATHS = {
    # The largest CUDA graph vLLM captures, in tokens (a uniform decode step of n requests is
    # n x (1 + num_speculative_tokens) tokens: vLLM's VllmConfig.uniform_decode_query_len).
    "max_capture_tokens": "compilation_config.max_cudagraph_capture_size",
    "capture_sizes": "compilation_config.cudagraph_capture_sizes",
    "num_speculative_tokens": "speculative_config.num_speculative_tokens",
    # The decode batch when no CUDA graph is captured (enforce_eager, cudagraph_mode NONE).
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "hidden": "model_config.get_hidden_size()",
    "flashinfer_autotune": "kernel_config.enable_flashinfer_autotune",
    # Dual-batch overlap: two micro-batches reduce concurrently from two threads.
    "ubatching": "parallel_config.use_ubatching",
}


@dataclass
class VllmSettings:
    """What a resolved VllmConfig says about the tensor-parallel all-reduce."""

    max_bs: int | None = None  # decode requests per step
    draft_tokens: int = 1  # tokens verified per request per step: num_speculative_tokens + 1
    hidden: int | None = None
    batch_source: str = "no vLLM config is current"
    autotune_disabled: bool = False
    ubatching: bool = False
    missing: list[str] = field(default_factory=list)  # paths absent upstream (renamed?)

    @property
    def max_rows(self) -> int | None:
        return self.max_bs * self.draft_tokens if self.max_bs else None


def _get(root: Any, path: str, missing: list[str]) -> Any:
    """``root.a.b`` for ``"a.b"`` (a trailing ``()`` calls it); None when a section is unset
    (no speculative_config), and the path is added to ``missing`` when an attribute does not
    exist at all (an upstream rename must not read as "not configured" silently)."""
    obj = root
    for part in path.split("."):
        if obj is None:
            return None
        call = part.endswith("()")
        name = part[:-2] if call else part
        if not hasattr(obj, name):
            missing.append(path)
            return None
        obj = getattr(obj, name)
        if call:
            obj = obj()
    return obj


def _positive(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def read_config(config: Any) -> VllmSettings:
    """The sizing, warm-up and eligibility inputs from a (resolved) VllmConfig, or defaults for
    None. Decode batch: vLLM captures CUDA graphs by token count, speculative tokens included,
    so the largest captured graph of T tokens holds ceil(T / (1 + k)) requests of 1 + k tokens;
    with no graph captured the scheduler's max_num_seqs requests of 1 + k tokens."""
    s = VllmSettings()
    if config is None:
        return s
    values = {key: _get(config, path, s.missing) for key, path in CONFIG_PATHS.items()}
    s.hidden = _positive(values["hidden"])
    s.draft_tokens = 1 + (_positive(values["num_speculative_tokens"]) or 0)
    captured = _positive(values["max_capture_tokens"])
    if captured is None and values["capture_sizes"]:
        captured = _positive(max(values["capture_sizes"]))
    spec = (
        f"{s.draft_tokens} tokens per request (1 + {s.draft_tokens - 1} speculative)"
        if s.draft_tokens > 1
        else "1 token per request"
    )
    if captured is not None:
        s.max_bs = -(-captured // s.draft_tokens)
        s.batch_source = f"the largest CUDA graph holds {captured} tokens at {spec}"
    else:
        s.max_bs = _positive(values["max_num_seqs"])
        s.batch_source = (
            f"no CUDA graph captured; scheduler max_num_seqs {s.max_bs} at {spec}"
            if s.max_bs
            else "no CUDA graph sizes and no max_num_seqs"
        )
    # Only an explicit False: at -O0 or --no-enable-flashinfer-autotune vLLM skips its own
    # autotune for a fast start, and so does the warm-up.
    s.autotune_disabled = values["flashinfer_autotune"] is False
    s.ubatching = bool(values["ubatching"])
    return s


def workspace_sizing(settings: VllmSettings) -> policy.Sizing:
    """PCIE_ALLREDUCE_MAX_NUMEL, else decode requests x (1 + speculative tokens) x hidden, else
    the announced guess (common.size_workspace)."""
    return common.size_workspace(
        "vllm", max_bs=settings.max_bs, draft_tokens=settings.draft_tokens, hidden=settings.hidden
    )


class VllmPcieAllReduce:
    """What ``CudaCommunicator.fi_pcie_ipc_ar_comm`` holds: the API of vLLM's own
    FlashInferPcieIpcAllReduce (``disabled``, ``should_use``, ``all_reduce``, ``capture``,
    ``setup``, ``destroy``) over one :class:`~pcie_allreduce.PcieAllReduce`, plus ``stats()``.

    Constructing it is collective over the group (the communicator's handshake), and so is
    the warm-up it ends with: a tune when this host has no cache (unless vLLM's FlashInfer
    autotune is off, the table is pinned, or PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1), then every
    program a captured call can need. vLLM builds its groups in the worker's init_device, so
    this runs before the model loads, before vLLM's kernel warm-up and autotune, and before any
    graph capture.
    """

    def __init__(
        self, communicator: Any, settings: VllmSettings, *, deterministic: bool = False
    ) -> None:
        import torch
        import torch.distributed as dist

        from ..communicator import PcieAllReduce

        device = torch.device(communicator.device)
        cuda = device.type == "cuda"
        # The group the fallback runs on: NCCL for CUDA tensors; gloo for CPU tensors (vLLM's
        # device group when it is gloo, else its gloo cpu_group). Bootstrap: the cpu_group.
        group = communicator.device_group
        if not cuda and dist.get_backend(group) != "gloo":
            group = communicator.cpu_group
        self.transport = policy.CUDA_IPC if cuda else policy.HOST_SHM
        self.settings = settings
        self.sizing = workspace_sizing(settings)
        self.deterministic = deterministic
        table = common.deterministic_table(self.transport) if deterministic else None
        self.ar = PcieAllReduce(
            group,
            device if cuda else "cpu",
            max_numel=self.sizing.max_numel,
            table=table,
            cpu_group=communicator.cpu_group,
        )
        self.rank = self.ar.rank
        self.world_size = self.ar.world_size
        self.device = self.ar.device
        self.hidden_dim = settings.hidden or 0
        # vLLM reads and may set this (its PCIe warm-up sets it under dual-batch overlap).
        self.disabled = not self.ar.enabled
        self._engine_declines: dict[str, int] = collections.Counter()
        self._fused_declines: dict[str, int] = collections.Counter()
        self._fused_routed = 0
        self._collective_declines = common.CollectiveDeclines()
        self._destroyed = False
        known = not self.sizing.guessed and settings.hidden and settings.max_rows
        self.warm_up = common.warm_up(
            self.ar,
            engine_autotune_disabled=settings.autotune_disabled,
            hidden=settings.hidden if known else None,
            max_rows=settings.max_rows if known else None,
        )

    # ------------------------------------------------------------------ vLLM's slot API
    @property
    def initialized(self) -> bool:
        return not self.disabled and not self._destroyed

    def setup(
        self,
        *,
        hidden_dim: int,
        dtype: Any = None,
        capture_sizes: Sequence[int] = (),
        tune_cache: Any = None,
    ) -> None:
        """vLLM calls this before graph capture only when VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC
        is set too. The tune already ran at construction (our cache is PCIE_ALLREDUCE_CACHE_DIR,
        not ``tune_cache``) and every dtype is served, so this only checks the workspace against
        the exact capture sizes and installs their programs."""
        sizes = [int(s) for s in capture_sizes if int(s) > 0]
        if self.disabled or self._destroyed or not sizes:
            return
        self.ar.prepare(int(hidden_dim), max(sizes))

    def should_use(self, inp: Any) -> bool:
        """True when the kernels take ``inp``; a declined tensor goes on down vLLM's chain and
        is counted here under its reason (stats()["declines"])."""
        if self.disabled:
            reason = "disabled by vLLM" if self.ar.enabled else self.ar.decline_reason(inp)
        else:
            reason = self.ar.decline_reason(inp)
        if reason is None:
            return True
        self._engine_declines[reason or "declined"] += 1
        return False

    def all_reduce(self, inp: Any) -> Any:
        """The sum over the group into a new tensor (vLLM's out-of-place contract)."""
        return self.ar.all_reduce(inp)

    def fused_add_rms_norm(self, x: Any, residual: Any, weight: Any, eps: float) -> Any:
        """``(y, residual_out)`` as new tensors from the fused kernels, or None when they do
        not take these tensors (counted in ``stats()["fused_declines"]``): the caller then runs
        vLLM's unfused all-reduce and norm."""
        if self.disabled or self._destroyed:
            return None
        reason = self.ar.fused_decline_reason(x, residual, weight)
        if reason is not None:
            self._fused_declines[reason] += 1
            return None
        self._fused_routed += 1
        return self.ar.all_reduce_add_rms_norm(x, residual, weight, eps)

    # ------------------------------------------------------------------ reduce-scatter, all-gather
    # What the tp communicator's routed methods (route_collectives) ask. Each returns vLLM's
    # result, or None when the kernels do not take the call: vLLM's own method then runs it.
    def collective_reason(self, x: Any, collective: str) -> str | None:
        """Why the kernels do not run ``collective`` on ``x`` (its input), or None. A decline
        is counted in ``stats()["collectives"][collective]["declines"]``."""
        if (self.disabled or self._destroyed) and self.ar.enabled:
            reason: str | None = "disabled by vLLM"
        else:
            reason = self.ar.collective_decline_reason(x, collective)
        if reason is not None:
            self._collective_declines.add(collective, reason)
        return reason

    def try_reduce_scatter(self, input_: Any, dim: int = -1) -> Any:
        """``CudaCommunicator.reduce_scatter(input_, dim)``: vLLM's layout (it moves dim 0 to
        ``dim``, scatters rows, moves them back), the sum from our kernels."""
        if input_.dim() == 0:
            return None
        if dim < 0:
            dim += input_.dim()
        x = input_.movedim(0, dim)  # exactly vLLM's (and its base class's) transform
        if x.shape[0] % self.world_size:
            self._collective_declines.add("reduce_scatter", common.SHAPE)
            return None  # vLLM's own path asserts on it
        if self.collective_reason(x, "reduce_scatter") is not None:
            return None
        return self.ar.reduce_scatter(x).movedim(0, dim).contiguous()

    def try_all_gather(self, input_: Any, dim: int = -1) -> Any:
        """``CudaCommunicator.all_gather(input_, dim)``: concatenated along ``dim``."""
        if input_.dim() == 0:
            return None
        if dim < 0:
            dim += input_.dim()
        if self.collective_reason(input_, "all_gather") is not None:
            return None
        return common.gathered_along(
            self.ar.all_gather(input_), self.world_size, input_.size(), dim
        )

    def try_all_gatherv(self, input_: Any, dim: int = 0, sizes: Sequence[int] | None = None) -> Any:
        """``CudaCommunicator.all_gatherv``: equal sizes (or none) only, one tensor or a list
        (all of it ours, or all of it vLLM's)."""
        if dim != 0:
            return None  # vLLM raises NotImplementedError
        if sizes is not None and any(s != sizes[0] for s in sizes):
            self._collective_declines.add("all_gather", common.VARIABLE_SIZES)
            return None
        single = not isinstance(input_, (list, tuple))
        tensors = [input_] if single else list(input_)
        for t in tensors:
            if t.dim() == 0:
                self._collective_declines.add("all_gather", common.SHAPE)
                return None
            if self.collective_reason(t, "all_gather") is not None:
                return None
        outs = [self.ar.all_gather(t) for t in tensors]
        return outs[0] if single else outs

    def try_reduce_scatterv(
        self, input_: Any, dim: int = -1, sizes: Sequence[int] | None = None, output: Any = None
    ) -> Any:
        """``CudaCommunicator.reduce_scatterv`` and ``reduce_scatterv_into_output``
        (``output`` given): equal sizes (or none) only."""
        if sizes is not None and any(s != sizes[0] for s in sizes):
            self._collective_declines.add("reduce_scatter", common.VARIABLE_SIZES)
            return None
        if output is None:
            return self.try_reduce_scatter(input_, dim)
        if input_.dim() == 0:
            return None
        if dim < 0:
            dim += input_.dim()
        world = self.world_size
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
        if self.collective_reason(input_, "reduce_scatter") is not None:
            return None
        if common.overlaps(output, input_):
            output.copy_(self.ar.reduce_scatter(input_))
        else:
            self.ar.reduce_scatter(input_, out=output)
        return output

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Entered by vLLM's ``GroupCoordinator.graph_capture()`` inside its capture stream."""
        with self.ar.capture():
            yield

    def destroy(self) -> None:
        """vLLM's ``CudaCommunicator.destroy()``, before the process groups go: logs the
        summary line once and destroys the communicator (collective, idempotent)."""
        if self._destroyed:
            return
        self._destroyed = True
        try:
            logger.info("%s", common.summary_line(self))
        finally:
            self.ar.destroy()

    # ------------------------------------------------------------------ ours
    def stats(self) -> dict[str, Any]:
        """PcieAllReduce.stats() with the declines that vLLM's own chain then ran added to
        ``declines`` (also totalled in ``engine_fallback``) and, for reduce-scatters and
        all-gathers, to ``collectives[c]["declines"]``, plus the sizing and warm-up."""
        s = self.ar.stats()
        declines = collections.Counter(s["declines"])
        declines.update(self._engine_declines)
        s["declines"] = dict(declines)
        s["engine_fallback"] = sum(self._engine_declines.values())
        fused_declines = collections.Counter(s.get("fused_declines", {}) or {})
        fused_declines.update(self._fused_declines)
        s["fused_declines"] = dict(fused_declines)
        s["fused_routed"] = self._fused_routed
        self._collective_declines.merge_into(s)
        s["sizing"] = self.sizing.how
        s["warm_up"] = dict(self.warm_up)
        s["deterministic"] = self.deterministic
        return s

    def __repr__(self) -> str:
        return f"VllmPcieAllReduce({self.ar!r})"


# ---------------------------------------------------------------------- installation
def register() -> None:
    """vLLM's general-plugin hook (run once per vLLM process): nothing unless
    PCIE_ALLREDUCE_ENABLE=1."""
    if not common.enabled():
        return
    install()


def install() -> bool:
    """Wraps ``CudaCommunicator.__init__`` (once per process). False when vLLM's CUDA
    communicator cannot be imported here."""
    try:
        from vllm.distributed.device_communicators import cuda_communicator
    except Exception as error:  # noqa: BLE001 - any import failure means: not on this vLLM
        logger.warning(
            "pcie_allreduce: PCIE_ALLREDUCE_ENABLE=1 but vLLM's CUDA communicator "
            "cannot be imported (%s: %s); vLLM keeps its own all-reduce",
            type(error).__name__,
            error,
        )
        return False
    cls = cuda_communicator.CudaCommunicator
    if _ORIGINAL_INIT in cls.__dict__:
        return True
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        fill_slot(self)

    setattr(cls, _ORIGINAL_INIT, original)
    cls.__init__ = __init__
    _route_logs_through_vllm()
    return True


def group_name(communicator: Any) -> str | None:
    """The name the group was created with: vLLM's unique name is ``<name>:<index>``."""
    unique = getattr(communicator, "unique_name", "") or ""
    return unique.rsplit(":", 1)[0] if unique else None


def fill_slot(communicator: Any) -> VllmPcieAllReduce | None:
    """Runs after vLLM's CudaCommunicator constructor: puts a VllmPcieAllReduce in the slot of
    the tp group's communicator (collective over that group, as vLLM's constructor is)."""
    name = group_name(communicator)
    why = common.ineligible(name, communicator.world_size)
    if why is None and communicator.device_group is None:
        why = "no torch.distributed device group (a stateless group)"
    if why is None and not hasattr(communicator, SLOT):
        why = f"vLLM's CudaCommunicator has no {SLOT} slot (renamed upstream?)"
    if why is not None:
        logger.debug("pcie_allreduce: vLLM group %r gets nothing: %s", name, why)
        return None

    import vllm.envs as envs
    from vllm.config import get_current_vllm_config_or_none

    first = communicator.rank_in_group == 0
    settings = read_config(get_current_vllm_config_or_none())
    if settings.missing and first:
        logger.warning(
            "pcie_allreduce: vLLM's config has no %s (renamed upstream?); sizing without it",
            ", ".join(settings.missing),
        )
    upstream = bool(getattr(envs, UPSTREAM_FLAG, False))
    theirs = getattr(communicator, SLOT)
    if settings.ubatching:
        if first:
            logger.warning(
                "pcie_allreduce: not installed in vLLM's tp group: dual-batch overlap "
                "(parallel_config.use_ubatching) reduces two micro-batches at once from two "
                "threads, and one workspace serves one call at a time%s",
                f"; {SLOT} keeps {type(theirs).__name__}" if theirs is not None else "",
            )
        return None

    deterministic = bool(envs.VLLM_BATCH_INVARIANT)
    adapter = VllmPcieAllReduce(communicator, settings, deterministic=deterministic)
    if theirs is not None:
        theirs.destroy()  # FlashInfer's allocates its workspace in setup(), never called now
    setattr(communicator, SLOT, adapter)
    routed = route_collectives(communicator)
    if adapter.ar.enabled:
        install_fusion_pass(get_current_vllm_config_or_none(), communicator.unique_name, log=first)
    if first:
        state = "enabled" if adapter.ar.enabled else f"disabled ({adapter.ar.disabled_reason})"
        logger.info(
            "pcie_allreduce: vLLM group tp (world %d, %s): %s%s; workspace: %s (%s); "
            "the slot also serves its %s",
            adapter.world_size,
            adapter.device,
            state,
            "; deterministic (VLLM_BATCH_INVARIANT=1): one oneshot tactic for every size"
            if deterministic
            else "",
            adapter.sizing.how,
            settings.batch_source,
            ", ".join(routed) or "nothing",
        )
        if upstream:
            if theirs is not None:
                replaced = f"vLLM's {type(theirs).__name__} was built and is destroyed"
            else:
                replaced = "vLLM had not built its own" + (
                    " under VLLM_BATCH_INVARIANT=1" if deterministic else ""
                )
            logger.warning(
                "pcie_allreduce: %s=1 and PCIE_ALLREDUCE_ENABLE=1 are both set; pcie_allreduce "
                "owns vLLM's PCIe all-reduce slot of group tp because PCIE_ALLREDUCE_ENABLE=1 "
                "is the explicit choice (%s)",
                UPSTREAM_FLAG,
                replaced,
            )
    return adapter


# ---------------------------------------------------------------------- reduce-scatter, all-gather
# vLLM 0.33's CudaCommunicator keeps a slot for a PCIe all-reduce backend (fi_pcie_ipc_ar_comm)
# but none for reduce-scatter or all-gather: those run pynccl, NCCL symmetric memory or AITER
# inline in its public methods. So the tp group's communicator *instance* gets its own copy of
# these public methods, the ones vLLM's GroupCoordinator (and so its vllm.reduce_scatter /
# vllm.all_gather custom ops) calls: each asks the slot, and calls vLLM's own method, taken
# from the class, for every call the slot declines. Nothing private is touched, the class stays
# as vLLM ships it, and no other group's communicator changes. When vLLM's destroy() empties
# the slot, every call goes to vLLM's methods again.
COLLECTIVE_ROUTES = (
    "reduce_scatter",
    "all_gather",
    "reduce_scatterv",
    "reduce_scatterv_into_output",
    "all_gatherv",
)
_ROUTED = "_pcie_allreduce_routed"  # set on a communicator instance once routed


def _our_slot(communicator: Any) -> VllmPcieAllReduce | None:
    slot = getattr(communicator, SLOT, None) if communicator is not None else None
    return slot if isinstance(slot, VllmPcieAllReduce) else None


def route_collectives(communicator: Any) -> list[str]:
    """Gives the tp communicator instance the routed versions of :data:`COLLECTIVE_ROUTES`
    (those its class has); returns their names. Idempotent."""
    import weakref

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
        slot = _our_slot(comm)
        out = slot.try_reduce_scatter(input_, dim) if slot is not None else None
        return cls.reduce_scatter(comm, input_, dim) if out is None else out

    def all_gather(input_: Any, dim: int = -1) -> Any:
        comm = ref()
        slot = _our_slot(comm)
        out = slot.try_all_gather(input_, dim) if slot is not None else None
        return cls.all_gather(comm, input_, dim) if out is None else out

    def reduce_scatterv(input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
        comm = ref()
        slot = _our_slot(comm)
        out = slot.try_reduce_scatterv(input_, dim, sizes) if slot is not None else None
        return cls.reduce_scatterv(comm, input_, dim, sizes) if out is None else out

    def reduce_scatterv_into_output(
        input_: Any, output: Any, dim: int = -1, sizes: list[int] | None = None
    ) -> Any:
        comm = ref()
        slot = _our_slot(comm)
        out = (
            slot.try_reduce_scatterv(input_, dim, sizes, output=output)
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
        slot = _our_slot(comm)
        out = slot.try_all_gatherv(input_, dim, sizes) if slot is not None else None
        return cls.all_gatherv(comm, input_, dim, sizes) if out is None else out

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


def _route_logs_through_vllm() -> None:
    """vLLM configures only its own "vllm" logger, so this package's INFO lines (the workspace
    line, the shutdown summary) would be dropped; unless the application configured logging
    itself, they go to vLLM's handlers at vLLM's level."""
    ours = logging.getLogger("pcie_allreduce")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


# ---------------------------------------------------------------------- the fused pass
_FUSED_OP_DEFINED = False


def define_fused_op() -> Any:
    """Defines :data:`FUSED_OP` once per process (a functional op: new outputs, inputs
    untouched) and returns it: ``(x, residual, weight, eps, group_name) -> (y, residual_out)``
    with ``residual_out = sum_ranks(x) + residual``, ``y = rms_norm(residual_out) * weight``."""
    global _FUSED_OP_DEFINED
    import torch

    namespace, name = FUSED_OP.split("::")
    if not _FUSED_OP_DEFINED:

        @torch.library.custom_op(
            FUSED_OP,
            mutates_args=(),
            schema=(
                "(Tensor x, Tensor residual, Tensor weight, float eps, str group_name) "
                "-> (Tensor, Tensor)"
            ),
        )
        def fused_add_rms_norm(x, residual, weight, eps, group_name):  # noqa: ANN001, ANN202
            return _run_fused(x, residual, weight, eps, group_name)

        @fused_add_rms_norm.register_fake
        def _(x, residual, weight, eps, group_name):  # noqa: ANN001, ANN202
            return torch.empty_like(x), torch.empty_like(residual)

        _FUSED_OP_DEFINED = True
    return getattr(getattr(torch.ops, namespace), name).default


def _run_fused(x: Any, residual: Any, weight: Any, eps: float, group_name: str) -> Any:
    """The op's body: our kernels when the tp group's slot takes the tensors, else vLLM's own
    all-reduce (its dispatch, our slot included) and vLLM's fused_add_rms_norm."""
    import torch
    import vllm.ir.ops
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    communicator = tp.device_communicator if tp.unique_name == group_name else None
    slot = getattr(communicator, SLOT, None)
    if isinstance(slot, VllmPcieAllReduce):
        fused = slot.fused_add_rms_norm(x, residual, weight, eps)
        if fused is not None:
            return fused
    summed = torch.ops.vllm.all_reduce(x, group_name=group_name)
    y, residual_out = vllm.ir.ops.fused_add_rms_norm(summed, residual, weight, eps)
    inputs = {t.data_ptr() for t in (x, residual, weight)}  # a custom op's outputs are new
    y = y.clone() if y.data_ptr() in inputs else y
    residual_out = (
        residual_out.clone() if residual_out.data_ptr() in inputs | {y.data_ptr()} else residual_out
    )
    return y, residual_out


def install_fusion_pass(config: Any, group_name: str, *, log: bool = True) -> bool:
    """Puts a ``PcieFusedAddRmsNormPass`` for ``group_name`` in vLLM's custom post-grad pass
    slot of ``config`` (the config vLLM's worker compiles with). False, with one line, when
    there is no config or the slot is already taken (the user's pass is kept)."""
    if config is None or getattr(config, "compilation_config", None) is None:
        return False
    from vllm.platforms import current_platform

    key = current_platform.pass_key
    inductor = config.compilation_config.inductor_compile_config
    held = inductor.get(key)
    cls = fusion_pass_class()
    if isinstance(held, cls):
        return True
    if held is not None:
        if log:
            logger.warning(
                "pcie_allreduce: vLLM's inductor_compile_config[%r] already holds %r; "
                "the fused all-reduce + RMSNorm pass is not installed (the group's "
                "all-reduce is still served)",
                key,
                held,
            )
        return False
    inductor[key] = cls(group_name)
    if log:
        logger.info(
            "pcie_allreduce: vLLM's compiled graphs get all-reduce + residual add + "
            "RMSNorm fused for group %s (inductor_compile_config[%r])",
            group_name,
            key,
        )
    return True


_PASS_CLASS: Any = None


def fusion_pass_class() -> Any:
    """``PcieFusedAddRmsNormPass``: :class:`FusedAddRmsNormRewrite` as a vLLM ``InductorPass``
    (what vLLM's pass manager accepts), made on first use so that importing this module
    imports nothing of vLLM."""
    global _PASS_CLASS
    if _PASS_CLASS is None:
        from vllm.compilation.passes.inductor_pass import InductorPass

        _PASS_CLASS = type(
            "PcieFusedAddRmsNormPass",
            (FusedAddRmsNormRewrite, InductorPass),
            {"__module__": __name__},
        )
    return _PASS_CLASS


class FusedAddRmsNormRewrite:
    """A vLLM post-grad pass (as ``fusion_pass_class()``): every ``vllm.all_reduce(x,
    group_name)`` over our group whose result only feeds
    ``vllm_ir.fused_add_rms_norm(sum, residual, weight, eps)`` becomes one
    :data:`FUSED_OP` node (same outputs); ``vllm_ir.rms_norm(sum, weight, eps)`` becomes the
    op with a zero residual (its ``residual_out`` is the sum, for the sum's other users).
    Only weights of the input's dtype and no ``variance_size`` (what our op computes)."""

    # Given by vLLM's InductorPass, the other base of fusion_pass_class().
    hash_dict: Callable[[Any], Any]
    hash_source: Callable[..., Any]

    def __init__(self, group_name: str) -> None:
        self.group_name = group_name
        self.matched_count = 0

    def uuid(self) -> Any:
        return self.hash_dict(
            {"source": self.hash_source(FusedAddRmsNormRewrite), "group": self.group_name}
        )

    def __call__(self, graph: Any) -> None:
        import torch

        all_reduce = torch.ops.vllm.all_reduce.default
        add_norm = torch.ops.vllm_ir.fused_add_rms_norm.default
        norm = torch.ops.vllm_ir.rms_norm.default
        fused = define_fused_op()
        order = {node: i for i, node in enumerate(graph.nodes)}
        matched = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (add_norm, norm):
                continue
            args = _norm_args(node, with_residual=node.target is add_norm)
            if args is None:
                continue
            summed, residual, weight, eps = args
            if (
                getattr(summed, "target", None) is not all_reduce
                or _group_of(summed) != self.group_name
                or not _same_dtype(summed, weight)
            ):
                continue
            others = [u for u in summed.users if u is not node]
            if node.target is add_norm and others:
                continue  # the sum is used elsewhere: the all-reduce stays
            if any(order[u] < order[node] for u in others):
                continue
            x = summed.args[0]
            with graph.inserting_before(node):
                if residual is None:
                    residual = graph.call_function(torch.ops.aten.zeros_like.default, (x,))
                    residual.meta["val"] = x.meta.get("val")
                out = graph.call_function(fused, (x, residual, weight, float(eps), self.group_name))
            val = node.meta.get("val")
            if node.target is add_norm:
                out.meta["val"] = val
                node.replace_all_uses_with(out)
            else:
                out.meta["val"] = (val, summed.meta.get("val"))
                with graph.inserting_after(out):
                    y = graph.call_function(operator.getitem, (out, 0))
                    y.meta["val"] = val
                with graph.inserting_after(y):
                    total = graph.call_function(operator.getitem, (out, 1))
                    total.meta["val"] = summed.meta.get("val")
                node.replace_all_uses_with(y)
                summed.replace_all_uses_with(total)
            graph.erase_node(node)
            graph.erase_node(summed)
            matched += 1
        self.matched_count = matched
        if matched:
            graph.lint()
            logger.debug("pcie_allreduce: fused %d all-reduce + RMSNorm pattern(s)", matched)


def _norm_args(node: Any, *, with_residual: bool) -> Any:
    """(sum, residual or None, weight, eps) of a vllm_ir norm node, or None when it has a
    ``variance_size`` or a missing weight (our op normalises the whole row with a weight)."""
    names = (
        ["x", "x_residual", "weight", "epsilon", "variance_size"]
        if with_residual
        else ["x", "weight", "epsilon", "variance_size"]
    )
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    if values.get("variance_size") is not None or values.get("weight") is None:
        return None
    if "epsilon" not in values or "x" not in values:
        return None
    return (values["x"], values.get("x_residual"), values["weight"], values["epsilon"])


def _group_of(node: Any) -> str | None:
    if len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("group_name")


def _same_dtype(a: Any, b: Any) -> bool:
    va, vb = getattr(a, "meta", {}).get("val"), getattr(b, "meta", {}).get("val")
    return va is not None and vb is not None and va.dtype == vb.dtype
