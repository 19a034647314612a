"""The transport a communicator would run, why it would decline, and the one verdict line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ... import env as env_mod
from ... import plan as plan_mod
from ... import policy
from ...native import _C
from .inventory import MAX_WORLD, Inventory, describe_islands

_P2P_ONLY = f"PCIE_ALLREDUCE_TRANSPORT={policy.CUDA_IPC}"
_HOSTMEM_COST = "slower per call than P2P (every flag poll is a PCIe round trip to host memory)"


def tactic_report(world: int, island_of: list[int]) -> dict[str, Any]:
    available, unavailable = [], {}
    for algorithm in plan_mod.ALGORITHMS:
        why = _C.why_unsupported(algorithm, world, island_of)
        if why is None:
            available.append(algorithm)
        else:
            unavailable[algorithm] = why
    return {"world": world, "available": available, "unavailable": unavailable}


def pairs_text(pairs: Sequence[Sequence[int]]) -> str:
    """Ordered GPU pairs as the reports name them: GPU0 -> GPU4, ..."""
    return ", ".join(f"GPU{s} -> GPU{d}" for s, d in pairs)


def _failing_text(p2p: dict[str, Any]) -> str:
    more = " (and possibly more: the list is cut at 8)" if p2p.get("truncated") else ""
    return f"{pairs_text(p2p['failing'])}{more}"


def transport_mode(env: Mapping[str, str]) -> tuple[str, str | None]:
    """(PCIE_ALLREDUCE_TRANSPORT of ``env`` as the communicator parses it, the error when it
    does not parse: then every communicator raises at construction)."""
    flags, problems = env_mod.read_flags(env)
    return flags.transport, problems.get("PCIE_ALLREDUCE_TRANSPORT")


def transport_report(
    inv: Inventory | None,
    p2p: dict[str, Any],
    mode: str = policy.AUTO,
    error: str | None = None,
) -> dict[str, Any]:
    """The transport a communicator over these GPUs would run, as ``stats()["transport"]``
    names it (cuda_ipc, cuda_host, or host_shm without GPUs); ``mode`` is
    PCIE_ALLREDUCE_TRANSPORT (auto, cuda_ipc or cuda_host)."""
    mode = policy.cuda_mode(mode, "mode")
    status = p2p.get("status")
    forced = f"PCIE_ALLREDUCE_TRANSPORT={policy.CUDA_HOST}"
    if error is not None:
        detail = f"{error}: every communicator raises at construction"
        name = policy.HOST_SHM if inv is None else policy.CUDA_IPC
    elif inv is None:
        name, detail = policy.HOST_SHM, f"CPU tensors: {policy.WHAT[policy.HOST_SHM]}"
    elif status in ("skipped", "not_applicable"):
        name = policy.CUDA_HOST if mode == policy.CUDA_HOST else policy.CUDA_IPC
        detail = f"none in use: {p2p.get('detail', '')}"
    elif mode == policy.CUDA_HOST:
        name = policy.CUDA_HOST
        detail = (
            f"{forced}: {policy.WHAT[policy.CUDA_HOST]} (forced; peer-to-peer is not "
            f"used), {_HOSTMEM_COST}"
        )
        if status == "ok":
            detail += f"; P2P works on all {len(p2p['pairs'])} pairs tested"
    elif status == "failed" and policy.transport_after_p2p_failure(mode) is None:
        name = policy.CUDA_IPC
        detail = (
            f"P2P failed on {_failing_text(p2p)}, and PCIE_ALLREDUCE_TRANSPORT="
            f"{policy.CUDA_IPC}: the communicator declines no_p2p (host memory is not "
            "tried)"
        )
    elif status == "failed":
        name = policy.CUDA_HOST
        detail = (
            f"P2P failed on {_failing_text(p2p)}: the communicator moves every workspace "
            f"into shared pinned host memory, {_HOSTMEM_COST}; fixing the IOMMU/ACS "
            "settings of the PCIe path between those GPUs restores P2P "
            f"({_P2P_ONLY} declines no_p2p instead). The doctor does not "
            "test host memory: each communicator checks it when it is constructed"
        )
    elif status == "error" and mode != policy.CUDA_IPC:
        name = policy.CUDA_IPC
        detail = (
            "peer-to-peer, unverified: the P2P test did not complete, so whether a "
            f"communicator stays on P2P or moves to shared pinned host memory "
            f"({policy.CUDA_HOST}) is unknown"
        )
    elif status == "ok":
        name = policy.CUDA_IPC
        detail = (
            f"peer-to-peer: {policy.WHAT[policy.CUDA_IPC]} (verified on {len(p2p['pairs'])} pairs)"
        )
    else:
        name = policy.CUDA_IPC
        detail = "peer-to-peer, if each communicator's own P2P check passes" + (
            f" ({_P2P_ONLY}: it declines no_p2p otherwise)"
            if mode == policy.CUDA_IPC
            else f"; otherwise shared pinned host memory ({policy.CUDA_HOST})"
        )
    out = {"name": name, "mode": mode if error is None else "invalid", "detail": detail}
    if error is not None:
        out["error"] = error
    return out


def gpu_declines(
    inv: Inventory, p2p: dict[str, Any], mode: str = policy.AUTO
) -> list[dict[str, str]]:
    """Why a communicator over these GPUs would turn itself off (or could not be trusted).
    Failing P2P pairs are a decline only with ``mode`` cuda_ipc: otherwise the communicator
    runs over host memory (cuda_host)."""
    mode = policy.cuda_mode(mode, "mode")
    out = []
    topo = inv.topology
    if topo is not None and topo.has_nvlink():
        a, b = topo.nvlink_pairs()[0]
        out.append(
            {
                "reason": "nvlink",
                "detail": f"NVLink present (GPU{a} and GPU{b}, "
                f"{len(topo.nvlink_pairs())} pairs): the engine's own custom all-reduce is "
                "faster there",
            }
        )
    if p2p.get("status") == "failed" and policy.transport_after_p2p_failure(mode) is None:
        out.append(
            {
                "reason": "no_p2p",
                "detail": "peer writes or reads did not arrive intact: "
                f"{_failing_text(p2p)}; {_P2P_ONLY}, so host memory is not tried",
            }
        )
    elif p2p.get("status") == "error" and mode != policy.CUDA_HOST:
        out.append({"reason": "no_p2p", "detail": p2p["detail"]})
    if inv.topology_error is not None:
        out.append(
            {
                "reason": "topology",
                "detail": "`nvidia-smi topo -m` does not parse "
                f"({inv.topology_error}): communicators raise at construction",
            }
        )
    if inv.count > MAX_WORLD:
        out.append(
            {
                "reason": "world_size",
                "detail": f"a group of all {inv.count} GPUs "
                f"(groups of 2..{MAX_WORLD} GPUs can use it)",
            }
        )
    return out


def _p2p_phrase(p2p: dict[str, Any]) -> str:
    status = p2p.get("status")
    if status == "ok":
        source = {"cached": " (cached)", "recorded": " (recorded)"}.get(p2p.get("source", ""), "")
        return f"P2P verified on {len(p2p['pairs'])} pairs{source}"
    if status == "inconclusive":
        return f"P2P inconclusive ({p2p['detail']})"
    return "P2P not tested (each communicator still checks it when it is constructed)"


def _transport_phrase(p2p: dict[str, Any], transport: dict[str, Any]) -> str:
    """What follows the tactics in a "can run" verdict on host memory."""
    if transport["mode"] == policy.CUDA_HOST:
        line = (
            f"host memory is forced by PCIE_ALLREDUCE_TRANSPORT={policy.CUDA_HOST}, {_HOSTMEM_COST}"
        )
        if p2p.get("status") == "failed":
            return line + f"; P2P fails anyway on {_failing_text(p2p)}"
        if p2p.get("status") == "error":
            return line + f"; P2P unknown: {p2p['detail']}"
        works = f" (transport {policy.AUTO} would use it)" if p2p.get("status") == "ok" else ""
        return line + f"; {_p2p_phrase(p2p)}{works}"
    return (
        f"P2P failed on {_failing_text(p2p)}, so every workspace is in shared pinned host "
        f"memory, {_HOSTMEM_COST}; fixing the IOMMU/ACS settings of the PCIe path between "
        f"those GPUs restores P2P ({_P2P_ONLY} declines no_p2p instead)"
    )


def gpu_verdict(
    inv: Inventory,
    p2p: dict[str, Any],
    table: dict[str, Any],
    tactics: dict[str, Any],
    transport: dict[str, Any] | None = None,
) -> tuple[bool, str, list[dict[str, str]]]:
    """(ok, verdict, declines); ``transport``: transport_report() (default: auto mode)."""
    if transport is None:
        transport = transport_report(inv, p2p)
    declines = gpu_declines(inv, p2p, policy.AUTO if transport.get("error") else transport["mode"])
    if transport.get("error"):
        declines.append(
            {
                "reason": "transport",
                "detail": f"{transport['error']}: communicators raise at construction",
            }
        )
    env_table = table.get("env_table")
    if env_table is not None and not env_table["ok"]:
        declines.append(
            {
                "reason": "table",
                "detail": f"PCIE_ALLREDUCE_TABLE {env_table['path']}: {env_table['error']}",
            }
        )
    blocking = [d for d in declines if d["reason"] != "world_size"]
    if inv.count < 2 and not blocking:
        return (
            False,
            (
                f"pcie_allreduce has nothing to do here: {inv.count} GPU (an all-reduce "
                f"needs 2..{MAX_WORLD} GPUs in a group)"
            ),
            declines,
        )
    plural = "GPU" if inv.count == 1 else "GPUs"
    shape = (
        f"{inv.count} {plural} in {describe_islands(inv.topology)} ({inv.table_key})"
        if inv.topology is not None
        else f"{inv.count} {plural}"
    )
    reasons = "; ".join(f"{d['reason']}: {d['detail']}" for d in declines)
    if blocking:
        return False, f"pcie_allreduce cannot run here: {shape}; would decline: {reasons}", declines
    usable = tactics["available"] or tactic_report(MAX_WORLD, [])["available"]
    if transport["name"] == policy.CUDA_HOST:
        line = (
            f"pcie_allreduce can run here over shared pinned host memory (transport "
            f"{policy.CUDA_HOST}): {shape}, tactics: {', '.join(usable)}; "
            f"{_transport_phrase(p2p, transport)}"
        )
    else:
        mode = f" ({_P2P_ONLY})" if transport["mode"] == policy.CUDA_IPC else ""
        line = (
            f"pcie_allreduce can run here: {shape}, {_p2p_phrase(p2p)}{mode}, tactics: "
            f"{', '.join(usable)}"
        )
    if declines:
        line += f"; would decline: {reasons}"
    return True, line, declines


def host_verdict(
    host: dict[str, Any], table: dict[str, Any], transport_error: str | None = None
) -> tuple[bool, str]:
    if transport_error is not None:
        return False, (
            f"no GPU found; the host transport cannot start: {transport_error} "
            "(communicators raise at construction)"
        )
    env_table = table.get("env_table")
    if env_table is not None and not env_table["ok"]:
        return False, (
            f"no GPU found; the host transport cannot start: PCIE_ALLREDUCE_TABLE "
            f"{env_table['path']}: {env_table['error']}"
        )
    if host["status"] == "ok":
        return True, (
            "no GPU found; pcie_allreduce can run here on CPU tensors: the host "
            f"shared-memory transport works: {host['detail']}"
        )
    if host["status"] == "failed":
        return False, f"no GPU found, and the host shared-memory transport failed: {host['detail']}"
    return False, (
        "no GPU found, and the host shared-memory transport was not tested, so it "
        "is not known to work"
    )
