"""PcieAllReduce: the communicator a serving engine holds for its tensor-parallel group.

It answers ``should_use(t)`` / ``decline_reason(t)``, runs ``all_reduce(t)`` on the kernels when
they are admitted and chosen by the tuning table, and on the group's own all-reduce otherwise,
so the result is always the correct sum. Construction and ``destroy()`` are collective.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
import socket
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import tuning
from .native import _C
from .env import parse_transport, read_env
from .bootstrap import Bootstrap
from .errors import PcieAllReduceTimeout
from .plan import island_map

logger = logging.getLogger("pcie_allreduce")

DEFAULT_ROWS = 64
DEFAULT_HIDDEN = 8192


def _whole(name: str, value: Any) -> int:
    """``value`` as an int when it is a whole number: an int (or numpy integer), or a float
    with no fraction; bool and 1024.5 are not."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            if isinstance(value, float) and value.is_integer():
                return int(value)
    raise ValueError(f"{name} must be a whole number, got {value!r}")


def resolve_max_numel(
    max_numel: Optional[int], hidden: Optional[int], max_rows: Optional[int]
) -> int:
    """explicit max_numel > PCIE_ALLREDUCE_MAX_NUMEL > max_rows x hidden > 64 rows (warned)."""
    if max_numel is not None:
        value = _whole("max_numel", max_numel)
        if value <= 0 or value % 8 != 0:
            raise ValueError(f"max_numel must be a positive multiple of 8, got {max_numel!r}")
        return value
    from_env = read_env().max_numel
    if from_env is not None:
        return from_env
    for name, value in (("hidden", hidden), ("max_rows", max_rows)):
        if value is not None and _whole(name, value) <= 0:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if hidden is not None and max_rows is not None:
        return int(hidden) * int(max_rows)
    rows = DEFAULT_ROWS
    width = int(hidden) if hidden is not None else DEFAULT_HIDDEN
    logger.warning(
        "pcie_allreduce: no max_numel given; sizing the workspace for %d rows x %d hidden = %d "
        "elements (pass max_numel, or hidden and max_rows = decode batch x draft tokens)",
        rows,
        width,
        rows * width,
    )
    return rows * width


def resolve_timeout(timeout_s: Optional[float], from_env: float) -> float:
    """The constructor's timeout_s under the same rule as PCIE_ALLREDUCE_TIMEOUT_S."""
    if timeout_s is None:
        return from_env
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
        0 <= timeout_s < math.inf
    ):
        raise ValueError(
            f"timeout_s must be a finite number of seconds >= 0 (0 waits forever), got "
            f"{timeout_s!r}"
        )
    return float(timeout_s)


def _read_text(path: str, what: str) -> str:
    """A table file's text, or an error naming the file and what was expected."""
    file = Path(path)
    if not file.is_file():
        problem = "is a directory" if file.is_dir() else "does not exist"
        raise FileNotFoundError(f"{what} {path!r} {problem}; expected a tuning-table CSV file")
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{what} {path!r} is not a text tuning table (not UTF-8 at byte {error.start})"
        ) from None


def _read_table(table: Optional[str]) -> tuple[str, str]:
    """(csv text, source name) from a table argument or PCIE_ALLREDUCE_TABLE; ('', 'embedded').

    ``table`` is CSV text when it holds a newline or a comma, else a path to a CSV file. A
    given table is parsed here, so its errors (no rows, a bad field) raise on this rank
    before it exchanges anything."""
    if table is None:
        table = read_env().table
        if table is None:
            return "", "embedded seed table"
        text, source = _read_text(table, "PCIE_ALLREDUCE_TABLE"), f"PCIE_ALLREDUCE_TABLE {table}"
    elif not isinstance(table, str) or table.strip() == "":
        raise ValueError(
            f"table must be CSV text or a path to a CSV file, got {table!r} (pass None for "
            "PCIE_ALLREDUCE_TABLE or the embedded seed table)"
        )
    elif "\n" not in table and "," not in table:
        text, source = _read_text(table, "table file"), f"table file {table}"
    else:
        text, source = table, "table argument"
    _C.TuningTable.parse(text, source)
    return text, source


def host_identity() -> str:
    """Which machine (and which boot of it) this process runs on: ranks that differ here cannot
    share memory, so the group stays on its own all-reduce (``multi_host``)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def _cpu_group_for(group: Any, cpu_group: Any) -> Any:
    if cpu_group is not None:
        return cpu_group
    if dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


class PcieAllReduce:
    """All-reduce for one process group on PCIe-only hosts.

    Args:
        group: the process group (NCCL for CUDA tensors, gloo for CPU tensors).
        device: ``cpu`` (host shared-memory transport) or a CUDA device.
        max_numel: workspace capacity in elements; fixed for the communicator's life.
        table: tuning table as CSV text or a path. Without one: PCIE_ALLREDUCE_TABLE, else
            this host's tuning cache (written by ``tune()``), else the embedded seed table;
            ``stats()["table_source"]`` names the one in use.
        cpu_group: a gloo group over the same ranks for bootstrapping (made if needed; making
            one is an unbounded torch collective, so engines pass the one they have).
        islands: ranks grouped by socket, overriding the probe (CPU tensors: NUMA nodes).
        transport: CUDA tensors only: ``"auto"`` (peer-to-peer; when the P2P check fails on
            any pair, every workspace moves to shared pinned host memory), ``"p2p"`` (decline
            ``no_p2p`` instead) or ``"hostmem"`` (always host memory). None:
            PCIE_ALLREDUCE_TRANSPORT, else auto. ``stats()["transport"]`` says which runs
            (``cuda``: P2P, ``cuda_host``: host memory, ``host``: CPU tensors) and
            ``stats()["transport_detail"]`` why.
    """

    def __init__(
        self,
        group: Any = None,
        device: Union[str, torch.device, int] = "cpu",
        *,
        max_numel: Optional[int] = None,
        table: Optional[str] = None,
        cpu_group: Any = None,
        hidden: Optional[int] = None,
        max_rows: Optional[int] = None,
        dtypes: Sequence[str] = ("bf16", "fp16", "fp32"),
        timeout_s: Optional[float] = None,
        topology: Optional[Any] = None,
        islands: Optional[Sequence[Sequence[int]]] = None,
        initial_generation: int = 0,
        enabled: bool = True,
        transport: Optional[str] = None,
    ) -> None:
        env = read_env()
        self._mode = env.transport if transport is None else parse_transport(transport,
                                                                             "transport")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device) if not isinstance(device, int) else torch.device(
            "cuda", device
        )
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if transport is not None and self._mode != "auto" and self.device.type != "cuda":
            raise ValueError(
                f"transport={transport!r} chooses how GPUs reach each other; this communicator "
                f"is on {self.device} (CPU tensors use POSIX shared memory): pass transport=None")
        self.max_numel = resolve_max_numel(max_numel, hidden, max_rows)
        self.timeout_s = resolve_timeout(timeout_s, env.timeout_s)
        if self.device.type == "cpu" and env.host_reduce is not None:
            # Process-wide and rank-local: every kernel set gives the same bits.
            try:
                _C.set_host_reduce_isa(env.host_reduce)
            except ValueError as e:
                raise ValueError(f"PCIE_ALLREDUCE_HOST_REDUCE={env.host_reduce}: {e}") from None
        opts = self._options(env, table, dtypes, initial_generation)
        # Everything above is checked on this rank alone. Making a gloo group (when none is
        # given) is torch's collective and unbounded; every exchange after it is bounded.
        self._cpu_group = _cpu_group_for(self.group, cpu_group)
        self._boot = Bootstrap(self._cpu_group, self.timeout_s)
        off = ("none", "")
        if not enabled:
            off = ("disabled", "constructed with enabled=False")
        elif env.enable is False:
            off = ("disabled", "PCIE_ALLREDUCE_ENABLE=0")
        off = self._meet(off)
        off = self._probe(opts, topology, islands, off)
        if opts.transport == "cuda_host" and opts.topology_key != "nvlink":
            opts.topology_key = tuning.HOSTMEM_KEY  # its own table rows and tuning cache
        self._set_fingerprint(opts)
        opts.disabled, opts.disabled_detail = self._handshake(opts, dtypes, off)
        self._take_table(opts)
        self._opts = opts
        self._comm = _C.Communicator(opts)
        self._transport_detail = _first_detail(opts.transport, self._mode, transport is None)
        if opts.transport == "host":
            self._connect()
        elif self._comm.enabled():
            why = self._connect_gpus()
            if why is not None and opts.transport == "cuda":
                self._after_p2p_failure(opts, why)
            elif why is not None:
                self._comm.disable("no_p2p", f"{why} ({self._transport_detail})")
        self.handle = _C.register_communicator(self._comm)
        # The op overloads, looked up once: torch.ops attribute lookups cost about a
        # microsecond per call, which is a third of a small CPU all-reduce.
        ops = torch.ops.pcie_allreduce
        self._op_out_of_place = ops.all_reduce.default
        self._op_in_place = ops.all_reduce_.default
        self._op_into = ops.all_reduce_into.default
        self._destroyed = False
        self._captures = 0
        if self.rank == 0:
            logger.info("pcie_allreduce: tuning table: %s", self._table_source)

    # ------------------------------------------------------------------ construction steps
    def _options(
        self, env: Any, table: Optional[str], dtypes: Sequence[str], initial_generation: int
    ) -> "_C.Options":
        """Everything this rank alone decides about the communicator."""
        opts = _C.Options()
        opts.rank = self.rank
        opts.world = self.world_size
        opts.max_numel = self.max_numel
        opts.dtypes = list(dtypes)
        if self.device.type != "cuda":
            opts.transport = "host"
        else:
            opts.transport = "cuda_host" if self._mode == "hostmem" else "cuda"
        opts.device = self.device.index if self.device.type == "cuda" else -1
        opts.timeout_s = self.timeout_s
        opts.initial_gen = int(initial_generation) & 0xFFFFFFFF
        opts.table_text, opts.table_source = _read_table(table)
        self._dtypes = list(dtypes)
        self._table_given = bool(opts.table_text)
        opts.group_name = self.group.group_name
        opts.log_level = env.log_level
        return opts

    def _set_fingerprint(self, opts: "_C.Options") -> None:
        """What this group's tuning cache is valid for (transport, topology key, GPUs)."""
        self._fingerprint_fields = tuning.fingerprint_fields(
            opts.transport, self.world_size, opts.topology_key, list(opts.island_of),
            self._devices, self._driver, self._links,
        )
        self._fingerprint = tuning.fingerprint(self._fingerprint_fields)

    def _take_table(self, opts: "_C.Options") -> None:
        """Remembers the table the communicator is built with (its text and where it came from)."""
        self._table_text = opts.table_text or _C.TuningTable.embedded_text()
        self._table_source = opts.table_source

    def _meet(self, off: Tuple[str, str]) -> Tuple[str, str]:
        """The first exchange: every rank arrives (or is named), and ranks on different
        machines turn the backend off before anything tries to share memory with a peer."""
        met = self._boot.gather(
            {"host": host_identity(), "id": int.from_bytes(os.urandom(6), "little")}, "meet"
        )
        self._id = met[0]["id"]  # rank 0's: names this communicator in destroy()'s farewell
        hosts = [m["host"] for m in met]
        if off[0] == "none" and len(set(hosts)) > 1:
            other = next(r for r, h in enumerate(hosts) if h != hosts[0])
            return "multi_host", (
                f"rank 0 runs on {hosts[0]} and rank {other} on {hosts[other]}: shared memory "
                "needs one host, so this group keeps its own all-reduce"
            )
        return off

    def _probe(
        self,
        opts: "_C.Options",
        topology: Optional[Any],
        islands: Optional[Sequence[Sequence[int]]],
        off: Tuple[str, str],
    ) -> Tuple[str, str]:
        """Topology key and islands (collective on CUDA: every rank names its GPU); NVLink
        hosts turn the backend off. Returns the (reason, detail) the backend is off for."""
        opts.topology_key, opts.island_of = "host", island_map(self.world_size, islands)
        self._devices, self._driver, self._links = tuning.host_devices(), "", ""
        if self.device.type != "cuda" or off[0] == "multi_host":
            return off
        self._devices = [torch.cuda.get_device_name(self.device)] * self.world_size
        if islands is not None:
            opts.topology_key = _C.Topology.from_islands([list(i) for i in islands]).table_key()
            return off
        from .topology import probe_cuda_group

        probe = probe_cuda_group(self._boot.gather, self.device, topology)
        opts.topology_key, opts.island_of = probe.table_key, probe.island_of
        self._devices, self._driver = probe.devices or self._devices, probe.driver
        self._links = probe.links
        if probe.decline is not None and off[0] == "none":
            return probe.decline, probe.detail
        return off

    def _handshake(
        self, opts: "_C.Options", dtypes: Sequence[str], off: Tuple[str, str]
    ) -> Tuple[str, str]:
        """Every rank must agree on everything that decides a call's path, or they deadlock:
        a disagreement (or any rank being off) turns the backend off on every rank."""
        mine = {
            "world": self.world_size,
            "max_numel": self.max_numel,
            "dtypes": sorted(dtypes),
            "transport": opts.transport,
            "transport_mode": self._mode if self.device.type == "cuda" else "host",
            # A given table is compared by hash; without one, every rank takes rank 0's
            # reading of the host's cache (a file another server may be writing right now).
            "table_hash": _C.TuningTable.parse(opts.table_text, opts.table_source).hash()
            if self._table_given
            else "cache or seed",
            "topology": opts.topology_key,
            "island_of": list(opts.island_of),
            "timeout_s": self.timeout_s,
            "disabled": off[0],
        }
        if self.rank == 0 and not self._table_given:
            mine["cache"] = self._read_cache()
        everyone: List[Dict[str, Any]] = self._boot.gather(mine, "handshake")
        cache = everyone[0].pop("cache", None)
        if cache is not None and all(e["table_hash"] == "cache or seed" for e in everyone):
            opts.table_text, opts.table_source = cache["text"], cache["source"]
        return off if off[0] != "none" else _disagreement(everyone)

    def _read_cache(self) -> Optional[Dict[str, str]]:
        """Rank 0's reading of this host's tuning cache: the table, or None (a file that
        exists but cannot be used is reported and ignored; the next tune replaces it)."""
        found = tuning.read_cache(tuning.cache_path(self._fingerprint), self._fingerprint)
        if found.problem is not None:
            logger.warning("pcie_allreduce: ignoring the tuning cache %s: %s; using the seed "
                           "table until `pcie-allreduce tune` replaces it", found.path,
                           found.problem)
        if found.text is None:
            return None
        return {"text": found.text, "source": f"cache {found.path}"}

    def _connect(self) -> None:
        """Every rank maps every peer's workspace, then drops what let peers find its own."""
        tokens = self._boot.gather_bytes(self._comm.local_token(), "connect")
        self._comm.connect(tokens)
        self._boot.barrier("connected")
        self._comm.retire_token()

    def _connect_gpus(self) -> Optional[str]:
        """Every rank maps every peer's workspace and writes into it. None when every pair
        works; else why not, the same text on every rank (a failure is gathered, not raised,
        so that every rank takes the same next step)."""
        tokens = self._boot.gather_bytes(self._comm.local_token(), "connect")
        try:
            self._comm.connect(tokens)
            mine = None
        except (RuntimeError, ValueError) as error:
            mine = str(error)
        errors: List[Optional[str]] = self._boot.gather(mine, "connected")
        self._comm.retire_token()
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, error = failed[0]
            return f"rank {r} cannot map its peers' workspaces ({error})"
        broken = self._broken_pairs()
        if broken:
            pairs = ", ".join(f"rank {s} -> rank {d}" for s, d in broken[:8])
            return f"peer writes did not arrive intact ({pairs})"
        return None

    def _broken_pairs(self) -> List[Tuple[int, int]]:
        """The write-and-verify (collective): every rank writes a pattern into every peer's
        workspace with the kernels' own stores and checks what arrived, because drivers report
        P2P that does not work. Returns the (writer, reader) pairs that failed."""
        nonce = int.from_bytes(os.urandom(4), "little")
        nonce = self._boot.gather(nonce, "p2p check")[0]  # rank 0's
        self._comm.probe_write(nonce)
        self._boot.barrier("p2p written")
        everyone: List[List[int]] = self._boot.gather(self._comm.probe_read(nonce), "p2p read")
        return [(src, dst) for dst, sources in enumerate(everyone) for src in sources]

    def _after_p2p_failure(self, opts: "_C.Options", why: str) -> None:
        """P2P failed on some pair (every rank knows the same ``why``): move every workspace to
        shared pinned host memory (the cuda_host transport), or, with transport ``p2p``,
        decline ``no_p2p``. Collective."""
        if self._mode == "p2p":
            self._comm.disable(
                "no_p2p",
                f"{why}; check the IOMMU/ACS settings of the PCIe path between those GPUs "
                "(transport p2p: host memory was not tried)",
            )
            self._transport_detail = f"peer-to-peer failed: {why}"
            return
        self._comm.close_peers()
        self._boot.barrier("p2p closed")
        self._comm.release()
        opts.transport, opts.topology_key = "cuda_host", tuning.HOSTMEM_KEY
        self._set_fingerprint(opts)
        if not self._table_given:  # this host's cache for the new transport, as rank 0 reads it
            cache = self._boot.gather(self._read_cache() if self.rank == 0 else None,
                                      "host memory table")[0]
            opts.table_text, opts.table_source = (
                (cache["text"], cache["source"]) if cache else ("", "embedded seed table"))
            self._take_table(opts)
        self._comm = _C.Communicator(opts)
        self._transport_detail = (
            f"peer-to-peer failed: {why}; every workspace is in shared pinned host memory")
        again = self._connect_gpus()
        if again is not None:
            self._comm.disable("no_p2p", f"{why}; host memory failed too: {again}")
            self._transport_detail = f"peer-to-peer and host memory failed: {again}"
        elif self.rank == 0:
            logger.warning("pcie_allreduce: %s (transport cuda_host; "
                           "PCIE_ALLREDUCE_TRANSPORT=p2p declines instead)",
                           self._transport_detail)

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return bool(self._comm.enabled())

    @property
    def disabled_reason(self) -> Optional[str]:
        reason = self._comm.disabled_reason()
        if reason is None:
            return None
        return f"{reason}: {self._comm.disabled_detail()}"

    @property
    def workspace_bytes(self) -> int:
        return int(self._comm.workspace_bytes())

    def decline_reason(self, t: torch.Tensor) -> Optional[str]:
        """None when the kernels would run ``t``; else the reason code (see stats())."""
        return self._comm.decline_reason(t)

    def supports(self, t: torch.Tensor) -> Optional[str]:
        """None when the kernels *can* run ``t`` (whatever the table prefers)."""
        return self._comm.supports(t)

    def should_use(self, t: torch.Tensor) -> bool:
        return self.decline_reason(t) is None

    def chosen_tactic(self, t: torch.Tensor) -> str:
        return str(self._comm.chosen_tactic(t))

    def stats(self) -> Dict[str, Any]:
        s = dict(self._comm.stats())
        s["table_source"] = self._table_source
        s["transport"] = self._opts.transport
        s["transport_detail"] = self._transport_detail
        s["captures"] = self._captures
        s["fingerprint"] = self._fingerprint
        s["workspace_bytes"] = self.workspace_bytes
        s["enabled"] = self.enabled
        s["disabled_reason"] = self.disabled_reason
        if self.device.type == "cpu":
            s["host_reduce"] = _C.host_reduce_isa()
        return s

    def failure(self) -> Optional[Dict[str, Any]]:
        return self._comm.failure()

    # ------------------------------------------------------------------ before capture
    def prepare(self, hidden: Optional[int] = None, max_rows: Optional[int] = None
                ) -> Dict[str, Any]:
        """Gets ready for graph capture: installs every program the table can pick for an
        admitted message, so nothing is installed inside a capture. With ``hidden`` and
        ``max_rows`` (decode batch x draft tokens), says once if the workspace (fixed at
        construction) is smaller than that, in which case the larger messages go to the
        fallback. Returns ``{"max_numel", "programs", "rows_covered"}``."""
        rows = None
        if hidden is not None or max_rows is not None:
            if hidden is None or max_rows is None:
                raise ValueError("prepare(hidden, max_rows): give both or neither")
            hidden, max_rows = _whole("hidden", hidden), _whole("max_rows", max_rows)
            if hidden <= 0 or max_rows <= 0:
                raise ValueError(f"prepare(hidden={hidden}, max_rows={max_rows}): expected "
                                 "positive whole numbers")
            rows = self.max_numel // hidden
            if rows < max_rows and self.rank == 0 and self.enabled:
                logger.warning(
                    "pcie_allreduce: the workspace holds %d elements = %d rows of %d; batches "
                    "of %d..%d rows go to the fallback (size it with max_numel or "
                    "PCIE_ALLREDUCE_MAX_NUMEL)", self.max_numel, rows, hidden, rows + 1,
                    max_rows)
        return {"max_numel": self.max_numel, "programs": int(self._comm.prepare()),
                "rows_covered": rows}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Brackets an engine's CUDA-graph capture (vLLM's ``graph_capture()`` enters it):
        prepares first, refuses ``tune()`` inside, and counts captured calls apart
        (``stats()["captures"]``). Calls captured in a graph replay on the stream the graph is
        launched on; ordering that stream is the caller's, as for any captured kernel."""
        if getattr(self, "_destroyed", True):
            raise RuntimeError("capture() on a destroyed PcieAllReduce")
        self.prepare()
        self._captures += 1
        with tuning.autotune_pass("pcie_allreduce graph capture"):
            yield

    # ------------------------------------------------------------------ tuning
    def tune(
        self,
        *,
        dtypes: Optional[Sequence[str]] = None,
        max_bytes: Optional[int] = None,
        budget_s: float = 120.0,
        force: bool = False,
        progress: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Measures every runnable tactic and the fallback on this host and writes the cache
        (collective). Without ``force`` a valid cache is loaded instead and nothing is
        measured. See :func:`pcie_allreduce.tuning.tune` for the report."""
        if getattr(self, "_destroyed", True):
            raise RuntimeError("tune() on a destroyed PcieAllReduce")
        return tuning.tune(self, dtypes=dtypes, max_bytes=max_bytes, budget_s=budget_s,
                           force=force, progress=progress)

    def _install_table(self, text: str, source: str) -> None:
        """Every rank installs the same table between the same two calls (the tuner)."""
        self._comm.set_table(text, source)
        changed = source != self._table_source
        self._table_text, self._table_source = text, source
        if self.rank == 0 and changed:
            logger.info("pcie_allreduce: tuning table: %s", source)

    # ------------------------------------------------------------------ the call
    def all_reduce(self, t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The sum of ``t`` over the group: kernels when admitted, the fallback otherwise.

        Raises PcieAllReduceTimeout (with the diagnostic) when a peer never arrived or
        disagreed about the call."""
        if out is None:
            return self._op_out_of_place(t, self.handle)
        self._op_into(t, self.handle, out)
        return out

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: no allocation (the lightest call; CPU tensors wait for peers without the
        GIL, like every torch op)."""
        self._op_in_place(t, self.handle)
        return t

    def synchronize(self) -> None:
        """Waits for the device; a kernel that timed out raises PcieAllReduceTimeout here."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as error:
                # A kernel that timed out traps, and CUDA reports only that it died: the
                # diagnostic it left in mapped host memory says why.
                diagnostic = self._comm.failure()
                if diagnostic is None:
                    raise
                raise PcieAllReduceTimeout(diagnostic["message"], diagnostic) from error
        self._comm.raise_if_failed()

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Collective and idempotent: call on every rank before destroying the process group."""
        if getattr(self, "_destroyed", True):
            return
        self._destroyed = True
        _C.unregister_communicator(self.handle)
        failed = self._comm.failure() is not None
        self._comm.close_peers()
        try:
            # No peer may still use our workspace when we free it, but a rank that failed
            # knows a peer did too (it may be gone): it tells the others and waits for nobody.
            self._boot.farewell(self._id, failed)
        except PcieAllReduceTimeout as error:
            logger.warning("pcie_allreduce: destroy() did not wait for every peer: %s", error)
        finally:
            self._comm.release()

    def __enter__(self) -> "PcieAllReduce":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else f"disabled ({self.disabled_reason})"
        return (
            f"PcieAllReduce(rank={self.rank}, world={self.world_size}, device={self.device}, "
            f"max_numel={self.max_numel}, {state})"
        )


def _first_detail(transport: str, mode: str, from_env: bool) -> str:
    """stats()["transport_detail"] before any peer is reached."""
    if transport == "host":
        return "CPU tensors: every workspace in POSIX shared memory"
    if transport == "cuda_host":
        source = "PCIE_ALLREDUCE_TRANSPORT=hostmem" if from_env else "transport='hostmem'"
        return f"{source}: every workspace in shared pinned host memory"
    return ("peer-to-peer: every peer's GPU memory mapped with CUDA IPC" +
            (" (transport p2p)" if mode == "p2p" else ""))


def _disagreement(everyone: List[Dict[str, Any]]) -> tuple[str, str]:
    """('none', '') when every rank may run the kernels with the same configuration."""
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
    return "none", ""
