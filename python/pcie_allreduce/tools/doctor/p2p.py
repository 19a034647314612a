"""The P2P write-and-verify: every ordered GPU pair written and read back through real CUDA IPC
mappings, in a subprocess that spawns one rank per GPU (a faulting peer write must not kill the
doctor). It always tests peer-to-peer (transport cuda_ipc), whatever PCIE_ALLREDUCE_TRANSPORT
says: in auto mode a failed check would move to host memory and hide the failure. A completed
result is cached per driver and set of GPUs (``p2p-<key>.json`` in the cache folder)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ... import files, policy
from .inventory import MAX_WORLD, Inventory
from .system import FixtureError, RunResult, System, probe_env

P2P_RANK_TIMEOUT_S = 60.0  # one rank's construction (gloo rendezvous, exchanges, the check)
P2P_TIMEOUT_S = 240.0  # the whole P2P subprocess: 8 ranks importing torch and initialising CUDA
P2P_RESULT_TAG = "P2P_RESULT "
P2P_CACHE_VERSION = 1
_REPORTED_PAIRS_CAP = 8  # the communicator names at most this many broken pairs


def p2p_cache_key(driver: str, bus_ids: Sequence[str], names: Sequence[str]) -> str:
    fields = {
        "driver": driver,
        "bus_ids": sorted(bus_ids),
        "names": list(names),
        "version": P2P_CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def p2p_cache_file(cache_dir: Path, inv: Inventory) -> Path:
    tested = inv.gpus[:MAX_WORLD]
    key = p2p_cache_key(
        inv.driver, [g["bus_id"] or "" for g in tested], [g["name"] for g in tested]
    )
    return cache_dir / f"p2p-{key}.json"


def pair_list(world: int) -> list[tuple[int, int]]:
    return [(s, d) for s in range(world) for d in range(world) if s != d]


def parse_failing_pairs(reason: str) -> list[tuple[int, int]]:
    """The ordered (writer, reader) pairs a ``no_p2p: ...`` disabled reason names."""
    return [(int(s), int(d)) for s, d in re.findall(r"rank (\d+) -> rank (\d+)", reason)]


def p2p_outcome(
    world: int, failing: Sequence[Sequence[int]], detail: str = "", truncated: bool = False
) -> dict[str, Any]:
    """Per ordered pair: "ok", "failed", or "unverified" (the failure list was cut short)."""
    bad = {(int(s), int(d)) for s, d in failing}
    unknown = "unverified" if truncated else "ok"
    pairs = [
        {"src": s, "dst": d, "status": "failed" if (s, d) in bad else unknown}
        for s, d in pair_list(world)
    ]
    return {
        "status": "failed" if bad else "ok",
        "world": world,
        "failing": [list(p) for p in sorted(bad)],
        "pairs": pairs,
        "detail": detail,
        "truncated": truncated,
    }


def interpret_p2p_run(world: int, run: RunResult, timeout_s: float) -> dict[str, Any]:
    """A P2P subprocess's result: every pair ok, failing pairs, or why the test itself failed."""
    if run.timed_out:
        return _p2p_error(
            f"the P2P test did not finish within {timeout_s:g} s (a hung peer "
            "write or a stuck rank); treat P2P as broken until it passes"
        )
    result = None
    for line in run.output.splitlines():
        if line.startswith(P2P_RESULT_TAG):
            try:
                result = json.loads(line[len(P2P_RESULT_TAG) :])
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
    return {
        "status": "inconclusive",
        "world": world,
        "failing": [],
        "pairs": [],
        "detail": f"the test communicator turned itself off for another reason: {reason}",
    }


def _p2p_error(detail: str) -> dict[str, Any]:
    return {"status": "error", "failing": [], "pairs": [], "detail": detail}


def read_p2p_cache(path: Path, key_file: str) -> dict[str, Any] | None:
    try:
        cached = json.loads(files.read_small(path, in_cache=True))
    except (OSError, ValueError):  # missing, refused (files.Refused), or not JSON
        return None
    if not isinstance(cached, dict) or cached.get("file") != key_file:
        return None
    if cached.get("status") not in ("ok", "failed") or not isinstance(cached.get("pairs"), list):
        return None
    return cached


def write_p2p_cache(path: Path, result: dict[str, Any]) -> None:
    """Caches a completed test (never a crash or timeout: those may be transient)."""
    record = {
        **result,
        "file": path.name,
        "tested_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        files.write_atomic(path, (json.dumps(record, indent=1) + "\n").encode())
    except OSError:
        pass  # a read-only cache only costs the next run another test


P2PRunner = Callable[[int, float], RunResult]


def p2p_probe_command(world: int, rank_timeout_s: float) -> list[str]:
    code = (
        "import sys; from pcie_allreduce.tools.doctor.p2p import p2p_probe_main; "
        "raise SystemExit(p2p_probe_main(int(sys.argv[1]), float(sys.argv[2])))"
    )
    return [sys.executable, "-c", code, str(world), str(rank_timeout_s)]


def check_p2p(
    system: System,
    inv: Inventory,
    *,
    skip: bool,
    runner: P2PRunner | None = None,
    timeout_s: float = P2P_TIMEOUT_S,
) -> dict[str, Any]:
    """Recorded result (fixtures), else the cache, else a test in a subprocess (unless skip)."""
    world = min(inv.count, MAX_WORLD)
    if world < 2:
        return {"status": "not_applicable", "detail": "fewer than 2 GPUs"}
    if inv.topology is not None and inv.topology.has_nvlink():
        return {
            "status": "skipped",
            "detail": "NVLink host: the backend declines before "
            "any peer write, so there is nothing to test",
        }
    if inv.topology_error is not None:
        return {
            "status": "skipped",
            "detail": "`nvidia-smi topo -m` does not parse, so no "
            "communicator can be constructed to test with",
        }
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


def _recorded_p2p(recorded: dict[str, Any], world: int) -> dict[str, Any]:
    if recorded.get("error"):
        return _p2p_error(str(recorded["error"]))
    failing = recorded.get("failing", [])
    ok_shape = isinstance(failing, list) and all(
        isinstance(p, list)
        and len(p) == 2
        and all(isinstance(x, int) and 0 <= x < world for x in p)
        and p[0] != p[1]
        for p in failing
    )
    if not ok_shape:
        raise FixtureError(
            f"p2p.json: 'failing' must list [writer, reader] GPU pairs in "
            f"0..{world - 1}, got {failing!r}"
        )
    return p2p_outcome(
        world, failing, str(recorded.get("detail", "")), bool(recorded.get("truncated", False))
    )


def _p2p_rank(rank: int, world: int, init_file: str, timeout_s: float, queue: Any) -> None:
    """One rank of the P2P test: constructing the communicator runs the write-and-verify.
    transport cuda_ipc: a failed check declines no_p2p (auto would hide it by moving to host
    memory)."""
    import torch
    import torch.distributed as dist

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        from ... import communicator

        group = dist.group.WORLD
        ar = communicator.PcieAllReduce(
            group,
            torch.device("cuda", rank),
            max_numel=4096,
            cpu_group=group,
            timeout_s=timeout_s,
            transport=policy.CUDA_IPC,
        )
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
        procs = [
            ctx.Process(target=_p2p_rank, args=(r, world, init_file, rank_timeout_s, queue))
            for r in range(world)
        ]
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
        errors.append(f"ranks {crashed} exited with codes {[procs[r].exitcode for r in crashed]}")
    result = {"error": "; ".join(errors)} if errors or not results else results[0]
    print(P2P_RESULT_TAG + json.dumps(result), flush=True)
    return 0 if not errors else 1
