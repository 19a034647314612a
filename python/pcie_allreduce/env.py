"""The one place that reads pcie_allreduce's environment flags.

Every flag is parsed here, once per call to :func:`read_env`, and a bad value raises a
``ValueError`` that says which flag, what it got and what it expects. The extension reads no
environment of its own: what it needs (``PCIE_ALLREDUCE_PDL``, the host reduce kernels) is
passed to it. :func:`snapshot` is the whole environment, for the subprocesses ``doctor`` starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import policy

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_LOG_LEVELS = {"quiet": 0, "warning": 1, "info": 1, "debug": 2}
_HOST_REDUCE = ("auto", "scalar", "avx2", "avx512")


@dataclass(frozen=True)
class Env:
    # PCIE_ALLREDUCE_ENABLE: None when unset (direct library use on, engine integrations off),
    # False for 0 (the kernels off everywhere: communicators construct disabled), True for 1
    # (also lets the engine integrations install themselves).
    enable: bool | None = None
    # PCIE_ALLREDUCE_MAX_NUMEL: the workspace in elements, under policy.check_max_numel's rule.
    max_numel: int | None = None
    # PCIE_ALLREDUCE_STREAM_MAX_NUMEL: the largest all-reduce (in elements) streamed through the
    # workspace in rounds; None: policy.stream_cap's default for the device.
    stream_max_numel: int | None = None
    # PCIE_ALLREDUCE_TABLE: a tuning-table CSV file that replaces the cache and the seed.
    table: str | None = None
    # PCIE_ALLREDUCE_TIMEOUT_S: every wait's deadline in seconds (0 waits forever).
    timeout_s: float = 30.0
    # PCIE_ALLREDUCE_LOG_LEVEL: 0 quiet, 1 one line per decline reason, 2 verbose.
    log_level: int = 1
    # PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1: tune() refuses (a cache already written still loads).
    disable_autotune: bool = False
    # PCIE_ALLREDUCE_HOST_REDUCE: the CPU reduce kernels (scalar, avx2, avx512); None: the
    # widest this CPU runs. Results are bit-identical whichever runs; only speed differs.
    host_reduce: str | None = None
    # PCIE_ALLREDUCE_TRANSPORT (CUDA tensors), canonical: "auto" uses cuda_ipc and moves to
    # cuda_host when the P2P check fails; "cuda_ipc" declines no_p2p instead; "cuda_host"
    # always uses shared pinned host memory (policy.CUDA_MODES lists the accepted spellings).
    transport: str = policy.AUTO
    # PCIE_ALLREDUCE_PDL=0: no programmatic dependent launch (sm_90+ GPUs); on by default.
    pdl: bool = True
    # PCIE_ALLREDUCE_SELF_TEST=0: no self-test before serving (Lifecycle.self_test); on by
    # default.
    self_test: bool = True
    # PCIE_ALLREDUCE_CACHE_DIR (expanded), and XDG_CACHE_HOME beneath which the cache is kept
    # without it; see tuning_cache_dir().
    cache_dir: Path | None = None
    xdg_cache_home: Path | None = None

    def tuning_cache_dir(self) -> Path:
        """``$PCIE_ALLREDUCE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pcie_allreduce``, else
        ``~/.cache/pcie_allreduce``."""
        if self.cache_dir is not None:
            return self.cache_dir
        return (self.xdg_cache_home or Path.home() / ".cache") / "pcie_allreduce"


def _flag(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 1/0 (or true/false, yes/no, on/off), got {raw!r}")


def _number(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], Any],
    check: Callable[..., Any],
    default: Any,
) -> Any:
    """A numeric flag: ``parse`` it, then ``check`` it under the policy's rule for it (a value
    that does not parse is checked as -1, so the rule's message says what was expected)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse(raw.strip())
    except ValueError:
        value = -1
    return check(value, name, shown=raw)


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


def _host_reduce(env: Mapping[str, str]) -> str | None:
    raw = env.get("PCIE_ALLREDUCE_HOST_REDUCE")
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in _HOST_REDUCE:
        raise ValueError(
            f"PCIE_ALLREDUCE_HOST_REDUCE must be one of {', '.join(_HOST_REDUCE)}, got {raw!r}"
        )
    return None if value == "auto" else value


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name, "").strip()
    return Path(raw).expanduser() if raw else None


def integrations_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the engine integrations may install themselves: PCIE_ALLREDUCE_ENABLE=1 only."""
    return read_env(env).enable is True


# Env field -> (its flag, its parser): each flag is read by exactly one of these.
_FLAGS: dict[str, tuple[str, Callable[[Mapping[str, str]], Any]]] = {
    "enable": ("PCIE_ALLREDUCE_ENABLE", lambda e: _flag(e, "PCIE_ALLREDUCE_ENABLE", None)),
    "max_numel": (
        "PCIE_ALLREDUCE_MAX_NUMEL",
        lambda e: _number(e, "PCIE_ALLREDUCE_MAX_NUMEL", int, policy.check_max_numel, None),
    ),
    "stream_max_numel": (
        "PCIE_ALLREDUCE_STREAM_MAX_NUMEL",
        lambda e: _number(
            e, "PCIE_ALLREDUCE_STREAM_MAX_NUMEL", int, policy.check_stream_max_numel, None
        ),
    ),
    "table": ("PCIE_ALLREDUCE_TABLE", lambda e: e.get("PCIE_ALLREDUCE_TABLE") or None),
    "timeout_s": (
        "PCIE_ALLREDUCE_TIMEOUT_S",
        lambda e: _number(e, "PCIE_ALLREDUCE_TIMEOUT_S", float, policy.check_timeout, 30.0),
    ),
    "log_level": ("PCIE_ALLREDUCE_LOG_LEVEL", _log_level),
    "disable_autotune": (
        "PCIE_ALLREDUCE_DISABLE_AUTOTUNE",
        lambda e: bool(_flag(e, "PCIE_ALLREDUCE_DISABLE_AUTOTUNE", False)),
    ),
    "host_reduce": ("PCIE_ALLREDUCE_HOST_REDUCE", _host_reduce),
    "transport": (
        "PCIE_ALLREDUCE_TRANSPORT",
        lambda e: policy.cuda_mode(e.get("PCIE_ALLREDUCE_TRANSPORT"), "PCIE_ALLREDUCE_TRANSPORT"),
    ),
    "pdl": ("PCIE_ALLREDUCE_PDL", lambda e: bool(_flag(e, "PCIE_ALLREDUCE_PDL", True))),
    "self_test": (
        "PCIE_ALLREDUCE_SELF_TEST",
        lambda e: bool(_flag(e, "PCIE_ALLREDUCE_SELF_TEST", True)),
    ),
    "cache_dir": ("PCIE_ALLREDUCE_CACHE_DIR", lambda e: _path(e, "PCIE_ALLREDUCE_CACHE_DIR")),
    "xdg_cache_home": ("XDG_CACHE_HOME", lambda e: _path(e, "XDG_CACHE_HOME")),
}


def read_flags(env: Mapping[str, str]) -> tuple[Env, dict[str, str]]:
    """Every flag of ``env`` parsed on its own: a bad one keeps its default and its error is
    returned under the flag's name (doctor reports them instead of raising)."""
    values: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for name, (flag, parse) in _FLAGS.items():
        try:
            values[name] = parse(env)
        except ValueError as error:
            problems[flag] = str(error)
    return Env(**values), problems


def read_env(env: Mapping[str, str] | None = None) -> Env:
    """Every flag of ``env`` (default: this process's environment), parsed and checked: the
    first bad one raises."""
    flags, problems = read_flags(os.environ if env is None else env)
    if problems:
        raise ValueError(next(iter(problems.values())))
    return flags


def snapshot() -> dict[str, str]:
    """This process's whole environment, copied: what a subprocess is started with."""
    return dict(os.environ)
