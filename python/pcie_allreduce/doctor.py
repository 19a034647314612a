"""`pcie-allreduce doctor`: can this backend run on this box, and if not, why not.

An inference-server operator runs it once per host. It gathers, in order:

1. the GPUs and their topology (NVML when ``pynvml`` imports, else ``nvidia-smi``), the NUMA
   node of every GPU, its islands and any NVLink pair;
2. a real peer write-and-verify for every ordered GPU pair, in a subprocess (a faulting peer
   write must not kill the doctor), cached per driver and set of GPUs; it always tests
   peer-to-peer (transport="p2p"), whatever PCIE_ALLREDUCE_TRANSPORT says;
3. the transport a communicator would use (PCIE_ALLREDUCE_TRANSPORT): peer-to-peer (``cuda``),
   or shared pinned host memory (``cuda_host``) when P2P failed on some pair in auto mode or
   host memory is forced; a P2P failure only blocks with PCIE_ALLREDUCE_TRANSPORT=p2p;
4. IOMMU/ACS hints from the kernel command line and the IOMMU groups (never fatal);
5. which tuning table a communicator would use here (for the transport it would use), and
   whether this host has a cache;
6. without GPUs: a real world-2 all-reduce on the host shared-memory transport;

and ends with one verdict line. Exit status: 0 when the backend can run here, 1 when it
cannot, 2 for a usage error (a bad ``--fixture`` directory).

Every read of the machine (NVML, nvidia-smi, sysfs, /proc, the environment, subprocesses) goes
through a :class:`System`, so ``--fixture DIR`` can replay a recorded host instead
(:class:`FixtureSystem`; the format is described in tests/python/fixtures/doctor/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .native import _C
from . import plan as plan_mod
from . import tuning
from .env import parse_transport
from .topology import run_nvidia_smi

MAX_WORLD = 8  # the kernels serve groups of 2..8 ranks
P2P_RANK_TIMEOUT_S = 60.0  # one rank's construction (gloo rendezvous, exchanges, the check)
P2P_TIMEOUT_S = 240.0  # the whole P2P subprocess: 8 ranks importing torch and initialising CUDA
HOST_TIMEOUT_S = 120.0  # the host-transport bench subprocess
P2P_RESULT_TAG = "P2P_RESULT "
P2P_CACHE_VERSION = 1
_REPORTED_PAIRS_CAP = 8  # _verify_p2p names at most this many broken pairs
# The test subprocesses choose their own transport (the P2P test passes transport="p2p"); a
# bad PCIE_ALLREDUCE_TRANSPORT is reported by the doctor itself, not as a crashed test.
_PROBE_ENV_DROP = ("CUDA_VISIBLE_DEVICES", "PCIE_ALLREDUCE_ENABLE", "PCIE_ALLREDUCE_TABLE",
                   "PCIE_ALLREDUCE_TRANSPORT")
_HOSTMEM_COST = ("slower per call than P2P (every flag poll is a PCIe round trip to host "
                 "memory)")

# nvmlDeviceGetTopologyCommonAncestor levels -> the classes of `nvidia-smi topo -m`.
_NVML_LEVEL_CLASS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class FixtureError(ValueError):
    """A --fixture directory that cannot be replayed (a usage error: exit status 2)."""


# ---------------------------------------------------------------------------- the system


@dataclass
class RunResult:
    """What a subprocess left behind: exit code (None when it was killed for the timeout)."""

    returncode: Optional[int]
    output: str
    timed_out: bool = False


@dataclass
class RawInventory:
    """GPUs as a probe found them, before the topology text is parsed."""

    probe: str  # "nvml", "nvidia-smi", "torch"
    names: List[str]
    bus_ids: List[str]
    driver: str
    topo_text: Optional[str]
    problems: List[str] = field(default_factory=list)


class System:
    """Everything the doctor reads from the machine. Subclasses: live or a recorded fixture."""

    label = "system"
    env: Mapping[str, str]  # the environment the doctor and its subprocesses see

    def nvml_inventory(self) -> Optional[RawInventory]:
        return None

    def nvidia_smi(self, args: Sequence[str]) -> Optional[str]:
        """stdout of ``nvidia-smi <args>``, or None when it is missing or fails."""
        raise NotImplementedError

    def cuda_device_names(self) -> List[str]:
        """The GPUs torch sees (the last resort when neither NVML nor nvidia-smi answers)."""
        return []

    def numa_node(self, bus_id: str) -> Optional[int]:
        raise NotImplementedError

    def kernel_cmdline(self) -> Optional[str]:
        raise NotImplementedError

    def iommu_groups(self) -> Optional[List[str]]:
        """One entry per IOMMU group: its domain type ("DMA", "identity", ...) or "" if
        unknown; None when the listing itself is unavailable."""
        raise NotImplementedError

    def cache_dir(self) -> Path:
        return tuning.cache_dir(self.env)

    def resolve(self, path: str) -> Path:
        """A path named by the environment (PCIE_ALLREDUCE_TABLE)."""
        return Path(path).expanduser()

    def host_devices(self) -> List[str]:
        raise NotImplementedError

    def recorded_p2p(self) -> Optional[Dict[str, Any]]:
        """A recorded P2P result (fixtures only); None: run the test."""
        return None

    def recorded_host_transport(self) -> Optional[Dict[str, Any]]:
        return None

    def can_run_tests(self) -> bool:
        """Whether this system may start GPU or shared-memory test subprocesses."""
        return False

    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> RunResult:
        raise NotImplementedError


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


class LiveSystem(System):
    """This machine."""

    label = "this machine"

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self.env = dict(os.environ if env is None else env)

    def nvml_inventory(self) -> Optional[RawInventory]:
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            return None
        try:
            return nvml_inventory(pynvml)
        except Exception:  # no driver, an old NVML without a call: fall back to nvidia-smi
            return None

    def nvidia_smi(self, args: Sequence[str]) -> Optional[str]:
        return run_nvidia_smi(list(args))

    def cuda_device_names(self) -> List[str]:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]

    def numa_node(self, bus_id: str) -> Optional[int]:
        return _int_or_none(_read(Path("/sys/bus/pci/devices") / bus_id / "numa_node"))

    def kernel_cmdline(self) -> Optional[str]:
        return _read(Path("/proc/cmdline"))

    def iommu_groups(self) -> Optional[List[str]]:
        root = Path("/sys/kernel/iommu_groups")
        if not root.is_dir():
            return None
        groups = sorted(root.iterdir(), key=lambda p: p.name)
        return [(_read(g / "type") or "").strip() for g in groups]

    def host_devices(self) -> List[str]:
        return tuning.host_devices()

    def can_run_tests(self) -> bool:
        return True

    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> RunResult:
        return run_bounded(argv, timeout_s, env)


def run_bounded(argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> RunResult:
    """Runs argv in its own session; on timeout kills that session (the ranks it spawned too)."""
    proc = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(env), start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return RunResult(proc.returncode, out or "")
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return RunResult(None, out or "", timed_out=True)


class FixtureSystem(System):
    """A recorded host: files in a directory stand in for nvidia-smi, sysfs and /proc."""

    KNOWN = ("nvidia_smi_topo.txt", "query_gpu.csv", "cmdline", "iommu_groups", "numa_nodes",
             "p2p.json", "host_transport.json", "env", "host_devices")

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FixtureError(f"--fixture {str(root)!r} is not a directory")
        if not any((self.root / name).exists() for name in self.KNOWN):
            raise FixtureError(
                f"--fixture {str(root)!r} holds none of the recorded files "
                f"({', '.join(self.KNOWN)}); see tests/python/fixtures/doctor/README.md"
            )
        self.label = f"fixture {self.root}"
        self.env = self._key_values("env")
        self._numa = self._numa_nodes()

    def _text(self, name: str) -> Optional[str]:
        path = self.root / name
        if not path.exists():
            return None
        text = _read(path)
        if text is None:
            raise FixtureError(f"fixture file {str(path)!r} is unreadable or not UTF-8")
        return text

    def _json(self, name: str) -> Optional[Dict[str, Any]]:
        text = self._text(name)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise FixtureError(f"fixture file {name}: not JSON ({error})") from None
        if not isinstance(value, dict):
            raise FixtureError(f"fixture file {name}: expected a JSON object")
        return value

    def _key_values(self, name: str) -> Dict[str, str]:
        pairs = {}
        for line in (self._text(name) or "").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, sep, value = line.partition("=")
                if not sep:
                    raise FixtureError(f"fixture file {name}: expected KEY=VALUE, got {line!r}")
                pairs[key.strip()] = value.strip()
        return pairs

    def _numa_nodes(self) -> Dict[str, int]:
        nodes = {}
        for line in (self._text("numa_nodes") or "").splitlines():
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            node = _int_or_none(words[-1]) if len(words) == 2 else None
            if node is None:
                raise FixtureError(f"fixture file numa_nodes: expected '<bus id> <node>', "
                                   f"got {line!r}")
            nodes[sysfs_bus_id(words[0])] = node
        return nodes

    def nvidia_smi(self, args: Sequence[str]) -> Optional[str]:
        if list(args) == ["topo", "-m"]:
            return self._text("nvidia_smi_topo.txt")
        if args and args[0].startswith("--query-gpu="):
            return self._text("query_gpu.csv")
        return None

    def numa_node(self, bus_id: str) -> Optional[int]:
        return self._numa.get(sysfs_bus_id(bus_id))

    def kernel_cmdline(self) -> Optional[str]:
        return self._text("cmdline")

    def iommu_groups(self) -> Optional[List[str]]:
        text = self._text("iommu_groups")
        if text is None:
            return None
        lines = [ln.split() for ln in text.splitlines()
                 if ln.strip() and not ln.lstrip().startswith("#")]
        if len(lines) == 1 and len(lines[0]) == 1 and lines[0][0].isdigit():
            return [""] * int(lines[0][0])  # a bare count
        return [words[1] if len(words) > 1 else "" for words in lines]

    def cache_dir(self) -> Path:
        given = self.env.get("PCIE_ALLREDUCE_CACHE_DIR", "").strip()
        return self.resolve(given) if given else self.root / "cache"

    def resolve(self, path: str) -> Path:
        return self.root / Path(path).expanduser()  # an absolute path stays absolute

    def host_devices(self) -> List[str]:
        listed = [ln.strip() for ln in (self._text("host_devices") or "").splitlines()]
        return [d for d in listed if d] or ["recorded host"]

    def recorded_p2p(self) -> Optional[Dict[str, Any]]:
        return self._json("p2p.json")

    def recorded_host_transport(self) -> Optional[Dict[str, Any]]:
        return self._json("host_transport.json")


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(str(text).strip())
    except ValueError:
        return None


def sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's 00000000:41:00.0 (or 41:00.0) as sysfs names it: 0000:41:00.0."""
    parts = bus_id.strip().lower().split(":")
    try:
        if len(parts) == 3:
            return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
        if len(parts) == 2:
            return f"0000:{parts[0]}:{parts[1]}"
    except ValueError:
        pass
    return bus_id.strip().lower()


# ---------------------------------------------------------------------------- GPU inventory


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_inventory(nvml: Any) -> RawInventory:
    """Names, bus ids, driver and a `nvidia-smi topo -m`-style matrix from NVML."""
    nvml.nvmlInit()
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        names = [_text(nvml.nvmlDeviceGetName(h)) for h in handles]
        buses = [sysfs_bus_id(_text(nvml.nvmlDeviceGetPciInfo(h).busId)) for h in handles]
        links = _nvlink_counts(nvml, handles, buses)
        classes = [
            [
                "X" if i == j else f"NV{links[i][j]}" if links[i][j] else
                _NVML_LEVEL_CLASS.get(int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)), "SYS")
                for j, b in enumerate(handles)
            ]
            for i, a in enumerate(handles)
        ]
    finally:
        nvml.nvmlShutdown()
    return RawInventory("nvml", names, buses, driver, topo_text_from_classes(classes))


def _nvlink_counts(nvml: Any, handles: List[Any], buses: List[str]) -> List[List[int]]:
    """Active NVLinks between every GPU pair; GPUs that both reach an NVSwitch count as linked."""
    n = len(handles)
    index_of = {bus: i for i, bus in enumerate(buses)}
    counts = [[0] * n for _ in range(n)]
    to_switch = [0] * n
    error = getattr(nvml, "NVMLError", Exception)
    for i, handle in enumerate(handles):
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = sysfs_bus_id(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
                                            .busId))
            except error:
                break  # NOT_SUPPORTED: a PCIe-only GPU has no links at all
            j = index_of.get(remote)
            if j is None:
                to_switch[i] += 1
            else:
                counts[i][j] += 1
    for i in range(n):
        for j in range(n):
            if i != j and to_switch[i] and to_switch[j]:
                counts[i][j] = max(counts[i][j], min(to_switch[i], to_switch[j]))
    return [[max(counts[i][j], counts[j][i]) for j in range(n)] for i in range(n)]


def topo_text_from_classes(classes: List[List[str]]) -> str:
    """A `nvidia-smi topo -m` matrix ("X" on the diagonal) that _C.Topology can parse."""
    n = len(classes)
    lines = ["\t" + "\t".join(f"GPU{i}" for i in range(n))]
    for i, row in enumerate(classes):
        lines.append(f"GPU{i}\t" + "\t".join(" X " if c == "X" else c for c in row))
    return "\n".join(lines) + "\n"


def parse_query_gpu(text: str) -> Tuple[List[str], List[str], str]:
    """(names, bus ids, driver) from `--query-gpu=index,name,pci.bus_id,driver_version`."""
    names, buses, drivers = [], [], []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4:
            continue
        names.append(", ".join(fields[1:-2]))
        buses.append(sysfs_bus_id(fields[-2]))
        drivers.append(fields[-1])
    return names, buses, (drivers[0] if drivers else "")


def raw_inventory(system: System) -> Optional[RawInventory]:
    """NVML, else nvidia-smi, else torch's device count (no topology); None: no GPU at all."""
    found = system.nvml_inventory()
    if found is not None and found.names:
        return found
    topo = system.nvidia_smi(["topo", "-m"])
    query = system.nvidia_smi(["--query-gpu=index,name,pci.bus_id,driver_version",
                               "--format=csv,noheader"])
    names, buses, driver = parse_query_gpu(query or "")
    if topo is not None or names:
        problems = [] if query else ["nvidia-smi --query-gpu gave nothing: GPU names, bus ids "
                                     "and driver version unknown"]
        return RawInventory("nvidia-smi", names, buses, driver, topo, problems)
    names = system.cuda_device_names()
    if names:
        return RawInventory("torch", names, [], "", None, [
            "neither NVML nor nvidia-smi answered: topology unknown (assumed one island) and "
            "NVLink cannot be ruled out"])
    return None


@dataclass
class Inventory:
    """The GPUs, their topology (None when it could not be read) and what went wrong."""

    probe: str
    gpus: List[Dict[str, Any]]
    driver: str
    topology: Optional[Any]
    problems: List[str]
    topology_error: Optional[str] = None  # `nvidia-smi topo -m` text that does not parse

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def island_of(self) -> List[int]:
        """The island map a communicator over all GPUs would use ([] when flat)."""
        if self.topology is None or len(self.topology.islands()) < 2:
            return []
        return list(self.topology.island_of())

    @property
    def table_key(self) -> str:
        return self.topology.table_key() if self.topology is not None else "flat"


def gather_inventory(system: System) -> Optional[Inventory]:
    raw = raw_inventory(system)
    if raw is None:
        return None
    problems = list(raw.problems)
    topology, topology_error = None, None
    if raw.topo_text is not None:
        try:
            topology = _C.Topology.from_nvidia_smi(raw.topo_text)
        except ValueError as error:
            topology_error = str(error)
            problems.append(f"could not parse `nvidia-smi topo -m`: {error}")
    count = topology.world if topology is not None else len(raw.names)
    if topology is not None and raw.names and len(raw.names) != count:
        problems.append(f"nvidia-smi lists {len(raw.names)} GPUs but its topology matrix has "
                        f"{count}; using the matrix")
    if topology is None and raw.topo_text is None and count >= 2:
        topology = _C.Topology.flat(count)
    gpus = [_gpu_entry(system, raw, topology, i) for i in range(count)]
    return Inventory(raw.probe, gpus, raw.driver, topology, problems, topology_error)


def _gpu_entry(system: System, raw: RawInventory, topology: Optional[Any],
               i: int) -> Dict[str, Any]:
    """Name, bus id and NUMA node (sysfs, else nvidia-smi's NUMA Affinity column)."""
    bus = raw.bus_ids[i] if i < len(raw.bus_ids) else None
    numa = system.numa_node(bus) if bus else None
    if (numa is None or numa < 0) and topology is not None and i < len(topology.numa_node):
        numa = topology.numa_node[i] if topology.numa_node[i] >= 0 else None
    name = raw.names[i] if i < len(raw.names) else "unknown"
    return {"index": i, "name": name, "bus_id": bus, "numa_node": numa}


def topology_report(inv: Inventory) -> Dict[str, Any]:
    topo = inv.topology
    if topo is None:
        return {"known": False}
    return {
        "known": True,
        "table_key": topo.table_key(),
        "islands": [list(i) for i in topo.islands()],
        "island_of": inv.island_of,
        "has_nvlink": topo.has_nvlink(),
        "nvlink_pairs": [list(p) for p in topo.nvlink_pairs()],
        "island_algorithms": topo.why_not_two_equal_islands() or "available",
        "links": [[topo.link(a, b) for b in range(topo.world)] for a in range(topo.world)],
    }


def describe_islands(topo: Any) -> str:
    sizes = [len(i) for i in topo.islands()]
    if len(sizes) == 1:
        return "one island"
    if len(set(sizes)) == 1:
        return f"{len(sizes)} islands of {sizes[0]}"
    return "islands of " + ", ".join(str(s) for s in sizes[:-1]) + f" and {sizes[-1]}"


# ---------------------------------------------------------------------------- P2P


def p2p_cache_key(driver: str, bus_ids: Sequence[str], names: Sequence[str]) -> str:
    fields = {"driver": driver, "bus_ids": sorted(bus_ids), "names": list(names),
              "version": P2P_CACHE_VERSION}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def p2p_cache_file(cache_dir: Path, inv: Inventory) -> Path:
    tested = inv.gpus[:MAX_WORLD]
    key = p2p_cache_key(inv.driver, [g["bus_id"] or "" for g in tested],
                        [g["name"] for g in tested])
    return cache_dir / f"p2p-{key}.json"


def pair_list(world: int) -> List[Tuple[int, int]]:
    return [(s, d) for s in range(world) for d in range(world) if s != d]


def parse_failing_pairs(reason: str) -> List[Tuple[int, int]]:
    """The ordered (writer, reader) pairs a ``no_p2p: ...`` disabled reason names."""
    return [(int(s), int(d)) for s, d in re.findall(r"rank (\d+) -> rank (\d+)", reason)]


def p2p_outcome(world: int, failing: Sequence[Sequence[int]], detail: str = "",
                truncated: bool = False) -> Dict[str, Any]:
    """Per ordered pair: "ok", "failed", or "unverified" (the failure list was cut short)."""
    bad = {(int(s), int(d)) for s, d in failing}
    unknown = "unverified" if truncated else "ok"
    pairs = [{"src": s, "dst": d, "status": "failed" if (s, d) in bad else unknown}
             for s, d in pair_list(world)]
    return {"status": "failed" if bad else "ok", "world": world,
            "failing": [list(p) for p in sorted(bad)], "pairs": pairs, "detail": detail,
            "truncated": truncated}


def interpret_p2p_run(world: int, run: RunResult, timeout_s: float) -> Dict[str, Any]:
    """A P2P subprocess's result: every pair ok, failing pairs, or why the test itself failed."""
    if run.timed_out:
        return _p2p_error(f"the P2P test did not finish within {timeout_s:g} s (a hung peer "
                          "write or a stuck rank); treat P2P as broken until it passes")
    result = None
    for line in run.output.splitlines():
        if line.startswith(P2P_RESULT_TAG):
            try:
                result = json.loads(line[len(P2P_RESULT_TAG):])
            except json.JSONDecodeError:
                result = None
    if not isinstance(result, dict):
        tail = " | ".join(run.output.strip().splitlines()[-3:]) or "no output"
        return _p2p_error(f"the P2P test crashed (exit code {run.returncode}): {tail}")
    if result.get("error"):
        return _p2p_error(f"the P2P test failed: {result['error']}")
    if result.get("enabled"):
        return p2p_outcome(world, [])
    reason = str(result.get("reason") or "")
    if reason.startswith("no_p2p:"):
        failing = parse_failing_pairs(reason)
        return p2p_outcome(world, failing, reason, len(failing) >= _REPORTED_PAIRS_CAP)
    return {"status": "inconclusive", "world": world, "failing": [], "pairs": [],
            "detail": f"the test communicator turned itself off for another reason: {reason}"}


def _p2p_error(detail: str) -> Dict[str, Any]:
    return {"status": "error", "failing": [], "pairs": [], "detail": detail}


def read_p2p_cache(path: Path, key_file: str) -> Optional[Dict[str, Any]]:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("file") != key_file:
        return None
    if cached.get("status") not in ("ok", "failed") or not isinstance(cached.get("pairs"), list):
        return None
    return cached


def write_p2p_cache(path: Path, result: Dict[str, Any]) -> None:
    """Caches a completed test (never a crash or timeout: those may be transient)."""
    record = {**result, "file": path.name, "tested_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the next run another test


P2PRunner = Callable[[int, float], RunResult]


def p2p_probe_command(world: int, rank_timeout_s: float) -> List[str]:
    code = ("import sys; from pcie_allreduce.doctor import p2p_probe_main; "
            "raise SystemExit(p2p_probe_main(int(sys.argv[1]), float(sys.argv[2])))")
    return [sys.executable, "-c", code, str(world), str(rank_timeout_s)]


def probe_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The test subprocesses see every GPU in nvidia-smi's (PCI bus) order, with the backend
    on and the embedded table, whatever this shell sets."""
    out = {k: v for k, v in env.items() if k not in _PROBE_ENV_DROP}
    out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return out


def check_p2p(system: System, inv: Inventory, *, skip: bool,
              runner: Optional[P2PRunner] = None,
              timeout_s: float = P2P_TIMEOUT_S) -> Dict[str, Any]:
    """Recorded result (fixtures), else the cache, else a test in a subprocess (unless skip)."""
    world = min(inv.count, MAX_WORLD)
    if world < 2:
        return {"status": "not_applicable", "detail": "fewer than 2 GPUs"}
    if inv.topology is not None and inv.topology.has_nvlink():
        return {"status": "skipped", "detail": "NVLink host: the backend declines before "
                "any peer write, so there is nothing to test"}
    if inv.topology_error is not None:
        return {"status": "skipped", "detail": "`nvidia-smi topo -m` does not parse, so no "
                "communicator can be constructed to test with"}
    recorded = system.recorded_p2p()
    if recorded is not None:
        return {**_recorded_p2p(recorded, world), "source": "recorded"}
    if not system.can_run_tests():
        return {"status": "not_tested", "detail": "the fixture records no P2P result"}
    cache_file = p2p_cache_file(system.cache_dir(), inv)
    cached = read_p2p_cache(cache_file, cache_file.name)
    if cached is not None:
        return {**cached, "source": "cached", "cache_file": str(cache_file)}
    if skip:
        return {"status": "not_tested", "detail": "--no-p2p-test given and no cached result"}
    if runner is None:
        def runner(w: int, t: float) -> RunResult:
            return system.run(p2p_probe_command(w, P2P_RANK_TIMEOUT_S), t, probe_env(system.env))
    result = interpret_p2p_run(world, runner(world, timeout_s), timeout_s)
    if result["status"] in ("ok", "failed"):
        write_p2p_cache(cache_file, result)
    return {**result, "source": "test", "cache_file": str(cache_file)}


def _recorded_p2p(recorded: Dict[str, Any], world: int) -> Dict[str, Any]:
    if recorded.get("error"):
        return _p2p_error(str(recorded["error"]))
    failing = recorded.get("failing", [])
    ok_shape = isinstance(failing, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and 0 <= x < world
                                                    for x in p) and p[0] != p[1]
        for p in failing)
    if not ok_shape:
        raise FixtureError(f"p2p.json: 'failing' must list [writer, reader] GPU pairs in "
                           f"0..{world - 1}, got {failing!r}")
    return p2p_outcome(world, failing, str(recorded.get("detail", "")),
                       bool(recorded.get("truncated", False)))


def _p2p_rank(rank: int, world: int, init_file: str, timeout_s: float, queue: Any) -> None:
    """One rank of the P2P test: constructing the communicator runs the write-and-verify.
    transport="p2p": a failed check declines no_p2p (auto would hide it by moving to host
    memory)."""
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        from .communicator import PcieAllReduce

        group = dist.group.WORLD
        ar = PcieAllReduce(group, torch.device("cuda", rank), max_numel=4096, cpu_group=group,
                           timeout_s=timeout_s, transport="p2p")
        if rank == 0:
            queue.put({"enabled": ar.enabled, "reason": ar.disabled_reason})
        ar.destroy()
        dist.destroy_process_group()
    except BaseException as error:  # the parent reports it; a rank must not hang the test
        queue.put({"error": f"rank {rank}: {type(error).__name__}: {error}"})
        raise


def p2p_probe_main(world: int, rank_timeout_s: float = P2P_RANK_TIMEOUT_S) -> int:
    """Entry point of the P2P subprocess: spawns the ranks, prints one P2P_RESULT line."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="pcie_ar_doctor.") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_p2p_rank, args=(r, world, init_file, rank_timeout_s, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + rank_timeout_s * 2
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in stuck:
            procs[r].kill()
            procs[r].join(5)
    messages = []
    while not queue.empty():
        messages.append(queue.get())
    errors = [m["error"] for m in messages if "error" in m]
    results = [m for m in messages if "error" not in m]
    if stuck:
        errors.insert(0, f"ranks {stuck} did not finish within {rank_timeout_s * 2:g} s")
    crashed = [r for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in stuck]
    if crashed and not errors:
        errors.append(f"ranks {crashed} exited with codes "
                      f"{[procs[r].exitcode for r in crashed]}")
    result = {"error": "; ".join(errors)} if errors or not results else results[0]
    print(P2P_RESULT_TAG + json.dumps(result), flush=True)
    return 0 if not errors else 1


# ---------------------------------------------------------------------------- IOMMU / ACS

_IOMMU_TRANSLATED_HINT = (
    "IOMMU on without passthrough: GPU peer writes may be redirected through the root "
    "complex or blocked; iommu=pt or disabling ACS on the switches usually restores P2P")
_ACS_HINT = (
    "ACS on the PCIe ports between them redirects peer writes to the root complex; "
    "`sudo lspci -vvv | grep ACSCtl` shows it (SrcValid+ ReqRedir+ means on)")


def _acs_hint(inv: Optional[Inventory], failing: Sequence[Sequence[int]]) -> str:
    topo = inv.topology if inv is not None else None
    switched = topo is not None and any(topo.link(s, d) in ("PIX", "PXB") for s, d in failing)
    where = "GPUs behind a PCIe switch fail peer writes" if switched else "peer writes fail"
    return f"{where}: {_ACS_HINT}"


def _cmdline_params(cmdline: str) -> Dict[str, str]:
    params = {}
    for token in cmdline.split():
        key, _, value = token.partition("=")
        params[key] = value
    return params


def iommu_mode(cmdline: Optional[str], group_types: Optional[List[str]]) -> Tuple[str, List[str]]:
    """("off" | "passthrough" | "translated" | "on" | "unknown", the cmdline flags seen)."""
    params = _cmdline_params(cmdline or "")
    flags = [f"{k}={v}" if v else k for k, v in params.items()
             if k in ("intel_iommu", "amd_iommu", "iommu", "iommu.passthrough", "iommu.strict")
             or k.startswith("pcie_acs_override") or (k == "pci" and "acs" in v)]
    vendor_on = any("on" in params.get(k, "").split(",") for k in ("intel_iommu", "amd_iommu"))
    off = any(params.get(k) == "off" for k in ("intel_iommu", "amd_iommu", "iommu"))
    passthrough = params.get("iommu") == "pt" or params.get("iommu.passthrough") in (
        "1", "on", "y", "yes")
    types = {t for t in (group_types or []) if t}
    if off or (group_types is not None and not group_types and not vendor_on):
        return "off", flags
    if passthrough or types == {"identity"}:
        return "passthrough", flags
    if types & {"DMA", "DMA-FQ"} or (vendor_on and not types):
        return "translated", flags
    if group_types:
        return "on", flags
    return "unknown", flags


def iommu_report(system: System, inv: Optional[Inventory],
                 failing: Sequence[Sequence[int]] = ()) -> Dict[str, Any]:
    """IOMMU mode and hints; ``failing``: the GPU pairs whose peer writes failed."""
    cmdline = system.kernel_cmdline()
    groups = system.iommu_groups()
    mode, flags = iommu_mode(cmdline, groups)
    hints = []
    if mode == "translated":
        hints.append(_IOMMU_TRANSLATED_HINT)
    elif mode == "on":
        hints.append(f"IOMMU active ({len(groups or [])} groups, domain type unknown): if P2P "
                     "fails, try iommu=pt")
    if failing:
        hints.append(_acs_hint(inv, failing))
    types: Dict[str, int] = {}
    for t in groups or []:
        types[t or "unknown"] = types.get(t or "unknown", 0) + 1
    return {"mode": mode, "cmdline_flags": flags, "cmdline_read": cmdline is not None,
            "groups": None if groups is None else len(groups), "group_types": types,
            "hints": hints}


# ---------------------------------------------------------------------------- tuning table


def _env_table(system: System) -> Optional[Dict[str, Any]]:
    given = (system.env.get("PCIE_ALLREDUCE_TABLE") or "").strip()
    if not given:
        return None
    path = system.resolve(given)
    report: Dict[str, Any] = {"path": str(path), "ok": False}
    try:
        text = path.read_bytes().decode("utf-8")
        table = _C.TuningTable.parse(text, str(path))
    except FileNotFoundError:
        report["error"] = "no such file (expected a tuning-table CSV file)"
    except IsADirectoryError:
        report["error"] = "is a directory (expected a tuning-table CSV file)"
    except UnicodeDecodeError as error:
        report["error"] = f"not a text tuning table (not UTF-8 at byte {error.start})"
    except (OSError, ValueError) as error:
        report["error"] = str(error)
    else:
        report.update(ok=True, rows=len(table))
    return report


def _cache_status(read: tuning.CacheRead) -> Dict[str, Any]:
    if read.text is not None:
        status = "valid"
    elif read.problem is None:
        status = "missing"
    elif read.problem.startswith("foreign") or read.problem.startswith("format"):
        status = "foreign"
    else:
        status = "corrupt"
    out: Dict[str, Any] = {"path": str(read.path), "status": status}
    if read.problem:
        out["problem"] = read.problem
    return out


def fingerprint_driver(inv: Inventory) -> str:
    """The driver field of a CUDA cache fingerprint, spelled as the communicator spells it
    (topology.driver_version(), or only the CUDA runtime without nvidia-smi)."""
    import torch

    if inv.probe == "torch":
        return f"cuda {torch.version.cuda}"
    return f"driver {inv.driver or 'unknown'}, cuda {torch.version.cuda}"


def fingerprint_links(inv: Inventory) -> str:
    """The links field of a CUDA cache fingerprint: the link classes of the group's GPUs, as
    the communicator computes them (``Topology.subset(ranks).fingerprint()``; empty when
    nvidia-smi could not be read)."""
    if inv.probe == "torch" or inv.topology is None:
        return ""
    return inv.topology.subset(list(range(inv.count))).fingerprint()


def gpu_cache_report(system: System, inv: Inventory, transport: str = "cuda") -> Dict[str, Any]:
    """This host's cache file for ``transport`` ("cuda", or "cuda_host" whose table key is
    "hostmem"), as the communicator's rank 0 reads it."""
    key = tuning.HOSTMEM_KEY if transport == "cuda_host" else inv.table_key
    fields = tuning.fingerprint_fields(transport, inv.count, key, inv.island_of,
                                       [g["name"] for g in inv.gpus], fingerprint_driver(inv),
                                       links=fingerprint_links(inv))
    fp = tuning.fingerprint(fields)
    path = tuning.cache_path(fp, {"PCIE_ALLREDUCE_CACHE_DIR": str(system.cache_dir())})
    return {"fingerprint": fp, **_cache_status(tuning.read_cache(path, fp))}


def host_cache_reports(system: System) -> List[Dict[str, Any]]:
    """Every host-transport cache file, checked against this host's fingerprint for its world."""
    out = []
    devices = system.host_devices()
    for path in sorted(system.cache_dir().glob("host-w*-*.csv")):
        match = re.match(r"host-w(\d+)-", path.name)
        if match is None:
            continue
        world = int(match.group(1))
        fp = tuning.fingerprint(tuning.fingerprint_fields("host", world, "host", [], devices, ""))
        out.append({"world": world, "fingerprint": fp,
                    **_cache_status(tuning.read_cache(path, fp))})
    return out


def table_report(system: System, inv: Optional[Inventory],
                 transport: str = "cuda") -> Dict[str, Any]:
    """Which table a communicator would use: PCIE_ALLREDUCE_TABLE, this host's cache (for the
    GPUs: the cache of ``transport``, the one the communicator would run), or the embedded seed
    table."""
    seed = _C.TuningTable.parse(_C.TuningTable.embedded_text(), "embedded")
    report: Dict[str, Any] = {"cache_dir": str(system.cache_dir()),
                              "env_table": _env_table(system),
                              "embedded_rows": len(seed)}
    if inv is not None and inv.count >= 2:
        report["gpu_cache"] = gpu_cache_report(system, inv, transport)
    report["host_caches"] = host_cache_reports(system)
    env_table = report["env_table"]
    gpu_cache = report.get("gpu_cache")
    valid_host = [c["path"] for c in report["host_caches"] if c["status"] == "valid"]
    if env_table is not None:
        report["in_use"] = f"PCIE_ALLREDUCE_TABLE {env_table['path']}" + (
            "" if env_table["ok"] else " (broken: communicators raise at construction)")
    elif gpu_cache is not None and gpu_cache["status"] == "valid":
        report["in_use"] = f"this host's tuning cache {gpu_cache['path']}"
    elif inv is None and valid_host:
        report["in_use"] = "this host's tuning cache " + ", ".join(valid_host)
    else:
        report["in_use"] = f"embedded seed table ({len(seed)} rows)"
    return report


# ---------------------------------------------------------------------------- host transport


def host_bench_command(json_out: str) -> List[str]:
    return [sys.executable, "-m", "pcie_allreduce", "bench", "--transport", "host", "--world",
            "2", "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "5", "--warmup", "1",
            "--json", json_out]


def interpret_host_run(run: RunResult, bench_json: Optional[str],
                       timeout_s: float) -> Dict[str, Any]:
    if run.timed_out:
        return {"status": "failed", "detail": f"the world-2 bench did not finish within "
                f"{timeout_s:g} s"}
    tail = " | ".join(run.output.strip().splitlines()[-3:]) or "no output"
    if run.returncode != 0 or bench_json is None:
        return {"status": "failed", "detail": f"the world-2 bench exited with code "
                f"{run.returncode}: {tail}"}
    try:
        result = json.loads(bench_json)
        stats, rows = result["stats"], result["rows"]
    except (ValueError, KeyError, TypeError):
        return {"status": "failed", "detail": "the world-2 bench wrote an unreadable result"}
    if not stats.get("enabled", False):
        return {"status": "failed", "detail": "the host transport turned itself off: "
                f"{stats.get('disabled_reason')}"}
    tactics = sorted({str(r.get("tactic")) for r in rows})
    return {"status": "ok", "detail": f"world-2 all-reduce of 4 KiB verified, tactic "
            f"{', '.join(tactics)}"}


def check_host_transport(system: System, timeout_s: float = HOST_TIMEOUT_S) -> Dict[str, Any]:
    recorded = system.recorded_host_transport()
    if recorded is not None:
        ok = bool(recorded.get("ok"))
        return {"status": "ok" if ok else "failed", "detail": str(recorded.get("detail", "")),
                "source": "recorded"}
    if not system.can_run_tests():
        return {"status": "not_tested", "detail": "the fixture records no host-transport result"}
    with tempfile.TemporaryDirectory(prefix="pcie_ar_doctor.") as tmp:
        out = os.path.join(tmp, "bench.json")
        run = system.run(host_bench_command(out), timeout_s, probe_env(system.env))
        result = interpret_host_run(run, _read(Path(out)), timeout_s)
    return {**result, "source": "test"}


# ---------------------------------------------------------------------------- verdict


def tactic_report(world: int, island_of: List[int]) -> Dict[str, Any]:
    available, unavailable = [], {}
    for algorithm in plan_mod.ALGORITHMS:
        why = _C.why_unsupported(algorithm, world, island_of)
        if why is None:
            available.append(algorithm)
        else:
            unavailable[algorithm] = why
    return {"world": world, "available": available, "unavailable": unavailable}


def _pairs_text(pairs: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"GPU{s} -> GPU{d}" for s, d in pairs)


def _failing_text(p2p: Dict[str, Any]) -> str:
    more = " (and possibly more: the list is cut at 8)" if p2p.get("truncated") else ""
    return f"{_pairs_text(p2p['failing'])}{more}"


def transport_mode(env: Mapping[str, str]) -> Tuple[str, Optional[str]]:
    """(PCIE_ALLREDUCE_TRANSPORT as the communicator parses it, the error when it does not
    parse: then every communicator raises at construction)."""
    try:
        return parse_transport(env.get("PCIE_ALLREDUCE_TRANSPORT")), None
    except ValueError as error:
        return "auto", str(error)


def transport_report(inv: Optional[Inventory], p2p: Dict[str, Any], mode: str = "auto",
                     error: Optional[str] = None) -> Dict[str, Any]:
    """The transport a communicator over these GPUs would run, as ``stats()["transport"]``
    names it: "cuda" (peer-to-peer), "cuda_host" (shared pinned host memory) or, without
    GPUs, "host"; ``mode`` is PCIE_ALLREDUCE_TRANSPORT (auto, p2p, hostmem)."""
    status = p2p.get("status")
    if error is not None:
        detail = f"{error}: every communicator raises at construction"
        name = "host" if inv is None else "cuda"
    elif inv is None:
        name, detail = "host", "CPU tensors: every workspace in POSIX shared memory"
    elif status in ("skipped", "not_applicable"):
        name = "cuda_host" if mode == "hostmem" else "cuda"
        detail = f"none in use: {p2p.get('detail', '')}"
    elif mode == "hostmem":
        name = "cuda_host"
        detail = ("PCIE_ALLREDUCE_TRANSPORT=hostmem: every workspace in shared pinned host "
                  f"memory (forced; peer-to-peer is not used), {_HOSTMEM_COST}")
        if status == "ok":
            detail += f"; P2P works on all {len(p2p['pairs'])} pairs tested"
    elif status == "failed" and mode == "p2p":
        name = "cuda"
        detail = (f"P2P failed on {_failing_text(p2p)}, and PCIE_ALLREDUCE_TRANSPORT=p2p: the "
                  "communicator declines no_p2p (host memory is not tried)")
    elif status == "failed":
        name = "cuda_host"
        detail = (f"P2P failed on {_failing_text(p2p)}: the communicator moves every workspace "
                  f"into shared pinned host memory, {_HOSTMEM_COST}; fixing the IOMMU/ACS "
                  "settings of the PCIe path between those GPUs restores P2P "
                  "(PCIE_ALLREDUCE_TRANSPORT=p2p declines no_p2p instead). The doctor does not "
                  "test host memory: each communicator checks it when it is constructed")
    elif status == "error" and mode != "p2p":
        name = "cuda"
        detail = ("peer-to-peer, unverified: the P2P test did not complete, so whether a "
                  "communicator stays on P2P or moves to shared pinned host memory (cuda_host) "
                  "is unknown")
    elif status == "ok":
        name = "cuda"
        detail = (f"peer-to-peer: every peer's GPU memory mapped with CUDA IPC (verified on "
                  f"{len(p2p['pairs'])} pairs)")
    else:
        name = "cuda"
        detail = "peer-to-peer, if each communicator's own P2P check passes" + (
            " (PCIE_ALLREDUCE_TRANSPORT=p2p: it declines no_p2p otherwise)" if mode == "p2p"
            else "; otherwise shared pinned host memory (cuda_host)")
    out = {"name": name, "mode": mode if error is None else "invalid", "detail": detail}
    if error is not None:
        out["error"] = error
    return out


def gpu_declines(inv: Inventory, p2p: Dict[str, Any],
                 mode: str = "auto") -> List[Dict[str, str]]:
    """Why a communicator over these GPUs would turn itself off (or could not be trusted).
    Failing P2P pairs are a decline only with ``mode`` "p2p": otherwise the communicator runs
    over host memory (cuda_host)."""
    out = []
    topo = inv.topology
    if topo is not None and topo.has_nvlink():
        a, b = topo.nvlink_pairs()[0]
        out.append({"reason": "nvlink", "detail": f"NVLink present (GPU{a} and GPU{b}, "
                    f"{len(topo.nvlink_pairs())} pairs): the engine's own custom all-reduce is "
                    "faster there"})
    if p2p.get("status") == "failed" and mode == "p2p":
        out.append({"reason": "no_p2p", "detail": "peer writes did not arrive intact: "
                    f"{_failing_text(p2p)}; PCIE_ALLREDUCE_TRANSPORT=p2p, so host memory is "
                    "not tried"})
    elif p2p.get("status") == "error" and mode != "hostmem":
        out.append({"reason": "no_p2p", "detail": p2p["detail"]})
    if inv.topology_error is not None:
        out.append({"reason": "topology", "detail": "`nvidia-smi topo -m` does not parse "
                    f"({inv.topology_error}): communicators raise at construction"})
    if inv.count > MAX_WORLD:
        out.append({"reason": "world_size", "detail": f"a group of all {inv.count} GPUs "
                    f"(groups of 2..{MAX_WORLD} GPUs can use it)"})
    return out


def _p2p_phrase(p2p: Dict[str, Any]) -> str:
    status = p2p.get("status")
    if status == "ok":
        source = {"cached": " (cached)", "recorded": " (recorded)"}.get(p2p.get("source"), "")
        return f"P2P verified on {len(p2p['pairs'])} pairs{source}"
    if status == "inconclusive":
        return f"P2P inconclusive ({p2p['detail']})"
    return "P2P not tested (each communicator still checks it when it is constructed)"


def _transport_phrase(p2p: Dict[str, Any], transport: Dict[str, Any]) -> str:
    """What follows the tactics in a "can run" verdict on host memory."""
    if transport["mode"] == "hostmem":
        line = (f"host memory is forced by PCIE_ALLREDUCE_TRANSPORT=hostmem, {_HOSTMEM_COST}")
        if p2p.get("status") == "failed":
            return line + f"; P2P fails anyway on {_failing_text(p2p)}"
        if p2p.get("status") == "error":
            return line + f"; P2P unknown: {p2p['detail']}"
        works = " (transport auto would use it)" if p2p.get("status") == "ok" else ""
        return line + f"; {_p2p_phrase(p2p)}{works}"
    return (f"P2P failed on {_failing_text(p2p)}, so every workspace is in shared pinned host "
            f"memory, {_HOSTMEM_COST}; fixing the IOMMU/ACS settings of the PCIe path between "
            "those GPUs restores P2P (PCIE_ALLREDUCE_TRANSPORT=p2p declines no_p2p instead)")


def gpu_verdict(inv: Inventory, p2p: Dict[str, Any], table: Dict[str, Any],
                tactics: Dict[str, Any], transport: Optional[Dict[str, Any]] = None,
                ) -> Tuple[bool, str, List[Dict[str, str]]]:
    """(ok, verdict, declines); ``transport``: transport_report() (default: auto mode)."""
    if transport is None:
        transport = transport_report(inv, p2p)
    declines = gpu_declines(inv, p2p, transport["mode"])
    if transport.get("error"):
        declines.append({"reason": "transport", "detail": f"{transport['error']}: "
                         "communicators raise at construction"})
    env_table = table.get("env_table")
    if env_table is not None and not env_table["ok"]:
        declines.append({"reason": "table", "detail": f"PCIE_ALLREDUCE_TABLE "
                         f"{env_table['path']}: {env_table['error']}"})
    blocking = [d for d in declines if d["reason"] != "world_size"]
    if inv.count < 2 and not blocking:
        return False, (f"pcie_allreduce has nothing to do here: {inv.count} GPU (an all-reduce "
                       f"needs 2..{MAX_WORLD} GPUs in a group)"), declines
    plural = "GPU" if inv.count == 1 else "GPUs"
    shape = (f"{inv.count} {plural} in {describe_islands(inv.topology)} ({inv.table_key})"
             if inv.topology is not None else f"{inv.count} {plural}")
    reasons = "; ".join(f"{d['reason']}: {d['detail']}" for d in declines)
    if blocking:
        return False, f"pcie_allreduce cannot run here: {shape}; would decline: {reasons}", \
            declines
    usable = tactics["available"] or tactic_report(MAX_WORLD, [])["available"]
    if transport["name"] == "cuda_host":
        line = (f"pcie_allreduce can run here over shared pinned host memory (transport "
                f"cuda_host): {shape}, tactics: {', '.join(usable)}; "
                f"{_transport_phrase(p2p, transport)}")
    else:
        mode = " (PCIE_ALLREDUCE_TRANSPORT=p2p)" if transport["mode"] == "p2p" else ""
        line = (f"pcie_allreduce can run here: {shape}, {_p2p_phrase(p2p)}{mode}, tactics: "
                f"{', '.join(usable)}")
    if declines:
        line += f"; would decline: {reasons}"
    return True, line, declines


def host_verdict(host: Dict[str, Any], table: Dict[str, Any],
                 transport_error: Optional[str] = None) -> Tuple[bool, str]:
    if transport_error is not None:
        return False, (f"no GPU found; the host transport cannot start: {transport_error} "
                       "(communicators raise at construction)")
    env_table = table.get("env_table")
    if env_table is not None and not env_table["ok"]:
        return False, (f"no GPU found; the host transport cannot start: PCIE_ALLREDUCE_TABLE "
                       f"{env_table['path']}: {env_table['error']}")
    if host["status"] == "ok":
        return True, ("no GPU found; pcie_allreduce can run here on CPU tensors: the host "
                      f"shared-memory transport works: {host['detail']}")
    if host["status"] == "failed":
        return False, f"no GPU found, and the host shared-memory transport failed: " \
            f"{host['detail']}"
    return False, ("no GPU found, and the host shared-memory transport was not tested, so it "
                   "is not known to work")


# ---------------------------------------------------------------------------- the run


def run(system: System, *, p2p_test: bool = True,
        p2p_runner: Optional[P2PRunner] = None) -> Dict[str, Any]:
    """The whole diagnosis as one JSON-ready dict: ``ok`` and ``verdict``, then the sections."""
    inv = gather_inventory(system)
    mode, mode_error = transport_mode(system.env)
    if inv is None:
        p2p: Dict[str, Any] = {"status": "not_applicable"}
        transport = transport_report(None, p2p, mode, mode_error)
        table = table_report(system, inv)
        host = check_host_transport(system)
        ok, verdict = host_verdict(host, table, mode_error)
        sections = dict(gpus={"count": 0, "probe": "none", "devices": [], "problems": []},
                        topology={"known": False}, p2p=p2p, transport=transport,
                        iommu=iommu_report(system, None), table=table, host_transport=host,
                        tactics=tactic_report(2, []), declines=[])
    else:
        p2p = check_p2p(system, inv, skip=not p2p_test, runner=p2p_runner)
        transport = transport_report(inv, p2p, mode, mode_error)
        table = table_report(system, inv, transport["name"])
        tactics = tactic_report(inv.count, inv.island_of)
        ok, verdict, declines = gpu_verdict(inv, p2p, table, tactics, transport)
        sections = dict(
            gpus={"count": inv.count, "probe": inv.probe, "driver": inv.driver,
                  "devices": inv.gpus, "problems": inv.problems},
            topology=topology_report(inv), p2p=p2p, transport=transport,
            iommu=iommu_report(system, inv, p2p.get("failing", [])), table=table,
            host_transport={"status": "not_tested", "detail": "GPUs present: "
                            "`pcie-allreduce bench --transport host` checks it"},
            tactics=tactics, declines=declines)
    if system.env.get("PCIE_ALLREDUCE_ENABLE", "").strip().lower() in ("0", "false", "no",
                                                                      "off"):
        verdict += " (note: PCIE_ALLREDUCE_ENABLE=0 in this environment turns it off)"
    return {"ok": ok, "verdict": verdict, "system": system.label, **sections}


# ---------------------------------------------------------------------------- text output


def _print_links(t: Dict[str, Any]) -> None:
    links = t["links"]
    print(("        " + "".join(f"GPU{i:<4}" for i in range(len(links)))).rstrip())
    for i, row in enumerate(links):
        cells = "".join(f"{'X' if i == j else c:<7}" for j, c in enumerate(row))
        print(f"  GPU{i:<4}{cells}".rstrip())
    print("  islands: " + " ".join("{" + ",".join(map(str, i)) + "}" for i in t["islands"]))


def _print_gpus(report: Dict[str, Any]) -> None:
    gpus = report["gpus"]
    print(f"GPUs ({gpus['probe']}, driver {gpus.get('driver') or 'unknown'})")
    for g in gpus["devices"]:
        numa = g["numa_node"] if g["numa_node"] is not None else "?"
        print(f"  GPU{g['index']}  {g['name']:<40} {g['bus_id'] or '?':<14} NUMA {numa}")
    for problem in gpus["problems"]:
        print(f"  ! {problem}")
    t = report["topology"]
    print("\nTopology")
    if not t["known"]:
        print("  unknown")
        return
    _print_links(t)
    print(f"  table key: {t['table_key']}; island algorithms: {t['island_algorithms']}")


def _print_p2p(p2p: Dict[str, Any]) -> None:
    print("\nP2P write-and-verify")
    status = p2p.get("status")
    source = p2p.get("source", "")
    where = f" [{source}{': ' + p2p['cache_file'] if p2p.get('cache_file') else ''}]"
    if status == "ok":
        print(f"  ok on all {len(p2p['pairs'])} ordered pairs{where}")
    elif status == "failed":
        print(f"  FAILED: {_pairs_text(p2p['failing'])}{where}")
        ok_pairs = sum(1 for p in p2p["pairs"] if p["status"] == "ok")
        print(f"  ok on {ok_pairs} of {len(p2p['pairs'])} ordered pairs")
    else:
        print(f"  {status}: {p2p.get('detail', '')}")


def _print_transport(transport: Dict[str, Any]) -> None:
    print("\nTransport")
    mode = "" if transport["name"] == "host" else f" (mode {transport['mode']})"
    print(f"  {transport['name']}{mode}: {transport['detail']}")


def _print_iommu(iommu: Dict[str, Any]) -> None:
    print("\nIOMMU / ACS")
    flags = " ".join(iommu["cmdline_flags"]) or "(no IOMMU flags)"
    print(f"  kernel command line: {flags if iommu['cmdline_read'] else 'unreadable'}")
    groups = iommu["groups"]
    print(f"  IOMMU groups: {'none listed' if groups is None else groups}"
          + (f" {iommu['group_types']}" if set(iommu["group_types"]) - {"unknown"} else "")
          + f"; mode: {iommu['mode']}")
    for hint in iommu["hints"]:
        print(f"  hint: {hint}")


def _print_table(table: Dict[str, Any]) -> None:
    print("\nTuning table")
    env_table = table["env_table"]
    if env_table is None:
        print("  PCIE_ALLREDUCE_TABLE: unset")
    else:
        state = f"{env_table['rows']} rows" if env_table["ok"] else f"BROKEN: {env_table['error']}"
        print(f"  PCIE_ALLREDUCE_TABLE: {env_table['path']} ({state})")
    print(f"  cache folder: {table['cache_dir']}")
    cache = table.get("gpu_cache")
    if cache is not None:
        print(f"  GPU cache {cache['fingerprint']}: {cache['status']}"
              + (f" ({cache['problem']})" if cache.get("problem") else ""))
    for c in table["host_caches"]:
        print(f"  host cache {Path(c['path']).name}: {c['status']}"
              + (f" ({c['problem']})" if c.get("problem") else ""))
    print(f"  in use: {table['in_use']}")


def _print_tactics(tactics: Dict[str, Any]) -> None:
    print(f"\nTactics (world {tactics['world']})")
    print(f"  can run: {', '.join(tactics['available']) or 'none'}")
    for algorithm, why in tactics["unavailable"].items():
        print(f"  not {algorithm}: {why}")


def print_text(report: Dict[str, Any]) -> None:
    print(f"pcie-allreduce doctor: {report['system']}\n")
    if report["gpus"]["count"]:
        _print_gpus(report)
        _print_p2p(report["p2p"])
    else:
        print("GPUs: no GPU found (no NVML, no nvidia-smi GPUs, torch sees none)")
        host = report["host_transport"]
        print(f"\nHost shared-memory transport\n  {host['status']}: {host['detail']}")
    _print_transport(report["transport"])
    _print_iommu(report["iommu"])
    _print_table(report["table"])
    _print_tactics(report["tactics"])
    print(f"\nverdict: {report['verdict']}")


# ---------------------------------------------------------------------------- CLI


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds `doctor` to argparse subparsers ``sub``."""
    d = sub.add_parser(
        "doctor",
        help="can this backend run here, and if not, why not",
        description="Checks the GPUs, their topology and NVLink, a real peer write on every "
        "GPU pair, the transport a communicator would use (peer-to-peer, or shared pinned host "
        "memory where P2P fails), IOMMU/ACS hints, the tuning table in use and (without GPUs) "
        "the host transport, then prints a verdict. Exit status: 0 the backend can run here, 1 it "
        "cannot, 2 usage error.",
    )
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument(
        "--fixture", metavar="DIR",
        help="diagnose a recorded host instead of this one: DIR holds nvidia_smi_topo.txt, "
        "query_gpu.csv, cmdline, iommu_groups, numa_nodes, p2p.json, host_transport.json, env "
        "(see tests/python/fixtures/doctor/README.md); nothing is run",
    )
    d.add_argument("--no-p2p-test", action="store_true",
                   help="do not run the P2P write-and-verify subprocess (a cached result is "
                   "still reported)")
    d.set_defaults(func=main)
    return d


def main(args: argparse.Namespace) -> int:
    try:
        system: System = FixtureSystem(Path(args.fixture)) if args.fixture else LiveSystem()
        report = run(system, p2p_test=not args.no_p2p_test)
    except FixtureError as error:
        print(f"pcie-allreduce doctor: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_text(report)
    return 0 if report["ok"] else 1
