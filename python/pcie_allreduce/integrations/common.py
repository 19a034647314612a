"""What the engine adapters share around the calls: which group is served, how big the
workspace is, what deterministic mode pins, the warm-up before graph capture, and the closing
stats line (the calls themselves: ``adapter.py``).

Nothing here imports an engine: the adapters (``vllm.py``, ``sglang.py``) read the engine's
configuration and pass plain values in.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .. import env as env_mod
from .. import policy
from ..errors import TuneError, TuneRefused

logger = logging.getLogger("pcie_allreduce")

TP_GROUP_NAME = "tp"  # exactly the engines' tensor-parallel group; never attention_tp, moe_tp
# The collectives besides the all-reduce that the adapters route (PcieAllReduce's names).
COLLECTIVES: tuple[str, ...] = ("reduce_scatter", "all_gather")
WARMUP_TUNE_BUDGET_S = 60.0  # a first start on a host without a cache measures this long


def enabled() -> bool:
    """PCIE_ALLREDUCE_ENABLE=1 (only then do the integrations install anything)."""
    return env_mod.integrations_enabled()


def ineligible(group_name: str | None, world_size: int) -> str | None:
    """Why this engine group does not get a PcieAllReduce, or None."""
    if group_name != TP_GROUP_NAME:
        return f"group {group_name!r} is not the tensor-parallel group {TP_GROUP_NAME!r}"
    if world_size < 2:
        return "tensor-parallel world size 1: nothing to reduce"
    return None


def size_workspace(
    engine: str, *, max_bs: int | None, draft_tokens: int | None, hidden: int | None
) -> policy.Sizing:
    """PCIE_ALLREDUCE_MAX_NUMEL wins; else decode CUDA-graph max batch x draft tokens (1
    without speculation) x hidden; else a guess, announced in one warning. The numbers follow
    ``policy.size_workspace``; ``how`` says it in the engine's terms."""
    draft = draft_tokens if draft_tokens and draft_tokens > 0 else 1
    width = hidden if hidden and hidden > 0 else None
    rows = max_bs * draft if max_bs and max_bs > 0 and width else None
    s = policy.size_workspace(from_env=env_mod.read_env().max_numel, hidden=width, max_rows=rows)
    if s.source == "hidden x max_rows":
        how = f"{engine}: decode max batch {max_bs} x {draft} token(s) per request: {s.how}"
    elif s.guessed:
        missing = " and ".join(
            n for n, v in (("the decode max batch", max_bs), ("the hidden size", hidden)) if not v
        )
        how = (
            f"{engine}: could not read {missing}; {s.how} (set PCIE_ALLREDUCE_MAX_NUMEL to size it)"
        )
        logger.warning("pcie_allreduce: %s", how)
    else:
        how = s.how
    return dataclasses.replace(s, how=how)


def deterministic_table(transport: str) -> str:
    """One tactic for every admitted size: oneshot sums every rank's input in rank order for
    each element whatever the message size, so a token's logits do not depend on the batch it
    was decoded in. (Sizes above the workspace still go to the engine's NCCL path.)"""
    blocks, threads = (1, 32) if policy.canonical(transport) == policy.HOST_SHM else (8, 256)
    return f"*,*,*,0,*,oneshot,push,0,{blocks},{threads}\n"


def warm_up(
    ar: Any,
    *,
    engine_autotune_disabled: bool,
    hidden: int | None = None,
    max_rows: int | None = None,
) -> dict[str, Any]:
    """Before graph capture and outside any engine autotune pass: tunes once when this host has
    no cache (unless the engine's or our disable-autotune flag is set, or the table was given),
    then installs every program a captured call could need."""
    outcome: dict[str, Any] = {"tuned": False}
    source = ar.stats()["table_source"]
    if not ar.enabled:
        outcome["why_not_tuned"] = f"disabled ({ar.disabled_reason})"
    elif engine_autotune_disabled:
        outcome["why_not_tuned"] = "the engine's autotune is disabled"
    elif not (source.startswith("cache ") or source == "embedded seed table"):
        outcome["why_not_tuned"] = f"a table was given ({source})"
    else:
        try:
            report = ar.tune(budget_s=WARMUP_TUNE_BUDGET_S)
            outcome.update(
                tuned=report["status"] == "tuned", measured=report["measured"], path=report["path"]
            )
        except TuneRefused as error:
            outcome["why_not_tuned"] = str(error)
        except TuneError as error:
            logger.warning("pcie_allreduce: warm-up tune failed, keeping %s: %s", source, error)
            outcome["why_not_tuned"] = str(error)
    outcome.update(ar.prepare(hidden, max_rows))
    return outcome


def collectives_summary(stats: dict[str, Any]) -> str:
    """``; reduce_scatter calls: ...; reduce_scatter declines: ...`` (then the same for
    all_gather) for each collective that saw a call or a decline, else an empty string."""
    parts = []
    for c in COLLECTIVES:
        entry = (stats.get("collectives") or {}).get(c) or {}
        calls, declines = entry.get("calls") or {}, entry.get("declines") or {}
        if not calls and not declines:
            continue
        for what, counts in (("calls", calls), ("declines", declines)):
            parts.append(
                f"; {c} {what}: "
                + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
            )
    return "".join(parts)


def summary_line(ar: Any, group: str = TP_GROUP_NAME) -> str:
    """One line an operator reads at shutdown: did the kernels run, and if not, why not."""
    s = ar.stats()
    calls = ", ".join(f"{k} {v}" for k, v in sorted(s["calls"].items())) or "none"
    declines = ", ".join(f"{k} {v}" for k, v in sorted(s["declines"].items())) or "none"
    state = "enabled" if s["enabled"] else f"disabled ({s['disabled_reason']})"
    line = (
        f"pcie_allreduce[{group} rank {ar.rank}/{ar.world_size}]: {state}; calls: {calls}; "
        f"declines: {declines}; staged {s['staged']}; table: {s['table_source']}"
    )
    routed, fused_declines = s.get("fused_routed", 0), s.get("fused_declines") or {}
    if routed or fused_declines:  # the engine's fused all-reduce + residual add + RMSNorm
        line += f"; fused add+rms_norm: {routed} routed, declines: " + (
            ", ".join(f"{k} {v}" for k, v in sorted(fused_declines.items())) or "none"
        )
    return line + collectives_summary(s)
