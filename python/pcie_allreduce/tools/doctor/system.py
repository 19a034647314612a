"""What the doctor reads from the machine, behind one interface: :class:`System`.

Every read (NVML, nvidia-smi, sysfs, /proc, the environment, subprocesses) goes through a
System, so ``--fixture DIR`` can replay a recorded host instead of this one
(:class:`FixtureSystem`; the format is described in tests/python/fixtures/doctor/README.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import env as env_mod
from ...topology import host_devices, run_nvidia_smi

# The test subprocesses choose their own transport (the P2P test passes transport="cuda_ipc");
# a bad PCIE_ALLREDUCE_TRANSPORT is reported by the doctor itself, not as a crashed test.
_PROBE_ENV_DROP = (
    "CUDA_VISIBLE_DEVICES",
    "PCIE_ALLREDUCE_ENABLE",
    "PCIE_ALLREDUCE_TABLE",
    "PCIE_ALLREDUCE_TRANSPORT",
)


class FixtureError(ValueError):
    """A --fixture directory that cannot be replayed (a usage error: exit status 2)."""


@dataclass
class RunResult:
    """What a subprocess left behind: exit code (None when it was killed for the timeout)."""

    returncode: int | None
    output: str
    timed_out: bool = False


class System:
    """Everything the doctor reads from the machine. Subclasses: live or a recorded fixture."""

    label = "system"
    env: Mapping[str, str]  # the environment the doctor and its subprocesses see

    def flags(self) -> tuple[env_mod.Env, dict[str, str]]:
        """This system's pcie_allreduce flags as a communicator would parse them, and the
        problem of each flag that does not parse (``env.read_flags``)."""
        return env_mod.read_flags(self.env)

    def nvml(self) -> Any | None:
        """The NVML bindings (``pynvml``) when they import here; None otherwise."""
        return None

    def nvidia_smi(self, args: Sequence[str]) -> str | None:
        """stdout of ``nvidia-smi <args>``, or None when it is missing or fails."""
        raise NotImplementedError

    def cuda_device_names(self) -> list[str]:
        """The GPUs torch sees (the last resort when neither NVML nor nvidia-smi answers)."""
        return []

    def numa_node(self, bus_id: str) -> int | None:
        raise NotImplementedError

    def kernel_cmdline(self) -> str | None:
        raise NotImplementedError

    def iommu_groups(self) -> list[str] | None:
        """One entry per IOMMU group: its domain type ("DMA", "identity", ...) or "" if
        unknown; None when the listing itself is unavailable."""
        raise NotImplementedError

    def cache_dir(self) -> Path:
        """The tuning cache folder a communicator here would use."""
        return self.flags()[0].tuning_cache_dir()

    def resolve(self, path: str) -> Path:
        """A path named by the environment (PCIE_ALLREDUCE_TABLE)."""
        return Path(path).expanduser()

    def host_devices(self) -> list[str]:
        raise NotImplementedError

    def recorded_p2p(self) -> dict[str, Any] | None:
        """A recorded P2P result (fixtures only); None: run the test."""
        return None

    def recorded_host_transport(self) -> dict[str, Any] | None:
        return None

    def can_run_tests(self) -> bool:
        """Whether this system may start GPU or shared-memory test subprocesses."""
        return False

    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> RunResult:
        raise NotImplementedError


def read_text(path: Path) -> str | None:
    """A file's text, or None when it is missing, unreadable or not UTF-8."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


class LiveSystem(System):
    """This machine."""

    label = "this machine"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = env_mod.snapshot() if env is None else dict(env)

    def nvml(self) -> Any | None:
        try:
            import pynvml
        except ImportError:
            return None
        return pynvml

    def nvidia_smi(self, args: Sequence[str]) -> str | None:
        return run_nvidia_smi(list(args))

    def cuda_device_names(self) -> list[str]:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]

    def numa_node(self, bus_id: str) -> int | None:
        return _int_or_none(read_text(Path("/sys/bus/pci/devices") / bus_id / "numa_node"))

    def kernel_cmdline(self) -> str | None:
        return read_text(Path("/proc/cmdline"))

    def iommu_groups(self) -> list[str] | None:
        root = Path("/sys/kernel/iommu_groups")
        if not root.is_dir():
            return None
        groups = sorted(root.iterdir(), key=lambda p: p.name)
        return [(read_text(g / "type") or "").strip() for g in groups]

    def host_devices(self) -> list[str]:
        return host_devices()

    def can_run_tests(self) -> bool:
        return True

    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> RunResult:
        return run_bounded(argv, timeout_s, env)


def run_bounded(argv: Sequence[str], timeout_s: float, env: Mapping[str, str]) -> RunResult:
    """Runs argv in its own session; on timeout kills that session (the ranks it spawned too)."""
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(env),
        start_new_session=True,
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

    KNOWN = (
        "nvidia_smi_topo.txt",
        "query_gpu.csv",
        "cmdline",
        "iommu_groups",
        "numa_nodes",
        "p2p.json",
        "host_transport.json",
        "env",
        "host_devices",
    )

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

    def _text(self, name: str) -> str | None:
        path = self.root / name
        if not path.exists():
            return None
        text = read_text(path)
        if text is None:
            raise FixtureError(f"fixture file {str(path)!r} is unreadable or not UTF-8")
        return text

    def _json(self, name: str) -> dict[str, Any] | None:
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

    def _key_values(self, name: str) -> dict[str, str]:
        pairs = {}
        for line in (self._text(name) or "").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, sep, value = line.partition("=")
                if not sep:
                    raise FixtureError(f"fixture file {name}: expected KEY=VALUE, got {line!r}")
                pairs[key.strip()] = value.strip()
        return pairs

    def _numa_nodes(self) -> dict[str, int]:
        nodes = {}
        for line in (self._text("numa_nodes") or "").splitlines():
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            node = _int_or_none(words[-1]) if len(words) == 2 else None
            if node is None:
                raise FixtureError(
                    f"fixture file numa_nodes: expected '<bus id> <node>', got {line!r}"
                )
            nodes[sysfs_bus_id(words[0])] = node
        return nodes

    def nvidia_smi(self, args: Sequence[str]) -> str | None:
        if list(args) == ["topo", "-m"]:
            return self._text("nvidia_smi_topo.txt")
        if args and args[0].startswith("--query-gpu="):
            return self._text("query_gpu.csv")
        return None

    def numa_node(self, bus_id: str) -> int | None:
        return self._numa.get(sysfs_bus_id(bus_id))

    def kernel_cmdline(self) -> str | None:
        return self._text("cmdline")

    def iommu_groups(self) -> list[str] | None:
        text = self._text("iommu_groups")
        if text is None:
            return None
        lines = [
            ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
        ]
        if len(lines) == 1 and len(lines[0]) == 1 and lines[0][0].isdigit():
            return [""] * int(lines[0][0])  # a bare count
        return [words[1] if len(words) > 1 else "" for words in lines]

    def cache_dir(self) -> Path:
        given = self.flags()[0].cache_dir
        return self.resolve(str(given)) if given is not None else self.root / "cache"

    def resolve(self, path: str) -> Path:
        return self.root / Path(path).expanduser()  # an absolute path stays absolute

    def host_devices(self) -> list[str]:
        listed = [ln.strip() for ln in (self._text("host_devices") or "").splitlines()]
        return [d for d in listed if d] or ["recorded host"]

    def recorded_p2p(self) -> dict[str, Any] | None:
        return self._json("p2p.json")

    def recorded_host_transport(self) -> dict[str, Any] | None:
        return self._json("host_transport.json")


def _int_or_none(text: str | None) -> int | None:
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


def probe_env(env: Mapping[str, str]) -> dict[str, str]:
    """The test subprocesses see every GPU in nvidia-smi's (PCI bus) order, with the backend
    on and the embedded table, whatever this shell sets."""
    out = {k: v for k, v in env.items() if k not in _PROBE_ENV_DROP}
    out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return out
