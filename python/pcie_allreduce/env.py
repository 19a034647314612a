"""The one place that reads pcie_allreduce's environment flags.

Every flag is parsed here, once per call to :func:`read_env`, and a bad value raises a
``ValueError`` that says which flag, what it got and what it expects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_LOG_LEVELS = {"quiet": 0, "warning": 1, "info": 1, "debug": 2}


@dataclass(frozen=True)
class Env:
    # PCIE_ALLREDUCE_ENABLE: None when unset (direct library use on, engine integrations off),
    # False for 0 (the kernels off everywhere: communicators construct disabled), True for 1
    # (also lets the engine integrations install themselves).
    enable: Optional[bool]
    max_numel: Optional[int]
    table: Optional[str]
    timeout_s: float
    log_level: int
    # PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1: tune() refuses (a cache already written still loads).
    disable_autotune: bool = False
    # PCIE_ALLREDUCE_HOST_REDUCE: the CPU reduce kernels (scalar, avx2, avx512); None: the
    # widest this CPU runs. Results are bit-identical whichever runs; only speed differs.
    host_reduce: Optional[str] = None
    # PCIE_ALLREDUCE_TRANSPORT (CUDA tensors): "auto" uses peer-to-peer and moves to shared
    # pinned host memory when the P2P check fails; "p2p" declines no_p2p instead; "hostmem"
    # always uses host memory (hosts where P2P is slow, and testing).
    transport: str = "auto"


def _flag(env: Mapping[str, str], name: str, default: Optional[bool]) -> Optional[bool]:
    raw = env.get(name)
    if raw is None or (default is None and raw.strip() == ""):
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false, yes/no, on/off), got {raw!r}")


def _max_numel(env: Mapping[str, str]) -> Optional[int]:
    raw = env.get("PCIE_ALLREDUCE_MAX_NUMEL")
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value <= 0 or value % 8 != 0:
        raise ValueError(
            f"PCIE_ALLREDUCE_MAX_NUMEL must be a positive multiple of 8 (elements), got {raw!r}"
        )
    return value


def _timeout(env: Mapping[str, str]) -> float:
    raw = env.get("PCIE_ALLREDUCE_TIMEOUT_S")
    if raw is None or raw.strip() == "":
        return 30.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"PCIE_ALLREDUCE_TIMEOUT_S must be a number of seconds >= 0 (0 waits forever), "
            f"got {raw!r}"
        )
    return value


def _log_level(env: Mapping[str, str]) -> int:
    raw = env.get("PCIE_ALLREDUCE_LOG_LEVEL")
    if raw is None or raw.strip() == "":
        return 1
    value = raw.strip().lower()
    if value in _LOG_LEVELS:
        return _LOG_LEVELS[value]
    if value in {"0", "1", "2"}:
        return int(value)
    raise ValueError(
        f"PCIE_ALLREDUCE_LOG_LEVEL must be 0/1/2 or quiet/warning/info/debug, got {raw!r}"
    )


_HOST_REDUCE = ("auto", "scalar", "avx2", "avx512")


def _host_reduce(env: Mapping[str, str]) -> Optional[str]:
    raw = env.get("PCIE_ALLREDUCE_HOST_REDUCE")
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in _HOST_REDUCE:
        raise ValueError(
            f"PCIE_ALLREDUCE_HOST_REDUCE must be one of {', '.join(_HOST_REDUCE)}, got {raw!r}"
        )
    return None if value == "auto" else value


TRANSPORTS = ("auto", "p2p", "hostmem")


def parse_transport(raw: Optional[str], name: str = "PCIE_ALLREDUCE_TRANSPORT") -> str:
    """One of TRANSPORTS (case and spaces ignored; unset or empty is auto), or ValueError."""
    if raw is None or raw.strip() == "":
        return "auto"
    value = raw.strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"{name} must be one of {', '.join(TRANSPORTS)}, got {raw!r}")
    return value


def integrations_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the engine integrations may install themselves: PCIE_ALLREDUCE_ENABLE=1 only."""
    return read_env(env).enable is True


def read_env(env: Optional[Mapping[str, str]] = None) -> Env:
    env = os.environ if env is None else env
    table = env.get("PCIE_ALLREDUCE_TABLE") or None
    return Env(
        enable=_flag(env, "PCIE_ALLREDUCE_ENABLE", None),
        max_numel=_max_numel(env),
        table=table,
        timeout_s=_timeout(env),
        log_level=_log_level(env),
        disable_autotune=bool(_flag(env, "PCIE_ALLREDUCE_DISABLE_AUTOTUNE", False)),
        host_reduce=_host_reduce(env),
        transport=parse_transport(env.get("PCIE_ALLREDUCE_TRANSPORT")),
    )
