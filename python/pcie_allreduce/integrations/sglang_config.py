"""What the SGLang adapter reads from SGLang's configuration, and how.

SGLang publishes its server arguments through ``sglang.srt.runtime_context`` (``get_exec()``,
``get_spec()``) once the server starts; before that its accessors raise ValueError. Every read
goes through :func:`read_config`, so a value that is not published yet reads as absent and a
path this SGLang lays out differently (a rename upstream) is said in a warning, never guessed
silently. ``tests/engines/sglang`` pins each path against the real SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("pcie_allreduce")


def read_config(path: str, read: Callable[[], Any]) -> tuple[Any, str | None]:
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


def decode_width() -> tuple[int | None, int | None, str]:
    """(decode CUDA-graph max batch, draft tokens per request or None, where they came from)
    from SGLang's published config; (None, None, why) before it is published."""
    from sglang.srt.runtime_context import get_exec, get_spec

    graphs, problem = read_config(
        "get_exec().graph.cuda_graph_config", lambda: get_exec().graph.cuda_graph_config
    )
    if problem:
        return None, None, problem
    max_bs, problem = read_config(
        "cuda_graph_config.decode.max_bs",
        lambda: graphs.decode.max_bs if graphs is not None else None,
    )
    spec, spec_problem = read_config("get_spec()", get_spec)
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


def deterministic_rule(engine_rule_fn: Callable[[], bool]) -> tuple[bool, str]:
    """Whether this group's reductions must not depend on the batch, and why.
    ``engine_rule_fn`` is ``GroupCoordinator._deterministic_collectives_enabled``."""
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec

    engine_rule = bool(engine_rule_fn())
    if envs.SGLANG_USE_1STAGE_ALLREDUCE.is_set():
        return engine_rule, f"SGLANG_USE_1STAGE_ALLREDUCE={int(engine_rule)}"
    if engine_rule:
        return True, "SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1"
    published, _ = read_config(
        "get_exec().deterministic.enable_deterministic_inference",
        lambda: get_exec().deterministic.enable_deterministic_inference,
    )
    return bool(published), "--enable-deterministic-inference" if published else "off"


def engine_autotune_disabled() -> bool:
    from sglang.srt.runtime_context import get_exec

    disabled, _ = read_config(
        "get_exec().kernel.disable_flashinfer_autotune",
        lambda: get_exec().kernel.disable_flashinfer_autotune,
    )
    return bool(disabled)
