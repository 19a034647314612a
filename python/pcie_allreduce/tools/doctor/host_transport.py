"""Without GPUs: a real world-2 all-reduce on the host shared-memory transport (host_shm), in a
subprocess (``pcie-allreduce bench --transport host_shm``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ... import policy
from .system import RunResult, System, probe_env, read_text

HOST_TIMEOUT_S = 120.0  # the host-transport bench subprocess


def host_bench_command(json_out: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pcie_allreduce",
        "bench",
        "--transport",
        policy.HOST_SHM,
        "--world",
        "2",
        "--min-bytes",
        "4K",
        "--max-bytes",
        "4K",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--json",
        json_out,
    ]


def interpret_host_run(run: RunResult, bench_json: str | None, timeout_s: float) -> dict[str, Any]:
    if run.timed_out:
        return {
            "status": "failed",
            "detail": f"the world-2 bench did not finish within {timeout_s:g} s",
        }
    tail = " | ".join(run.output.strip().splitlines()[-3:]) or "no output"
    if run.returncode != 0 or bench_json is None:
        return {
            "status": "failed",
            "detail": f"the world-2 bench exited with code {run.returncode}: {tail}",
        }
    try:
        result = json.loads(bench_json)
        stats, rows = result["stats"], result["rows"]
    except (ValueError, KeyError, TypeError):
        return {"status": "failed", "detail": "the world-2 bench wrote an unreadable result"}
    if not stats.get("enabled", False):
        return {
            "status": "failed",
            "detail": f"the host transport turned itself off: {stats.get('disabled_reason')}",
        }
    tactics = sorted({str(r.get("tactic")) for r in rows})
    detail = f"world-2 all-reduce of 4 KiB verified, tactic {', '.join(tactics)}"
    self_test = stats.get("self_test") or {}
    failed = self_test.get("failed") or []
    if failed:
        wrong = "; ".join(
            f"{f.get('op')} {f.get('dtype')} {f.get('tactic')} ({f.get('detail')})" for f in failed
        )
        return {
            "status": "failed",
            "detail": f"{detail}; the self-test withdrew {len(failed)} tactic(s) that gave "
            f"wrong bits (their calls take the fallback, decline reason self_test): {wrong}",
        }
    if self_test.get("cases"):
        detail += f"; self-test: {self_test['cases']} (op, dtype, tactic) cases bit-exact"
    return {"status": "ok", "detail": detail}


def check_host_transport(system: System, timeout_s: float = HOST_TIMEOUT_S) -> dict[str, Any]:
    recorded = system.recorded_host_transport()
    if recorded is not None:
        ok = bool(recorded.get("ok"))
        return {
            "status": "ok" if ok else "failed",
            "detail": str(recorded.get("detail", "")),
            "source": "recorded",
        }
    if not system.can_run_tests():
        return {"status": "not_tested", "detail": "the fixture records no host-transport result"}
    with tempfile.TemporaryDirectory(prefix="pcie_ar_doctor.") as tmp:
        out = os.path.join(tmp, "bench.json")
        run = system.run(host_bench_command(out), timeout_s, probe_env(system.env))
        result = interpret_host_run(run, read_text(Path(out)), timeout_s)
    return {**result, "source": "test"}
