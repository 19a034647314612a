"""The GPUs the doctor finds and their topology: NVML when ``pynvml`` imports, else
``nvidia-smi``, else only torch's device count; the NUMA node of every GPU, the islands and any
NVLink pair."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ... import policy
from ...native import _C
from .system import System, sysfs_bus_id

MAX_WORLD = 8  # the kernels serve groups of 2..8 ranks

# nvmlDeviceGetTopologyCommonAncestor levels -> the classes of `nvidia-smi topo -m`.
_NVML_LEVEL_CLASS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


@dataclass
class RawInventory:
    """GPUs as a probe found them, before the topology text is parsed."""

    probe: str  # "nvml", "nvidia-smi", "torch"
    names: list[str]
    bus_ids: list[str]
    driver: str
    topo_text: str | None
    problems: list[str] = field(default_factory=list)


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
                "X"
                if i == j
                else f"NV{links[i][j]}"
                if links[i][j]
                else _NVML_LEVEL_CLASS.get(
                    int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)), "SYS"
                )
                for j, b in enumerate(handles)
            ]
            for i, a in enumerate(handles)
        ]
    finally:
        nvml.nvmlShutdown()
    return RawInventory("nvml", names, buses, driver, topo_text_from_classes(classes))


def _nvlink_counts(nvml: Any, handles: list[Any], buses: list[str]) -> list[list[int]]:
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
                remote = sysfs_bus_id(
                    _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                )
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


def topo_text_from_classes(classes: list[list[str]]) -> str:
    """A `nvidia-smi topo -m` matrix ("X" on the diagonal) that _C.Topology can parse."""
    n = len(classes)
    lines = ["\t" + "\t".join(f"GPU{i}" for i in range(n))]
    for i, row in enumerate(classes):
        lines.append(f"GPU{i}\t" + "\t".join(" X " if c == "X" else c for c in row))
    return "\n".join(lines) + "\n"


def parse_query_gpu(text: str) -> tuple[list[str], list[str], str]:
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


def raw_inventory(system: System) -> RawInventory | None:
    """NVML, else nvidia-smi, else torch's device count (no topology); None: no GPU at all."""
    nvml = system.nvml()
    if nvml is not None:
        try:
            found = nvml_inventory(nvml)
        except Exception:  # no driver, an old NVML without a call: fall back to nvidia-smi
            found = None
        if found is not None and found.names:
            return found
    topo = system.nvidia_smi(["topo", "-m"])
    query = system.nvidia_smi(
        ["--query-gpu=index,name,pci.bus_id,driver_version", "--format=csv,noheader"]
    )
    names, buses, driver = parse_query_gpu(query or "")
    if topo is not None or names:
        problems = (
            []
            if query
            else [
                "nvidia-smi --query-gpu gave nothing: GPU names, bus ids and driver version unknown"
            ]
        )
        return RawInventory("nvidia-smi", names, buses, driver, topo, problems)
    names = system.cuda_device_names()
    if names:
        return RawInventory(
            "torch",
            names,
            [],
            "",
            None,
            [
                "neither NVML nor nvidia-smi answered: topology unknown (assumed one island) and "
                "NVLink cannot be ruled out"
            ],
        )
    return None


@dataclass
class Inventory:
    """The GPUs, their topology (None when it could not be read) and what went wrong."""

    probe: str
    gpus: list[dict[str, Any]]
    driver: str
    topology: Any | None
    problems: list[str]
    topology_error: str | None = None  # `nvidia-smi topo -m` text that does not parse

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def island_of(self) -> list[int]:
        """The island map a communicator over all GPUs would use ([] when flat)."""
        return [] if self.topology is None else policy.islands_for_table(self.topology)

    @property
    def table_key(self) -> str:
        return self.topology.table_key() if self.topology is not None else "flat"


def gather_inventory(system: System) -> Inventory | None:
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
        problems.append(
            f"nvidia-smi lists {len(raw.names)} GPUs but its topology matrix has "
            f"{count}; using the matrix"
        )
    if topology is None and raw.topo_text is None and count >= 2:
        topology = _C.Topology.flat(count)
    gpus = [_gpu_entry(system, raw, topology, i) for i in range(count)]
    return Inventory(raw.probe, gpus, raw.driver, topology, problems, topology_error)


def _gpu_entry(system: System, raw: RawInventory, topology: Any | None, i: int) -> dict[str, Any]:
    """Name, bus id and NUMA node (sysfs, else nvidia-smi's NUMA Affinity column)."""
    bus = raw.bus_ids[i] if i < len(raw.bus_ids) else None
    numa = system.numa_node(bus) if bus else None
    if (numa is None or numa < 0) and topology is not None and i < len(topology.numa_node):
        numa = topology.numa_node[i] if topology.numa_node[i] >= 0 else None
    name = raw.names[i] if i < len(raw.names) else "unknown"
    return {"index": i, "name": name, "bus_id": bus, "numa_node": numa}


def topology_report(inv: Inventory) -> dict[str, Any]:
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
