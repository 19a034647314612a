"""The rules a communicator follows before any rank talks, as pure functions.

From the arguments, the parsed environment (:class:`pcie_allreduce.env.Env`) and the probe
results they say which transport runs, which table key and fingerprint the group has, where its
tuning table comes from and how large its workspace is. The communicator, the tuner, doctor and
the engine integrations call them instead of restating them. Nothing here reads the machine, the
environment or a file, and nothing here loads the extension.

The transports, one name each (``stats()["transport"]``, doctor, fingerprints, the CLI):

- ``host_shm``: CPU tensors, every workspace in POSIX shared memory;
- ``cuda_ipc``: GPUs over peer-to-peer, every peer's GPU memory mapped with CUDA IPC;
- ``cuda_host``: GPUs without peer-to-peer, every workspace in shared pinned host memory;

and the selection ``auto``: CUDA tensors run ``cuda_ipc`` and move to ``cuda_host`` when the
P2P write-and-verify fails on some pair. Accepted as input wherever a transport is named (the
``transport=`` argument, ``PCIE_ALLREDUCE_TRANSPORT``, ``--transport``), case and spaces
ignored: the names and the aliases ``host`` (host_shm), ``cuda`` and ``p2p`` (cuda_ipc),
``hostmem`` (cuda_host).
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import __version__

# ---------------------------------------------------------------------------- transports
AUTO = "auto"
HOST_SHM = "host_shm"
CUDA_IPC = "cuda_ipc"
CUDA_HOST = "cuda_host"
TRANSPORTS = (HOST_SHM, CUDA_IPC, CUDA_HOST)
ALIASES = {"host": HOST_SHM, "cuda": CUDA_IPC, "p2p": CUDA_IPC, "hostmem": CUDA_HOST}
CUDA_MODES = (AUTO, CUDA_IPC, CUDA_HOST)  # what a CUDA communicator may be asked to run
# What each transport does, for stats()["transport_detail"] and doctor.
WHAT = {
    HOST_SHM: "every workspace in POSIX shared memory",
    CUDA_IPC: "every peer's GPU memory mapped with CUDA IPC",
    CUDA_HOST: "every workspace in shared pinned host memory",
}


def transport_names() -> dict[str, list[str]]:
    """{canonical name: its aliases}, as ``_C.transport_names()`` gives the extension's."""
    return {name: sorted(a for a, n in ALIASES.items() if n == name) for name in TRANSPORTS}


def _spellings(names: Sequence[str]) -> str:
    aliases = [f"{a} = {ALIASES[a]}" for a in ALIASES if ALIASES[a] in names]
    return f"one of {', '.join(names)}" + (f" (or {', '.join(aliases)})" if aliases else "")


def canonical(
    raw: str | None, what: str = "transport", accepted: Sequence[str] = (AUTO, *TRANSPORTS)
) -> str:
    """The canonical name of ``raw`` (a name or an alias; case and spaces ignored; None or
    empty is auto), or a ValueError saying what ``what`` accepts."""
    value = AUTO if raw is None or raw.strip() == "" else raw.strip().lower()
    value = ALIASES.get(value, value)
    if value not in accepted:
        raise ValueError(f"{what} must be {_spellings(accepted)}, got {raw!r}")
    return value


def cuda_mode(raw: str | None, what: str) -> str:
    """What a CUDA communicator is asked to run: auto, cuda_ipc or cuda_host."""
    return canonical(raw, what, CUDA_MODES)


@dataclass(frozen=True)
class TransportChoice:
    """The transport a communicator starts with and what it was asked for."""

    name: str  # host_shm, cuda_ipc or cuda_host
    mode: str  # host_shm for CPU tensors; else auto, cuda_ipc or cuda_host
    asked_by: str  # "transport=...", "PCIE_ALLREDUCE_TRANSPORT=..." or "" (the default)

    def detail(self) -> str:
        """``stats()["transport_detail"]`` before any peer is reached."""
        if self.name == HOST_SHM:
            return f"CPU tensors: {WHAT[HOST_SHM]}"
        if self.name == CUDA_HOST:
            return f"{self.asked_by}: {WHAT[CUDA_HOST]}"
        return f"peer-to-peer: {WHAT[CUDA_IPC]}" + (
            f" (transport {CUDA_IPC})" if self.mode == CUDA_IPC else ""
        )


def choose_transport(
    device_type: str, argument: str | None, env_mode: str, device: str = ""
) -> TransportChoice:
    """``transport=`` (None: ``env_mode``, PCIE_ALLREDUCE_TRANSPORT) for a communicator whose
    tensors live on ``device_type``; a transport those tensors cannot use is a ValueError."""
    if device_type != "cuda":
        if argument is not None and canonical(argument) not in (AUTO, HOST_SHM):
            raise ValueError(
                f"transport={argument!r} chooses how GPUs reach each other; this communicator "
                f"is on {device or device_type} (CPU tensors use POSIX shared memory): pass "
                f"transport=None, {AUTO!r} or {HOST_SHM!r}"
            )
        return TransportChoice(HOST_SHM, HOST_SHM, "")
    if argument is None:
        mode, asked_by = env_mode, f"PCIE_ALLREDUCE_TRANSPORT={env_mode}"
    else:
        if canonical(argument) == HOST_SHM:
            raise ValueError(
                f"transport={argument!r} is the CPU tensors' transport; this "
                f"communicator is on {device or device_type}: pass "
                f"{_spellings(CUDA_MODES)}, or None"
            )
        mode = cuda_mode(argument, "transport")
        asked_by = f"transport={mode!r}"
    return TransportChoice(CUDA_HOST if mode == CUDA_HOST else CUDA_IPC, mode, asked_by)


def transport_after_p2p_failure(mode: str) -> str | None:
    """What a CUDA group runs when the P2P write-and-verify fails on some pair: cuda_host (in
    auto mode it moves there; asked for cuda_host it never used P2P); None when cuda_ipc was
    asked for: the group declines ``no_p2p``."""
    return None if mode == CUDA_IPC else CUDA_HOST


# ---------------------------------------------------------------------------- table keys
# The topology keys of transports with their own table rows and tuning cache. Tables written
# before the vocabulary had one name per transport spell them host and hostmem; the extension
# reads those rows as these keys.
LEGACY_TABLE_KEYS = {"host": HOST_SHM, "hostmem": CUDA_HOST}


def canonical_table_key(key: str) -> str:
    """A table key as the extension reads it: host and hostmem are host_shm and cuda_host."""
    return LEGACY_TABLE_KEYS.get(key, key)


def table_key(transport: str, probed: str = "flat") -> str:
    """The topology key a group's table rows and tuning cache are matched on: ``host_shm`` for
    CPU tensors, ``cuda_host`` for GPUs through host memory (an NVLink host stays ``nvlink``,
    which declines), else the probed GPU topology (``islands-2x4``, ``flat``, ...)."""
    if transport == HOST_SHM:
        return HOST_SHM
    if transport == CUDA_HOST and probed != "nvlink":
        return CUDA_HOST
    return probed


def islands_for_table(topology: Any) -> list[int]:
    """A topology's rank -> island map as tables and fingerprints use it ([] for one island)."""
    return list(topology.island_of()) if len(topology.islands()) > 1 else []


# ---------------------------------------------------------------------------- fingerprint
# The tuning cache's file format (tuning/cache.py); part of the fingerprint, so a library that
# writes another format never reads an old file as its own.
CACHE_FORMAT = 1


def driver_field(driver: str | None, cuda_runtime: str | None) -> str:
    """The driver field of a CUDA fingerprint: the NVIDIA driver (None when nvidia-smi could not
    be asked; "" when it did not say) and the CUDA runtime torch was built with."""
    if driver is None:
        return f"cuda {cuda_runtime}"
    return f"driver {driver or 'unknown'}, cuda {cuda_runtime}"


def fingerprint_fields(
    transport: str,
    world: int,
    topology_key: str,
    island_of: Sequence[int],
    devices: Sequence[str],
    driver: str = "",
    links: str = "",
) -> dict[str, Any]:
    """Everything that changes which tactic wins: what a cache file is valid for (``links``:
    the group's pairwise link classes, ``Topology.fingerprint()`` of its GPUs). Transport and
    key may be given in any accepted spelling; the fields hold the canonical ones."""
    return {
        "library": __version__,
        "format": CACHE_FORMAT,
        "transport": canonical(transport, "fingerprint transport", TRANSPORTS),
        "world": int(world),
        "topology": canonical_table_key(topology_key),
        "island_of": [int(i) for i in island_of],
        "devices": [str(d) for d in devices],
        "driver": driver,
        "links": links,
    }


def fingerprint(fields: Mapping[str, Any]) -> str:
    """``<transport>-w<world>-<12 hex digits>``: a file name, readable where it matters."""
    digest = hashlib.sha256(json.dumps(dict(fields), sort_keys=True).encode()).hexdigest()
    return f"{fields['transport']}-w{fields['world']}-{digest[:12]}"


# ---------------------------------------------------------------------------- table source
SEED_SOURCE = "embedded seed table"


def cache_source(path: Any) -> str:
    """``stats()["table_source"]`` of a table read from this host's tuning cache."""
    return f"cache {path}"


@dataclass(frozen=True)
class TableRequest:
    """Where a communicator's tuning table comes from, before anything is read: CSV ``text``
    given as the argument, a file (``path``, named by the argument or PCIE_ALLREDUCE_TABLE), or
    neither: then rank 0's reading of this host's tuning cache, else the embedded seed."""

    text: str | None = None
    path: str | None = None
    source: str = SEED_SOURCE  # stats()["table_source"]; the seed's until a cache is found
    what: str = ""  # names the file in errors: "table file" or "PCIE_ALLREDUCE_TABLE"

    @property
    def given(self) -> bool:
        """A table was given (compared by hash across ranks; the cache is not read)."""
        return self.text is not None or self.path is not None


def table_request(argument: str | None, env_table: str | None) -> TableRequest:
    """The ``table=`` argument (CSV text when it holds a newline or a comma, else a path), else
    PCIE_ALLREDUCE_TABLE (a path), else the cache or the seed."""
    if argument is None:
        if env_table is None:
            return TableRequest()
        return TableRequest(
            path=env_table, source=f"PCIE_ALLREDUCE_TABLE {env_table}", what="PCIE_ALLREDUCE_TABLE"
        )
    if not isinstance(argument, str) or argument.strip() == "":
        raise ValueError(
            f"table must be CSV text or a path to a CSV file, got {argument!r} (pass None for "
            "PCIE_ALLREDUCE_TABLE or the embedded seed table)"
        )
    if "\n" not in argument and "," not in argument:
        return TableRequest(path=argument, source=f"table file {argument}", what="table file")
    return TableRequest(text=argument, source="table argument")


# ---------------------------------------------------------------------------- max_numel
# The one rule for a workspace's size in elements, whoever gives it. The extension's layout
# (plan/layout.cc make_layout) needs max_numel x element size to be whole 16-byte vectors and
# max_numel to fit in 32 bits (flags carry it). A multiple of 8 elements is that for every dtype
# set (2-byte dtypes need 8; a fp32-only workspace would take 4, one rule is simpler to state).
NUMEL_MULTIPLE = 8
MAX_NUMEL_LIMIT = (1 << 32) - NUMEL_MULTIPLE
DEFAULT_ROWS = 64  # the guess when nobody says how many rows a decode step reduces
DEFAULT_HIDDEN = 8192


@dataclass(frozen=True)
class Sizing:
    """A workspace size in elements, and which source gave it (for the one log line)."""

    max_numel: int
    source: str  # "max_numel", "PCIE_ALLREDUCE_MAX_NUMEL", "hidden x max_rows" or "guess"
    how: str
    guessed: bool = False


def whole(name: str, value: Any) -> int:
    """``value`` as an int when it is a whole number: an int (or numpy integer), or a float
    with no fraction; bool and 1024.5 are not."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            if isinstance(value, float) and value.is_integer():
                return int(value)
    raise ValueError(f"{name} must be a whole number, got {value!r}")


def check_max_numel(value: Any, source: str, shown: Any = None) -> int:
    """``value`` when it is a positive multiple of 8 (elements) that fits in 32 bits, else a
    ValueError naming ``source`` and what it gave (``shown``: the text, for an env flag)."""
    number = whole(source, value) if shown is None else value
    if not (0 < number <= MAX_NUMEL_LIMIT and number % NUMEL_MULTIPLE == 0):
        raise ValueError(
            f"{source} must be a positive multiple of {NUMEL_MULTIPLE} (elements), got "
            f"{value if shown is None else shown!r}; at most {MAX_NUMEL_LIMIT} (every workspace "
            "holds whole 16-byte vectors and its flags carry the count in 32 bits)"
        )
    return number


# Streaming past the workspace (every operation, as rounds through it): on by default
# for CPU tensors, whose fallback (gloo) it beats at every size measured (docs/benchmarks.md); off
# for CUDA tensors until a tune on a GPU measures streamed sizes against NCCL's ring.
STREAM_DEFAULT_CPU = 1 << 31
STREAM_LIMIT = 1 << 40


def check_stream_max_numel(value: Any, source: str, shown: Any = None) -> int:
    """``value`` when it is a whole number of elements in 0..STREAM_LIMIT (0: no streaming), else
    a ValueError naming ``source`` and what it gave (``shown``: the text, for an env flag)."""
    number = whole(source, value) if shown is None else value
    if not 0 <= number <= STREAM_LIMIT:
        raise ValueError(
            f"{source} must be a whole number of elements in 0..{STREAM_LIMIT} (0: messages "
            f"above the workspace decline too_large), got {value if shown is None else shown!r}"
        )
    return number


def stream_cap(explicit: Any, from_env: int | None, device_type: str) -> int:
    """Explicit stream_max_numel > PCIE_ALLREDUCE_STREAM_MAX_NUMEL > the default for the device
    (STREAM_DEFAULT_CPU on CPU tensors, 0 on CUDA tensors)."""
    if explicit is not None:
        return check_stream_max_numel(explicit, "stream_max_numel")
    if from_env is not None:
        return from_env
    return STREAM_DEFAULT_CPU if device_type == "cpu" else 0


# The longest wait that every clock on the way holds: the store's timedelta, the kernels'
# nanosecond deadline and the bootstrap's millisecond waits (1e10 s overflowed one of them).
MAX_TIMEOUT_S = 1_000_000_000


def check_timeout(value: Any, source: str, shown: Any = None) -> float:
    """``value`` in seconds when it is a finite number >= 0 (0 waits forever), else a
    ValueError naming ``source`` and what it gave (``shown``: the text, for an env flag)."""
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0
    if not 0 <= number <= MAX_TIMEOUT_S:
        raise ValueError(
            f"{source} must be a finite number of seconds >= 0 and at most "
            f"{MAX_TIMEOUT_S} (about 31 years; 0 waits forever), got "
            f"{value if shown is None else shown!r}"
        )
    return float(number)


def _round_up(numel: int, how: str) -> Sizing:
    rounded = -(-numel // NUMEL_MULTIPLE) * NUMEL_MULTIPLE
    if rounded > MAX_NUMEL_LIMIT:
        raise ValueError(
            f"{how}: more than the {MAX_NUMEL_LIMIT} elements a workspace can hold "
            "(flags carry the count in 32 bits); pass a smaller max_numel"
        )
    if rounded != numel:
        how += f", rounded up to {rounded} (a multiple of {NUMEL_MULTIPLE})"
    return Sizing(rounded, "", how)


def size_workspace(
    *,
    explicit: Any = None,
    from_env: int | None = None,
    hidden: Any = None,
    max_rows: Any = None,
) -> Sizing:
    """Explicit max_numel > PCIE_ALLREDUCE_MAX_NUMEL > max_rows x hidden > 64 rows x hidden
    (8192 when unknown), announced as a guess. Given sizes must follow the rule
    (check_max_numel); sizes derived from rows and hidden are rounded up to it, since a
    workspace a few elements larger still holds every message they describe."""
    if explicit is not None:
        numel = check_max_numel(explicit, "max_numel")
        return Sizing(numel, "max_numel", f"max_numel={numel}")
    if from_env is not None:
        return Sizing(from_env, "PCIE_ALLREDUCE_MAX_NUMEL", f"PCIE_ALLREDUCE_MAX_NUMEL={from_env}")
    for name, value in (("hidden", hidden), ("max_rows", max_rows)):
        if value is not None and whole(name, value) <= 0:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if hidden is not None and max_rows is not None:
        rows, width = whole("max_rows", max_rows), whole("hidden", hidden)
        s = _round_up(rows * width, f"{rows} rows x {width} hidden = {rows * width} elements")
        return Sizing(s.max_numel, "hidden x max_rows", s.how)
    width = whole("hidden", hidden) if hidden is not None else DEFAULT_HIDDEN
    s = _round_up(
        DEFAULT_ROWS * width,
        f"guessing {DEFAULT_ROWS} rows x {width} hidden = {DEFAULT_ROWS * width} elements",
    )
    return Sizing(s.max_numel, "guess", s.how, guessed=True)


def rows_covered(max_numel: int, hidden: Any, max_rows: Any) -> int | None:
    """How many rows of ``hidden`` a workspace of ``max_numel`` holds (``prepare(hidden,
    max_rows)``); None when neither is given. Both or neither, positive whole numbers."""
    if hidden is None and max_rows is None:
        return None
    if hidden is None or max_rows is None:
        raise ValueError("prepare(hidden, max_rows): give both or neither")
    hidden, max_rows = whole("hidden", hidden), whole("max_rows", max_rows)
    if hidden <= 0 or max_rows <= 0:
        raise ValueError(
            f"prepare(hidden={hidden}, max_rows={max_rows}): expected positive whole numbers"
        )
    return max_numel // hidden
