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
(``vllm_routes.py``): a call the kernels take runs there, every other call runs vLLM's own
method from the class, untouched.

The fused end of a layer (all-reduce + (residual add +) RMSNorm (+ FP8 / NVFP4 quantisation),
the eight patterns of vLLM's own all-reduce fusion): where our slot is filled, a torch.compile
post-grad pass goes into vLLM's custom post-grad pass slot and rewrites each pattern into one
op that runs ``EngineSlot.all_reduce_rms_norm`` (``vllm_fusion.py``, whose names this module
exports).

Every call the slot gets is decided once (the shared core, ``adapter.EngineSlot``); calls that
stay on vLLM's path are counted per reason in ``stats()``.

What it reads from vLLM (each path is pinned by tests/engines/vllm against the real vLLM):
:data:`CONFIG_PATHS` from ``vllm.config.get_current_vllm_config_or_none()`` (set while vLLM's
worker builds its groups), ``vllm.envs.VLLM_BATCH_INVARIANT`` and
``vllm.envs.VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import policy
from . import common
from .adapter import ALL_REDUCE, EngineSlot
from .vllm_fusion import (  # noqa: F401 - the pass's names, exported here as before
    FORMS,
    FUSED_OP,
    FusedAddRmsNormRewrite,
    define_fused_op,
    define_fused_ops,
    fusion_pass_class,
    install_fusion_pass,
)
from .vllm_routes import COLLECTIVE_ROUTES, route_collectives  # noqa: F401 - likewise

logger = logging.getLogger("pcie_allreduce.vllm")

UPSTREAM_FLAG = "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC"
SLOT = "fi_pcie_ipc_ar_comm"  # CudaCommunicator's attribute that vLLM dispatches to
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


class VllmPcieAllReduce(EngineSlot):
    """What ``CudaCommunicator.fi_pcie_ipc_ar_comm`` holds: the API of vLLM's own
    FlashInferPcieIpcAllReduce (``disabled``, ``should_use``, ``all_reduce``, ``capture``,
    ``setup``, ``destroy``) over one :class:`~pcie_allreduce.PcieAllReduce` (``ar``), plus
    ``stats()``. The shared core (``EngineSlot``) decides and counts every call, the fused op's
    (``vllm_fusion.py``) and the routed collectives' (``vllm_routes.py``) included.

    Constructing it is collective over the group (the communicator's handshake), and so is
    the warm-up it ends with: a tune when this host has no cache (unless vLLM's FlashInfer
    autotune is off, the table is pinned, or PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1), then every
    program a captured call can need. vLLM builds its groups in the worker's init_device, so
    this runs before the model loads, before vLLM's kernel warm-up and autotune, and before any
    graph capture.
    """

    ENGINE = "vLLM"

    def __init__(
        self, communicator: Any, settings: VllmSettings, *, deterministic: bool = False
    ) -> None:
        super().__init__(int(communicator.rank_in_group), int(communicator.world_size))
        self.settings = settings
        self.sizing = workspace_sizing(settings)
        self.deterministic = deterministic
        self.build(
            communicator.device,
            communicator.device_group,
            communicator.cpu_group,
            max_numel=self.sizing.max_numel,
            deterministic=deterministic,
        )
        self.rank = self.ar.rank
        self.world_size = self.ar.world_size
        self.device = self.ar.device
        self.hidden_dim = settings.hidden or 0
        # vLLM reads and may set this (its PCIe warm-up sets it under dual-batch overlap).
        self.disabled = not self.ar.enabled
        self._destroyed = False
        known = not self.sizing.guessed and settings.hidden and settings.max_rows
        self.warm_up = common.warm_up(
            self.ar,
            engine_autotune_disabled=settings.autotune_disabled,
            hidden=settings.hidden if known else None,
            max_rows=settings.max_rows if known else None,
        )

    def slot_decline(self) -> str | None:
        """vLLM turned the slot off (or destroyed it) while the communicator is on."""
        off = (self.disabled or self._destroyed) and self.ar.enabled
        return "disabled by vLLM" if off else None

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
        return self.admits(ALL_REDUCE, inp)

    def all_reduce(self, inp: Any) -> Any:
        """The sum over the group into a new tensor (vLLM's out-of-place contract)."""
        return self.ar.all_reduce(inp)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Entered by vLLM's ``GroupCoordinator.graph_capture()`` inside its capture stream."""
        with self.ar.capture():
            yield

    def destroy(self) -> None:
        """vLLM's ``CudaCommunicator.destroy()``, before the process groups go: logs the
        summary line once and destroys the communicator (collective, idempotent)."""
        if not self._destroyed:
            self._destroyed = True
            self.close()

    # ------------------------------------------------------------------ ours
    def stats(self) -> dict[str, Any]:
        """The core's stats (``EngineSlot.stats``: what vLLM's own chain ran, added), plus the
        sizing and warm-up."""
        s = super().stats()
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


def slot_of(communicator: Any) -> VllmPcieAllReduce | None:
    """Our slot in vLLM's ``communicator`` (None: no communicator, or the slot is not ours)."""
    slot = getattr(communicator, SLOT, None) if communicator is not None else None
    return slot if isinstance(slot, VllmPcieAllReduce) else None


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
