"""The CLI: topo on real nvidia-smi texts and on a host without GPUs; bench end to end."""

import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "cpp" / "data"


def run_cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "pcie_allreduce", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_topo_on_two_sockets_shows_islands_and_cross_island_traffic():
    done = run_cli("topo", "--nvidia-smi-topo", str(DATA / "two_socket_8gpu.txt"), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["islands"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert report["table_key"] == "islands-2x4"
    assert report["fingerprint"].startswith("islands-2x4-w8-")
    rows = {(r["algorithm"], r.get("direction"), r.get("staged")): r for r in report["schedules"]}
    assert rows[("island_twoshot", "push", True)]["cross_island_elements"] == 1.0
    assert rows[("oneshot", "push", True)]["cross_island_elements"] == 16.0
    assert all(r["verified"] for r in report["schedules"] if r["supported"])
    assert rows[("oneshot", "push", True)]["max_outbound_per_stage"] == 1
    ll = [r for r in report["schedules"] if r.get("protocol") in ("ll", "lamport")]
    assert {(r["algorithm"], r["protocol"]) for r in ll} == {
        (a, p)
        for a in ("oneshot", "twoshot", "island_oneshot", "island_twoshot")
        for p in ("ll", "lamport")
    }
    assert all(r["cost"]["system_fences"] == 0 and r["cost"]["peer_polls"] == 0 for r in ll)
    assert all(r["cost"]["peer_polls"] == 0 for r in report["schedules"] if r["supported"])


def test_topo_text_output_names_the_fingerprint_and_nvlink():
    done = run_cli("topo", "--nvidia-smi-topo", str(DATA / "dgx_nvlink_8gpu.txt"))
    assert done.returncode == 0, done.stderr
    assert "fingerprint: nvlink-w8-" in done.stdout
    assert "NVLink present" in done.stdout


def test_topo_without_gpus_describes_the_host():
    done = run_cli("topo")
    assert done.returncode == 0, done.stderr
    # This machine may or may not have GPUs; without them topo must say so.
    if "No GPUs found" in done.stdout:
        assert "CPUs" in done.stdout and "host shared-memory transport" in done.stdout


def test_topo_reports_malformed_text_with_its_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X\n")
    done = run_cli("topo", "--nvidia-smi-topo", str(bad))
    assert done.returncode == 2
    assert "line 2" in done.stderr and "FOO" in done.stderr


def test_bench_on_the_host_transport_verifies_and_prints_the_table(tmp_path):
    out = tmp_path / "rows.json"
    done = run_cli(
        "bench",
        "--transport",
        "host",
        "--world",
        "2",
        "--dtype",
        "bf16",
        "--min-bytes",
        "1K",
        "--max-bytes",
        "16K",
        "--step-factor",
        "4",
        "--iters",
        "20",
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "size(B)" in done.stdout and "speedup" in done.stdout
    result = json.loads(out.read_text())
    assert [r["size"] for r in result["rows"]] == [1024, 4096, 16384]
    assert all(r["wrong"] == 0 for r in result["rows"])
    assert all(r["fallback_us"] > 0 and r["time_us"] > 0 for r in result["rows"])
    assert "verified" in done.stdout
    assert (
        "# communicator transport: host_shm (CPU tensors: every workspace in POSIX shared "
        "memory)" in done.stdout
    )


def test_bench_refuses_cuda_without_gpus_or_bad_arguments():
    import torch

    if torch.cuda.device_count() < 2:
        for transport in ("cuda", "hostmem"):
            done = run_cli("bench", "--transport", transport)
            assert done.returncode == 2, done.stderr
            assert f"--transport {transport} needs at least 2 GPUs" in done.stderr
    done = run_cli("bench", "--transport", "host", "--world", "9")
    assert done.returncode == 2 and "2..8" in done.stderr


def run_cli_env(env_extra, *args, timeout=600):
    import os

    return subprocess.run(
        [sys.executable, "-m", "pcie_allreduce", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env_extra},
    )


def test_tune_writes_the_cache_and_a_second_run_measures_nothing(tmp_path):
    env = {"PCIE_ALLREDUCE_CACHE_DIR": str(tmp_path)}
    report = tmp_path / "report.json"
    args = ("tune", "--transport", "host", "--world", "2", "--max-bytes", "4K", "--budget", "8")
    first = run_cli_env(env, *args, "--json", str(report))
    assert first.returncode == 0, first.stdout + first.stderr
    written = list(tmp_path.glob("host_shm-w2-*.csv"))
    assert len(written) == 1 and f"# wrote {written[0]}" in first.stdout
    data = json.loads(report.read_text())
    assert data["status"] == "tuned" and data["measured"] > 0
    assert f"# measured {data['measured']} (bucket, tactic) pairs" in first.stdout
    # Every bucket's row, the incumbent and the chosen tactic with their times.
    # ... for each op (the collectives measured against their own fallback too).
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        assert [(c["dtype"], c["bytes"]) for c in data["choices"] if c["op"] == op] == [
            (d, b) for d in ("bf16", "fp16", "fp32") for b in (1024, 2048, 4096)
        ], op
    for c in data["choices"]:
        assert f"{c['bytes']:>9}" in first.stdout and c["winner"] in first.stdout
    second = run_cli_env(env, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "measured nothing" in second.stdout and str(written[0]) in second.stdout


def test_tune_refusals_and_bad_arguments_exit_2_saying_why(tmp_path):
    env = {"PCIE_ALLREDUCE_CACHE_DIR": str(tmp_path), "PCIE_ALLREDUCE_DISABLE_AUTOTUNE": "1"}
    done = run_cli_env(env, "tune", "--transport", "host", "--max-bytes", "2K")
    assert done.returncode == 2 and "PCIE_ALLREDUCE_DISABLE_AUTOTUNE=1" in done.stderr
    assert "measured nothing" in done.stderr
    assert not list(tmp_path.glob("*.csv"))
    for budget in ("0", "inf", "nan"):  # inf once passed the check and failed both ranks (exit 1)
        done = run_cli("tune", "--transport", "host", "--budget", budget)
        assert done.returncode == 2 and "--budget must be a positive, finite" in done.stderr, (
            budget,
            done.returncode,
            done.stderr,
        )
    done = run_cli("tune", "--transport", "host", "--world", "1")
    assert done.returncode == 2 and "2..8" in done.stderr


def test_doctor_gives_a_verdict_here_and_on_a_recorded_nvlink_host():
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
    here = run_cli("doctor", "--json")
    report = json.loads(here.stdout)
    assert here.returncode == (0 if report["ok"] else 1) and isinstance(report["verdict"], str)
    nvlink = run_cli("doctor", "--json", "--fixture", str(fixtures / "dgx_nvlink_8gpu"))
    report = json.loads(nvlink.stdout)
    assert (
        nvlink.returncode == 1 and report["ok"] is False and "nvlink" in report["verdict"].lower()
    )
    text = run_cli("doctor", "--fixture", str(fixtures / "two_socket_8gpu"), "--no-p2p-test")
    assert text.returncode == 0 and text.stdout.strip().splitlines()[-1].startswith("verdict:")


def test_doctor_gives_a_verdict_when_nvidia_smi_prints_bytes_that_are_not_utf8(tmp_path):
    """A broken driver install whose nvidia-smi prints garbage is a failed probe, not a crash
    (it exited 2 with no verdict, from a UnicodeDecodeError)."""
    import os

    fake = tmp_path / "nvidia-smi"
    fake.write_bytes(b"#!/bin/sh\nprintf 'GPU0\\377\\376 X\\n'\n")
    fake.chmod(0o755)
    done = run_cli_env(
        {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}, "doctor", "--json", "--no-p2p-test"
    )
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    assert isinstance(report["verdict"], str) and report["verdict"], report
