"""tests/gpu/quick.sh's control flow, with stub programs in place of the GPU ones: a step that
passes, one that fails, one that traps (dies of a signal, as a failure path's trapped kernel
does), one that outlives its limit; every later step still runs, every result is already in
results.jsonl when the next step starts, and the budget clips limits and skips what it cannot
hold. The real programs run only on a device machine."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
QUICK = ROOT / "tests" / "gpu" / "quick.sh"

# The stub check program: what each of quick.sh's invocations does, by its arguments. Every
# call also appends its arguments and the steps results.jsonl held at that moment to calls.log.
STUB_CHECK = """#!/usr/bin/env bash
echo "$* $(wc -l < "$OUT/results.jsonl") pdl=${PCIE_ALLREDUCE_PDL:-on}" >> "$STUB_DIR/calls.log"
case "$*" in
  --world=2) echo "loopback world 2: all passed" ;;
  --mismatch-test) echo "FAIL: no mismatch reported"; exit 1 ;;
  --ll-timeout-test) kill -ABRT $$ ;;
  --world=8) echo "started world 8"; exec sleep 60 ;;
  *) echo "ok: $*" ;;
esac
"""
STUB_MICROBENCH = """#!/usr/bin/env bash
echo "microbench $(wc -l < "$OUT/results.jsonl")" >> "$STUB_DIR/calls.log"
echo "# system fence"
echo '{"bench": "system_fence", "fence_ns": 1500}' >> "$PCIE_GPU_JSONL"
"""
# The stub interpreter of the torch part's checks, by script.
STUB_PYTHON = """#!/usr/bin/env bash
echo "python $* $(wc -l < "$OUT/results.jsonl")" >> "$STUB_DIR/calls.log"
case "$*" in
  tests/gpu/torch_check.py) echo "torch check: all passed" ;;
  tests/gpu/hostmem_check.py) echo "hostmem: world 2"; exec sleep 60 ;;
  tests/gpu/tune_check.py) echo "tune: FAIL"; exit 3 ;;
  "-m pcie_allreduce doctor --json") echo '{"verdict": "ok"}' ;;
  *) echo "unexpected: $*"; exit 9 ;;
esac
"""
STUB_SMI = """#!/usr/bin/env bash
echo "NVIDIA H100 80GB HBM3, 580.00, 81559 MiB, 5, 16"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, *parts: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    stubs, out = tmp_path / "stubs", tmp_path / "out"
    stubs.mkdir(exist_ok=True)
    _executable(stubs / "pcie_gpu_check", STUB_CHECK)
    _executable(stubs / "pcie_gpu_microbench", STUB_MICROBENCH)
    _executable(stubs / "nvidia-smi", STUB_SMI)
    _executable(stubs / "python", STUB_PYTHON)
    full_env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(out),
        "STUB_DIR": str(stubs),
        "QUICK_BIN_DIR": str(stubs),
        "QUICK_PYTHON": str(stubs / "python"),
        **env,
    }
    proc = subprocess.run(
        ["bash", str(QUICK), *parts],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (out / "results.jsonl").read_text().splitlines()
    return proc, [json.loads(line) for line in lines]


def test_every_step_runs_after_a_failure_a_trap_and_a_timeout(tmp_path: Path) -> None:
    proc, results = _run(tmp_path, QUICK_LIMIT_loopback_w8="2")
    by_step = {r["step"]: r for r in results}
    assert list(by_step) == [
        "nvidia-smi",
        "microbench",
        "loopback-w2",
        "fail-timeout",
        "fail-mismatch",
        "fail-ll-timeout",
        "fail-ll-mismatch",
        "fail-lamport-timeout",
        "fail-lamport-mismatch",
        "loopback-w8",
        "loopback-w4",
        "pdl-off",
    ], proc.stdout
    assert by_step["fail-mismatch"]["status"] == "failed" and by_step["fail-mismatch"]["rc"] == 1
    assert by_step["fail-ll-timeout"]["status"] == "signal"
    assert by_step["fail-ll-timeout"]["rc"] == 128 + 6  # SIGABRT, as a trapped kernel's abort
    assert by_step["loopback-w8"]["status"] == "timeout"
    assert by_step["loopback-w8"]["limit_s"] == 2 and by_step["loopback-w8"]["seconds"] < 10
    ok = [s for s, r in by_step.items() if r["status"] == "ok"]
    assert len(ok) == 9, results
    assert proc.returncode == 1  # something failed
    # Each step's log is kept, a killed step's output up to its end included.
    out = tmp_path / "out"
    assert "all passed" in (out / "loopback-w2.log").read_text()
    assert "started world 8" in (out / "loopback-w8.log").read_text()
    assert "# system fence" in (out / "microbench.log").read_text()
    assert json.loads((out / "microbench.jsonl").read_text())["fence_ns"] == 1500
    # Every step found the results of all steps before it already written (nothing held back
    # to the end), and only the PDL-off step ran with PDL off.
    calls = (tmp_path / "stubs" / "calls.log").read_text().splitlines()
    assert calls[0] == "microbench 1" and calls[1] == "--world=2 2 pdl=on"
    assert calls[-1] == "--quick --world=2 11 pdl=0"


def test_the_budget_clips_a_long_step_and_skips_what_no_longer_fits(tmp_path: Path) -> None:
    proc, results = _run(tmp_path, QUICK_BUDGET_S="8", QUICK_MIN_STEP_S="3")
    by_step = {r["step"]: r for r in results}
    w8 = by_step["loopback-w8"]
    # World 8's default limit (120 s) is clipped to the budget left, and it runs out there.
    assert w8["status"] == "timeout" and w8["limit_s"] <= 8, w8
    after = [r for r in results if results.index(r) > results.index(w8)]
    assert [r["step"] for r in after] == ["loopback-w4", "pdl-off"]
    assert all(r["status"] == "skipped" and r["rc"] == -1 for r in after), after
    assert proc.returncode == 1
    assert "device check (quick kernels): FAIL" in proc.stdout


@pytest.mark.parametrize("missing", ["pcie_gpu_check", "pcie_gpu_microbench"])
def test_no_check_program_is_one_failed_result_not_a_hang(tmp_path: Path, missing: str) -> None:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _executable(stubs / "nvidia-smi", STUB_SMI)
    other = {"pcie_gpu_check": STUB_CHECK, "pcie_gpu_microbench": STUB_MICROBENCH}
    for name, text in other.items():
        if name != missing:
            _executable(stubs / name, text)
    env = {
        **os.environ,
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "QUICK_BIN_DIR": str(stubs),
    }
    proc = subprocess.run(["bash", str(QUICK)], cwd=ROOT, env=env, capture_output=True, text=True)
    results = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert proc.returncode == 1
    assert [r["step"] for r in results] == ["nvidia-smi", "programs-missing"]
    assert results[1]["status"] == "failed"


def test_the_torch_part_appends_its_steps_after_the_kernels_part(tmp_path: Path) -> None:
    _run(tmp_path, "kernels", QUICK_LIMIT_loopback_w8="1")
    proc, results = _run(tmp_path, "torch", QUICK_LIMIT_hostmem_check="2")
    kernels = [r for r in results if r["part"] == "kernels"]
    torch_steps = {r["step"]: r for r in results if r["part"] == "torch"}
    assert len(kernels) == 12 and results[: len(kernels)] == kernels  # kept, and first
    assert list(torch_steps) == ["torch-check", "hostmem-check", "tune-check", "doctor"]
    status = {name: r["status"] for name, r in torch_steps.items()}
    assert status == {
        "torch-check": "ok",
        "hostmem-check": "timeout",
        "tune-check": "failed",
        "doctor": "ok",
    }, proc.stdout
    assert torch_steps["tune-check"]["rc"] == 3
    assert proc.returncode == 1 and "device check (quick torch): FAIL" in proc.stdout
    assert '"verdict": "ok"' in (tmp_path / "out" / "doctor.log").read_text()


def test_an_unknown_part_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(QUICK), "everything"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
