"""How a :class:`~pcie_allreduce.PcieAllReduce` is built: the steps every rank takes, in order.

1. **decide_locally** (this rank alone, before any exchange): sizes, transport and table checked
   (``policy``), the table file read and parsed, the extension's ``Options`` filled;
2. **meet**: every rank arrives; ranks on different machines turn the backend off
   (``multi_host``) before anything maps a peer's memory;
3. **probe**: table key and islands (on GPUs every rank names its GPU; NVLink declines);
4. **handshake**: every rank agrees on what decides a call's path, or the backend turns off on
   every rank, naming the rank and field; rank 0's reading of this host's tuning cache travels
   with it, so every rank adopts the same table;
5. **connect**: tokens exchanged, peers mapped, tokens retired; on GPUs the P2P
   write-and-verify, whose failure moves every rank to ``cuda_host`` (transport auto) or
   declines ``no_p2p`` (transport cuda_ipc). Failures are gathered, not raised, so every rank
   takes the same next step.

Every exchange goes through :class:`~pcie_allreduce.bootstrap.Bootstrap`, bounded by the
timeout. The result is a :class:`Built`: the extension's communicator, registered for the ops.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import files, policy
from .bootstrap import Bootstrap
from .env import read_env
from .native import _C
from .plan import island_map
from .topology import host_devices, probe_cuda_group
from .tuning import cache

logger = logging.getLogger("pcie_allreduce")

Off = tuple[str, str]  # (decline reason, detail); ("none", "") while the backend may run
ON: Off = ("none", "")


@dataclass(frozen=True)
class Config:
    """What every rank of the group agreed on at construction (``PcieAllReduce.config``)."""

    transport: str  # canonical: host_shm, cuda_ipc or cuda_host
    mode: str  # what was asked: host_shm (CPU tensors), auto, cuda_ipc or cuda_host
    topology_key: str  # the key table rows and the tuning cache are matched on
    island_of: tuple[int, ...]  # rank -> island; () for one island
    dtypes: tuple[str, ...]  # the admitted dtypes
    max_blocks: int  # the most CTAs (host: slices) a tactic may use on this transport
    fingerprint: str  # names this host's tuning cache file for the group
    fingerprint_fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Table:
    """The tuning table a communicator decides with, and where it came from."""

    text: str
    source: str


@dataclass
class Built:
    """What construction hands the communicator."""

    comm: Any  # _C.Communicator
    handle: int  # for the torch ops
    boot: Bootstrap
    config: Config
    table: Table
    detail: str  # stats()["transport_detail"]
    id: int  # rank 0's random id for this communicator: destroy()'s farewell names it


def host_identity() -> str:
    """Which machine (and which boot of it) this process runs on: ranks that differ here cannot
    share memory, so the group stays on its own all-reduce (``multi_host``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def read_table(request: policy.TableRequest) -> Table:
    """The given table's text, parsed here so its errors (no rows, a bad field, a missing file)
    raise on this rank before it exchanges anything; the empty text when none was given."""
    text = request.text if request.text is not None else ""
    if request.path is not None:
        file = Path(request.path)
        try:
            text = files.read_small(file, in_cache=False).decode("utf-8")
        except (FileNotFoundError, IsADirectoryError) as error:
            problem = "is a directory" if isinstance(error, IsADirectoryError) else "does not exist"
            raise FileNotFoundError(
                f"{request.what} {request.path!r} {problem}; expected a tuning-table CSV file"
            ) from None
        except files.Refused as error:  # a FIFO, a device, a file of many megabytes
            raise ValueError(f"{request.what}: {error}") from None
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{request.what} {request.path!r} is not a text tuning table (not "
                f"UTF-8 at byte {error.start})"
            ) from None
    if request.given:
        _C.TuningTable.parse(text, request.source)
    return Table(text, request.source)


def _cpu_group_for(group: Any, cpu_group: Any) -> Any:
    if cpu_group is not None:
        return cpu_group
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(ranks=dist.get_process_group_ranks(group), backend="gloo")


@dataclass
class Local:
    """What a rank decides alone, before any exchange."""

    opts: Any  # _C.Options as far as this rank knows them
    choice: policy.TransportChoice
    table_given: bool
    off: Off


def device_of(device: str | torch.device | int) -> torch.device:
    """``cpu``, or a CUDA device with its index (an int is a CUDA index; ``cuda`` is the
    current device)."""
    out = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if out.type == "cuda" and out.index is None:
        out = torch.device("cuda", torch.cuda.current_device())
    return out


def decide_locally(
    group: Any,
    device: torch.device,
    *,
    max_numel: Any,
    hidden: Any,
    max_rows: Any,
    table: str | None,
    dtypes: Sequence[str],
    timeout_s: Any,
    initial_generation: int,
    enabled: bool,
    transport: str | None,
    stream_max_numel: Any = None,
) -> Local:
    """Step 1: the arguments checked (``policy``), the table file read and parsed, the CPU
    reduce kernels chosen, the extension's Options filled; everything raises before any
    exchange. Transport, table key and islands follow from the probe."""
    env = read_env()
    choice = policy.choose_transport(device.type, transport, env.transport, str(device))
    sizing = policy.size_workspace(
        explicit=max_numel, from_env=env.max_numel, hidden=hidden, max_rows=max_rows
    )
    if sizing.guessed:
        logger.warning(
            "pcie_allreduce: no max_numel given; %s (pass max_numel, or hidden and "
            "max_rows = decode batch x draft tokens)",
            sizing.how,
        )
    timeout = env.timeout_s if timeout_s is None else policy.check_timeout(timeout_s, "timeout_s")
    if device.type == "cpu" and env.host_reduce is not None:
        # Process-wide and rank-local: every kernel set gives the same bits.
        try:
            _C.set_host_reduce_isa(env.host_reduce)
        except ValueError as e:
            raise ValueError(f"PCIE_ALLREDUCE_HOST_REDUCE={env.host_reduce}: {e}") from None
    request = policy.table_request(table, env.table)
    given = read_table(request)
    opts = _C.Options()
    opts.rank, opts.world = dist.get_rank(group), dist.get_world_size(group)
    opts.max_numel = sizing.max_numel
    opts.dtypes = list(dtypes)
    opts.device = device.index if device.type == "cuda" else -1
    opts.timeout_s = timeout
    opts.initial_gen = int(initial_generation) & 0xFFFFFFFF
    opts.table_text, opts.table_source = given.text, given.source
    opts.group_name = group.group_name
    opts.log_level = env.log_level
    opts.pdl = env.pdl
    opts.stream_max_numel = policy.stream_cap(stream_max_numel, env.stream_max_numel, device.type)
    off = ON
    if not enabled:
        off = ("disabled", "constructed with enabled=False")
    elif env.enable is False:
        off = ("disabled", "PCIE_ALLREDUCE_ENABLE=0")
    return Local(opts, choice, request.given, off)


def build(
    group: Any,
    cpu_group: Any,
    device: torch.device,
    local: Local,
    *,
    topology: Any,
    islands: Sequence[Sequence[int]] | None,
) -> Built:
    """Steps 2 to 5 (collective). Making a gloo group when none is given is torch's own
    collective and unbounded; every exchange after it is bounded by the timeout."""
    boot = Bootstrap(_cpu_group_for(group, cpu_group), float(local.opts.timeout_s))
    builder = Builder(boot, device, local.opts, local.choice, local.table_given)
    return builder.run(local.off, topology, islands)


class Builder:
    """One construction: the steps above as methods, each one exchange (or a few)."""

    def __init__(
        self,
        boot: Bootstrap,
        device: torch.device,
        opts: Any,
        choice: policy.TransportChoice,
        table_given: bool,
    ) -> None:
        self.boot, self.device, self.opts = boot, device, opts
        self.choice, self.table_given = choice, table_given
        self.rank, self.world = int(opts.rank), int(opts.world)
        self.detail = choice.detail()
        self.transport = choice.name
        self.probed, self.key = "flat", policy.HOST_SHM
        self.island_of: list[int] = []
        self.devices: list[str] = []
        self.driver = self.links = ""
        self.fields: dict[str, Any] = {}
        self.fingerprint = ""
        self.id = 0

    def run(self, off: Off, topology: Any, islands: Sequence[Sequence[int]] | None) -> Built:
        off = self.meet(off)
        off = self.probe(topology, islands, off)
        self.set_transport(self.transport)
        self.opts.disabled, self.opts.disabled_detail = self.handshake(off)
        comm = _C.Communicator(self.opts)
        if self.transport == policy.HOST_SHM:
            self.connect(comm)
        elif comm.enabled():
            why = self.connect_gpus(comm)
            if why is not None and self.transport == policy.CUDA_IPC:
                comm = self.after_p2p_failure(comm, why)
            elif why is not None:
                comm.disable("no_p2p", f"{why} ({self.detail})")
        config = Config(
            self.transport,
            self.choice.mode,
            self.key,
            tuple(self.island_of),
            tuple(self.opts.dtypes),
            int(self.opts.max_blocks),
            self.fingerprint,
            dict(self.fields),
        )
        table = Table(
            self.opts.table_text or _C.TuningTable.embedded_text(), self.opts.table_source
        )
        return Built(
            comm, _C.register_communicator(comm), self.boot, config, table, self.detail, self.id
        )

    def set_transport(self, transport: str) -> None:
        """The transport, its table key and the fingerprint of this host's cache for it."""
        self.transport, self.key = transport, policy.table_key(transport, self.probed)
        self.opts.transport, self.opts.topology_key = transport, self.key
        self.opts.island_of = list(self.island_of)
        self.fields = policy.fingerprint_fields(
            transport, self.world, self.key, self.island_of, self.devices, self.driver, self.links
        )
        self.fingerprint = policy.fingerprint(self.fields)

    # ------------------------------------------------------------------ the exchanges
    def meet(self, off: Off) -> Off:
        """The first exchange: every rank arrives (or is named), and ranks on different
        machines turn the backend off before anything tries to share memory with a peer."""
        met = self.boot.gather(
            {"host": host_identity(), "id": int.from_bytes(os.urandom(6), "little")}, "meet"
        )
        self.id = met[0]["id"]
        hosts = [m["host"] for m in met]
        if off == ON and len(set(hosts)) > 1:
            other = next(r for r, h in enumerate(hosts) if h != hosts[0])
            return "multi_host", (
                f"rank 0 runs on {hosts[0]} and rank {other} on {hosts[other]}: shared memory "
                "needs one host, so this group keeps its own all-reduce"
            )
        return off

    def probe(self, topology: Any, islands: Sequence[Sequence[int]] | None, off: Off) -> Off:
        """Table key and islands (collective on CUDA: every rank names its GPU); NVLink hosts
        turn the backend off."""
        self.island_of = island_map(self.world, islands)
        self.devices = host_devices()
        if self.device.type != "cuda" or off[0] == "multi_host":
            return off
        self.devices = [torch.cuda.get_device_name(self.device)] * self.world
        if islands is not None:
            self.probed = _C.Topology.from_islands([list(i) for i in islands]).table_key()
            return off
        found = probe_cuda_group(self.boot.gather, self.device, topology)
        self.probed, self.island_of = found.table_key, found.island_of
        self.devices, self.driver = found.devices or self.devices, found.driver
        self.links = found.links
        if found.decline is not None and off == ON:
            return found.decline, found.detail
        return off

    def handshake(self, off: Off) -> Off:
        """Every rank must agree on everything that decides a call's path, or they deadlock:
        a disagreement (or any rank being off) turns the backend off on every rank."""
        opts = self.opts
        mine = {
            "world": self.world,
            "max_numel": int(opts.max_numel),
            # Which calls stream depends on it: every rank must take the same path.
            "stream_max_numel": int(opts.stream_max_numel),
            "dtypes": sorted(self.opts.dtypes),
            "transport": self.transport,
            "transport_mode": self.choice.mode,
            # A given table is compared by hash; without one, every rank takes rank 0's
            # reading of the host's cache (a file another server may be writing right now).
            "table_hash": _C.TuningTable.parse(opts.table_text, opts.table_source).hash()
            if self.table_given
            else "cache or seed",
            "topology": self.key,
            "island_of": list(self.island_of),
            "timeout_s": float(opts.timeout_s),
            "disabled": off[0],
        }
        if self.rank == 0 and not self.table_given:
            mine["cache"] = self.read_cache()
        everyone: list[dict[str, Any]] = self.boot.gather(mine, "handshake")
        found = everyone[0].pop("cache", None)
        if found is not None and all(e["table_hash"] == "cache or seed" for e in everyone):
            opts.table_text, opts.table_source = found["text"], found["source"]
        return off if off != ON else _disagreement(everyone)

    def read_cache(self) -> dict[str, str] | None:
        """Rank 0's reading of this host's tuning cache: the table, or None (a file that
        exists but cannot be used is reported and ignored; the next tune replaces it)."""
        found = cache.read_cache(cache.cache_path(self.fingerprint), self.fingerprint)
        if found.problem is not None:
            logger.warning(
                "pcie_allreduce: ignoring the tuning cache %s: %s; using the seed "
                "table until `pcie-allreduce tune` replaces it",
                found.path,
                found.problem,
            )
        if found.text is None:
            return None
        return {"text": found.text, "source": policy.cache_source(found.path)}

    def connect(self, comm: Any) -> None:
        """Every rank maps every peer's workspace, then drops what let peers find its own."""
        comm.connect(self.boot.gather_bytes(comm.local_token(), "connect"))
        self.boot.barrier("connected")
        comm.retire_token()

    def connect_gpus(self, comm: Any) -> str | None:
        """Every rank maps every peer's workspace and writes into it. None when every pair
        works; else why not, the same text on every rank."""
        tokens = self.boot.gather_bytes(comm.local_token(), "connect")
        try:
            comm.connect(tokens)
            mine = None
        except (RuntimeError, ValueError) as error:
            mine = str(error)
        errors: list[str | None] = self.boot.gather(mine, "connected")
        comm.retire_token()
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, reason = failed[0]
            return f"rank {r} cannot map its peers' workspaces ({reason})"
        broken = self.broken_pairs(comm)
        if broken:
            pairs = ", ".join(f"rank {s} -> rank {d}" for s, d in broken[:8])
            return f"peer writes or reads did not arrive intact ({pairs})"
        return None

    def broken_pairs(self, comm: Any) -> list[tuple[int, int]]:
        """The write-and-verify (collective): every rank writes a pattern into every peer's
        workspace with the kernels' own stores and checks what arrived, then loads every peer's
        own pattern with the pull kernels' loads, because drivers report P2P that does not work
        (and a fabric may carry writes yet break reads). Returns the (peer, reader) pairs that
        failed either way."""
        nonce = int.from_bytes(os.urandom(4), "little")
        nonce = self.boot.gather(nonce, "p2p check")[0]  # rank 0's
        comm.probe_write(nonce)
        self.boot.barrier("p2p written")
        everyone: list[list[int]] = self.boot.gather(comm.probe_read(nonce), "p2p read")
        return [(src, dst) for dst, sources in enumerate(everyone) for src in sources]

    def after_p2p_failure(self, comm: Any, why: str) -> Any:
        """P2P failed on some pair (every rank knows the same ``why``): move every workspace to
        shared pinned host memory (transport auto), or decline no_p2p (transport cuda_ipc).
        Collective. Returns the communicator that runs from now on."""
        moved_to = policy.transport_after_p2p_failure(self.choice.mode)
        if moved_to is None:
            comm.disable(
                "no_p2p",
                f"{why}; check the IOMMU/ACS settings of the PCIe path "
                f"between those GPUs (transport {policy.CUDA_IPC}: host memory was not "
                "tried)",
            )
            self.detail = f"peer-to-peer failed: {why}"
            return comm
        comm.close_peers()
        self.boot.barrier("p2p closed")
        comm.release()
        self.set_transport(moved_to)
        if not self.table_given:  # this host's cache for the new transport, as rank 0 reads it
            found = self.boot.gather(
                self.read_cache() if self.rank == 0 else None, "host memory table"
            )[0]
            self.opts.table_text, self.opts.table_source = (
                (found["text"], found["source"]) if found else ("", policy.SEED_SOURCE)
            )
        comm = _C.Communicator(self.opts)
        self.detail = f"peer-to-peer failed: {why}; every workspace is in shared pinned host memory"
        again = self.connect_gpus(comm)
        if again is not None:
            comm.disable("no_p2p", f"{why}; host memory failed too: {again}")
            self.detail = f"peer-to-peer and host memory failed: {again}"
        elif self.rank == 0:
            logger.warning(
                "pcie_allreduce: %s (transport %s; PCIE_ALLREDUCE_TRANSPORT=%s declines instead)",
                self.detail,
                moved_to,
                policy.CUDA_IPC,
            )
        return comm


def _disagreement(everyone: list[dict[str, Any]]) -> Off:
    """ON when every rank may run the kernels with the same configuration."""
    for r, theirs in enumerate(everyone):
        if theirs["disabled"] != "none":
            return "disabled", f"rank {r} is disabled ({theirs['disabled']})"
    for key in everyone[0]:
        for r, theirs in enumerate(everyone):
            if theirs[key] != everyone[0][key]:
                return "disabled", (
                    f"ranks disagree on {key}: rank {r} has {theirs[key]!r}, "
                    f"rank 0 has {everyone[0][key]!r}"
                )
    return ON
