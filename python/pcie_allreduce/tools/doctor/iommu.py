"""IOMMU / ACS hints from the kernel command line and the IOMMU groups: whether peer writes may
be redirected through the root complex or blocked. Hints only, never fatal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .inventory import Inventory
from .system import System

_IOMMU_TRANSLATED_HINT = (
    "IOMMU on without passthrough: GPU peer writes may be redirected through the root "
    "complex or blocked; iommu=pt or disabling ACS on the switches usually restores P2P"
)
_ACS_HINT = (
    "ACS on the PCIe ports between them redirects peer writes to the root complex; "
    "`sudo lspci -vvv | grep ACSCtl` shows it (SrcValid+ ReqRedir+ means on)"
)


def _acs_hint(inv: Inventory | None, failing: Sequence[Sequence[int]]) -> str:
    topo = inv.topology if inv is not None else None
    switched = topo is not None and any(topo.link(s, d) in ("PIX", "PXB") for s, d in failing)
    where = "GPUs behind a PCIe switch fail peer writes" if switched else "peer writes fail"
    return f"{where}: {_ACS_HINT}"


def _cmdline_params(cmdline: str) -> dict[str, str]:
    params = {}
    for token in cmdline.split():
        key, _, value = token.partition("=")
        params[key] = value
    return params


def iommu_mode(cmdline: str | None, group_types: list[str] | None) -> tuple[str, list[str]]:
    """("off" | "passthrough" | "translated" | "on" | "unknown", the cmdline flags seen)."""
    params = _cmdline_params(cmdline or "")
    flags = [
        f"{k}={v}" if v else k
        for k, v in params.items()
        if k in ("intel_iommu", "amd_iommu", "iommu", "iommu.passthrough", "iommu.strict")
        or k.startswith("pcie_acs_override")
        or (k == "pci" and "acs" in v)
    ]
    vendor_on = any("on" in params.get(k, "").split(",") for k in ("intel_iommu", "amd_iommu"))
    off = any(params.get(k) == "off" for k in ("intel_iommu", "amd_iommu", "iommu"))
    passthrough = params.get("iommu") == "pt" or params.get("iommu.passthrough") in (
        "1",
        "on",
        "y",
        "yes",
    )
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


def iommu_report(
    system: System, inv: Inventory | None, failing: Sequence[Sequence[int]] = ()
) -> dict[str, Any]:
    """IOMMU mode and hints; ``failing``: the GPU pairs whose peer writes failed."""
    cmdline = system.kernel_cmdline()
    groups = system.iommu_groups()
    mode, flags = iommu_mode(cmdline, groups)
    hints = []
    if mode == "translated":
        hints.append(_IOMMU_TRANSLATED_HINT)
    elif mode == "on":
        hints.append(
            f"IOMMU active ({len(groups or [])} groups, domain type unknown): if P2P "
            "fails, try iommu=pt"
        )
    if failing:
        hints.append(_acs_hint(inv, failing))
    types: dict[str, int] = {}
    for t in groups or []:
        types[t or "unknown"] = types.get(t or "unknown", 0) + 1
    return {
        "mode": mode,
        "cmdline_flags": flags,
        "cmdline_read": cmdline is not None,
        "groups": None if groups is None else len(groups),
        "group_types": types,
        "hints": hints,
    }
